"""The tick schedule of continuous batching: which prefill chunk each rank computes, when requests join.

In every tick of :class:`pipemlx.BatchGenerator` each rank computes at most one
chunk of a queued prompt: the chunk rank 0 computes in tick t, rank 1 computes
in tick t+1, and so on. This module decides it all as plain data, from data
every rank has (the queue of requests and their lengths, the batch size,
removals agreed between ticks), so every rank derives the same :class:`Tick`
and checks the others did with :meth:`Tick.fingerprint`. Nothing here imports
MLX (:mod:`pipemlx.schedule.batch_sim` simulates the ranks' messages).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from . import plan as prefill_plan
from .autostep import choose_step
from .costmodel import CostModel, LayerCosts

FINGERPRINT_MODULUS = 1 << 23  # fits a message's int32 field, and is exact as a float32 too


@dataclass(frozen=True)
class QueuedPrompt:
    """A queued request's prompt: ``positions`` prompt positions to prefill, ``reserve`` positions its cache may reach.

    ``boundaries``: prompt positions no chunk crosses (the ends of the segments of mlx-lm's
    ``insert_segments``), increasing, each in ``1 .. positions``: a chunk that would cross one ends there.
    """

    uid: int
    positions: int
    reserve: int = 0
    boundaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.positions < 0 or self.reserve < 0:
            raise ValueError(f"request {self.uid}: positions and reserve must be >= 0, got {self}")
        bounds = (0, *self.boundaries)
        if any(b <= a for a, b in zip(bounds, bounds[1:])) or any(b > self.positions for b in self.boundaries):
            raise ValueError(f"request {self.uid}: boundaries must increase within 1 .. {self.positions}, got {self}")

    def chunk_stop(self, start: int, size: int) -> int:
        """Where a chunk of at most ``size`` positions starting at ``start`` ends: at the prompt's end or the
        first boundary past ``start`` if either comes sooner."""
        stop = min(self.positions, start + size)
        return next((b for b in self.boundaries if start < b < stop), stop)


@dataclass(frozen=True)
class TickChunk:
    """Positions ``start`` .. ``stop - 1`` of request ``uid``'s prefill, computed by one rank in one tick; ``last``
    when they end it. (A prefill plan's chunk is :class:`pipemlx.schedule.plan.Chunk`.)"""

    uid: int
    start: int
    stop: int
    last: bool

    @property
    def length(self) -> int:
        return self.stop - self.start


class ChunkSizes(Protocol):
    """Chunk sizes that depend on where in its prompt a chunk starts (the same on every rank)."""

    def tokens_at(self, start: int) -> int:
        """The length (>= 1) of a chunk starting at prompt position ``start``."""
        ...


@dataclass(frozen=True)
class AutoSteps:
    """``prefill_step_size="auto"`` in a batch: a prompt prefilled while nothing decodes comes in chunks of the step
    :func:`~pipemlx.schedule.autostep.choose_step` predicts fastest for its length on ``costs`` (the calibrated
    model the ranks agreed on: the same step on every rank)."""

    costs: CostModel
    chosen: dict[int, int] = field(default_factory=dict[int, int], compare=False)  # by positions: each simulated once

    def tokens_for(self, positions: int) -> int:
        """The step for a prompt of ``positions`` positions to prefill (>= 1)."""
        if positions not in self.chosen:
            self.chosen[positions] = max(1, choose_step(positions + 1, self.costs))
        return self.chosen[positions]


@dataclass(frozen=True)
class EqualCostChunks:
    """Chunks that each cost what a ``tokens``-token chunk at position 0 costs, by ``costs``.

    Attention makes a chunk's cost grow with its start (it attends to every
    position before it), so equal-length chunks load a tick more and more as a
    long prompt fills, and the decoding requests' time between tokens grows
    with it. Here the later chunks are shorter instead: at ``start``, the
    longest chunk (at most ``tokens``, at least 1, a multiple of 8 from 32 up)
    whose predicted cost stays within the first chunk's. ``costs`` must be the
    same on every rank (the calibrated model the ranks agreed on).
    """

    tokens: int
    costs: LayerCosts

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")

    def cost(self, start: int, length: int) -> float:
        """Predicted seconds of a layer on prompt positions ``start`` .. ``start + length - 1``."""
        return self.costs.seconds(prefill_plan.Chunk(0, start, start + length))

    def tokens_at(self, start: int) -> int:
        budget = self.cost(0, self.tokens)
        low, high = 1, self.tokens  # the longest length within the budget, by bisection (cost grows with length)
        while low < high:
            middle = (low + high + 1) // 2
            if self.cost(start, middle) <= budget:
                low = middle
            else:
                high = middle - 1
        return low if low < 32 else low - low % 8


@dataclass(frozen=True)
class Admission:
    """A memory budget per rank: a request starts only when every rank's KV cache still fits.

    ``bytes_per_position[r]`` is what one cached position costs on rank ``r``
    (its local layers); ``budget[r]`` the bytes rank ``r`` may spend on caches.
    The batch cache is left-padded, so a batch of ``n`` rows whose longest
    reservation is ``L`` positions costs ``n * L`` positions on every rank.
    """

    bytes_per_position: tuple[int, ...]
    budget: tuple[int, ...]

    def fits(self, reserves: Sequence[int]) -> bool:
        """Whether requests reserving ``reserves`` positions fit in one left-padded batch on every rank."""
        if not reserves:
            return True
        positions = len(reserves) * max(reserves)
        return all(positions * b <= limit for b, limit in zip(self.bytes_per_position, self.budget))


class Admits(Protocol):
    """Whether requests reserving ``reserves`` positions may all be in the batch at once."""

    def fits(self, reserves: Sequence[int]) -> bool: ...


@dataclass(frozen=True)
class AdmissionLimits:
    """A memory budget (:class:`Admission`, or none) and a most rows at once (mlx-lm's ``completion_batch_size``)."""

    memory: Admission | None = None
    rows: int | None = None

    def fits(self, reserves: Sequence[int]) -> bool:
        """Whether requests reserving ``reserves`` positions fit both limits."""
        if self.rows is not None and len(reserves) > self.rows:
            return False
        return self.memory is None or self.memory.fits(reserves)


@dataclass(frozen=True)
class TickState:
    """What every rank knows between two ticks.

    ``queue``: requests not yet wholly handed to rank 0, in order (``started``
    positions of the first one already were); ``inflight[r - 1]``: the chunk
    rank ``r`` computes in the next tick (rank ``r - 1`` computed it in the
    last one); ``ready``: requests whose every chunk every rank has computed,
    joining the batch in the next tick; ``tick``: ticks run so far.
    """

    world_size: int
    queue: tuple[QueuedPrompt, ...] = ()
    started: int = 0
    inflight: tuple[TickChunk | None, ...] = ()
    ready: tuple[int, ...] = ()
    tick: int = 0
    reserves: dict[int, int] = field(default_factory=dict[int, int], compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.inflight:
            object.__setattr__(self, "inflight", (None,) * (self.world_size - 1))

    @property
    def prefilling(self) -> tuple[int, ...]:
        """Requests with a chunk on some rank or ready to join, in order: admitted, not yet decoding."""
        seen: list[int] = []
        for chunk in reversed(self.inflight):
            if chunk is not None and chunk.uid not in seen:
                seen.append(chunk.uid)
        if self.queue and self.started and self.queue[0].uid not in seen:
            seen.append(self.queue[0].uid)
        return (*self.ready, *(u for u in seen if u not in self.ready))

    def idle(self) -> bool:
        """True when there is nothing to prefill and nothing to join."""
        return not self.queue and not self.ready and all(c is None for c in self.inflight)


@dataclass(frozen=True)
class Tick:
    """One tick of the schedule, the same on every rank.

    ``joins``: requests that join the decode batch at the start of the tick
    (their caches are complete on every rank); ``chunks[r]``: the chunk rank
    ``r`` computes in the tick after the decode step (``None``: none);
    ``completes``: requests whose last chunk the last rank computes in this
    tick (they join in the next one).
    """

    index: int
    joins: tuple[int, ...]
    chunks: tuple[TickChunk | None, ...]
    completes: tuple[int, ...]

    def fingerprint(self) -> int:
        """A number every rank computes alike from the tick's content (below :data:`FINGERPRINT_MODULUS`)."""
        parts = [uid + 1 for uid in self.joins]
        for chunk in self.chunks:
            parts += (0, 0, 0) if chunk is None else (chunk.uid + 1, chunk.start + 1, chunk.stop + 1)
        return fingerprint(parts, start=self.index)

    def receives(self, rank: int) -> TickChunk | None:
        """The chunk ``rank`` receives from ``rank - 1`` at the end of the tick (to compute in the next one)."""
        return self.chunks[rank - 1] if rank > 0 else None


def fingerprint(parts: Iterable[int], start: int = 0) -> int:
    """A number every rank computes alike from ``parts`` in order, below :data:`FINGERPRINT_MODULUS`.

    The ranks compare it as an agreed field of a message (:mod:`pipemlx.runtime.protocol`).
    """
    value = start % FINGERPRINT_MODULUS
    for part in parts:
        value = (value * 1_000_003 + part) % FINGERPRINT_MODULUS
    return value


def enqueue(state: TickState, prompts: Iterable[QueuedPrompt]) -> TickState:
    """``state`` with ``prompts`` queued behind the others."""
    added = tuple(prompts)
    reserves = {**state.reserves, **{j.uid: j.reserve for j in added}}
    return replace(state, queue=state.queue + added, reserves=reserves)


def drop(state: TickState, uids: Iterable[int]) -> TickState:
    """``state`` without the requests ``uids`` (queued, in flight or ready); their in-flight chunks are dropped."""
    gone = set(uids)
    if not gone:
        return state
    head_dropped = bool(state.queue) and state.queue[0].uid in gone
    return replace(
        state,
        queue=tuple(j for j in state.queue if j.uid not in gone),
        started=0 if head_dropped else state.started,
        inflight=tuple(None if c is not None and c.uid in gone else c for c in state.inflight),
        ready=tuple(u for u in state.ready if u not in gone),
        reserves={u: r for u, r in state.reserves.items() if u not in gone},
    )


def plan_tick(
    state: TickState,
    decoding: Sequence[int],
    chunk_tokens: int | ChunkSizes,
    lone_chunk_tokens: int | AutoSteps | None = None,
    admission: Admits | None = None,
    prefill_batch_size: int | None = None,
) -> tuple[Tick, TickState]:
    """The next tick and the state after it.

    ``decoding``: the reservations (positions) of the requests in the decode
    batch before the tick's joins. Rank 0 takes the next ``chunk_tokens``
    positions of the first queued request (:class:`ChunkSizes`: as many as it
    gives for where the chunk starts; ``lone_chunk_tokens`` when no request
    decodes or joins in the tick, :class:`AutoSteps`: chosen for the prompt's length); rank ``r`` computes what rank ``r - 1``
    computed in the last tick. A request starts only when ``admission`` admits
    it together with everything decoding and prefilling, and fewer than
    ``prefill_batch_size`` requests are started and not yet decoding (those
    joining in this tick not counted). Requests start in order, so one that
    waits holds back those behind it. A request with no positions to prefill is
    ready at once. Pure: the same arguments give the same tick everywhere.
    """
    if (isinstance(chunk_tokens, int) and chunk_tokens < 1) or (
        isinstance(lone_chunk_tokens, int) and lone_chunk_tokens < 1
    ):
        raise ValueError(f"chunk sizes must be >= 1, got {chunk_tokens} and {lone_chunk_tokens}")
    if prefill_batch_size is not None and prefill_batch_size < 1:
        raise ValueError(f"prefill_batch_size must be >= 1, got {prefill_batch_size}")
    joins = state.ready
    rows = len(decoding) + len(joins)
    queue, started = list(state.queue), state.started
    ready: list[int] = []
    pipeline = _in_pipeline(state)
    committed = [*decoding, *(state.reserves.get(u, 0) for u in pipeline)]
    prefilling = sum(1 for u in pipeline if u not in joins)  # started, not decoding after this tick's joins
    first: TickChunk | None = None
    while queue and first is None:
        prompt = queue[0]
        if not started:
            if prefill_batch_size is not None and prefilling >= prefill_batch_size:
                break
            if admission is not None and not admission.fits([*committed, prompt.reserve]):
                break
            committed.append(prompt.reserve)
            prefilling += 1
        if prompt.positions == 0:
            ready.append(prompt.uid)
            queue.pop(0)
            started = 0
            continue
        if rows or lone_chunk_tokens is None:
            size = _size(chunk_tokens, started)
        elif isinstance(lone_chunk_tokens, AutoSteps):
            size = lone_chunk_tokens.tokens_for(prompt.positions)
        else:
            size = lone_chunk_tokens
        stop = prompt.chunk_stop(started, size)
        first = TickChunk(prompt.uid, started, stop, stop == prompt.positions)
        if first.last:
            queue.pop(0)
            started = 0
        else:
            started = stop
    chunks = (first, *state.inflight)
    done = chunks[-1]
    completes = (done.uid,) if done is not None and done.last else ()
    if state.world_size == 1:
        chunks = (first,)
    tick = Tick(state.tick, joins, chunks, completes)
    after = TickState(
        world_size=state.world_size,
        queue=tuple(queue),
        started=started,
        inflight=chunks[:-1],
        ready=(*ready, *completes),
        tick=state.tick + 1,
        reserves={u: r for u, r in state.reserves.items() if u not in joins},
    )
    return tick, after


def _size(chunk_tokens: int | ChunkSizes, start: int) -> int:
    if isinstance(chunk_tokens, int):
        return chunk_tokens
    size = chunk_tokens.tokens_at(start)
    if size < 1:
        raise ValueError(f"{chunk_tokens} gave a chunk of {size} tokens at position {start}; chunks need >= 1")
    return size


def _in_pipeline(state: TickState) -> list[int]:
    """Requests admitted and not yet decoding: ready, in flight, or the started head of the queue."""
    return list(state.prefilling)


# Decode groups in flight -------------------------------------------------------------------------------------------

AUTO_MIN_ROWS_PER_GROUP = 8
"""``decode_groups="auto"``: the batch is never cut into groups of fewer live rows than this on average (at S=2,
one to fifteen requests always decode as one group). A step of few rows costs far more than its share (reading the
weights dominates) and each group's tick pays the fixed costs again: measured at S=2 (docs/performance.md), groups
of 4 rows gain at most a few hundredths over one group of 8 (0.96-1.03x on the light shape) or lose (0.85-0.92x
where the head is large), while trying them cost 5-20% of a 65-token run; groups of 8 won on every shape measured."""
AUTO_SAMPLES = 3
"""``decode_groups="auto"``: steady ticks timed in a way of decoding (one group or groups, at a row count) before
:func:`choose_groups` compares it with the other way; the median of the latest :data:`AUTO_KEEP` is its cost."""
AUTO_SETTLE = 2
"""``decode_groups="auto"``: the first steady ticks after a split, a merge or a join that are not timed (measured: the
first ticks of a new way ran 2-3x its steady cost, its batch caches and steps new)."""
AUTO_KEEP = 8
"""``decode_groups="auto"``: the latest steady ticks kept per way of decoding and row count (older ones go, so the
comparison follows the caches' growth)."""
AUTO_MARGIN = 0.05
"""``decode_groups="auto"``: groups must be measured this much cheaper per token than one group before the batch
splits (hysteresis: two ways about as fast do not take turns); they merge back once measured no cheaper."""
SERIAL = 0
"""The id of the one group of the serial batch (every rank computes its step in turn, in one tick)."""


@dataclass(frozen=True)
class GroupRule:
    """When the decode batch runs as groups in flight: at most ``most`` groups, split from ``enter`` live rows on
    (the joining requests counted), merged back into one batch below ``leave``. ``measured``
    (``decode_groups="auto"``): from ``enter`` rows on, only where :class:`GroupTimings` says groups pay."""

    most: int
    enter: int
    leave: int
    measured: bool = False

    def __post_init__(self) -> None:
        if self.most < 2 or self.enter < 2 or not 1 <= self.leave <= self.enter:
            raise ValueError(f"a group rule needs most >= 2, enter >= 2 and 1 <= leave <= enter, got {self}")

    @staticmethod
    def of(setting: object, world_size: int) -> GroupRule | None:
        """The rule of ``BatchGenerator(decode_groups=setting)`` on ``world_size`` ranks; ``None``: one batch always.

        ``"auto"``: ``world_size`` groups, measured (:class:`GroupTimings`), from :data:`AUTO_MIN_ROWS_PER_GROUP`
        live rows per group on; ``1``: never; an int ``n >= 2``: groups (at most ``world_size``) whenever at least
        ``n`` rows are live. Raises ``ValueError`` for anything else.
        """
        if setting == "auto":
            if world_size < 2:
                return None
            floor = AUTO_MIN_ROWS_PER_GROUP * world_size
            return GroupRule(world_size, floor, floor, measured=True)
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
            raise ValueError(f"decode_groups must be 'auto' or a positive int, got {setting!r}")
        if setting == 1 or world_size < 2:
            return None
        return GroupRule(world_size, setting, setting)


def choose_groups(serial: float | None, grouped: float | None, grouping: bool, margin: float = AUTO_MARGIN) -> bool:
    """Whether the batch should decode as groups in flight next, from the measured seconds per token of one group
    (``serial``) and of groups (``grouped``) at its row count (``None``: not measured yet); ``grouping``: whether it
    does now.

    With both measured, one group splits only where groups are measured ``margin`` cheaper, and groups merge back
    as soon as they are measured no cheaper than one group (between the two it stays: hysteresis; groups are never
    kept where they lose). With one measured, it tries the other (a probe: it is measured in the next steady ticks,
    then compared); with neither, it stays. Pure: every rank decides alike from the same measurements.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in 0 .. 1, got {margin}")
    if serial is None and grouped is None:
        return grouping
    if grouped is None:
        return True
    if serial is None:
        return False
    if grouping:
        return grouped < serial
    return grouped < serial * (1 - margin)


@dataclass
class GroupTimings:
    """``decode_groups="auto"``: the seconds per token of the batch's steady ticks, by way of decoding (one group or
    groups) and live rows, as every rank read them in the ticks' all-gathers (the mean of the ranks' times of each):
    the same on every rank, so every rank decides alike (:meth:`want`).

    A steady tick prefills nothing, joins, splits or merges nothing, and (groups) has a group on every rank; the
    first :data:`AUTO_SETTLE` after a split, a merge or a join are not recorded (the generator leaves them out). A way
    is measured at a row count once it has :data:`AUTO_SAMPLES` steady ticks there within the last ``fresh``
    ticks (older ones are forgotten, so a way measured long ago, at shorter contexts, is measured again);
    its cost is the median of the latest :data:`AUTO_KEEP`. Where the two ways are not both measured at the row
    count, :meth:`want` compares them at the nearest row count where they are (within a quarter of the rows, at
    least 2), so a batch whose rows change by a few as requests finish and join is not probed anew each time.
    """

    fresh: int = 512
    samples: dict[tuple[bool, int], list[tuple[int, float]]] = field(
        default_factory=dict[tuple[bool, int], list[tuple[int, float]]]
    )

    def record(self, grouped: bool, rows: int, tick: int, seconds_per_token: float) -> None:
        """A steady tick ``tick`` of ``rows`` live rows, decoded as groups or not, cost ``seconds_per_token``."""
        kept = self.samples.setdefault((grouped, rows), [])
        kept.append((tick, seconds_per_token))
        del kept[:-AUTO_KEEP]

    def cost(self, grouped: bool, rows: int, now: int) -> float | None:
        """The measured seconds per token of ``rows`` rows decoded as groups or not at tick ``now`` (``None``: fewer
        than :data:`AUTO_SAMPLES` fresh steady ticks)."""
        fresh = [s for t, s in self.samples.get((grouped, rows), []) if now - t <= self.fresh]
        if len(fresh) < AUTO_SAMPLES:
            return None
        return statistics.median(fresh)

    def want(self, rows: int, grouping: bool, now: int) -> bool:
        """Whether ``rows`` live rows should decode as groups after tick ``now`` (:func:`choose_groups`)."""
        serial, grouped = self.cost(False, rows, now), self.cost(True, rows, now)
        if serial is None or grouped is None:
            serial, grouped = self.nearest(rows, now) or (serial, grouped)
        return choose_groups(serial, grouped, grouping)

    def nearest(self, rows: int, now: int) -> tuple[float, float] | None:
        """The costs of one group and of groups at the row count nearest ``rows`` where both are measured, within
        ``max(2, rows // 4)`` rows (the fewer rows on a tie); ``None`` where there is none."""
        reach = max(2, rows // 4)
        counts = sorted({r for _, r in self.samples if abs(r - rows) <= reach}, key=lambda r: (abs(r - rows), r))
        for count in counts:
            serial, grouped = self.cost(False, count, now), self.cost(True, count, now)
            if serial is not None and grouped is not None:
                return serial, grouped
        return None


@dataclass(frozen=True)
class GroupState:
    """The decode groups between two ticks, the same on every rank.

    ``serial``: the batch is one group (:data:`SERIAL`) whose step every rank computes in turn within each tick.
    Otherwise the rows are in groups in flight: ``flight[r - 1]`` is the group rank ``r`` computes in the next tick
    (rank ``r - 1`` computed it in the last one, and its hidden states were received at the end of it); ``idle``:
    the groups whose step is not under way (their last step's tokens reached every rank), in the order they take
    rank 0. ``next_id``: the id the next group formed gets.
    """

    world_size: int
    serial: bool = True
    flight: tuple[int | None, ...] = ()
    idle: tuple[int, ...] = ()
    next_id: int = SERIAL + 1

    def __post_init__(self) -> None:
        if not self.flight:
            object.__setattr__(self, "flight", (None,) * (self.world_size - 1))

    @property
    def groups(self) -> tuple[int, ...]:
        """Every group, in id order (:data:`SERIAL` alone in the serial batch)."""
        if self.serial:
            return (SERIAL,)
        return tuple(sorted({*self.idle, *(g for g in self.flight if g is not None)}))

    def in_flight(self) -> bool:
        """Whether some group's step is under way (received by a rank that computes it in the next tick)."""
        return any(g is not None for g in self.flight)

    def position(self, group: int) -> int | None:
        """The rank that computes ``group``'s step under way in the next tick; ``None`` when it is idle."""
        return next((r + 1 for r, g in enumerate(self.flight) if g == group), None)


@dataclass(frozen=True)
class GroupTick:
    """What happens to the decode groups in one tick, the same on every rank.

    At the tick's start, in this order: the ``dropped`` groups (idle, no live row) are forgotten; with ``merge``
    every group is merged into the serial batch; the tick's joining requests join group ``joins_into`` (a new
    group when it is ``formed``); with ``split`` the serial batch's live rows are cut into those new groups, in
    row order, as even as they go. Then ``decode[r]`` is the group rank ``r`` computes (``None``: none);
    ``serial``: the tick's decode is the serial batch's, every rank in turn. ``decode[-1]`` finishes its step: its
    tokens are the all-gather's.
    """

    index: int
    serial: bool
    decode: tuple[int | None, ...]
    joins_into: int | None = None
    formed: bool = False
    split: tuple[int, ...] = ()
    merge: bool = False
    dropped: tuple[int, ...] = ()

    @property
    def finishing(self) -> int | None:
        """The group whose step ends in this tick (its tokens reach every rank in the all-gather)."""
        return self.decode[-1]

    def fingerprint(self) -> int:
        """A number every rank computes alike from the tick's content (below :data:`FINGERPRINT_MODULUS`)."""
        parts = [
            int(self.serial),
            int(self.merge),
            int(self.formed),
            -1 if self.joins_into is None else self.joins_into,
        ]
        parts += [-1 if g is None else g for g in self.decode]
        parts += [len(self.split), *self.split, len(self.dropped), *self.dropped]
        return fingerprint((p + 2 for p in parts), start=self.index)


def plan_groups(
    state: GroupState, live: dict[int, int], joining: int, rule: GroupRule | None, index: int, want: bool = True
) -> tuple[GroupTick, GroupState]:
    """The decode groups of tick ``index`` and the state after it.

    ``live``: the live rows of every group of ``state`` (before the tick's joins); ``joining``: how many requests
    join in the tick. With ``rule`` (None: the serial batch always), the serial batch splits into
    ``min(rule.most, rows)`` groups once it has ``rule.enter`` live rows, the first taking rank 0 at once and the
    others in the next ticks; each tick rank 0 takes the idle group that has waited longest. The joining requests
    form a group of their own while there are fewer than ``min(rule.most, rows)`` groups (or none is idle; it
    waits its turn behind the idle ones), else join the idle group that has waited longest. Below ``rule.leave``
    live rows, or with one group left that has live rows and none joining (it would travel the ranks alone, each
    rank idle but one tick in S), no group takes rank 0 any more, and once none is in flight they merge back
    into the serial batch (in the same tick, which then decodes it; it splits again from ``rule.enter`` rows).
    ``want`` False (a measured rule's decision, :class:`GroupTimings`) keeps the serial batch, or drains and merges
    the groups, as too few rows would. An idle group without live rows is dropped. Pure: the same arguments give
    the same tick everywhere.
    """
    size = state.world_size
    total = sum(live.get(g, 0) for g in state.groups) + joining
    if state.serial:
        if rule is None or total < rule.enter or not want:
            tick = GroupTick(index, True, (SERIAL,) * size, SERIAL if joining else None)
            return tick, state
        count = min(rule.most, total)
        ids = tuple(range(state.next_id, state.next_id + count))
        decode = (ids[0], *state.flight)
        tick = GroupTick(index, False, decode, SERIAL if joining else None, split=ids)
        return tick, GroupState(size, False, decode[:-1], (*ids[1:],), state.next_id + count)
    dropped = tuple(g for g in state.idle if live.get(g, 0) == 0)
    idle = [g for g in state.idle if g not in dropped]
    kept = [g for g in state.groups if g not in dropped]
    alive = [g for g in kept if live.get(g, 0)]
    next_id = state.next_id
    formed = False
    joins_into: int | None = None
    take: int | None = None
    if rule is not None and total >= rule.leave and want and (len(alive) >= 2 or joining):
        if joining and (not idle or len(kept) < min(rule.most, total)):  # a group of their own, waiting its turn
            idle.append(next_id)
            joins_into, next_id, formed = next_id, next_id + 1, True
        elif joining:
            joins_into = idle[0]
        if idle:
            take = idle.pop(0)
    elif not state.in_flight():  # every group idle: merged back into the serial batch, decoded in this tick
        tick = GroupTick(index, True, (SERIAL,) * size, SERIAL if joining else None, merge=True, dropped=dropped)
        return tick, GroupState(size, next_id=next_id)
    elif joining:  # draining: the requests wait in an idle group for the merge
        if not idle:
            idle.append(next_id)
            next_id, formed = next_id + 1, True
        joins_into = idle[0]
    decode = (take, *state.flight)
    finished = decode[-1]
    after_idle = (*idle, *(() if finished is None else (finished,)))
    tick = GroupTick(index, False, decode, joins_into, formed, dropped=dropped)
    return tick, GroupState(size, False, decode[:-1], after_idle, next_id)
