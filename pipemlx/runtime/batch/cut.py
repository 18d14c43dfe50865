"""Cutting rows of mlx-lm ``BatchKVCache`` layers back per row, in place: after a step that fed each row several
positions (its next token and its guesses, padded to the widest row), each row drops the positions it did not
keep, and the rows stay right-aligned at one shared position, as mlx-lm's ``BatchKVCache`` needs them. The batch's
target caches after a step with guesses, and the batched draft's (:mod:`.draft`) after each of its reads.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll  # pyright: ignore[reportUnknownVariableType]

from ..caches import cache_parts


def cut_rows(batch_caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[i]`` positions from mlx-lm ``BatchKVCache`` layers, in place (lazily).

    The rows of a ``BatchKVCache`` end at one shared position (``_idx``; each row left-padded). The batch's end
    goes back by a common count ``c`` (:func:`common_cut`: the one that leaves the fewest rows to move); a row that
    rejected more than ``c`` is moved right by the difference (what it rejected moves past the end, where the next
    step overwrites it) and its left padding grows by as much, as mlx-lm's ``BatchKVCache.finalize`` turns right
    padding into left padding; a row that rejected less is moved left into its own left padding. Its keys keep the
    rotary positions they were computed at, and its offset (its own position) goes back by what it rejected. Moving
    rows copies them whole (every position: the rows stay right-aligned): only the rows that move are copied
    where they are few (a third of the batch or fewer), else the whole cache in one roll. Raises ``TypeError`` for
    a layer of another kind (checked before anything changes).
    """
    parts = cache_parts(batch_caches)
    kinds = sorted({type(p).__name__ for p in parts if type(p) is not BatchKVCache})
    if kinds:
        raise TypeError(f"cannot cut rows of {kinds} back per row: batched speculation needs plain KV caches")
    if not rejected or not parts:
        return
    padding: list[int] = [0] * len(rejected)
    if len(set(rejected)) > 1 and parts[0].keys is not None:  # every layer is cut alike: one has every row's
        padding = cast(list[int], parts[0].left_padding.tolist())
    common = common_cut(rejected, padding)
    shifts = [r - common for r in rejected]
    moving = [i for i, s in enumerate(shifts) if s]
    few = 3 * len(moving) <= len(rejected)  # a few rows move: copy only them
    shift = mx.array(shifts, dtype=mx.int32)  # the same for every layer: made once
    rows = mx.array(moving, dtype=mx.int32)
    by = mx.array([shifts[i] for i in moving], dtype=mx.int32)[:, None]
    for part in parts:
        if common:
            part.trim(common)
        if moving and part.keys is not None:
            if few:
                part.keys[rows] = dynamic_roll(part.keys[rows], by, axis=2)
                part.values[rows] = dynamic_roll(part.values[rows], by, axis=2)
            else:
                part.keys = dynamic_roll(part.keys, shift[:, None], axis=2)
                part.values = dynamic_roll(part.values, shift[:, None], axis=2)
            part.left_padding = part.left_padding + shift
            part.offset = part.offset - shift


def common_cut(rejected: list[int], padding: list[int]) -> int:
    """The count the batch's end goes back by in :func:`cut_rows`: of the rows' ``rejected`` counts, the one the
    most rows share (they need not move), among those every other row can reach: a row that rejected fewer moves
    left by the difference, which its left ``padding`` must hold; the smallest on a tie (the smallest always can)."""
    best, best_staying = min(rejected), -1
    for c in sorted(set(rejected)):
        if any(r < c and p < c - r for r, p in zip(rejected, padding)):
            continue
        staying = sum(1 for r in rejected if r == c)
        if staying > best_staying:
            best, best_staying = c, staying
    return best


__all__ = ["common_cut", "cut_rows"]
