"""Rank program: pipelined prefill + decode against single-device mlx-lm, in one process per rank.

Reads a JSON spec from argv[1]; prints one JSON line with what this rank saw.
Every rank also runs the reference (the whole model, no pipeline) itself, so
the parent test compares each rank against single-device mlx-lm.

Spec: {"arch", "config"?, "seed", "split"?, "lend"? (default: shard_model's, "auto"), "layer_costs"?, "max_tokens", "steps": [...]}
("layer_costs": [chunk_s, token_s, attention_s] that lend="auto" decides from instead of timing a layer) where a step is
  {"kind": "pipeline", "M", "step"}        pipeline_prefill then generate_step(prompt[-1:])
  {"kind": "plain", "M", "step", "args"?}  generate_step on the sharded model, no pipeline_prefill
  {"kind": "pipemlx", "M", "step", "args"?} pipemlx.generate_step on the sharded model
("args": more keyword arguments for both decodes and the reference's, e.g. kv_bits or max_kv_size.)
  {"kind": "auto", "M"}                    pipeline_prefill(prefill_step_size="auto"), the reference at the step it returns
  {"kind": "queue_exception"}              a send_mode(model, "queue") block left by an exception
Reports {"rank", "size", "steps": [...]}. Or {"cases": {name: spec, ...}}: several such specs in one launch
(each with its own reference and sharded model, one after the other on the same group), reported as
{"rank", "size", "cases": {name: [step reports]}}; one launch instead of one per spec saves every rank's
start-up (importing MLX and mlx-lm), which costs more than a tiny case.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
import pipemlx.models.lending as lending
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.costmodel import LayerCosts
from pipemlx.testing import build_model, tiny_config

TIMED_LAYER_COSTS = lending.group_layer_costs


def prompt_of(length: int, vocab: int, seed: int) -> mx.array:
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(seed + 7919 * length)).astype(mx.int32)


def decode(
    prompt: mx.array,
    model: Any,
    cache: list[Any] | None,
    step: int,
    max_tokens: int,
    logprobs: list[Any] | None = None,
    **args: Any,
) -> tuple[list[int], list[list[int]]]:
    """mlx-lm's tokens and progress calls; each token's logprobs appended to ``logprobs`` when given."""
    calls: list[list[int]] = []
    kept = logprobs if logprobs is not None else []
    tokens = [
        int(t)
        for t, lp in generate_step(
            prompt,
            model,
            prompt_cache=cache,
            prefill_step_size=step,
            max_tokens=max_tokens,
            prompt_progress_callback=lambda a, b: calls.append([a, b]),
            **args,
        )
        if kept.append(lp) is None
    ]
    return tokens, calls


def layer_caches(cache: list[Any]) -> list[Any]:
    """The caches of ``cache``, an mlx-lm ``CacheList`` (lend_heads: a layer's own and the lent heads') opened."""
    return [inner for c in cache for inner in getattr(c, "caches", (c,))]


def compare_logprobs(logprobs: list[Any], ref_logprobs: list[Any]) -> dict[str, Any]:
    """How many of this rank's tokens came with logprobs (pipemlx.generate_step: the last rank's only; mlx-lm's
    generate_step on the sharded model: every rank's), and the largest difference from the reference's."""
    compared = [(a, b) for a, b in zip(logprobs, ref_logprobs) if a is not None]
    diff = max((float(mx.max(mx.abs(a - b))) for a, b in compared), default=None)
    return {"logprobs_compared": len(compared), "logprob_diff": diff}


def use_layer_costs(costs: list[float] | None) -> None:
    """lend="auto" decides from these layer costs (chunk_s, token_s, attention_s) instead of timing a layer:
    a count known in advance, whatever the machine's load. ``None``: timed, as in production."""
    lending.group_layer_costs = (  # pyright: ignore[reportAttributeAccessIssue]
        TIMED_LAYER_COSTS if costs is None else lambda model, layer, info, group: LayerCosts(*costs)
    )


def run_case(spec: dict[str, Any], group: mx.distributed.Group) -> list[dict[str, Any]]:
    config = tiny_config(spec["arch"], **spec.get("config", {}))
    use_layer_costs(spec.get("layer_costs"))
    reference = build_model(config, seed=spec["seed"])
    model = pipemlx.shard_model(
        build_model(config, seed=spec["seed"]),
        group,
        split=spec.get("split"),
        lend=spec.get("lend", "auto"),
    )
    max_tokens = spec["max_tokens"]
    seen: list[dict[str, Any]] = []
    for s in spec["steps"]:
        entry: dict[str, Any] = dict(s)
        if s["kind"] == "queue_exception":
            try:
                stage = stage_of(model)
                with pipemlx.send_mode(model, "queue"), stage.executing_plan():
                    model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model))  # queues a send (rank < last)
                    entry["queued_inside"] = len(stage.send_queue)
                    raise KeyError("left by an exception")
            except KeyError:
                pass
            entry["mode_after"] = stage_of(model).mode
            entry["queued_after"] = len(stage_of(model).send_queue)
            seen.append(entry)
            continue
        entry["lent_heads"] = stage_of(model).info.lending.heads  # lend="auto": the count this rank chose
        prompt = prompt_of(s["M"], config["vocab_size"], spec["seed"])
        if s["kind"] == "auto":
            cache = make_prompt_cache(model)
            calls = []
            step = pipemlx.pipeline_prefill(
                model,
                prompt,
                cache,
                prefill_step_size="auto",
                prompt_progress_callback=lambda a, b: calls.append([a, b]),
            )
            entry["step"], entry["progress"] = step, calls
            auto_logprobs: list[Any] = []
            auto_ref_logprobs: list[Any] = []
            entry["tokens"], _ = decode(prompt[-1:], model, cache, step, max_tokens, auto_logprobs)
            entry["ref_tokens"], _ = decode(prompt, reference, None, step, max_tokens, auto_ref_logprobs)
            entry |= compare_logprobs(auto_logprobs, auto_ref_logprobs)
            seen.append(entry)
            continue
        args = s.get("args", {})
        ref_logprobs: list[mx.array] = []
        logprobs: list[mx.array | None] = []
        ref_tokens, ref_calls = decode(prompt, reference, None, s["step"], max_tokens, ref_logprobs, **args)
        # generate_step reports (M, M) after its first token; the prefill part is everything before.
        entry["ref_tokens"], entry["ref_progress"] = ref_tokens, ref_calls[:-1]
        if s["kind"] == "plain":
            entry["tokens"], calls = decode(prompt, model, None, s["step"], max_tokens, logprobs, **args)
            entry["progress"] = calls[:-1]
        elif s["kind"] == "pipemlx":
            calls = []
            steps = pipemlx.generate_step(
                prompt,
                model,
                prefill_step_size=s["step"],
                max_tokens=max_tokens,
                prompt_progress_callback=lambda a, b: calls.append([a, b]),
                **args,
            )
            entry["tokens"] = [int(t) for t, lp in steps if logprobs.append(lp) is None]
            entry["progress"] = calls[:-1]
        else:
            cache = make_prompt_cache(model)
            calls: list[list[int]] = []
            pipemlx.pipeline_prefill(
                model,
                prompt,
                cache,
                prefill_step_size=s["step"],
                prompt_progress_callback=lambda a, b: calls.append([a, b]),
            )
            entry["progress"] = calls
            entry["cache_offsets"] = sorted({c.offset for c in layer_caches(cache)})
            entry["tokens"], _ = decode(prompt[-1:], model, cache, s["step"], max_tokens, logprobs)
        entry |= compare_logprobs(logprobs, ref_logprobs)
        seen.append(entry)
    # generate_step leaves one forward pass in flight; let it finish on every rank before going on.
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    return seen


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    report: dict[str, Any] = {"rank": group.rank(), "size": group.size()}
    if "cases" in spec:
        report["cases"] = {name: run_case(case, group) for name, case in spec["cases"].items()}
    else:
        report["steps"] = run_case(spec, group)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
