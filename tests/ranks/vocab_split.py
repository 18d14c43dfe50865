"""Rank program: ``shard_model(head="split")`` (each rank holds its rows of the embedding and the head) against
single-process mlx-lm, in one process per rank.

Reads a JSON spec from argv[1]: {"cases": {name: {"arch", "config"?, "seed", "quantize"?, "steps": [...]}}} where
a step is {"M", "max_tokens", "temp"?, "processor"?, "follow"?, "share"?} ("follow": a second prompt of that many
tokens decoded on the same cache, the conversation's next turn; "share": share_logprobs, every rank's logprobs). Every rank runs the reference itself and reports, per
step, its tokens and the reference's, and on the last rank the largest logprob difference; per case, the bytes of
the embedding and head it holds ("vocab_bytes"; the whole model's: "whole_vocab_bytes") and of every parameter
outside the layers ("outside_layers"), and the errors that mlx-lm's own generate_step, BatchGenerator and a draft
model raise on the split model.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

import pipemlx
import pipemlx.runtime.sampling as sampling
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def prompt_of(length: int, vocab: int, seed: int) -> mx.array:
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(seed + 7919 * length)).astype(mx.int32)


def parameter_bytes(model: nn.Module, prefix: str = "") -> int:
    return sum(
        v.nbytes for k, v in tree_flatten(model.parameters()) if isinstance(v, mx.array) and k.startswith(prefix)
    )


def vocab_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the embedding's and the separate head's parameters (0 where tied)."""
    return {"embedding": parameter_bytes(model, "model.embed_tokens."), "head": parameter_bytes(model, "lm_head.")}


def built(spec: dict[str, Any]) -> nn.Module:
    model = build_model(tiny_config(spec["arch"], **spec.get("config", {})), seed=spec["seed"])
    if spec.get("quantize"):
        nn.quantize(model, group_size=32, bits=4)
    return model


def options(step: dict[str, Any]) -> dict[str, Any]:
    """The same sampler and processors for mlx-lm and pipemlx (a fresh processor for each: they keep state)."""
    args: dict[str, Any] = {}
    if step.get("temp"):
        args["sampler"] = make_sampler(temp=step["temp"], top_k=step.get("top_k", 0))
    if step.get("processor"):
        args["logits_processors"] = make_logits_processors(repetition_penalty=1.3)
    return args


def decode(steps: Any) -> tuple[list[int], list[Any]]:
    tokens: list[int] = []
    logprobs: list[Any] = []
    for token, lp in steps:
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, logprobs


def largest_difference(ours: list[Any], ref: list[Any]) -> float | None:
    pairs = [(a, b) for a, b in zip(ours, ref) if a is not None]
    return max((float(mx.max(mx.abs(a - b))) for a, b in pairs), default=None)


class Tokens(TokenizerWrapper):
    """The least of a tokenizer mlx-lm's stream_generate needs with a prompt of token ids (the text is not read)."""

    def __init__(self) -> None:
        pass

    @property
    def eos_token_ids(self) -> set[int]:
        return set()

    @property
    def detokenizer(self) -> Any:
        class Detokenizer:
            text = last_segment = ""

            def reset(self) -> None: ...
            def add_token(self, token: int) -> None: ...
            def finalize(self) -> None: ...

        return Detokenizer()


def run_batch(spec: dict[str, Any], reference: nn.Module, model: nn.Module, vocab: int) -> dict[str, Any]:
    """pipemlx.BatchGenerator on the split model: requests inserted at their ticks (some while others decode),
    each with its own processors or none; per request its tokens and its solo mlx-lm run's, and the largest
    logprob difference where this rank has them (the last rank; every rank in a tick with processors); and the
    ticks whose decode shared the head. With "lean_batch": logprobs=False (greedy ticks share the split head)."""
    requests = spec["batch"]
    solo = []
    for i, r in enumerate(requests):
        prompt = prompt_of(r["M"], vocab, spec["seed"] + 31 * i)
        args = {"logits_processors": processors(r)} if r.get("processor") else {}
        solo.append(decode(generate_step(prompt, reference, max_tokens=r["max_tokens"], **args)))
    generator = pipemlx.BatchGenerator(
        model,
        prefill_chunk_tokens=8,
        prefill_step_size=8,
        prefill_chunking="fixed",
        logprobs=not spec.get("lean_batch"),
        decode_groups=spec.get("decode_groups", 1),
    )
    got: dict[int, list[int]] = {}
    logprobs: dict[int, list[Any]] = {}
    uids: dict[int, int] = {}
    finished = 0
    most_groups = 0  # the most decode groups in flight after a tick (0: one group throughout)
    for tick in range(64):
        for i, r in enumerate(requests):
            if r["insert_at"] == tick:
                prompt = prompt_of(r["M"], vocab, spec["seed"] + 31 * i).tolist()
                chosen = [processors(r)] if r.get("processor") else [None]
                (uids[i],) = generator.insert([prompt], [r["max_tokens"]], logits_processors=chosen)
        responses = generator.next()
        groups = generator._group_state  # pyright: ignore[reportPrivateUsage]
        most_groups = max(most_groups, 0 if groups.serial else len(groups.groups))
        for response in responses:
            got.setdefault(response.uid, []).append(int(response.token))
            logprobs.setdefault(response.uid, []).append(response.logprobs)
            finished += response.finish_reason is not None
        if finished == len(requests):
            break
    generator.close()
    report: list[dict[str, Any]] = []
    for i in range(len(requests)):
        uid = uids[i]
        ours = logprobs.get(uid, [])
        report.append(
            {
                "tokens": got.get(uid, []),
                "ref_tokens": solo[i][0],
                "compared": sum(lp is not None for lp in ours),
                "logprob_diff": largest_difference(ours, solo[i][1]),
            }
        )
    return {"requests": report, "shared_head_ticks": generator.shared_head_ticks, "most_groups": most_groups}


def processors(request: dict[str, Any]) -> list[Any]:
    return make_logits_processors(repetition_penalty=1.3)


def run_case(spec: dict[str, Any], group: mx.distributed.Group) -> dict[str, Any]:
    reference = built(spec)
    vocab = tiny_config(spec["arch"], **spec.get("config", {}))["vocab_size"]
    model = pipemlx.shard_model(built(spec), group, head="split", lend="mlp")  # a cut inside a layer, untimed
    result: dict[str, Any] = {
        "vocab_bytes": vocab_bytes(model),
        "whole_vocab_bytes": vocab_bytes(reference),
        "outside_layers": parameter_bytes(model) - parameter_bytes(model, "model.layers."),
        "steps": [],
    }
    # Greedy speculation decides mlx-lm's plain greedy tokens: a draft of other weights (some guesses rejected)
    # and prompt lookup; each verify pass's logits for k+1 positions come from every rank's rows.
    draft = built({**spec, "seed": spec["seed"] + 100})
    speculation = {"draft": {"draft_model": draft, "num_draft_tokens": 3}, "lookup": {"prompt_lookup": 2}}
    for s in spec["steps"]:
        prompt = prompt_of(s["M"], vocab, spec["seed"])
        ref_cache, cache = make_prompt_cache(reference), stage_of(model).new_cache(model)
        turns = [prompt] + ([prompt_of(s["follow"], vocab, spec["seed"] + 1)] if s.get("follow") else [])
        entry: dict[str, Any] = {**s, "tokens": [], "ref_tokens": [], "logprob_diff": None, "compared": 0}
        for turn in turns:
            mx.random.seed(11)
            ref = decode(
                generate_step(
                    turn,
                    reference,
                    prompt_cache=ref_cache,
                    max_tokens=s["max_tokens"],
                    prefill_step_size=4,
                    **options(s),
                )
            )
            mx.random.seed(11)
            stream = pipemlx.generate_step(
                turn,
                model,
                prompt_cache=cache,
                max_tokens=s["max_tokens"],
                prefill_step_size=4,
                share_logprobs=bool(s.get("share")),
                logprobs=not s.get("lean"),
                **speculation.get(s.get("speculate", ""), {}),
                **options(s),
            )
            ours = decode(stream)
            entry["speculated"] = entry.get("speculated", True) and stream.speculating
            entry["shared_head"] = entry.get("shared_head", True) and stream.shared_head
            entry["tokens"] += ours[0]
            entry["ref_tokens"] += ref[0]
            diff = largest_difference(ours[1], ref[1])
            entry["compared"] += sum(lp is not None for lp in ours[1])
            if diff is not None:
                entry["logprob_diff"] = max(diff, entry["logprob_diff"] or 0.0)
        result["steps"].append(entry)
    if spec.get("batch"):
        result["batch"] = run_batch(spec, reference, model, vocab)
        # Again with decode groups in flight (decode_groups=2: two or more groups whenever two rows are live).
        result["batch_groups"] = run_batch({**spec, "decode_groups": 2}, reference, model, vocab)
    # mlx-lm's own generate_step on the split model (its forward passes: embeddings summed, logits gathered on
    # every rank), prefilled in chunks of 4, then a second turn on the same cache; and mlx-lm's stream_generate.
    entry = {"tokens": [], "ref_tokens": [], "logprob_diff": None, "compared": 0}
    ref_cache, cache = make_prompt_cache(reference), make_prompt_cache(model)
    for turn in (prompt_of(11, vocab, spec["seed"] + 5), prompt_of(3, vocab, spec["seed"] + 6)):
        ref = decode(generate_step(turn, reference, prompt_cache=ref_cache, max_tokens=4, prefill_step_size=4))
        ours = decode(generate_step(turn, model, prompt_cache=cache, max_tokens=4, prefill_step_size=4))
        entry["tokens"] += ours[0]
        entry["ref_tokens"] += ref[0]
        entry["compared"] += len(ours[1])
        entry["logprob_diff"] = max(largest_difference(ours[1], ref[1]) or 0.0, entry["logprob_diff"] or 0.0)
    prompt = prompt_of(6, vocab, spec["seed"] + 7)
    entry["stream_tokens"] = [r.token for r in stream_generate(model, Tokens(), prompt, max_tokens=3)]
    entry["ref_stream_tokens"] = [r.token for r in stream_generate(reference, Tokens(), prompt, max_tokens=3)]
    result["mlx_lm"] = entry
    # What mlx-lm's refused generate_step left: the ranks agree again before the next case.
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    sampling.EMBED_BLOCK = 4  # a prompt's embeddings summed in several blocks, as a long prompt's are
    group = init_group()
    cases = {name: run_case(case, group) for name, case in spec["cases"].items()}
    print(json.dumps({"rank": group.rank(), "size": group.size(), "cases": cases}), flush=True)


if __name__ == "__main__":
    main()
