"""Lean decoding: only the last rank applies the head and samples; the token id travels, not logits.

mlx-lm's ``generate_step`` on a sharded model works as is (the default, see
:func:`pipemlx.shard_model`): every rank receives the final hidden state and
applies the norm and head itself. :func:`lean_generate_step` is the opt-in
alternative: per token, each rank runs its layers and sends on, the last rank
computes the logits and samples, and one 4-byte token id reaches every rank.
The head is read from memory by one rank instead of all of them (on one
machine the ranks share its memory bandwidth), and the sampler runs on the
last rank only, so a random sampler needs no seed shared across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.generate import generation_stream  # pyright: ignore[reportUnknownVariableType]

from .caches import cache_state
from .stage import stage_of

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def lean_generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    prompt_cache: list[Any],
    max_tokens: int = 256,
    sampler: Sampler | None = None,
) -> Generator[int, None, None]:
    """Yield up to ``max_tokens`` token ids, the same on every rank, decoding from ``prompt``.

    Call it on every rank with the same ``prompt`` (usually ``prompt[-1:]``
    after :func:`pipemlx.pipeline_prefill`) and cache. With the default greedy
    sampler the tokens equal mlx-lm's ``generate_step`` on one process. Unlike
    ``generate_step`` it leaves no forward pass in flight when it stops.
    """
    stage = stage_of(model)
    stage.check_usable()
    if not isinstance(max_tokens, int) or max_tokens < 0:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D array of token ids, got shape {tuple(prompt.shape)}")
    sample = sampler or greedy

    def step(tokens: mx.array) -> mx.array:
        with mx.stream(generation_stream), stage.without_broadcast():  # pyright: ignore[reportUnknownArgumentType]
            output = cast(mx.array, model(tokens[None], cache=prompt_cache))
            if stage.is_last:
                logits = output[:, -1, :]
                share = sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.int32)
            else:  # a zero share, issued only after this rank's send (tied to its cache)
                leaves = cast(list[tuple[str, Any]], tree_flatten(cache_state(prompt_cache)))
                evaluated = [a for _, a in leaves if isinstance(a, mx.array)]
                share = cast(mx.array, mx.depends(mx.zeros((1,), dtype=mx.int32), evaluated))  # pyright: ignore[reportUnknownMemberType]
            return mx.distributed.all_sum(share, group=stage.group) if stage.world_size > 1 else share

    if max_tokens == 0:
        return
    token = step(prompt)
    mx.async_eval(token)  # pyright: ignore[reportUnknownMemberType]
    for n in range(max_tokens):
        upcoming = step(token) if n + 1 < max_tokens else None
        if upcoming is not None:
            mx.async_eval(upcoming)  # pyright: ignore[reportUnknownMemberType]
        yield cast(int, token.item())
        if upcoming is None:
            break
        token = upcoming
