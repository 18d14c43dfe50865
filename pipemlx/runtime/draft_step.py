"""A draft model's forward over a few tokens, compiled.

A small draft's forward on a CPU costs MLX's per-operation dispatch far more
than arithmetic (measured: 1.0-1.7 ms for the demo's 2-layer draft, most of it
dispatching and Python building the graph). :func:`mx.compile` replays a traced
forward as one fused graph, but a trace is tied to its inputs' shapes and to
the Python values it saw, and mlx-lm's ``KVCache`` changes both at every token
(its offset is an int, what it returns grows). :class:`FixedKVCache` keeps them
still: room for a fixed number of positions, its offset an array, attention over
every position with those at or past the offset masked. Then one trace serves
every position (until the cache grows, by doubling), and the forward costs about
half (0.7 ms against 1.7 ms, same process, same draft).

:func:`compiled_forward` checks a model against mlx-lm's own cache before it
lends it the compiled forward, so a model that reads the cache in another way (a window,
an offset used as an int, a cache of another kind) keeps mlx-lm's forward.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import KVCache, make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

ROOM_STEP = 256
"""A :class:`FixedKVCache` holds a multiple of this many positions (it doubles when it grows)."""
COMPILED_TOKENS = 4
"""A draft reads at most this many tokens at once through its compiled forward (each count is traced once)."""
PROBE = (1, 2, 3, 4, 5, 6)
"""The token ids of the check in :func:`compiled_forward`."""
PROBE_READS = (2, 3, 1)
"""How the check reads :data:`PROBE`: as a prompt, then through the compiled forward (several tokens, then one)."""
PROBE_TOLERANCE = 1e-3
"""How far the compiled forward's logits may be from mlx-lm's, relative to the largest logit (rounding, not a bug)."""


class FixedKVCache:
    """A layer's keys and values with room for a fixed number of positions; what it holds is ``length`` of them.

    It answers what mlx-lm's models ask of a cache (``offset``, ``update_and_fetch``,
    ``make_mask``, ``trim``), with the offset an array and every array's shape the
    same whatever the offset, so a compiled forward is traced once. Only
    :meth:`make_room` changes the room, before a forward, never inside one.
    """

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.room = 0
        self.length = 0
        self.offset = mx.array(0, dtype=mx.int32)

    def make_room(self, positions: int) -> None:
        """Room for at least ``positions`` positions (the keys' shape is known after the first forward)."""
        if positions <= self.room:
            return
        room = max(ROOM_STEP, self.room)
        while room < positions:
            room *= 2
        if self.keys is not None and self.values is not None:
            self.keys = _padded(self.keys, room)
            self.values = _padded(self.values, room)
        self.room = room

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:
            batch, heads, _, dims = keys.shape
            self.keys = mx.zeros((batch, heads, self.room, dims), dtype=keys.dtype)
            self.values = mx.zeros((batch, heads, self.room, values.shape[-1]), dtype=values.dtype)
        at = mx.reshape(self.offset, (1,))
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        self.offset = self.offset + keys.shape[2]
        self.length += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Query ``i`` (at position ``offset + i``) sees the positions up to its own."""
        del return_array  # always an array
        if window_size is not None:
            raise ValueError("a sliding window needs mlx-lm's own cache")
        return mx.arange(self.room)[None, :] <= (self.offset + mx.arange(n))[:, None]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (they are masked, then overwritten)."""
        n = min(n, self.length)
        self.length -= n
        self.offset = mx.array(self.length, dtype=mx.int32)
        return n

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values, self.offset) if a is not None]


class CompiledForward:
    """``model``'s forward over up to :data:`COMPILED_TOKENS` tokens, compiled once per count, over the
    :class:`FixedKVCache` s of any of its drafts.

    The trace runs the model over caches of its own, set to the arrays it is
    given; a call then reads the tokens into the caller's caches and returns
    their logits (shape ``(1, n, vocabulary)``). A cache that grew is traced again.
    """

    def __init__(self, model: nn.Module, layers: int) -> None:
        self.model = model
        self.weights = _weights(model)  # a trace holds the weights it saw: other weights need another one
        self.traced = [FixedKVCache() for _ in range(layers)]
        self.compiled = mx.compile(self._forward)

    def holds_weights_of(self, model: nn.Module) -> bool:
        """Whether ``model``'s parameters are still the arrays this forward was traced with."""
        now = _weights(model)
        return len(now) == len(self.weights) and all(a is b for a, b in zip(now, self.weights))

    def __call__(self, tokens: mx.array, caches: list[FixedKVCache]) -> mx.array:
        length, count = caches[0].length, tokens.size
        for cache in caches:
            cache.make_room(length + count)
        arrays = [a for cache in caches for a in (cache.keys, cache.values) if a is not None]
        if len(arrays) != 2 * len(caches):  # nothing read yet: the keys' shape is not known
            return read(self.model, caches, tokens)
        offset = caches[0].offset
        logits, *updated = self.compiled(tokens, offset, *arrays)
        for i, cache in enumerate(caches):
            cache.keys, cache.values = updated[2 * i], updated[2 * i + 1]
            cache.offset, cache.length = offset + count, length + count
        return logits

    def _forward(self, tokens: mx.array, offset: mx.array, *arrays: mx.array) -> list[mx.array]:
        for i, cache in enumerate(self.traced):
            cache.keys, cache.values, cache.offset = arrays[2 * i], arrays[2 * i + 1], offset
            cache.room = arrays[2 * i].shape[2]
        logits = cast(mx.array, self.model(tokens[None], cache=self.traced))
        return [logits, *(a for cache in self.traced for a in (cache.keys, cache.values) if a is not None)]


_ATTRIBUTE = "_pipemlx_compiled_forward"


def compiled_forward(model: nn.Module) -> CompiledForward | None:
    """``model``'s :class:`CompiledForward`, made and checked once per model; ``None`` where it may not have one.

    A model has one only if its every layer takes mlx-lm's plain ``KVCache`` and
    the compiled forward's logits over :data:`PROBE` (several tokens at once, then
    one) agree with mlx-lm's forward. Else its drafts keep mlx-lm's cache and
    forward: a model that reads the cache in another way (a window, its offset as
    an int) is never given a wrong one. A model whose weights were replaced since
    (``model.update``, ``load_weights``) gets a new one.
    """
    if hasattr(model, _ATTRIBUTE):
        known = cast(CompiledForward | None, getattr(model, _ATTRIBUTE))
        if known is None or known.holds_weights_of(model):
            return known
    caches = make_prompt_cache(model)
    forward = CompiledForward(model, len(caches)) if all(type(c) is KVCache for c in caches) else None
    if forward is not None and not _agrees(model, forward):
        forward = None
    object.__setattr__(model, _ATTRIBUTE, forward)  # beside the model's parameters, not among them
    return forward


def read(model: nn.Module, caches: list[Any], tokens: mx.array) -> mx.array:
    """``model``'s logits over ``tokens`` (shape ``(n,)``), read into ``caches`` (a :class:`FixedKVCache` makes
    room first)."""
    for cache in caches:
        if isinstance(cache, FixedKVCache):
            cache.make_room(cache.length + tokens.size)
    return cast(mx.array, model(tokens[None], cache=caches))


def _agrees(model: nn.Module, forward: CompiledForward) -> bool:
    """Whether ``forward`` over :class:`FixedKVCache` s gives mlx-lm's logits over :data:`PROBE`, read in
    :data:`PROBE_READS` (the first read as a prompt is, the others through ``forward``)."""
    vocabulary = _vocabulary(model)
    if vocabulary is None:
        return False
    reference = make_prompt_cache(model)
    caches = [FixedKVCache() for _ in reference]
    try:
        expected: list[mx.array] = []
        got: list[mx.array] = []
        start = 0
        for i, count in enumerate(PROBE_READS):
            tokens = mx.array([t % vocabulary for t in PROBE[start : start + count]], dtype=mx.int32)
            start += count
            expected.append(cast(mx.array, model(tokens[None], cache=reference))[0])
            got.append((read(model, caches, tokens) if i == 0 else forward(tokens, caches))[0])
        want, have = mx.concatenate(expected), mx.concatenate(got)
        scale = max(1.0, cast(float, mx.max(mx.abs(want)).item()))
        return cast(float, mx.max(mx.abs(want - have)).item()) <= PROBE_TOLERANCE * scale
    except Exception:  # a model that asks the cache what this one does not answer: mlx-lm's forward
        return False


def _weights(model: nn.Module) -> list[mx.array]:
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return [array for _, array in leaves]


def _vocabulary(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _padded(array: mx.array, room: int) -> mx.array:
    *lead, length, dims = array.shape
    return mx.concatenate([array, mx.zeros((*lead, room - length, dims), dtype=array.dtype)], axis=2)
