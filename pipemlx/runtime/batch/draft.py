"""A draft model's guesses for every guessing row of a batch, one draft forward a step for all of them.

Drafting row after row costs a draft forward per row and guess, and a small draft's forward costs MLX's
per-operation dispatch far more than arithmetic (docs/batching.md, "A draft model in the batch"). Here the rows'
draft caches are one mlx-lm ``BatchKVCache`` per draft layer, left-padded as the target's batch caches are, and
every step feeds all rows at once:

1. A row that guesses for the first time reads its history but the last token alone, into a ``KVCache`` of its
   own, at most :data:`JOIN_TOKENS` tokens a draw for all such rows together (a long prompt is read over several
   ticks, as the target's prefill is chunked, rather than stalling every stream in one tick; the row guesses
   nothing meanwhile), and joins the batch (``merge``, ``extend``) once it has read them all.
2. Each row's cache is cut back to the longest prefix it shares with its row's history (the guesses its row
   rejected; :func:`~.cut.cut_rows`, per row), then every row reads what it lacks of its history (at least its
   last token), right-padded to the longest such read, and the padding is cut off again; the logits at each
   row's last real position give its first guess.
3. ``k - 1`` more steps feed every row's latest guess (greedy: the argmax), one position a row.

Rows that are in the batch but are not asked for guesses this time (an ``"auto"`` probe asks one row) feed
padding that is cut off again, and their unused guesses stay in their caches as :data:`UNKNOWN` positions until
their next draw cuts them off. Every rank runs the same steps on the same histories, so every rank draws the
same guesses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..speculative import DRAFT_PREFILL_STEP, common_prefix
from .cut import cut_rows

JOIN_TOKENS = 256
"""The most history tokens the rows that have not joined yet read in one draw, together: a bound on what joining
adds to a tick (the cost of reading a prompt: docs/batching.md, "A draft model in the batch")."""
UNKNOWN = -1
"""A position of a row's draft cache whose token is not known (a row that read nothing in a step fed padding,
then guesses of its own): it matches no history token, so the next draw cuts it off."""


class BatchDraft:
    """One draft model's caches for the rows of a batch, and the tokens each row's cache holds."""

    def __init__(self, model: nn.Module, join_tokens: int = JOIN_TOKENS) -> None:
        self.model = model
        self.join_tokens = join_tokens
        self.caches: list[Any] = []  # one BatchKVCache per draft layer; empty while no row has joined
        self.uids: list[int] = []  # per row, in order
        self.held: list[list[int]] = []  # per row: the tokens its cache holds
        self.joining: dict[int, tuple[list[Any], list[int]]] = {}  # per uid not joined yet: its cache, tokens read
        self.read: dict[int, int] = {}  # per uid: the history tokens its last draw read

    def __contains__(self, uid: int) -> bool:
        return uid in self.uids

    def __len__(self) -> int:
        return len(self.uids)

    def backlog(self, uid: int, history: Sequence[int]) -> int:
        """How many of ``history``'s tokens the row's draft would read before guessing (all, before it joined)."""
        if uid in self.joining:
            return len(history) - len(self.joining[uid][1])
        if uid not in self.uids:
            return len(history)
        return len(history) - common_prefix(self.held[self.uids.index(uid)], history)

    def drop(self, uids: set[int]) -> None:
        """Rows whose requests left: out of the batch caches."""
        keep = [i for i, u in enumerate(self.uids) if u not in uids]
        for uid in uids:
            self.read.pop(uid, None)
            self.joining.pop(uid, None)
        if len(keep) == len(self.uids):
            return
        self.uids = [self.uids[i] for i in keep]
        self.held = [self.held[i] for i in keep]
        if not keep:
            self.caches = []
            return
        for cache in self.caches:
            cache.filter(keep)

    def propose(self, asked: Mapping[int, tuple[Sequence[int], int]]) -> dict[int, list[int]]:
        """``{uid: guesses}`` for the rows ``asked`` (``{uid: (history, count)}``, every count at least 1): each
        row's draft's greedy continuation of its history, ``count`` tokens; none for a row still reading its
        history to join (:data:`JOIN_TOKENS` a draw)."""
        self.read = {}
        self._join([(uid, history) for uid, (history, _) in asked.items() if uid not in self.uids])
        asked = {uid: a for uid, a in asked.items() if uid in self.uids}
        if not asked:
            return {}
        steps = max(count for _, count in asked.values())
        histories = [asked[uid][0] if uid in asked else None for uid in self.uids]
        # 2. Cut each row back to what it shares with its history, then read the rest (at least the last token).
        kept = [
            len(held) if h is None else min(common_prefix(held, h), len(h) - 1)
            for held, h in zip(self.held, histories, strict=True)
        ]
        cut_rows(self.caches, [len(held) - k for held, k in zip(self.held, kept, strict=True)])
        pending = [[] if h is None else list(h[k:]) for h, k in zip(histories, kept, strict=True)]
        width = max(len(p) for p in pending)
        ids = mx.array([p + [0] * (width - len(p)) for p in pending], dtype=mx.int32)
        logits = cast(mx.array, self.model(ids, cache=self.caches))
        cut_rows(self.caches, [width - len(p) for p in pending])
        last = mx.array([max(len(p) - 1, 0) for p in pending], dtype=mx.int32)
        guess = mx.argmax(logits[mx.arange(len(pending)), last], axis=-1).astype(mx.int32)
        chain = [guess]
        for _ in range(steps - 1):
            logits = cast(mx.array, self.model(guess[:, None], cache=self.caches))
            guess = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
            chain.append(guess)
        drawn = cast(list[list[int]], mx.stack(chain, axis=1).tolist())
        for i, (h, k, p) in enumerate(zip(histories, kept, pending, strict=True)):
            if h is None:  # it fed padding (cut off) and then guesses of its own: positions nobody knows
                self.held[i] = self.held[i] + [UNKNOWN] * (steps - 1)
                continue
            self.held[i] = self.held[i][:k] + p + drawn[i][: steps - 1]
            self.read[self.uids[i]] = self.read.get(self.uids[i], 0) + len(p)
        return {uid: drawn[self.uids.index(uid)][:count] for uid, (_, count) in asked.items()}

    def _join(self, rows: list[tuple[int, Sequence[int]]]) -> None:
        """Rows not in the batch read their histories but the last token, each into a cache of its own, at most
        :attr:`join_tokens` tokens in all (in order); those that read them all join the batch."""
        budget = self.join_tokens
        ready: list[tuple[int, list[Any], list[int]]] = []
        for uid, history in rows:
            cache, read = self.joining.setdefault(uid, (make_prompt_cache(self.model), []))  # plain KVCaches
            target = list(history[:-1])
            take = min(budget, len(target) - len(read))
            for start in range(len(read), len(read) + take, DRAFT_PREFILL_STEP):
                chunk = target[start : min(start + DRAFT_PREFILL_STEP, len(read) + take)]
                self.model(mx.array([chunk], dtype=mx.int32), cache=cache)
                mx.eval([c.state for c in cache])  # pyright: ignore[reportUnknownMemberType]
            read.extend(target[len(read) : len(read) + take])
            budget -= take
            self.read[uid] = take
            if len(read) == len(target):
                ready.append((uid, cache, read))
                del self.joining[uid]
        if not ready:
            return
        for uid, _, read in ready:
            self.uids.append(uid)
            self.held.append(read)
        merged = [ready[0][1][layer].merge([c[layer] for _, c, _ in ready]) for layer in range(len(ready[0][1]))]
        if self.caches:
            for batch, extra in zip(self.caches, merged, strict=True):
                batch.extend(extra)
        else:
            self.caches = merged


__all__ = ["JOIN_TOKENS", "UNKNOWN", "BatchDraft"]
