"""Rank program: two forward passes of a sharded model built before either is evaluated, then one mx.eval.

Reports the error each rank raised (or that the passes ran), then serves one request exactly.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model, tiny_config


def main() -> None:
    group = init_group()
    config = tiny_config("llama")
    reference = build_model(config, seed=1)
    model = pipemlx.shard_model(build_model(config, seed=1), group, timeout=10)
    cache = make_prompt_cache(model)
    report: dict[str, object] = {"rank": group.rank()}
    try:
        first = model(mx.array([[1, 2, 3]]), cache=cache)
        second = model(mx.array([[4, 5]]), cache=cache)
        mx.eval(first, second)
        report["error"] = None
    except pipemlx.PipelineError as exc:
        report["error"] = str(exc)
    prompt = mx.array([7, 8, 9, 10, 11], dtype=mx.int32)
    report["tokens"] = [t for t, _ in pipemlx.generate_step(prompt, model, max_tokens=4, prefill_step_size=2)]
    report["reference"] = [t for t, _ in generate_step(prompt, reference, max_tokens=4, prefill_step_size=2)]
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
