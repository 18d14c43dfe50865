"""Rank program: speculative decoding through the pipeline against mlx-lm's plain decoding.

Spec: {"arch", "config" (overrides), "cases": [{"name", "M", "repeat", "max_tokens", "draft": "same"|"other"|"mismatch"|"fails"|null, "lookup": n|null,
"k", "penalty", "kv_bits", "stop_at", "max_kv_size", "break_after": {"rank", "after"}, "temp", "seed",
"mode": generate_step's speculation (default "serial"), "cancel_after": {"rank", "after"}, "share": share_logprobs,
"kill": {"rank", "after"}: that rank reports and leaves mid-request (the last case)}]}. Every prompt repeats a
random piece ``repeat`` times (so prompt lookup finds matches). Reports, per case, the pipeline's tokens, the
reference's (mlx-lm's generate_step on the whole model, no speculation), the cache's length, the guesses
tally and whether the steps speculated. A case with a ``seed`` also reports mlx-lm's
``speculative_generate_step`` with the same draft, sampler and seed (tokens and log-probabilities), and every rank
seeds its decode with it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def prompt_of(case: dict[str, Any], vocab: int) -> mx.array:
    piece = mx.random.randint(0, vocab, (case["M"],), key=mx.random.key(case["M"])).astype(mx.int32)
    return mx.concatenate([piece] * case.get("repeat", 1))


class FailingDraft(nn.Module):
    """The ``"same"`` draft, raising on its ``fail_at``-th call (its weights, so its fingerprint, are the model's)."""

    def __init__(self, model: nn.Module, fail_at: int) -> None:
        super().__init__()
        self.model = model
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the draft model failed")
        return self.model(inputs, cache=cache)

    @property
    def layers(self) -> Any:  # mlx-lm's make_prompt_cache reads the model's layers
        return self.model.layers


def draft_of(case: dict[str, Any], rank: int) -> str:
    """The draft this rank guesses with: ``"mismatch"`` gives rank 0 another draft than the others."""
    if case["draft"] == "mismatch":
        return "other" if rank == 0 else "same"
    return case["draft"]


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    config = tiny_config(spec["arch"], **spec.get("config", {}))
    reference = build_model(config)
    # The whole head on every rank: pipelined passes need it on the last rank (the default head, split across the
    # ranks, makes speculation="auto" serial; tests/test_vocab_split.py runs speculation on a split head).
    model = pipemlx.shard_model(build_model(config), group, head="all")
    drafts = {"same": build_model(config), "other": build_model({**config, "num_hidden_layers": 1}, 7)}
    drafts["fails"] = FailingDraft(drafts["same"], fail_at=4)
    mx.random.seed(100 + group.rank())  # deliberately different on every rank: only the last rank samples
    results: list[dict[str, Any]] = []
    for case in spec["cases"]:
        prompt = prompt_of(case, config["vocab_size"])
        max_tokens = case["max_tokens"]
        processors = make_logits_processors(repetition_penalty=case["penalty"]) if case.get("penalty") else None
        options: dict[str, Any] = {"max_tokens": max_tokens, "kv_bits": case.get("kv_bits"), "kv_group_size": 32}
        if case.get("kv_bits"):
            options["quantized_kv_start"] = 0
        ref_options = {**options, "max_kv_size": case.get("max_kv_size")}
        if case.get("temp"):
            options["sampler"] = make_sampler(temp=case["temp"])
        plain_logprobs: list[mx.array] = []
        ref_pairs = list(
            generate_step(prompt, reference, logits_processors=processors, prefill_step_size=8, **ref_options)
        )
        ref = [int(t) for t, _ in ref_pairs]
        if case.get("share"):  # share_logprobs: every rank yields the last rank's log-probabilities
            plain_logprobs = [lp for _, lp in ref_pairs]
        seeded: dict[str, Any] = {}
        pipelined = case.get("mode", "serial") != "serial"
        if "seed" in case and pipelined:  # pipelined: mlx-lm's plain decoding, seeded, is what every rank yields
            mx.random.seed(case["seed"])
            pairs_ = list(generate_step(prompt, reference, prefill_step_size=8, **options))
            seeded = {"plain_tokens": [int(t) for t, _ in pairs_]}
            plain_logprobs = [lp for _, lp in pairs_]
            mx.random.seed(case["seed"])
        elif "seed" in case:  # mlx-lm's speculative decoding, seeded: the draws the pipeline must repeat
            mx.random.seed(case["seed"])
            pairs = list(
                speculative_generate_step(
                    prompt,
                    reference,
                    drafts[case["draft"]],
                    num_draft_tokens=case["k"],
                    prefill_step_size=8,
                    **options,
                )
            )
            seeded = {"spec_tokens": [int(t) for t, _, _ in pairs], "spec_logprobs": [lp for _, lp, _ in pairs]}
            seeded["spec_from_draft"] = [bool(d) for _, _, d in pairs]
            mx.random.seed(case["seed"])
        stops = [ref[case["stop_at"]]] if "stop_at" in case else []
        cache = stage_of(model).new_cache(model, case.get("max_kv_size"))
        calls: list[list[float]] = []  # seeded: each sampler call's rows and its inputs' fingerprint, on this rank
        if seeded and not pipelined:
            plain = options["sampler"]

            def recorded(logprobs: mx.array, plain: Any = plain) -> mx.array:
                head = logprobs[:, :8].astype(mx.float32)
                calls.append([logprobs.shape[0], round(float(mx.sum(mx.where(head > -1e9, head, 0)).item()), 3)])
                return plain(logprobs)

            options = {**options, "sampler": recorded}
        tokens: list[int] = []
        cancel = case.get("cancel_after")  # should_cancel says yes on one rank once it yielded that many tokens
        should_cancel = None
        if cancel is not None and cancel["rank"] == group.rank():

            def should_cancel(after: int = cancel["after"]) -> bool:
                return len(tokens) >= after

        stream = pipemlx.generate_step(
            prompt,
            model,
            prompt_cache=cache,
            logits_processors=processors,
            draft_model=drafts[draft_of(case, group.rank())] if case.get("draft") else None,
            prompt_lookup=case.get("lookup"),
            num_draft_tokens=case.get("k", 3),
            stop_tokens=stops,
            prefill_step_size=8,
            speculation=case.get("mode", "serial"),
            should_cancel=should_cancel,
            share_logprobs=bool(case.get("share")),
            timeout=case.get("timeout"),  # a rank that misses the stop then fails the test in seconds, not hangs
            **options,
        )
        drift = 0.0  # the largest difference from mlx-lm's seeded log-probabilities (the last rank's)
        from_draft: list[bool] = []
        brk = case.get("break_after")
        try:
            for token, logprobs in stream:
                tokens.append(token)
                from_draft.append(stream.from_draft)
                n = len(tokens) - 1
                if seeded and logprobs is not None and not pipelined and n < len(seeded["spec_logprobs"]):
                    drift = max(drift, float(mx.max(mx.abs(logprobs - seeded["spec_logprobs"][n])).item()))
                if plain_logprobs and n < len(plain_logprobs):  # every rank yields them (a sampler shares them)
                    if logprobs is None:
                        drift = float("inf")
                    else:
                        drift = max(drift, float(mx.max(mx.abs(logprobs - plain_logprobs[n])).item()))
                if brk is not None and brk["rank"] == group.rank() and len(tokens) == brk["after"]:
                    break
                kill = case.get("kill")  # this rank dies mid-request, after reporting the cases before
                if kill is not None and kill["rank"] == group.rank() and len(tokens) == kill["after"]:
                    print(json.dumps({"rank": group.rank(), "results": results, "killed": True}), flush=True)
                    os._exit(0)
            stream.close()
        except RuntimeError as exc:  # PipelineMismatchError, PeerLostError, PipelineTimeoutError, the draft's own
            stop = getattr(stream, "stop", None)
            ended = {} if stop is None else {"stop": [stop.reason, stop.tokens], "stop_ranks": list(stop.ranks)}
            results.append({"name": case["name"], "error": f"{type(exc).__name__}: {exc}", **ended})
            continue
        stop = stream.stop
        results.append(
            {
                "name": case["name"],
                "tokens": tokens,
                "reference": ref,
                "offset": cache[0].offset,
                "prompt": prompt.size,
                "guesses": list(stream.guesses),
                "decided": stream.decided,
                "speculating": stream.speculating,
                "pipelined": stream.pipelined,
                "stop": None if stop is None else [stop.reason, stop.tokens],
                "stop_ranks": [] if stop is None else list(stop.ranks),
                "stop_tokens": stops,
                "rotating": any(isinstance(c, RotatingKVCache) for c in cache),
                "from_draft": from_draft,
                **{k: v for k, v in seeded.items() if k != "spec_logprobs"},
                "drift": drift,
                "sampler_calls": calls,
            }
        )
    print(json.dumps({"rank": group.rank(), "results": results}), flush=True)
    if any(case.get("kill") for case in spec["cases"]):
        os._exit(0)  # a peer died: a communication may still be blocked inside MLX, leave without its teardown


if __name__ == "__main__":
    main()
