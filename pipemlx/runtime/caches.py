"""Helpers for mlx-lm cache objects that pipemlx needs."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (  # pyright: ignore[reportUnknownVariableType]
    BatchRotatingKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..errors import PipelineError


def _depends(value: mx.array, dependency: mx.array) -> mx.array:
    """``value``, made to depend on ``dependency``: evaluating it evaluates both."""
    return cast(mx.array, mx.depends(value, dependency))  # pyright: ignore[reportUnknownMemberType]


def attach_dependency(cache: Any, array: mx.array) -> None:
    """Make evaluating ``cache.state`` also evaluate ``array``.

    mlx-lm's ``generate_step`` evaluates only the caches' state while it prefills
    a prompt. A rank's send and the broadcast of the final hidden state must run
    all the same, or the next rank waits forever, so they are tied to the cache
    of the rank's last local layer. Raises :class:`PipelineError` for a cache
    pipemlx does not know how to tie to.
    """
    sub_caches = getattr(cache, "caches", None)
    if isinstance(sub_caches, (list, tuple)) and sub_caches:
        attach_dependency(sub_caches[0], array)
        return
    keys = getattr(cache, "keys", None)
    if isinstance(keys, mx.array):
        cache.keys = _depends(keys, array)
        return
    if isinstance(keys, (tuple, list)) and keys and isinstance(keys[0], mx.array):
        # A QuantizedKVCache: (packed, scales, biases), a list straight from mx.quantize.
        parts = cast(list[mx.array], list(keys))  # pyright: ignore[reportUnknownArgumentType]
        cache.keys = type(keys)([_depends(parts[0], array), *parts[1:]])  # pyright: ignore[reportUnknownArgumentType]
        return
    arrays = getattr(cache, "cache", None)
    if isinstance(arrays, list):
        for i, entry in enumerate(arrays):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            if isinstance(entry, mx.array):
                arrays[i] = _depends(entry, array)
                return
    raise PipelineError(
        f"cannot tie the pipeline's send to a {type(cache).__name__} that holds no array yet; "
        "the last local layer must update its cache"
    )


def quantized_dims(model: nn.Module) -> tuple[int, ...]:
    """The last dimensions (sorted, distinct) of the keys and values that ``kv_bits`` would quantize.

    Call it on the whole, unsharded model: one token goes through it on fresh
    caches without being evaluated (MLX knows the shapes before computing
    anything, so no weight is read), and every cache mlx-lm's
    ``maybe_quantize_kv_cache`` would quantize (one with ``to_quantized``)
    gives its keys' and values' widths. ``()`` when the model holds no such
    cache or cannot be run that way.
    """
    try:
        caches: list[Any] = make_prompt_cache(model)
        model(mx.array([[0]], dtype=mx.int32), cache=caches)
    except Exception:  # an architecture that cannot be probed this way keeps the plain check
        return ()
    dims: set[int] = set()
    for cache in caches:
        keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
        if hasattr(cache, "to_quantized") and isinstance(keys, mx.array) and isinstance(values, mx.array):
            dims.update((keys.shape[-1], values.shape[-1]))
    return tuple(sorted(dims))


def cannot_quantize(cache: Any) -> bool:
    """Whether mlx-lm's ``maybe_quantize_kv_cache`` would try to quantize ``cache`` and fail.

    A ``RotatingKVCache`` (a sliding-window layer's, or any layer's with
    ``max_kv_size``) has a ``to_quantized`` that raises ``NotImplementedError``
    once the cache reaches ``quantized_kv_start``; mlx-lm cannot quantize it either.
    """
    return hasattr(cache, "to_quantized") and isinstance(cache, (RotatingKVCache, BatchRotatingKVCache))


def unquantizable_layers(model: nn.Module, max_kv_size: int | None = None) -> tuple[tuple[int, str], ...]:
    """``(layer, cache class)`` for each cache of ``make_prompt_cache(model, max_kv_size)`` that ``kv_bits`` cannot quantize.

    Call it on the whole, unsharded model (layer indices are the model's): the
    answer is then the same on every rank, whatever layers it keeps. ``()``
    when the model makes no such cache or its caches cannot be made.
    """
    try:
        caches: list[Any] = make_prompt_cache(model, max_kv_size=max_kv_size)
    except Exception:  # an architecture whose caches cannot be made this way: nothing known to refuse
        return ()
    return tuple((i, type(c).__name__) for i, c in enumerate(caches) if cannot_quantize(c))


def cache_parts(cache: list[Any]) -> list[Any]:
    """The layer caches of ``cache`` with each ``CacheList`` opened into its parts, in order.

    (``lend_heads``: the first layer after a cut keeps its own cache and the lent heads'.)
    """
    parts: list[Any] = []
    for c in cache:
        inner = getattr(c, "caches", None)
        parts.extend(cache_parts(list(cast(list[Any], inner))) if isinstance(inner, (list, tuple)) else [c])
    return parts


def cache_state(cache: list[Any]) -> list[Any]:
    """The arrays to evaluate so that every cache holds what was computed into it."""
    return [c.state for c in cache]


def cache_offset(cache: list[Any]) -> int:
    """How many positions ``cache`` already holds (a reused prefix): the first layer cache's offset.

    Caches without positions (linear-attention state) count as 0 unless
    another layer's cache has an offset; all layers of one prompt agree.
    """
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
        sub_caches = getattr(c, "caches", None)
        if isinstance(sub_caches, (list, tuple)):
            inner = cache_offset(list(cast(list[Any], sub_caches)))
            if inner:
                return inner
    return 0


UNCOUNTED = -1
""":func:`counted_offset` of caches that hold state but count no positions (linear attention, convolutions)."""


def counted_offset(cache: list[Any]) -> int:
    """:func:`cache_offset`, or :data:`UNCOUNTED` when no layer cache counts positions and some holds state.

    A rank whose local layers all keep a recurrent state (linear attention,
    convolutions, Mamba) cannot tell how long a reused prefix is; the ranks
    whose caches count positions agree on it for that rank.
    """
    counts = any(isinstance(getattr(c, "offset", None), int) for c in cache_parts(cache))
    if counts or all(_says(c, "empty") for c in cache):
        return cache_offset(cache)
    return UNCOUNTED


def always_trimmable(cache: list[Any]) -> bool:
    """Whether every layer cache can be cut back at any length: no rotating window (which cannot once it is
    full) and no recurrent state (which never can)."""
    return all(not isinstance(c, RotatingKVCache) and _says(c, "is_trimmable") for c in cache_parts(cache))


def _says(cache: Any, question: str) -> bool:
    """Whether ``cache`` has the method ``question`` and it answers yes."""
    answer = getattr(cache, question, None)
    return callable(answer) and bool(answer())


def trim_to(cache: list[Any], length: int) -> bool:
    """Cut every cache back to its first ``length`` positions; False (and no change) if one cannot be trimmed."""
    if not all(hasattr(c, "is_trimmable") and c.is_trimmable() for c in cache):
        return False
    for c in cache:
        excess = _positions(c) - length
        if excess > 0:
            c.trim(excess)
    return True


def _positions(cache: Any) -> int:
    """How many positions one layer's cache holds: its offset (mlx-lm's ``QuantizedKVCache`` has no ``size()``),
    the most of its parts' (a ``CacheList``), else its ``size()``."""
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int):
        return offset
    parts = getattr(cache, "caches", None)
    if isinstance(parts, (list, tuple)):
        return max((_positions(c) for c in cast(list[Any], parts)), default=0)
    return int(cache.size())
