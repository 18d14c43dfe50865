"""Rank program: MLX's peak memory during a pipelined prefill against a control forward pass, per rank.

Spec: {"vocab", "step", "chunks"}. Reports this rank's peak above the weights during pipeline_prefill
(queue mode, the multi-rank path) and during one plain forward pass whose logits are evaluated.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model, tiny_config


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    step = spec["step"]
    model = pipemlx.shard_model(build_model(tiny_config("llama", vocab_size=spec["vocab"])), group)
    prompt = mx.arange(spec["chunks"] * step + 1, dtype=mx.int32) % spec["vocab"]
    mx.eval(prompt)

    cache = make_prompt_cache(model)
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # the weights
    pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=step)
    prefill_peak = mx.get_peak_memory() - before

    control_cache = make_prompt_cache(model)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model(prompt[None, :step], cache=control_cache))  # every rank: the whole model's logits
    control_peak = mx.get_peak_memory() - before
    offsets = sorted({c.offset for c in cache})
    print(json.dumps({"rank": group.rank(), "prefill": prefill_peak, "control": control_peak, "offsets": offsets}))


if __name__ == "__main__":
    main()
