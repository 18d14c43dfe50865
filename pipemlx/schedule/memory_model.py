"""What a rank's memory holds at a target context (pure: no MLX, no files).

A rank's peak memory while it prefills a prompt of ``context`` tokens in
chunks of ``step`` tokens and decodes is modelled as

    weights of its layers (+ the fixed weights it holds: head, embedding)
  + the caches of its layers at ``context`` tokens, as mlx-lm allocates them
  + the peak of one prefill chunk: its activations and one layer's cache growth

**Caches**, per layer kind (:class:`LayerCache`):

- ``full`` attention (mlx-lm's ``KVCache``): keys and values for every
  position, allocated in blocks of 256 positions (a chunk that does not fit
  grows the buffer by whole blocks), so the bytes follow the chunking exactly;
  with ``kv_bits`` (mlx-lm's ``QuantizedKVCache``, from ``quantized_kv_start``
  on) ``kv_bits`` per element plus a scale and a bias per group.
- ``sliding`` window (``RotatingKVCache``): at most ``window - 1`` positions
  plus the chunk being processed, whatever the context (not quantized: mlx-lm
  cannot quantize it).
- ``state`` (linear attention, Mamba, short convolutions: ``ArraysCache``):
  a constant number of bytes.
- a layer can have both (``state_bytes`` and attention: falcon-h1).

**One chunk's peak** (:func:`chunk_peak`), fitted to MLX's measured peak
memory on the CPU (``mx.get_peak_memory``, ``tests/test_memory_model.py``):
the attention scores of the chunk against every position it sees
(``heads x chunk x span`` elements), the boolean mask (``chunk x span``
bytes), two ``chunk x intermediate`` and eleven ``chunk x hidden``
activations, and the growth of one layer's cache (its old buffer lives until
the grown one is filled).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .memory_split import MemoryPlanError, ModelBytes, align_columns, format_size, plan_layers
from .split import check_world, layer_range

KV_BLOCK = 256  # mlx-lm's KVCache.step: caches grow by whole blocks of this many positions
HIDDEN_BUFFERS = 11
INTERMEDIATE_BUFFERS = 2
CACHE_GROWTH = 1.2
"""Fitted coefficients of :func:`chunk_peak` (see the module docstring)."""
DEFAULT_QUANTIZED_KV_START = 5000
HeadPolicy = Literal["all", "last", "split"]


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer caches.

    ``kind`` is ``"full"``, ``"sliding"`` (``window`` positions), or
    ``"none"`` (no attention cache). ``kv_heads`` x (``k_dim`` + ``v_dim``)
    elements per position for the attention cache; ``state_bytes`` constant
    bytes besides (linear attention, Mamba or convolution state).
    """

    kind: Literal["full", "sliding", "none"]
    kv_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: int | None = None
    state_bytes: int = 0

    def elements_per_position(self) -> int:
        return self.kv_heads * (self.k_dim + self.v_dim) if self.kind != "none" else 0


@dataclass(frozen=True)
class Activations:
    """The sizes one prefill chunk's activations scale with."""

    hidden: int
    intermediate: int
    heads: int
    dtype_bytes: int


@dataclass(frozen=True)
class MemoryModel:
    """Everything the per-rank memory needs: parameter bytes, per-layer caches, activation sizes."""

    bytes: ModelBytes
    caches: tuple[LayerCache, ...]
    activations: Activations
    max_context: int | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.caches) != len(self.bytes.layers):
            raise ValueError(f"{len(self.caches)} layer caches for {len(self.bytes.layers)} layers")


@dataclass(frozen=True)
class Settings:
    """The request the memory is planned for."""

    context: int
    step: int = 512
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    head: HeadPolicy = "all"
    fused_attention: bool = False
    """True where attention runs as one fused kernel (MLX on Metal for common head sizes): no scores are
    materialised. Only the CPU's materialised attention is measured (``tests/test_memory_model.py``)."""

    def __post_init__(self) -> None:
        for name in ("context", "step", "kv_group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive number of tokens, got {value!r}")
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8 (or None), got {self.kv_bits!r}")
        if self.quantized_kv_start < 0:
            raise ValueError(f"quantized_kv_start must not be negative, got {self.quantized_kv_start}")
        if self.head not in ("all", "last", "split"):
            raise ValueError(f"head must be 'all', 'last' or 'split', got {self.head!r}")


def prefill_chunks(context: int, step: int) -> list[int]:
    """Chunk sizes that fill a cache with ``context`` positions as mlx-lm's ``generate_step`` does.

    A prompt of ``context`` tokens: chunks of ``min(step, remaining - 1)``
    until one token is left, which the first decode step processes.
    """
    chunks: list[int] = []
    remaining = context
    while remaining > 1:
        n = min(step, remaining - 1)
        chunks.append(n)
        remaining -= n
    chunks.append(1)
    return chunks


def _position_bytes(layer: LayerCache, dtype_bytes: int, settings: Settings, quantized: bool) -> float:
    elements = layer.elements_per_position()
    if not quantized or settings.kv_bits is None:
        return elements * dtype_bytes
    groups = layer.kv_heads * (layer.k_dim + layer.v_dim) / settings.kv_group_size
    return elements * settings.kv_bits / 8 + groups * 2 * dtype_bytes


def layer_cache_trace(layer: LayerCache, dtype_bytes: int, settings: Settings) -> list[tuple[int, int, int, int, int]]:
    """Per chunk: (chunk size, positions it attends to, cache bytes after it, bytes of a growth, bytes converted).

    Follows mlx-lm's caches exactly: ``KVCache`` grows by blocks of :data:`KV_BLOCK` (trimming a partly used last
    block first) into a larger buffer (the "growth"). With ``kv_bits`` the whole buffer is converted to a
    ``QuantizedKVCache`` after the chunk that reaches ``quantized_kv_start`` (both live for a moment: "converted"),
    which then grows alike. ``RotatingKVCache`` keeps ``window - 1`` positions plus the chunk.
    """
    rows: list[tuple[int, int, int, int, int]] = []
    offset = capacity = 0
    quantized = False
    window = layer.window or 0
    quantizable = layer.kind == "full" and settings.kv_bits is not None
    for n in prefill_chunks(settings.context, settings.step):
        if layer.kind == "none":
            rows.append((n, 0, layer.state_bytes, 0, 0))
            continue
        per_position = _position_bytes(layer, dtype_bytes, settings, quantized)
        if layer.kind == "sliding":
            span = (min(offset, window - 1) if n > 1 else min(offset, window)) + n
            offset += n
            held = span if n > 1 else min(offset, window)
            rows.append((n, span, int(held * per_position) + layer.state_bytes, 0, 0))
            continue
        growth = converted = 0
        if offset + n > capacity:
            kept = offset if offset % KV_BLOCK else capacity
            capacity = kept + math.ceil(n / KV_BLOCK) * KV_BLOCK
            growth = int(capacity * per_position)
        offset += n
        cache = int(capacity * per_position)
        if quantizable and not quantized and offset >= settings.quantized_kv_start:
            quantized = True
            converted = cache
            cache = int(capacity * _position_bytes(layer, dtype_bytes, settings, True))
        rows.append((n, offset, cache + layer.state_bytes, growth, converted))
    return rows


def chunk_peak(activations: Activations, chunk: int, span: int, fused_attention: bool = False) -> int:
    """Peak bytes of one chunk's activations (no caches, no weights); see the module docstring."""
    b = activations.dtype_bytes
    scores = 0 if fused_attention else activations.heads * chunk * span * b
    mask = chunk * span if chunk > 1 and not fused_attention else 0
    return (
        scores
        + mask
        + INTERMEDIATE_BUFFERS * chunk * activations.intermediate * b
        + HIDDEN_BUFFERS * chunk * activations.hidden * b
    )


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory at the planned context."""

    rank: int
    layers: range
    weights: int
    kv: int
    chunk: int
    budget: int | None

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.chunk

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.total


def fixed_bytes(model: ModelBytes, rank: int, world_size: int, head: HeadPolicy) -> int:
    """Bytes ``rank`` holds besides its layers; with ``head="last"`` only the last rank holds the head, with
    ``head="split"`` every rank its share of the vocabulary's rows (1/S) of the embedding and of the head (the
    rest, a final norm, counted with the head: whole where the head is the embedding, else by the same share)."""
    if head == "all" or world_size == 1:
        return model.fixed(rank, world_size)
    if head == "split":  # tied: "head" is the final norm (whole on every rank); else mostly the lm_head's rows
        return share(model.embedding, rank, world_size) + (
            model.head if model.tied else share(model.head, rank, world_size)
        )
    last = rank == world_size - 1
    if model.tied:  # rank 0 keeps the embedding, the last rank the head (the same weights)
        return (model.embedding if rank == 0 or last else 0) + (model.head if last else 0)
    return (model.embedding if rank == 0 else 0) + (model.head if last else 0)


def share(total: int, rank: int, world_size: int) -> int:
    """Rank ``rank``'s share of ``total`` bytes split by rows as :func:`pipemlx.models.vocab_head.row_range` does."""
    return total * (rank + 1) // world_size - total * rank // world_size


def rank_memory(
    model: MemoryModel, layers: range, rank: int, world_size: int, settings: Settings, budget: int | None = None
) -> RankMemory:
    """Weights, caches and chunk peak of the rank holding ``layers`` (global indices)."""
    b = model.activations.dtype_bytes
    weights = sum(model.bytes.layers[layers.start : layers.stop]) + fixed_bytes(
        model.bytes, rank, world_size, settings.head
    )
    traces = [layer_cache_trace(model.caches[i], b, settings) for i in layers]
    kv = max(sum(t[k][2] for t in traces) for k in range(len(traces[0]))) if traces else 0
    final_kv = sum(t[-1][2] for t in traces)
    peak = 0
    for k in range(len(traces[0]) if traces else 0):
        chunk = traces[0][k][0]
        cache_now = sum(t[k][2] for t in traces)
        span = max(t[k][1] for t in traces)
        growth = max(t[k][3] for t in traces)  # layers grow one after the other
        converted = sum(t[k][4] for t in traces)  # mlx-lm converts every layer at once
        peak = max(
            peak,
            cache_now
            + converted
            + chunk_peak(model.activations, chunk, span, settings.fused_attention)
            + int(CACHE_GROWTH * growth),
        )
    return RankMemory(rank, layers, weights, final_kv, max(peak, kv) - final_kv, budget)


@dataclass(frozen=True)
class ContextPlan:
    """A split and each rank's memory at ``settings.context``."""

    split: tuple[int, ...]
    ranks: tuple[RankMemory, ...]
    model: MemoryModel
    settings: Settings
    longest_context: int | None = None
    limiting_rank: int | None = None


def layer_cost(model: MemoryModel, index: int, settings: Settings) -> int:
    """A layer's weights plus its cache at the context: what the split weighs per layer."""
    trace = layer_cache_trace(model.caches[index], model.activations.dtype_bytes, settings)
    return model.bytes.layers[index] + max(row[2] for row in trace)


def plan_context(
    model: MemoryModel,
    world_size: int,
    settings: Settings,
    budgets: Sequence[int] | None = None,
    split: Sequence[int] | None = None,
) -> ContextPlan:
    """The split (``split`` if given, else planned) and every rank's memory at ``settings.context``.

    A planned split weighs what :func:`split_weights` says over each rank's budget. Raises :class:`MemoryPlanError`
    naming the rank, what it needs and has, and the longest context that fits, when a rank exceeds its budget.
    """
    n = len(model.bytes.layers)
    check_world(n, world_size)
    check_context(model, settings.context)
    if budgets is not None and len(budgets) != world_size:
        raise ValueError(f"{len(budgets)} budgets for {world_size} ranks")
    if split is None:
        costs, fixed = split_weights(model, world_size, settings)
        split = plan_layers(costs, fixed, budgets if budgets is not None else [1] * world_size)
    split = tuple(split)
    ranks = tuple(
        rank_memory(model, layer_range(split, r), r, world_size, settings, None if budgets is None else budgets[r])
        for r in range(world_size)
    )
    longest, limiting = (None, None) if budgets is None else longest_context(model, split, budgets, settings)
    plan = ContextPlan(split, ranks, model, settings, longest, limiting)
    over = [r for r in ranks if r.budget is not None and r.total > r.budget]
    if over:
        worst = max(over, key=lambda r: r.total / (r.budget or 1))
        fits = (
            f"the longest context this split holds is {longest} tokens (rank {limiting} limits it)"
            if longest
            else "no context fits: the weights alone do not"
        )
        raise MemoryPlanError(
            f"rank {worst.rank} needs {format_size(worst.total)} (weights {format_size(worst.weights)}, "
            f"KV cache {format_size(worst.kv)} at {settings.context} tokens, chunk peak {format_size(worst.chunk)}) "
            f"but has {format_size(worst.budget or 0)}; split {list(split)}; {fits}"
        )
    return plan


def split_weights(model: MemoryModel, world_size: int, settings: Settings | None) -> tuple[list[int], list[int]]:
    """What a split weighs against the budgets: per layer its weights and its cache at the context; per rank its fixed
    weights and one chunk's peak (the parameters alone without ``settings``)."""
    n = len(model.bytes.layers)
    if settings is None:
        return list(model.bytes.layers), [fixed_bytes(model.bytes, r, world_size, "all") for r in range(world_size)]
    costs = [layer_cost(model, i, settings) for i in range(n)]
    peak = max((rank_memory(model, range(i, i + 1), 1, 2, settings).chunk for i in range(n)), default=0)
    return costs, [fixed_bytes(model.bytes, r, world_size, settings.head) + peak for r in range(world_size)]


def check_context(model: MemoryModel, context: int) -> None:
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if model.max_context is not None and context > model.max_context:
        raise ValueError(
            f"context {context} is longer than the model's maximum of {model.max_context} tokens "
            "(max_position_embeddings in its config.json)"
        )


def longest_context(
    model: MemoryModel, split: Sequence[int], budgets: Sequence[int], settings: Settings
) -> tuple[int, int | None]:
    """The longest context every rank of ``split`` holds within its budget, and the rank that limits it.

    ``(0, rank)`` when even one token does not fit; searched up to the model's
    maximum context (or 2^24 tokens).
    """
    world = len(split)
    ceiling = model.max_context or 2**24

    def fits(context: int) -> int | None:
        chosen = dataclasses.replace(settings, context=context)
        for r in range(world):
            if rank_memory(model, layer_range(split, r), r, world, chosen).total > budgets[r]:
                return r
        return None

    first = fits(1)
    if first is not None:
        return 0, first
    if fits(ceiling) is None:
        return ceiling, None
    low, high = 1, ceiling  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid) is None:
            low = mid
        else:
            high = mid
    return low, fits(high)


def format_context_plan(plan: ContextPlan) -> str:
    """Per rank: layers, weights, KV at the context, chunk peak, total against budget, headroom; then the model."""
    s = plan.settings
    header = ("rank", "layers", "count", "weights", f"KV@{s.context}", "chunk peak", "total", "budget", "headroom")
    rows: list[tuple[str, ...]] = [header]
    for p in plan.ranks:
        rows.append(
            (
                str(p.rank),
                f"{p.layers.start}-{p.layers.stop - 1}",
                str(len(p.layers)),
                format_size(p.weights),
                format_size(p.kv),
                format_size(p.chunk),
                format_size(p.total),
                "-" if p.budget is None else format_size(p.budget),
                "-" if p.headroom is None else f"{format_size(p.headroom)} ({100 * p.headroom / (p.budget or 1):.0f}%)",
            )
        )
    lines = align_columns(rows)
    m = plan.model.bytes
    kinds = sorted(
        {c.kind for c in plan.model.caches} | ({"state"} if any(c.state_bytes for c in plan.model.caches) else set())
    )
    lines.append(
        f"model: {len(m.layers)} layers ({', '.join(kinds)}), {format_size(m.total)} of weights; "
        f"context {s.context} tokens in chunks of {s.step}"
        f"{f', KV cache {s.kv_bits}-bit' if s.kv_bits else ''}; split {list(plan.split)}"
    )
    if plan.longest_context is not None:
        if plan.limiting_rank is None:
            lines.append(f"longest context: {plan.longest_context} tokens (the model's maximum) fits every rank")
        else:
            lines.append(
                f"longest context: {plan.longest_context} tokens with this split (rank {plan.limiting_rank} limits it)"
            )
    lines.extend(f"note: {note}" for note in plan.model.notes)
    return "\n".join(lines)


def check_speeds(speeds: Sequence[float], world_size: int) -> tuple[float, ...]:
    """Per-rank speeds (any unit: only their ratios count), checked."""
    values = tuple(float(s) for s in speeds)
    if len(values) != world_size:
        raise ValueError(f"speeds lists {len(values)} ranks but the group has {world_size}")
    if not all(math.isfinite(s) and s > 0 for s in values):
        raise ValueError(f"speeds must be positive numbers, got {list(speeds)}")
    return values


def plan_balanced(
    model: MemoryModel,
    world_size: int,
    speeds: Sequence[float],
    budgets: Sequence[int] | None = None,
    settings: Settings | None = None,
) -> tuple[int, ...]:
    """Layers per rank in proportion to each rank's speed, within its memory budget.

    A rank's prefill time is its layers' compute (taken as their parameter
    bytes) over its speed; the split makes the slowest rank as fast as it can
    be, then the next, and so on. With ``budgets`` a rank may hold only what
    fits (:func:`split_weights`). Raises :class:`MemoryPlanError` when no split fits.
    """
    n = len(model.bytes.layers)
    check_world(n, world_size)
    rates = check_speeds(speeds, world_size)
    allowed: Callable[[int, int, int], bool] | None = None
    if budgets is not None:
        if len(budgets) != world_size:
            raise ValueError(f"{len(budgets)} budgets for {world_size} ranks")
        if settings is not None:
            check_context(model, settings.context)
        costs, fixed = split_weights(model, world_size, settings)
        prefix = [0]
        for c in costs:
            prefix.append(prefix[-1] + c)
        limits = list(budgets)

        def fits(rank: int, start: int, stop: int) -> bool:
            return fixed[rank] + prefix[stop] - prefix[start] <= limits[rank]

        allowed = fits

    return plan_layers(model.bytes.layers, [0] * world_size, rates, allowed)
