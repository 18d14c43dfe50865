"""Rank program: several architectures in one launch, pipeline against single-device mlx-lm.

Reads a JSON spec from argv[1]:
  {"archs": [{"arch", "split"?}...], "seed", "max_tokens", "prompts": [[M, step]...], "plain": [M, step],
   "reuse": [M, step]}
For each architecture every rank builds the tiny model twice (same seed): one
whole (the reference, mlx-lm's own generate_step) and one sharded. It runs
pipeline_prefill + generate_step(prompt[-1:]) for every prompt, then
pipemlx.generate_step on ``reuse``'s M new tokens with the last prompt's cache
(a reused prefix), and a plain mlx-lm generate_step on the sharded model, and
reports tokens, the largest logprob
difference against the reference, and the local cache kinds next to the
whole model's cache kinds for the same layers. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.models.lending import LentHeadsCache
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def prompt_of(length: int, vocab: int, seed: int) -> mx.array:
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(seed + 7919 * length)).astype(mx.int32)


def decode(
    prompt: mx.array, model: Any, cache: list[Any] | None, step: int, max_tokens: int
) -> tuple[list[int], list[mx.array]]:
    tokens: list[int] = []
    logprobs: list[mx.array] = []
    for token, lp in generate_step(prompt, model, prompt_cache=cache, prefill_step_size=step, max_tokens=max_tokens):
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, logprobs


def cache_kind(cache: Any) -> str:
    """A cache's class and the settings that make it differ from another of its class; a layer that borrows heads
    (lend="auto", the default) keeps a LentHeadsCache whose own part is the one the whole model makes."""
    if isinstance(cache, LentHeadsCache):
        return cache_kind(cache.parts[0])
    inner = getattr(cache, "caches", None)
    if isinstance(inner, (list, tuple)):
        return f"{type(cache).__name__}({', '.join(cache_kind(c) for c in inner)})"
    settings = [f"{k}={getattr(cache, k)}" for k in ("max_size", "keep", "bits") if hasattr(cache, k)]
    size = getattr(cache, "cache", None)
    if isinstance(size, list):
        settings.append(f"size={len(size)}")
    return f"{type(cache).__name__}({', '.join(settings)})"


def largest_difference(a: list[mx.array], b: list[mx.array]) -> float:
    return max((float(mx.max(mx.abs(x - y))) for x, y in zip(a, b)), default=0.0)


def settle(group: mx.distributed.Group) -> None:
    """generate_step leaves a forward pass in flight; finish it on every rank before going on."""
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))


def reuse_prefix(
    model: Any, reference: Any, cache: list[Any], ref_cache: list[Any], spec: dict[str, Any], vocab: int
) -> dict[str, Any]:
    """pipemlx.generate_step on new tokens after the prefix in ``cache``; mlx-lm's on the reference's."""
    length, step = spec["reuse"]
    prompt = prompt_of(length, vocab, spec["seed"] + 1)
    ref_tokens, ref_logprobs = decode(prompt, reference, ref_cache, step, spec["max_tokens"])
    tokens: list[int] = []
    logprobs: list[mx.array] = []
    # S=2 leaves the logprobs on the last rank (with head="all", lazy: every rank shares the output head and the
    # last rank computes the whole head only when they are read, here; with head="split", the default where the
    # architecture allows, every step gathers the whole logits from every rank's rows);
    # S=3 shares them with every rank (the head stays on the last rank).
    stage = stage_of(model)
    shared = stage.world_size == 3
    decoding = pipemlx.generate_step(
        prompt, model, prompt_cache=cache, prefill_step_size=step, max_tokens=spec["max_tokens"], share_logprobs=shared
    )
    for token, lp in decoding:
        tokens.append(token)
        if shared or stage.is_last:
            logprobs.append(cast(mx.array, lp))
    if not logprobs:
        ref_logprobs = []
    return {
        "kind": "reuse",
        "M": length,
        "step": step,
        "tokens": tokens,
        "ref_tokens": ref_tokens,
        "logprob_diff": largest_difference(logprobs, ref_logprobs),
        "shared_head": decoding.shared_head,
        "head": stage.info.head,
    }


def run_arch(entry: dict[str, Any], spec: dict[str, Any], group: mx.distributed.Group) -> dict[str, Any]:
    started = time.perf_counter()
    config = tiny_config(entry["arch"])
    seed, max_tokens = spec["seed"], spec["max_tokens"]
    reference = build_model(config, seed=seed)
    model = pipemlx.shard_model(build_model(config, seed=seed), group, split=entry.get("split"))
    stage = stage_of(model)
    local = stage.info.layers
    report: dict[str, Any] = {
        "arch": entry["arch"],
        "split": list(stage.info.split),
        "cache_kinds": [cache_kind(c) for c in make_prompt_cache(model)],
        "reference_cache_kinds": [cache_kind(c) for c in make_prompt_cache(reference)[local.start : local.stop]],
        "runs": [],
    }
    cache, ref_cache = make_prompt_cache(model), make_prompt_cache(reference)
    for length, step in spec["prompts"]:
        prompt = prompt_of(length, config["vocab_size"], seed)
        ref_cache = make_prompt_cache(reference)
        ref_tokens, ref_logprobs = decode(prompt, reference, ref_cache, step, max_tokens)
        cache = make_prompt_cache(model)
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=step)
        offsets = sorted({int(getattr(c, "offset", -1)) for c in cache if hasattr(c, "offset")})
        tokens, logprobs = decode(prompt[-1:], model, cache, step, max_tokens)
        settle(group)
        report["runs"].append(
            {
                "kind": "pipeline",
                "M": length,
                "step": step,
                "tokens": tokens,
                "ref_tokens": ref_tokens,
                "logprob_diff": largest_difference(logprobs, ref_logprobs),
                "offsets": offsets,
            }
        )
    report["runs"].append(reuse_prefix(model, reference, cache, ref_cache, spec, config["vocab_size"]))
    length, step = spec["plain"]
    prompt = prompt_of(length, config["vocab_size"], seed)
    ref_tokens, ref_logprobs = decode(prompt, reference, None, step, max_tokens)
    tokens, logprobs = decode(prompt, model, None, step, max_tokens)
    settle(group)
    report["runs"].append(
        {
            "kind": "plain",
            "M": length,
            "step": step,
            "tokens": tokens,
            "ref_tokens": ref_tokens,
            "logprob_diff": largest_difference(logprobs, ref_logprobs),
        }
    )
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    reports = [run_arch(entry, spec, group) for entry in spec["archs"]]
    print(json.dumps({"rank": group.rank(), "size": group.size(), "archs": reports}), flush=True)


if __name__ == "__main__":
    main()
