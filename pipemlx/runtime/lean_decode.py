"""lean_generate_step: :func:`pipemlx.generate_step`'s token ids alone, for callers that want no log-probabilities."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .generate import Sampler, generate_step


def lean_generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    prompt_cache: list[Any],
    max_tokens: int = 256,
    sampler: Sampler | None = None,
) -> Generator[int, None, None]:
    """Yield up to ``max_tokens`` token ids, the same on every rank: :func:`pipemlx.generate_step`'s tokens.

    Call it on every rank with the same ``prompt`` (usually ``prompt[-1:]``
    after :func:`pipemlx.pipeline_prefill`) and cache. Stopping early on any
    rank stops every rank at the same token; nothing is left in flight.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
    steps = generate_step(
        prompt, model, prompt_cache=prompt_cache, max_tokens=max_tokens, sampler=sampler, logprobs=False
    )
    for token, _ in steps:
        yield token
