"""What every rank holds while it serves: its share of the model, its end of the broadcast, its prefix cache,
and where it stands (its *slot*, which every broadcast carries to every rank)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..runtime.caches import always_trimmable, cache_offset, cache_parts
from ..runtime.generate import generate_step
from ..runtime.stage import stage_of
from .broadcast import HELLO, Channel, Header
from .prefix_cache import PrefixCache, PrefixReuse
from .requests import OUTCOMES, Outcome
from .settings import EngineSettings

WARM_UP_TOKENS = 4
MB = float(1 << 20)


class Rank:
    """What every rank holds: the model, its end of the broadcast, its prefix cache, where it stands."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        group: mx.distributed.Group,
        settings: EngineSettings,
        draft: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.draft = draft  # --draft-model, whole on every rank (speculative decoding, one request at a time)
        self.tokenizer = tokenizer
        self.eos = [int(t) for t in getattr(tokenizer, "eos_token_ids", ())]
        self.rank = group.rank()
        self.size = group.size()
        self.settings = settings
        self.stage = stage_of(model)
        self.channel = Channel(group)
        self.prefix = PrefixCache(0)
        self.last_seq = 0
        self.last_cache_tokens = 0
        self.last_outcome = 0
        self.bytes_per_token = 0
        self.trimmable = 0
        self.slots: list[dict[str, int]] = []  # every rank's slot, as of the last broadcast

    def slot(self) -> dict[str, int]:
        return {
            "pid": os.getpid(),
            "last_seq": self.last_seq,
            "cache_tokens": self.last_cache_tokens,
            "outcome": self.last_outcome,
            "bytes_per_token": self.bytes_per_token,
            "trimmable": self.trimmable,
            "prefix_entries": len(self.prefix.entries),
            "prefix_tokens": self.prefix.tokens,
        }

    def exchange(self, fields: Mapping[str, int] | None, timeout: float, what: str) -> Header:
        """One broadcast: rank 0's ``fields`` (``None`` elsewhere) and this rank's slot."""
        header = self.channel.exchange(fields, self.slot(), timeout, what)
        self.slots = header.slots
        return header

    def start(self) -> None:
        """Run one small request through the pipeline (every rank), measure the KV footprint, then greet."""
        cache = make_prompt_cache(self.model)
        prompt = mx.arange(1, WARM_UP_TOKENS + 1, dtype=mx.int32)
        for _ in generate_step(prompt, self.model, prompt_cache=cache, max_tokens=1, timeout=self.settings.timeout):
            pass
        self.bytes_per_token = _bytes_per_token(cache)
        self.trimmable = int(always_trimmable(make_prompt_cache(self.model)))
        hello = {"op": HELLO} if self.rank == 0 else None
        slots = self.exchange(hello, self.settings.timeout, "greeting the other ranks").slots
        largest = max(s["bytes_per_token"] for s in slots)
        # Entries are cut back only when every rank can cut its caches back.
        budget = int(self.settings.prefix_cache_mb * MB) // largest
        self.prefix = PrefixCache(budget, cut_back=all(s["trimmable"] for s in slots))

    def checkout(self, plan: PrefixReuse) -> list[Any]:
        """The cache a request starts from: its planned prefix-cache entry, or a new one."""
        return self.prefix.checkout(plan, lambda: make_prompt_cache(self.model))

    def ended(self, seq: int, cache_tokens: int, outcome: Outcome) -> None:
        """Request ``seq`` left this rank's scheduler, its cache holding ``cache_tokens`` positions."""
        self.last_seq, self.last_cache_tokens, self.last_outcome = seq, cache_tokens, OUTCOMES.index(outcome)


def _bytes_per_token(cache: list[Any]) -> int:
    """The KV bytes one cached position takes in ``cache`` (this rank's layers), from the arrays it holds."""
    offset = max(1, cache_offset(cache))
    total = 0.0
    for c in cache_parts(cache):
        leaves = cast(list[tuple[str, Any]], tree_flatten(c.state))
        size = sum(a.nbytes for _, a in leaves if isinstance(a, mx.array))
        keys = getattr(c, "keys", None)  # a KVCache allocates positions ahead: divide by what it holds room for
        positions = keys.shape[-2] if isinstance(keys, mx.array) and keys.ndim >= 2 else offset
        total += size / max(1, positions)
    return max(1, round(total))
