"""Rank program: bad pipeline_prefill calls raise the same error on every rank; a good one works after."""

from __future__ import annotations

import json
import tempfile
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_tokenizer

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model, tiny_config, write_tokenizer

WIDE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}  # head_dim 64
ONE_SLIDING = {**WIDE, "sliding_window": 4, "layer_types": ["full_attention"] * 5 + ["sliding_attention"]}


def rotating_refusals(group: Any) -> dict[str, Any]:
    """kv_bits with rotating caches: refused alike on both ranks, though only rank 1 holds the sliding layer."""
    config = tiny_config("llama", **ONE_SLIDING)
    model = pipemlx.shard_model(build_model(config), group)
    prompt = mx.arange(12, dtype=mx.int32)
    kv: dict[str, Any] = {"kv_bits": 4, "quantized_kv_start": 0}
    with tempfile.TemporaryDirectory() as path:
        write_tokenizer(path, 256)
        tokenizer = load_tokenizer(path)
    calls = [
        lambda: pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model), prefill_step_size=4, **kv),
        lambda: next(pipemlx.generate_step(prompt, model, prefill_step_size=4, **kv)),
        lambda: next(pipemlx.stream_generate(model, tokenizer, prompt, prefill_step_size=4, **kv)),
    ]
    errors: list[str] = []
    for call in calls:
        try:
            call()
            errors.append("no error")
        except ValueError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    tokens = [int(t) for t, _ in pipemlx.generate_step(prompt, model, prefill_step_size=4, max_tokens=4)]
    reference = [int(t) for t, _ in generate_step(prompt, build_model(config), prefill_step_size=4, max_tokens=4)]
    mx.synchronize(generation_stream)
    # A cache list of its own making with rotating caches on rank 1 only: refused at the handshake there.
    plain = pipemlx.shard_model(build_model(tiny_config("llama", **WIDE)), group)
    given = make_prompt_cache(plain) if group.rank() == 0 else [RotatingKVCache(64, keep=4) for _ in plain.layers]
    try:
        pipemlx.pipeline_prefill(plain, prompt, given, prefill_step_size=4, **kv)
        errors.append("no error")
    except (ValueError, pipemlx.PrefillCancelled) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    after = [int(t) for t, _ in pipemlx.generate_step(prompt, plain, prefill_step_size=4, max_tokens=4, **kv)]
    return {"errors": errors, "tokens_after": tokens, "reference": reference, "given_cache_after": after}


def main() -> None:
    group = init_group()
    config = tiny_config("llama")
    reference = build_model(config)
    model = pipemlx.shard_model(build_model(config), group)
    bad_calls: list[tuple[Any, dict[str, Any]]] = [
        (mx.array([], dtype=mx.int32), {}),
        (mx.arange(10), {"prefill_step_size": 0}),
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
    pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=4)
    tokens = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=5)]
    reference_tokens = [int(t) for t, _ in generate_step(prompt, reference, prefill_step_size=4, max_tokens=5)]
    mx.synchronize(generation_stream)
    # Rank 0 cuts inside its last layer (lend="mlp"), rank 1 does not: named before anything is sent.
    lent = pipemlx.shard_model(build_model(config), group, lend="mlp" if group.rank() == 0 else "none")
    try:
        pipemlx.pipeline_prefill(lent, prompt, make_prompt_cache(lent), prefill_step_size=4)
        errors.append("no error")
    except pipemlx.PipelineMismatchError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    # Both cut inside the layer, rank 0 also lends a head (a wider message), rank 1 expects none: named too.
    heads = pipemlx.shard_model(build_model(config), group, lend=int(group.rank() == 0))
    try:
        pipemlx.pipeline_prefill(heads, prompt, make_prompt_cache(heads), prefill_step_size=4)
        errors.append("no error")
    except pipemlx.PipelineMismatchError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    # A sampler on the last rank only: every rank runs the sampler, so the ranks must all have one or none.
    sampler = (lambda logprobs: mx.argmax(logprobs, axis=-1)) if group.rank() == group.size() - 1 else None
    try:
        next(pipemlx.generate_step(prompt, model, prefill_step_size=4, max_tokens=2, sampler=sampler))
        errors.append("no error")
    except pipemlx.PipelineMismatchError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    rotating = rotating_refusals(group)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    report = {"errors": errors, "tokens_after": tokens, "reference": reference_tokens, "rotating": rotating}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
