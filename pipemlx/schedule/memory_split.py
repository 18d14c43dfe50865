"""Plan a layer split from parameter bytes and per-rank memory budgets (pure: no MLX, no files).

:func:`plan_split` is a pure function from a model's parameter bytes
(:class:`ModelBytes`) and per-rank budgets to a contiguous split. The byte
counts come from a model folder's safetensors headers
(:func:`pipemlx.models.safetensors.model_bytes_from_dir`, no tensor is read) or
from a built, possibly lazily loaded model
(:func:`pipemlx.models.parameters.model_bytes_from_model`); ``pipemlx split``
(:mod:`pipemlx.cli.split`) prints a split as a table.

Besides its layers, every rank holds some fixed weights (see
``docs/loading.md``): the final norm and the output head on every rank (each
rank computes the logits while decoding), the embedding on rank 0, and on
every rank when the head is tied to the embedding.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from types import MappingProxyType

from .split import check_world, layer_range

SIZE_UNITS: MappingProxyType[str, int] = MappingProxyType(
    {"": 1, "B": 1}
    | {prefix + suffix: 10 ** (3 * power) for power, prefix in enumerate("KMGT", 1) for suffix in ("", "B")}
    | {prefix + "IB": 2 ** (10 * power) for power, prefix in enumerate("KMGT", 1)}
)


class MemoryPlanError(ValueError):
    """The model cannot be split so that every rank fits its memory budget."""


@dataclass(frozen=True)
class ModelBytes:
    """Parameter bytes of a model, as a split needs them.

    ``layers[i]`` is decoder layer ``i``; ``embedding`` the input embedding;
    ``head`` everything else outside the layers (final norm, output head, ...);
    ``tied`` whether the output head is the embedding itself.
    """

    layers: tuple[int, ...]
    embedding: int
    head: int
    tied: bool

    @property
    def total(self) -> int:
        """Bytes of the whole model on one device."""
        return sum(self.layers) + self.embedding + self.head

    def fixed(self, rank: int, world_size: int) -> int:
        """Bytes ``rank`` holds besides its layers: the head everywhere, the embedding on rank 0 (everywhere if tied)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        return self.head + (self.embedding if rank == 0 or self.tied else 0)


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a :class:`MemoryPlan`."""

    rank: int
    layers: range
    layer_bytes: int
    fixed_bytes: int
    budget: int | None

    @property
    def total(self) -> int:
        return self.layer_bytes + self.fixed_bytes

    @property
    def share(self) -> float | None:
        """Fraction of the budget this rank uses (``None`` without budgets)."""
        return None if self.budget is None else self.total / self.budget


@dataclass(frozen=True)
class MemoryPlan:
    """A split and what it costs each rank."""

    split: tuple[int, ...]
    ranks: tuple[RankPlan, ...]
    model: ModelBytes


def parse_size(text: str | float) -> int:
    """Bytes in ``text``: ``"24GB"`` (10^9), ``"16GiB"`` (2^30), ``"512M"``, ``"1.5G"``, ``"1000"``, or a number.

    A number (an int, a float such as ``24e9``, a NumPy scalar) is bytes, rounded down.
    """
    if isinstance(text, bool) or not isinstance(text, (str, numbers.Real)):
        raise TypeError(f"a memory size must be a number of bytes or a string like '24GB', got {text!r}")
    if isinstance(text, numbers.Real):
        if not math.isfinite(text):
            raise ValueError(f"a memory size must be finite, got {text!r}")
        value = int(text)
    else:
        if text.strip().startswith("-"):
            raise ValueError(f"a memory size cannot be negative, got {text!r}")
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in SIZE_UNITS:
            raise ValueError(
                f"cannot read memory size {text!r}: expected a number with an optional unit "
                f"({', '.join(u for u in SIZE_UNITS if u)}), e.g. '24GB' or '16GiB'"
            )
        try:
            value = int(Decimal(match.group(1)) * SIZE_UNITS[unit])
        except InvalidOperation as exc:  # pragma: no cover - the pattern admits only numbers
            raise ValueError(f"cannot read memory size {text!r}") from exc
    if value <= 0:
        raise ValueError(f"a memory budget must be positive, got {text!r}")
    return value


def format_size(num_bytes: int) -> str:
    """``1.23 GB`` style (decimal units)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def resolve_budgets(memory: Sequence[float | str] | float | str | None, world_size: int) -> tuple[int, ...] | None:
    """Per-rank budgets in bytes from a list, or one value for every rank; ``None`` stays ``None`` (even)."""
    if memory is None:
        return None
    if isinstance(memory, (int, float, str, numbers.Real)):
        return (parse_size(memory),) * world_size
    budgets = tuple(parse_size(m) for m in memory)
    if len(budgets) != world_size:
        raise ValueError(f"memory lists {len(budgets)} budgets but the group has {world_size} ranks")
    return budgets


def plan_layers(
    layer_bytes: Sequence[int],
    fixed: Sequence[int],
    budgets: Sequence[float],
    allowed: Callable[[int, int, int], bool] | None = None,
) -> tuple[int, ...]:
    """Layers per rank: the contiguous split whose loads are as even as the budgets allow.

    Rank ``r`` holding layers ``j..i-1`` carries ``fixed[r] + sum(layer_bytes[j:i])``
    bytes, a load of that over ``budgets[r]``. The split returned makes the
    largest load as small as possible, then the second largest, and so on.
    Every rank gets at least one layer; among equal choices the lower ranks get
    more layers. It does not check that the loads are at most 1 (:func:`plan_split`
    does). ``allowed(rank, start, stop)``, when given, rules out ranks holding
    layers ``start..stop-1``; raises :class:`MemoryPlanError` when no split is allowed.
    """
    n, world = len(layer_bytes), len(budgets)
    check_world(n, world)
    if len(fixed) != world:
        raise ValueError(f"fixed lists {len(fixed)} ranks but budgets list {world}")
    if any(b <= 0 for b in budgets):
        raise ValueError(f"budgets must be positive, got {list(budgets)}")
    prefix = [0]
    for size in layer_bytes:
        if size < 0:
            raise ValueError(f"layer bytes must not be negative, got {size}")
        prefix.append(prefix[-1] + size)

    def load(rank: int, start: int, stop: int) -> float:
        return (fixed[rank] + prefix[stop] - prefix[start]) / budgets[rank]

    # best[i] = (loads sorted largest first, previous boundary) for ranks 0..r holding layers 0..i-1.
    def ok(rank: int, start: int, stop: int) -> bool:
        return allowed is None or allowed(rank, start, stop)

    best: list[dict[int, tuple[tuple[float, ...], int]]] = [
        {i: ((load(0, 0, i),), 0) for i in range(1, n - world + 2) if ok(0, 0, i)}
    ]
    for rank in range(1, world):
        row: dict[int, tuple[tuple[float, ...], int]] = {}
        for stop in range(rank + 1, n - (world - 1 - rank) + 1):
            chosen: tuple[tuple[float, ...], int] | None = None
            for start in range(stop - 1, rank - 1, -1):  # later boundary first: lower ranks get more on ties
                if start not in best[rank - 1] or not ok(rank, start, stop):
                    continue
                loads = tuple(sorted((*best[rank - 1][start][0], load(rank, start, stop)), reverse=True))
                if chosen is None or loads < chosen[0]:
                    chosen = (loads, start)
            if chosen is not None:
                row[stop] = chosen
        best.append(row)
    if n not in best[world - 1]:
        raise MemoryPlanError(f"no split of {n} layers over {world} ranks keeps every rank within its memory")
    bounds = [n]
    for rank in range(world - 1, 0, -1):
        bounds.append(best[rank][bounds[-1]][1])
    bounds.append(0)
    bounds.reverse()
    return tuple(bounds[r + 1] - bounds[r] for r in range(world))


def plan_split(model: ModelBytes, world_size: int, budgets: Sequence[int] | None = None) -> MemoryPlan:
    """The split of ``model`` over ``world_size`` ranks for the given per-rank ``budgets`` (bytes).

    With ``budgets=None`` every rank counts as having the same memory: the
    split balances bytes (embedding and head included) rather than layer
    counts. With budgets the loads are proportional to them, and
    :class:`MemoryPlanError` is raised, naming the numbers, when no split fits.
    """
    check_world(len(model.layers), world_size)
    if budgets is not None and len(budgets) != world_size:
        raise ValueError(f"{len(budgets)} budgets for {world_size} ranks")
    fixed = [model.fixed(r, world_size) for r in range(world_size)]
    split = plan_layers(model.layers, fixed, budgets if budgets is not None else [1] * world_size)
    plan = memory_plan(model, split, budgets)
    over = [p for p in plan.ranks if p.budget is not None and p.total > p.budget]
    if over and budgets is not None:
        worst = max(over, key=lambda p: p.total / (p.budget or 1))
        raise MemoryPlanError(
            f"the model does not fit: {format_size(model.total)} in {len(model.layers)} layers "
            f"(largest layer {format_size(max(model.layers))}) over budgets "
            f"{[format_size(b) for b in budgets]} (sum {format_size(sum(budgets))}); every rank also holds "
            f"{format_size(model.head)} of norm/head and rank 0{'' if not model.tied else ' and every other rank'} "
            f"the {format_size(model.embedding)} embedding. The best split {list(split)} still puts rank "
            f"{worst.rank} at {format_size(worst.total)}, over its {format_size(worst.budget or 0)}"
        )
    return plan


def memory_plan(model: ModelBytes, split: Sequence[int], budgets: Sequence[int] | None = None) -> MemoryPlan:
    """What ``split`` costs each rank in parameters, with its budget if ``budgets`` are given."""
    world = len(split)
    ranks: list[RankPlan] = []
    for r in range(world):
        local = layer_range(split, r)
        budget = None if budgets is None else budgets[r]
        ranks.append(RankPlan(r, local, sum(model.layers[local.start : local.stop]), model.fixed(r, world), budget))
    return MemoryPlan(tuple(split), tuple(ranks), model)


def align_columns(rows: list[tuple[str, ...]]) -> list[str]:
    """A table's rows as lines: the first two columns left-aligned, the others right-aligned."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return [
        "  ".join(cell.rjust(w) if c > 1 else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: layers, bytes and share of budget per rank."""
    header = ("rank", "layers", "count", "layer bytes", "fixed bytes", "total", "budget", "share")
    rows: list[tuple[str, ...]] = [header]
    for p in plan.ranks:
        rows.append(
            (
                str(p.rank),
                f"{p.layers.start}-{p.layers.stop - 1}",
                str(len(p.layers)),
                format_size(p.layer_bytes),
                format_size(p.fixed_bytes),
                format_size(p.total),
                "-" if p.budget is None else format_size(p.budget),
                "-" if p.share is None else f"{100 * p.share:.1f}%",
            )
        )
    lines = align_columns(rows)
    model = plan.model
    lines.append(
        f"model: {len(model.layers)} layers, {format_size(model.total)} "
        f"(embedding {format_size(model.embedding)}, norm/head {format_size(model.head)}"
        f"{', tied' if model.tied else ''}); split {list(plan.split)}"
    )
    return "\n".join(lines)
