"""The batch's rows: which request each row of the batch caches holds, and the surgery on those caches.

The batch caches are mlx-lm's (``BatchKVCache``: left-padded; merged, extended, filtered and extracted as
mlx-lm's ``BatchGenerator`` does). A finished or removed request's row stays as a *dead row* until
:meth:`Rows.compact_if_worth_it` filters the dead rows out, and a joining request takes a dead row's place
(:func:`fill_rows`): a ``filter`` or an ``extend`` rebuilds every batch cache, and the decode step after a
rebuild is slower than a steady one (docs/batching.md, "Finished requests"). Every decision here is taken
from data every rank has (the rows, who finished), so the rows keep one order on every rank.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache  # pyright: ignore[reportUnknownVariableType]

from ...schedule.batch_plan import fingerprint
from ..caches import UNCOUNTED, cache_parts, cache_state
from .requests import BatchRequest

COMPACT_DEAD_FRACTION = 0.5
"""Dead rows (finished or removed requests) are filtered out of the batch caches once they are this share of
the rows (or when no live row is left, or a request that joins finds too few of them to take their places)."""
DEAD_ROW_INPUT = 0  # the token a dead row's decode step feeds (its output is ignored)


class Rows:
    """The batch: per row its request (a ``done`` one is a dead row) and next input; per local layer a batch cache.

    Merges, filters and extractions run on ``stream`` (the stage's compute stream); the batch caches are evaluated
    at once after a merge or filter, extracted rows when :meth:`settle` is called.
    """

    def __init__(self, stream: mx.Stream) -> None:
        self.stream = stream
        self.requests: list[BatchRequest] = []  # per row, in order
        self.inputs: list[int] = []  # per row: the token its next step feeds
        self.caches: list[Any] = []  # one batch cache per local layer; empty while there is no row

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def active(self) -> list[BatchRequest]:
        """The live rows' requests, in row order."""
        return [r for r in self.requests if not r.done]

    @property
    def dead(self) -> int:
        return sum(1 for r in self.requests if r.done)

    def row_of(self, request: BatchRequest) -> int | None:
        return next((i for i, r in enumerate(self.requests) if r is request), None)

    def join(self, joining: list[BatchRequest], caches: list[list[Any]]) -> None:
        """Put requests whose prefill every rank completed, with their per-layer ``caches``, into the batch.

        They take the first dead rows' places when there are enough of them (:func:`fill_rows`); otherwise the
        dead rows are filtered out and the requests appended. Which rows they take depends on the rows alone,
        not on what each rank's caches let it do in place.
        """
        dead = [i for i, r in enumerate(self.requests) if r.done]
        if self.caches and len(dead) >= len(joining):
            slots = dead[: len(joining)]
            fill_rows(self.caches, len(self.requests), slots, caches)
            for slot, request in zip(slots, joining):
                self.requests[slot] = request
                self.inputs[slot] = request.prompt[-1]
        else:
            if dead:
                self.compact()
            # Each layer cache's own batch class, as mlx-lm's BatchGenerator does: KVCache -> BatchKVCache.
            merged = [caches[0][layer].merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
            if self.caches:
                for batch, extra in zip(self.caches, merged):
                    batch.extend(extra)
            else:
                self.caches = merged
            self.requests.extend(joining)
            self.inputs = [*self.inputs, *(r.prompt[-1] for r in joining)]
        evaluate(self.caches, self.stream)

    def fed(self, tokens: list[int]) -> None:
        """After a decode step: each live row's next input is its token, a dead row's :data:`DEAD_ROW_INPUT`."""
        self.inputs = [DEAD_ROW_INPUT if r.done else t for r, t in zip(self.requests, tokens)]

    def compact_if_worth_it(self) -> None:
        """Filter the dead rows out once they are at least :data:`COMPACT_DEAD_FRACTION` of the rows.

        Filtering rebuilds every batch cache, while a dead row costs its decode step little. Requests prefilled
        through the ticks join one tick apart and so finish one tick apart: filtering each out at once would pay
        the rebuild once per request.
        """
        dead = self.dead
        if dead and dead >= COMPACT_DEAD_FRACTION * len(self.requests):
            self.compact()

    def compact(self) -> None:
        """Filter the dead rows out of the batch caches (all of them: the caches go)."""
        keep = [i for i, r in enumerate(self.requests) if not r.done]
        self.requests = [self.requests[i] for i in keep]
        self.inputs = [self.inputs[i] for i in keep]
        if not keep:
            self.caches = []
            return
        for c in self.caches:
            c.filter(keep)
        evaluate(self.caches, self.stream)

    def split(self, parts: int) -> list[Rows]:
        """The live rows cut into ``parts`` batches (``parts`` <= live rows), in row order, as even as they go:
        each a new :class:`Rows` whose batch caches hold copies of its rows (this one is left empty)."""
        live = [i for i, r in enumerate(self.requests) if not r.done]
        bounds = [len(live) * k // parts for k in range(parts + 1)]
        cut = [self._copy_of(live[a:b]) for a, b in zip(bounds, bounds[1:])]
        self.requests, self.inputs, self.caches = [], [], []
        return cut

    def absorb(self, others: list[Rows]) -> None:
        """Append the live rows of ``others`` (which are left empty) to this batch, in order (copies of them)."""
        for other in others:
            live = [i for i, r in enumerate(other.requests) if not r.done]
            if live:
                self.compact()
                copy = other._copy_of(live)
                if self.caches:
                    for batch, extra in zip(self.caches, copy.caches):
                        batch.extend(extra)
                else:
                    self.caches = copy.caches
                self.requests += copy.requests
                self.inputs += copy.inputs
            other.requests, other.inputs, other.caches = [], [], []
        evaluate(self.caches, self.stream)

    def _copy_of(self, rows: list[int]) -> Rows:
        """A new batch of rows ``rows`` of this one: their caches extracted and merged again, as a join merges."""
        copy = Rows(self.stream)
        copy.requests = [self.requests[i] for i in rows]
        copy.inputs = [self.inputs[i] for i in rows]
        if rows and self.caches and all(part.empty() for part in cache_parts(self.caches)):
            # Rows that joined without a computed position (one-token prompts) and no step since: mlx-lm's
            # BatchKVCache cannot extract from a cache without keys; a filtered copy holds the same (nothing).
            copy.caches = [deepcopy(c) for c in self.caches]
            with mx.stream(self.stream):
                for c in copy.caches:
                    c.filter(rows)
            evaluate(copy.caches, self.stream)
        elif rows:
            extracted = [self.extract(i) for i in rows]
            with mx.stream(self.stream):
                copy.caches = [
                    extracted[0][layer].merge([c[layer] for c in extracted]) for layer in range(len(extracted[0]))
                ]
            evaluate(copy.caches, self.stream)
        return copy

    def extract(self, row: int) -> list[Any]:
        """Row ``row``'s per-layer caches, taken out of the batch caches (lazy: :meth:`settle` them)."""
        with mx.stream(self.stream):
            return [c.extract(row) for c in self.caches]

    def settle(self, extracted: list[list[Any]]) -> None:
        """Evaluate extracted caches now: a copy of their rows only.

        Left lazy, they would hold the batch caches' current buffers, and the next decode step could not update
        those in place: it would copy every batch cache.
        """
        if extracted:
            evaluate([c for cache in extracted for c in cache], self.stream)

    def uids_fingerprint(self) -> int:
        """Of the rows' uids, a dead row counting as 0."""
        return fingerprint(0 if r.done else r.uid + 1 for r in self.requests)

    def prefixes_fingerprint(self) -> int:
        """Of the rows' reused prefix lengths (a dead row: 0); ``UNCOUNTED`` when this rank cannot count one."""
        if any(not r.done and r.prefix == UNCOUNTED for r in self.requests):
            return UNCOUNTED
        return fingerprint(0 if r.done else r.prefix + 1 for r in self.requests)


def evaluate(caches: list[Any], stream: mx.Stream) -> None:
    """Evaluate ``caches`` (layer caches) now, on ``stream``: local work."""
    with mx.stream(stream):
        mx.eval(cache_state(caches))  # pyright: ignore[reportUnknownMemberType]


def fill_rows(batch_caches: list[Any], rows: int, slots: list[int], caches: list[list[Any]]) -> None:
    """Put request ``k``'s per-layer ``caches[k]`` into row ``slots[k]`` of the ``rows``-row batch caches.

    What those rows held (dead rows) is dropped. A ``BatchKVCache`` layer is written in place: each joining row
    right-aligned at the batch's current position, its left padding the rest (what the dead row left there is
    masked, as padding is). Only when a joining row is longer than the batch's are all rows first moved right
    by the difference (one copy, where ``extend`` makes one or two and the ``filter`` of the dead row another).
    In place, only the joining rows are copied and no batch cache is rebuilt. Any other layer cache is extended
    and then filtered into the same row order.
    """
    for layer, batch in enumerate(batch_caches):
        joining = [c[layer] for c in caches]
        parts, joining_parts = cache_parts([batch]), [cache_parts([c]) for c in joining]
        if all(len(p) == len(parts) and all(map(_fits_in_place, parts, p)) for p in joining_parts):
            for i, part in enumerate(parts):  # a CacheList's parts (lend_heads) alike, in step with the other layers
                _widen(part, max(p[i].offset for p in joining_parts))
                for slot, p in zip(slots, joining_parts):
                    _write_row(part, slot, p[i])
            continue
        batch.extend(joining[0].merge(joining))
        order = list(range(rows))
        for k, slot in enumerate(slots):
            order[slot] = rows + k
        batch.filter(order)


def _fits_in_place(batch: Any, cache: Any) -> bool:
    """Whether ``cache`` (one request's, of the same layer) can be written into a row of ``batch``."""
    return (type(batch), type(cache)) == (BatchKVCache, KVCache) and batch.keys is not None


def _widen(batch: Any, positions: int) -> None:
    """Move every row of ``batch`` (a ``BatchKVCache``) right, so that it holds at least ``positions``."""
    shift = positions - batch.size()
    if shift <= 0:
        return
    keys, values, offset, left_padding, end = batch.state
    widths = [(0, 0), (0, 0), (shift, 0), (0, 0)]
    batch.state = (mx.pad(keys, widths), mx.pad(values, widths), offset, left_padding + shift, end + shift)


def _write_row(batch: Any, row: int, cache: Any) -> None:
    """Row ``row`` of ``batch`` (a ``BatchKVCache``) becomes ``cache``'s positions, right-aligned, left-padded."""
    end, length = batch.size(), cache.offset
    if length:
        batch.keys[row : row + 1, :, end - length : end, :] = cache.keys[..., :length, :]
        batch.values[row : row + 1, :, end - length : end, :] = cache.values[..., :length, :]
    batch.left_padding[row] = end - length
    batch.offset[row] = length
