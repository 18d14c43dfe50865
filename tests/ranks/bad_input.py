"""Rank program: bad pipeline_prefill calls raise the same error on every rank; a good one works after."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model, tiny_config


def main() -> None:
    group = init_group()
    config = tiny_config("llama")
    reference = build_model(config)
    model = pipemlx.shard_model(build_model(config), group)
    bad_calls: list[tuple[Any, dict[str, Any]]] = [
        (mx.array([], dtype=mx.int32), {}),
        (mx.arange(10), {"step_size": 0}),
        (mx.arange(10).astype(mx.float32), {}),
        # MLX quantizes with group size 32, but not the tiny llama's 16-wide heads.
        (mx.arange(10), {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}),
    ]
    errors: list[str] = []
    for prompt, kwargs in bad_calls:
        try:
            pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model), **kwargs)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    prompt = mx.arange(20, dtype=mx.int32)
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, prompt, cache, step_size=4)
    tokens = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=5)]
    reference_tokens = [int(t) for t, _ in generate_step(prompt, reference, prefill_step_size=4, max_tokens=5)]
    mx.synchronize(generation_stream)
    # Rank 0 cuts inside its last layer (lend_mlp), rank 1 does not: named before anything is sent.
    lent = pipemlx.shard_model(build_model(config), group, lend_mlp=group.rank() == 0)
    try:
        pipemlx.pipeline_prefill(lent, prompt, make_prompt_cache(lent), step_size=4)
        errors.append("no error")
    except pipemlx.PipelineMismatchError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    print(json.dumps({"errors": errors, "tokens_after": tokens, "reference": reference_tokens}), flush=True)


if __name__ == "__main__":
    main()
