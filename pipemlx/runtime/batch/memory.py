"""Admission control for :class:`pipemlx.BatchGenerator`: every rank's KV bytes per position and budget, shared once."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ...errors import PeerLostError, PipelineTimeoutError
from ...schedule.batch_plan import Admission
from ..caches import cache_parts
from ..protocol import MEMORY
from ..stage import PipelineStage

BUDGET_UNIT = 1024  # budgets cross the wire in KiB (int32), so a budget is rounded down to a whole KiB


def cache_bytes_per_position(model: nn.Module, stage: PipelineStage) -> int:
    """Bytes one cached position costs in this rank's local layers, measured on a one-token cache.

    The local layers run on their own (nothing crosses the wire) on one token into a fresh cache; a layer cache
    without keys and values (a fixed-size state) counts 0.
    """
    cache = make_prompt_cache(model)
    with stage.detached(), mx.stream(stage.compute_stream):
        model(mx.zeros((1, 1), dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])  # pyright: ignore[reportUnknownMemberType]
    return _bytes_per_position(cache)


def draft_bytes_per_position(draft: nn.Module, stage: PipelineStage) -> int:
    """Bytes one cached position costs in a whole draft model's caches (every rank holds a draft cache per guessing
    row, as long as the row's history), measured on a one-token cache as :func:`cache_bytes_per_position`."""
    cache = make_prompt_cache(draft)
    with mx.stream(stage.compute_stream):
        draft(mx.zeros((1, 1), dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])  # pyright: ignore[reportUnknownMemberType]
    return _bytes_per_position(cache)


def _bytes_per_position(cache: list[Any]) -> int:
    """The keys' and values' bytes per position of a one-token cache (fixed-size states count 0)."""
    total = 0.0
    for c in cache_parts(cache):
        for array in (getattr(c, "keys", None), getattr(c, "values", None)):
            if isinstance(array, mx.array) and array.ndim == 4 and array.shape[2] > 0:
                total += array.nbytes / array.shape[2]
    return int(round(total))


def exchange_admission(
    model: nn.Module, stage: PipelineStage, budget: int, timeout: float | None, draft: nn.Module | None = None
) -> Admission:
    """Every rank's bytes per position and budget (one all-gather): the same :class:`Admission` on every rank.

    With a ``draft`` model, each position reserves the draft's bytes too, on every rank (a request that never
    guesses reserves them as well: the reservation is made before anyone knows)."""
    per_position = cache_bytes_per_position(model, stage)
    if draft is not None:
        per_position += draft_bytes_per_position(draft, stage)
    mine = {"bytes_per_position": per_position, "budget_kib": budget // BUDGET_UNIT}
    where, who = "the batch generator's memory exchange", stage.describe()
    try:
        table = MEMORY.exchange(stage.group, stage.compute_stream, mine, timeout=timeout, where=where, who=who)
    except (PipelineTimeoutError, PeerLostError) as exc:
        stage.mark_broken(exc)
        raise
    return Admission(tuple(table["bytes_per_position"]), tuple(b * BUDGET_UNIT for b in table["budget_kib"]))
