"""Rank program: quantized KV caches, pipeline against single-device mlx-lm with the same settings.

Spec: {"arch", "config"?, "seed", "max_tokens",
       "runs": [{"M", "step", "kv_bits", "kv_group_size", "quantized_kv_start"}...]}
For each run every rank decodes the prompt with mlx-lm's generate_step on the
whole model (the reference) and with pipeline_prefill + generate_step on its
shard, both with the run's kv settings. Reports tokens, the largest logprob
difference and the cache classes after the prefill and after decoding.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.models.lending import LentHeadsCache
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def kinds(cache: list[Any]) -> list[str]:
    """Each layer cache's class; a layer that borrows heads (lend="auto", the default) keeps a LentHeadsCache,
    whose own part is the cache the whole model's layer has."""
    return [type(c.parts[0] if isinstance(c, LentHeadsCache) else c).__name__ for c in cache]


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    config = tiny_config(spec["arch"], **spec.get("config", {}))
    reference = build_model(config, seed=spec["seed"])
    model = pipemlx.shard_model(build_model(config, seed=spec["seed"]), group)
    reports: list[dict[str, Any]] = []
    for run in spec["runs"]:
        kv = {k: run[k] for k in ("kv_bits", "kv_group_size", "quantized_kv_start")}
        prompt = mx.random.randint(0, config["vocab_size"], (run["M"],), key=mx.random.key(run["M"])).astype(mx.int32)
        ref_cache = make_prompt_cache(reference)
        ref = list(
            generate_step(
                prompt,
                reference,
                prompt_cache=ref_cache,
                prefill_step_size=run["step"],
                max_tokens=spec["max_tokens"],
                **kv,
            )
        )
        cache = make_prompt_cache(model)
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=run["step"], **kv)
        after_prefill = kinds(cache)
        out = list(generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"], **kv))
        mx.synchronize(generation_stream)
        mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
        local = stage_of(model).info.layers
        reports.append(
            {
                **run,
                "tokens": [int(t) for t, _ in out],
                "ref_tokens": [int(t) for t, _ in ref],
                "logprob_diff": max(float(mx.max(mx.abs(a[1] - b[1]))) for a, b in zip(out, ref)),
                "after_prefill": after_prefill,
                "after_decode": kinds(cache),
                "ref_after_decode": [type(c).__name__ for c in ref_cache[local.start : local.stop]],
            }
        )
    print(json.dumps({"rank": group.rank(), "runs": reports}), flush=True)


if __name__ == "__main__":
    main()
