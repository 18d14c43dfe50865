"""``step_size="auto"``: the chunk size the cost model expects to prefill fastest on this group.

The ranks first agree on a :class:`~pipemlx.schedule.costmodel.CostModel`
(measured on the group by :func:`pipemlx.runtime.calibrate.calibrate`). The
step is then the candidate whose simulated prefill
(:func:`pipemlx.schedule.costmodel.predict`: the real plans, per-chunk compute
growing with position, the S-1 bubble, per-message and per-agreement costs) is
shortest. Pure Python: no MLX; every rank derives the very same step from the
very same cost model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from .costmodel import CostModel, predict
from .plan import Action, Chunk, chunks_of_lengths

CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Powers of two: the lengths the calibration times (``pipemlx.runtime.calibrate.CALIBRATION_LENGTHS``), so a
candidate's middle chunks cost what was measured, not what was interpolated between two lengths."""
MAX_CHUNKS = 512  # candidates that would cut the prompt into more chunks than this are not simulated


class AutoRequest:
    """What ranks compare in the handshake before an auto step is chosen: the prompt length, step 0."""

    step_size = 0

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def fingerprint(self) -> int:
        return 0


def candidate_steps(num_tokens: int) -> list[int]:
    """Steps worth simulating for a prompt of ``num_tokens``: the whole prefill in one chunk, and
    :data:`CANDIDATES` that give at most :data:`MAX_CHUNKS` chunks."""
    prefill = max(1, num_tokens - 1)
    steps = {prefill} | {c for c in CANDIDATES if c < prefill and math.ceil(prefill / c) <= MAX_CHUNKS}
    return sorted(steps)


def choose_step(num_tokens: int, costs: CostModel) -> int:
    """The candidate step with the shortest predicted prefill; the larger step on a tie."""
    timed = [
        (predict(num_tokens, step, costs, agree_every=None).prefill_s, -step) for step in candidate_steps(num_tokens)
    ]
    return -min(timed)[1]


DEFAULT_MAX_CHUNK_SECONDS = 2.0
"""Metal ends a command buffer that runs for more than a few seconds: auto never plans a chunk the cost model
predicts to take longer than this on any rank."""
RAMP_MIN_TOKENS = 16  # the smallest chunk a ramp starts or ends with
NEAR_TIE = 0.01  # a non-uniform cut must be predicted this much faster than the best uniform one to be chosen


RAMP_LEVELS = ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (2, 4))
"""``(head, tail)`` ramp depths tried for each step: the drain (tail) matters most, so it goes deeper."""
RAMPED_STEPS = 3  # ramps are tried around the best this many uniform steps (each ramp is one more simulation)
TAIL_RATIOS = (0.625, 0.75)
"""Gentler drains tried too (:func:`tail_lengths`): each chunk of the tail this share of the one before."""


def ramp_lengths(num_tokens: int, step: int, head: int = 2, tail: int = 2) -> tuple[int, ...] | None:
    """Chunks of ``step`` tokens, ``head`` halvings ramping up at the start and ``tail`` ramping down at the end.

    ``ramp_lengths(M, 256, 2, 3)`` is ``64, 128, 256, ..., 256, 128, 64, 32``.
    While the first chunk runs on rank 0 the others wait, and while the last
    chunk runs on the last rank the others are idle: small chunks there shorten
    the pipeline's fill and drain (the idea of TeraPipe, Li et al. 2021). The
    remainder goes right after the ramp-up, where attention is cheapest. None
    when a ramp would hold a chunk under :data:`RAMP_MIN_TOKENS` or the prompt
    is too short for it; ``head=tail=0`` is the uniform cut with the remainder first.
    """
    prefill = num_tokens - 1
    up = [step >> level for level in range(head, 0, -1)]
    down = [step >> level for level in range(1, tail + 1)]
    if min(up + down, default=RAMP_MIN_TOKENS) < RAMP_MIN_TOKENS:
        return None
    rest = prefill - sum(up) - sum(down)
    if rest < 2 * step:
        return None
    return (*up, *_remainder_first(rest, step), *down)


def tail_lengths(num_tokens: int, step: int, ratio: float) -> tuple[int, ...] | None:
    """Chunks of ``step`` tokens, then a tail each ``ratio`` of the one before (multiples of 8, down to 16).

    ``tail_lengths(M, 256, 0.75)`` ends ``256, 192, 144, 104, 80, 56, 40, 32, 24, 16``. A halving tail
    (:func:`ramp_lengths`) drains fastest, but on a pipeline whose last ranks are lighter than the
    first (the last rank's last layer only projects keys and values in a prefill), a chunk half as long
    as the one before reaches a later rank before that rank is done with the one before: the later rank,
    not rank 0, then bounds the drain. A tail shrinking more slowly keeps each later rank just busy. None
    when the prompt is too short for the tail and two chunks of ``step``.
    """
    tail: list[int] = []
    length = step * ratio
    while length >= RAMP_MIN_TOKENS:
        tail.append(int(length) // 8 * 8)
        length *= ratio
    rest = num_tokens - 1 - sum(tail)
    if not tail or rest < 2 * step:
        return None
    return (*_remainder_first(rest, step), *tail)


def _remainder_first(positions: int, step: int) -> tuple[int, ...]:
    """``positions`` in chunks of ``step``, the remainder (if any) first, where attention is cheapest."""
    return ((positions % step,) if positions % step else ()) + (step,) * (positions // step)


def uniform_lengths(num_tokens: int, step: int) -> tuple[int, ...]:
    """The chunks mlx-lm's ``generate_step`` cuts a ``num_tokens`` prompt into with ``step``."""
    prefill = num_tokens - 1
    return (step,) * (prefill // step) + ((prefill % step,) if prefill % step else ())


def slowest_chunk_s(num_tokens: int, lengths: Sequence[int], costs: CostModel) -> float:
    """The cost model's time for the most expensive chunk on the busiest rank."""
    chunks = chunks_of_lengths(num_tokens, lengths)
    return max(costs.compute(rank, chunk) for chunk in chunks for rank in range(costs.world_size))


def choose_chunks(
    num_tokens: int, costs: CostModel, max_chunk_seconds: float = DEFAULT_MAX_CHUNK_SECONDS
) -> tuple[int, ...]:
    """The chunk lengths with the shortest predicted prefill, uniform or ramped, each chunk within the cap.

    Candidates: every step of :func:`candidate_steps` cut as mlx-lm cuts it,
    and, around the :data:`RAMPED_STEPS` best of those, the same step with the
    ramps of :data:`RAMP_LEVELS` and the tails of :data:`TAIL_RATIOS`; a ramped
    cut wins only when it is predicted :data:`NEAR_TIE` faster than the best
    uniform one. Candidates with a chunk predicted above ``max_chunk_seconds``
    on some rank are dropped (when all would be, the uniform cut whose slowest
    chunk is cheapest is taken). Pure: every rank derives the same lengths.

    The last :data:`PLANNING_CACHE_SIZE` choices are remembered (:func:`planning_cache_info`): a cost model is a
    frozen dataclass, so the same arguments give the same lengths, without simulating again.
    """
    return _planned(num_tokens, costs, max_chunk_seconds)[0]


PLANNING_CACHE_SIZE = 64
"""Choices of :func:`choose_chunks` remembered, the least recently used forgotten first."""


def planning_cache_info() -> functools._CacheInfo:  # pyright: ignore[reportPrivateUsage]
    """Hits, misses and size of :func:`choose_chunks`' cache (``functools.lru_cache``'s ``cache_info``)."""
    return _planned_cached.cache_info()


def clear_planning_cache() -> None:
    """Forget every remembered choice of :func:`choose_chunks` (to time planning from scratch, say)."""
    _planned_cached.cache_clear()


def _planned(num_tokens: int, costs: CostModel, max_chunk_seconds: float) -> tuple[tuple[int, ...], float | None]:
    """:func:`_plan`, from the cache when the arguments can be hashed (a cost model built with lists cannot)."""
    try:
        hash((num_tokens, costs, max_chunk_seconds))
    except TypeError:
        return _plan(num_tokens, costs, max_chunk_seconds)
    return _planned_cached(num_tokens, costs, max_chunk_seconds)


@functools.lru_cache(maxsize=PLANNING_CACHE_SIZE)
def _planned_cached(
    num_tokens: int, costs: CostModel, max_chunk_seconds: float
) -> tuple[tuple[int, ...], float | None]:
    return _plan(num_tokens, costs, max_chunk_seconds)


class _RememberedCosts:
    """``costs``' durations, each chunk's compute seconds computed once per rank (the cap's check and every
    simulation of one :func:`choose_chunks` call ask for the same chunks): the very same floats."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.computed: dict[tuple[int, int, int], float] = {}

    def compute(self, rank: int, chunk: Chunk) -> float:
        key = (rank, chunk.start, chunk.stop)  # a chunk's cost depends on its positions, not its index
        seconds = self.computed.get(key)
        if seconds is None:
            seconds = self.computed[key] = self.costs.compute(rank, chunk)
        return seconds

    def transfer(self, source: int, dest: int, shape: tuple[int, int]) -> float:
        return self.costs.transfer(source, dest, shape)

    def collective(self, action: Action) -> float:
        return self.costs.collective(action)

    def slowest_chunk_s(self, num_tokens: int, lengths: Sequence[int]) -> float:
        """:func:`slowest_chunk_s`, from the remembered seconds."""
        chunks = chunks_of_lengths(num_tokens, lengths)
        return max(self.compute(rank, chunk) for chunk in chunks for rank in range(self.costs.world_size))


def _plan(num_tokens: int, costs: CostModel, max_chunk_seconds: float) -> tuple[tuple[int, ...], float | None]:
    """:func:`choose_chunks`' lengths and their predicted prefill seconds (None where it was not simulated: no
    chunk, or no cut within the cap). Each candidate is simulated once."""
    if num_tokens < 2:
        return (), None
    durations = _RememberedCosts(costs)
    simulated: dict[tuple[int, ...], float] = {}

    def seconds(lengths: tuple[int, ...]) -> float:
        if lengths not in simulated:
            simulated[lengths] = predict(
                num_tokens, max(lengths), costs, chunk_lengths=lengths, agree_every=None, durations=durations
            ).prefill_s
        return simulated[lengths]

    def within_cap(lengths: tuple[int, ...]) -> bool:
        return durations.slowest_chunk_s(num_tokens, lengths) <= max_chunk_seconds

    uniform = [uniform_lengths(num_tokens, step) for step in candidate_steps(num_tokens)]
    allowed = [c for c in uniform if within_cap(c)]
    if not allowed:
        return min(uniform, key=lambda c: (durations.slowest_chunk_s(num_tokens, c), -max(c))), None
    ranked = sorted(allowed, key=lambda c: (seconds(c), -max(c)))
    best_uniform = ranked[0]
    ramped = {
        r
        for c in ranked[:RAMPED_STEPS]
        for head, tail in RAMP_LEVELS
        if head or tail
        if (r := ramp_lengths(num_tokens, max(c), head, tail)) is not None and within_cap(r)
    } | {
        r
        for c in ranked[:RAMPED_STEPS]
        for ratio in TAIL_RATIOS
        if (r := tail_lengths(num_tokens, max(c), ratio)) is not None and within_cap(r)
    }
    best_ramped = min(ramped, key=lambda c: (seconds(c), -max(c), c), default=None)
    if best_ramped is not None and seconds(best_ramped) < (1 - NEAR_TIE) * seconds(best_uniform):
        return best_ramped, seconds(best_ramped)
    return best_uniform, seconds(best_uniform)


def choose_lent_heads(num_tokens: int, cuts: Sequence[CostModel]) -> int:
    """Of ``cuts``, the cost models of lending 0, 1, 2, ... key-value heads (``shard_model(lend=k)``), the
    index whose fastest chunking (:func:`choose_chunks`) is predicted to prefill ``num_tokens`` soonest; the
    fewest heads among those within :data:`NEAR_TIE` of it (each lent head widens the messages). Pure: every
    rank derives the same count from the same cost models."""
    if num_tokens < 2 or len(cuts) < 2:
        return 0

    def seconds(costs: CostModel) -> float:
        lengths, simulated = _planned(num_tokens, costs, DEFAULT_MAX_CHUNK_SECONDS)  # choose_chunks' lengths
        if simulated is not None:
            return simulated
        return predict(num_tokens, max(lengths), costs, chunk_lengths=lengths, agree_every=None).prefill_s

    times = [seconds(c) for c in cuts]
    fastest = min(times)
    return next(k for k, t in enumerate(times) if t <= (1 + NEAR_TIE) * fastest)
