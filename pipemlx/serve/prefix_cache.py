"""The prefix cache: KV caches of recent requests, reused by requests that extend them (LRU, bounded).

Every rank keeps its own :class:`PrefixCache` holding its own layers' caches,
and every rank's copy takes the same decisions: rank 0 plans each request
(:meth:`PrefixCache.plan`, broadcast with the request), every rank then applies
the plan (:meth:`PrefixCache.checkout`) and stores the result
(:meth:`PrefixCache.store`) from data every rank has (the request's tokens and
the agreed generated tokens). Sizes are counted in tokens, never in local bytes,
so that ranks holding different numbers of layers still evict the same entries;
the byte budget becomes a token budget once, at start-up, from the largest
per-token footprint among the ranks.

Entries belong to a partition (the request's :attr:`~.requests.Request.partition`: its API key and
``cache_salt``): a request reuses and extends only its own partition's entries, so that how much of a prompt
was cached (``cached_tokens``, the time to the first token) says nothing about other partitions' prompts.
The budget is shared by all.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..runtime.speculative import common_prefix


@dataclass(frozen=True)
class PrefixReuse:
    """How to start a request: from entry ``entry`` (-1: an empty cache), keeping its first ``reuse`` tokens.

    ``copy``: the entry is longer than what is reused, so it is copied and stays
    in the cache; otherwise the request takes it over and stores it back extended.
    """

    entry: int = -1
    reuse: int = 0
    copy: bool = False


@dataclass
class Entry:
    id: int
    tokens: tuple[int, ...]
    cache: list[Any]
    partition: str = ""


class PrefixCache:
    """An LRU of ``(tokens, KV cache)`` entries, bounded by ``budget_tokens`` tokens in all.

    ``cut_back`` says whether every rank can cut any entry back to a shorter
    prefix (the ranks share it at start-up); when one cannot (a sliding window,
    a recurrent state), :meth:`plan` reuses entries only as exact prefixes.
    """

    def __init__(self, budget_tokens: int, cut_back: bool = True) -> None:
        self.budget_tokens = max(0, budget_tokens)
        self.cut_back = cut_back
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.next_id = 1
        self.hits = 0
        self.misses = 0

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries.values())

    def plan(self, tokens: Sequence[int], partition: str = "") -> PrefixReuse:
        """The entry of ``partition`` sharing the longest prefix with ``tokens`` (at least one token is left to
        compute)."""
        best, best_reuse = None, 0
        limit = len(tokens) - 1
        for entry in self.entries.values():
            if entry.partition != partition:
                continue
            reuse = min(common_prefix(entry.tokens, tokens), limit)
            if reuse < len(entry.tokens) and not (self.cut_back and can_trim_prompt_cache(entry.cache)):
                continue  # an entry some rank cannot cut back (a full window, a recurrent state): exact extensions
            if reuse > best_reuse:
                best, best_reuse = entry, reuse
        if best is None:
            self.misses += 1
            return PrefixReuse()
        self.hits += 1
        return PrefixReuse(best.id, best_reuse, best_reuse < len(best.tokens))

    def checkout(self, plan: PrefixReuse, make_cache: Callable[[], list[Any]]) -> list[Any]:
        """The cache to run a request on: the planned entry's (taken or copied), cut to ``plan.reuse`` tokens."""
        if plan.entry < 0:
            return make_cache()
        entry = self.entries.get(plan.entry)
        if entry is None:  # the ranks' caches diverged: every rank's prefill check reports it
            return make_cache()
        if plan.copy:
            self.entries.move_to_end(entry.id)
            cache = copy.deepcopy(entry.cache)
        else:
            del self.entries[entry.id]
            cache = entry.cache
        excess = len(entry.tokens) - plan.reuse
        if excess > 0:
            trim_prompt_cache(cache, excess)
        return cache

    def store(self, tokens: Sequence[int], cache: list[Any], partition: str = "") -> bool:
        """Keep ``cache`` (holding exactly ``tokens``) as the most recent entry of ``partition``; False when it is
        not kept."""
        kept = tuple(tokens)
        if not kept or len(kept) > self.budget_tokens:
            return False
        for entry in list(self.entries.values()):
            if entry.partition != partition:
                continue
            shared = common_prefix(entry.tokens, kept)
            if shared == len(kept):  # an entry already holds these tokens (and maybe more): keep that one
                self.entries.move_to_end(entry.id)
                return False
            if shared == len(entry.tokens):  # the new entry extends this one, which it replaces
                del self.entries[entry.id]
        while self.entries and self.tokens + len(kept) > self.budget_tokens:
            self.entries.popitem(last=False)
        self.entries[self.next_id] = Entry(self.next_id, kept, cache, partition)
        self.next_id += 1
        return True

    def clear(self) -> None:
        self.entries.clear()
