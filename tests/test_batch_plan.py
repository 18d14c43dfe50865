"""The tick schedule of continuous batching (pipemlx.schedule.batch_plan), checked by itself and simulated.

Random arrivals, prompt lengths, decode lengths and cancellations at random ticks are driven through
plan_tick exactly as pipemlx.BatchGenerator drives it; then every rank's messages run through the batch
simulator with rendezvous sends (no buffering at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipemlx.schedule.batch_plan import (
    AUTO_KEEP,
    AUTO_MARGIN,
    AUTO_MIN_ROWS_PER_GROUP,
    AUTO_SAMPLES,
    SERIAL,
    Admission,
    AdmissionLimits,
    EqualCostChunks,
    GroupRule,
    GroupState,
    GroupTick,
    GroupTimings,
    QueuedPrompt,
    Tick,
    TickChunk,
    TickState,
    choose_groups,
    drop,
    enqueue,
    plan_groups,
    plan_tick,
)
from pipemlx.schedule.batch_sim import Op, run_ticks, tick_ops
from pipemlx.schedule.costmodel import LayerCosts


@dataclass
class Run:
    """The record of one driven schedule."""

    ticks: list[Tick] = field(default_factory=list[Tick])
    rows: list[int] = field(default_factory=list[int])
    joined: dict[int, int] = field(default_factory=dict[int, int])  # uid -> tick it joined
    cancelled: set[int] = field(default_factory=set[int])
    peaks: list[list[int]] = field(default_factory=list[list[int]])  # reservations committed per tick
    prefilling: list[tuple[int, ...]] = field(default_factory=list[tuple[int, ...]])  # started, not decoding, per tick


@dataclass(frozen=True)
class Scenario:
    world_size: int
    chunk: int
    lone: int | None
    arrivals: list[tuple[int, int, int]]  # (tick, positions, decode tokens)
    cancels: list[tuple[int, int]]  # (tick, index of an arrival)
    budget: int | None
    attention: float | None = None  # equal-cost chunks with this cost per query-key pair (a token costs 1)
    max_rows: int | None = None  # completion_batch_size: requests decoding or prefilling at once
    prefill_rows: int | None = None  # prefill_batch_size: requests started and not yet decoding at once
    cuts: tuple[int, ...] = ()  # segment boundaries of every request (those inside its prompt)

    def queued(self, uid: int) -> QueuedPrompt:
        _, positions, tokens = self.arrivals[uid]
        return QueuedPrompt(
            uid, positions, positions + 1 + tokens, tuple(c for c in sorted(set(self.cuts)) if c <= positions)
        )

    @property
    def sizes(self) -> int | EqualCostChunks:
        return (
            self.chunk if self.attention is None else EqualCostChunks(self.chunk, LayerCosts(0.5, 1.0, self.attention))
        )


scenarios = st.builds(
    Scenario,
    world_size=st.integers(1, 4),
    chunk=st.integers(1, 12),
    lone=st.none() | st.integers(1, 24),
    arrivals=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=6),
    cancels=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=3),
    budget=st.none() | st.integers(50, 200),
    attention=st.none() | st.floats(0.0, 2.0),
    max_rows=st.none() | st.integers(1, 3),
    prefill_rows=st.none() | st.integers(1, 3),
    cuts=st.lists(st.integers(1, 40), max_size=4).map(tuple),
)


def drive(s: Scenario, limit: int = 400) -> Run:
    """Drive plan_tick the way BatchGenerator does; decoding requests leave after their decode tokens."""
    state = TickState(s.world_size)
    memory = None if s.budget is None else Admission((1,) * s.world_size, (s.budget,) * s.world_size)
    admission = None if memory is None and s.max_rows is None else AdmissionLimits(memory, s.max_rows)
    run = Run()
    decoding: dict[int, list[int]] = {}  # uid -> [reserve, tokens left]
    queued = {i: s.queued(i) for i in range(len(s.arrivals))}
    for t in range(limit):
        state = enqueue(state, [queued[i] for i, a in enumerate(s.arrivals) if a[0] == t])
        gone = {i for at, i in s.cancels if at == t and i < len(s.arrivals) and s.arrivals[i][0] <= t}
        gone -= run.cancelled | {u for u in run.joined if u not in decoding}
        if gone:
            state = drop(state, gone)
            run.cancelled |= gone
            for uid in gone:
                decoding.pop(uid, None)
        pending = t <= max(a[0] for a in s.arrivals)
        if state.idle() and not decoding:
            if not pending:
                break
            continue
        tick, state = plan_tick(state, [r for r, _ in decoding.values()], s.sizes, s.lone, admission, s.prefill_rows)
        for uid in tick.joins:
            assert uid not in run.joined, f"request {uid} joins twice"
            run.joined[uid] = tick.index
            decoding[uid] = [queued[uid].reserve, s.arrivals[uid][2]]
        run.peaks.append([r for r, _ in decoding.values()] + [state.reserves.get(u, 0) for u in state.prefilling])
        run.prefilling.append(state.prefilling)
        run.ticks.append(tick)
        run.rows.append(len(decoding))
        for uid in list(decoding):
            decoding[uid][1] -= 1
            if decoding[uid][1] == 0:
                del decoding[uid]
    else:
        pytest.fail(f"the schedule did not finish in {limit} ticks: {state}")
    return run


def computed(run: Run, rank: int) -> dict[int, list[TickChunk]]:
    chunks: dict[int, list[TickChunk]] = {}
    for tick in run.ticks:
        chunk = tick.chunks[rank]
        if chunk is not None:
            chunks.setdefault(chunk.uid, []).append(chunk)
    return chunks


@given(scenarios)
def test_every_position_is_prefilled_once_in_order_on_every_rank(s: Scenario) -> None:
    run = drive(s)
    for rank in range(s.world_size):
        per_request = computed(run, rank)
        for uid, chunks in per_request.items():
            starts = [c.start for c in chunks]
            stops = [c.stop for c in chunks]
            assert starts == [0, *stops[:-1]], f"rank {rank}, request {uid}: chunks not contiguous: {chunks}"
            assert all(c.length > 0 for c in chunks)
            assert [c.last for c in chunks].count(True) <= 1 and (
                not chunks[-1].last or stops[-1] == s.arrivals[uid][1]
            )
        for uid, (_, positions, _) in enumerate(s.arrivals):
            if uid in run.joined:
                done = per_request.get(uid, [])
                assert sum(c.length for c in done) == positions, f"rank {rank}, request {uid}: {done}"


@given(scenarios)
def test_chunks_travel_the_ranks_one_tick_apart_and_requests_join_after_the_last_rank(s: Scenario) -> None:
    run = drive(s)
    for t, tick in enumerate(run.ticks[1:], start=1):
        for rank in range(1, s.world_size):
            chunk = tick.chunks[rank]
            if chunk is not None:
                assert run.ticks[t - 1].chunks[rank - 1] == chunk, (t, rank, chunk)
    last = s.world_size - 1
    for uid, joined in run.joined.items():
        if s.arrivals[uid][1]:
            finished = [k.index for k in run.ticks if (c := k.chunks[last]) and c.uid == uid and c.last]
            assert finished == [joined - 1], (uid, finished, joined)
    # No request lost or duplicated: every request joins once or was cancelled, never both.
    for uid in range(len(s.arrivals)):
        assert (uid in run.joined) or (uid in run.cancelled), f"request {uid} was lost"


@given(scenarios)
def test_the_ranks_messages_run_through_without_buffering(s: Scenario) -> None:
    run = drive(s)
    programs: list[list[Op]] = [
        [op for tick, rows in zip(run.ticks, run.rows) for op in tick_ops(tick, rows, r, s.world_size)]
        for r in range(s.world_size)
    ]
    assert run_ticks(programs, capacity=0) == []


@given(scenarios.filter(lambda s: s.budget is not None))
def test_admitted_requests_always_fit_the_budget(s: Scenario) -> None:
    run = drive(s)
    assert s.budget is not None
    for reserves in run.peaks:  # decoding and admitted requests after each tick's decisions (left-padded batch)
        assert not reserves or len(reserves) * max(reserves) <= s.budget, reserves


@given(scenarios.filter(lambda s: s.max_rows is not None))
def test_no_more_requests_than_the_row_limit_decode_or_prefill_at_once(s: Scenario) -> None:
    run = drive(s)
    assert s.max_rows is not None
    assert all(len(reserves) <= s.max_rows for reserves in run.peaks), run.peaks


@given(scenarios.filter(lambda s: s.prefill_rows is not None))
def test_no_more_requests_than_the_prefill_batch_size_are_prefilled_at_once(s: Scenario) -> None:
    # After each tick: requests started and not yet decoding (ready to join, a chunk on some rank, or the head
    # of the queue partly handed to rank 0); every chunk of the tick is one of theirs or of those joining now.
    run = drive(s)
    assert s.prefill_rows is not None
    assert all(len(p) <= s.prefill_rows for p in run.prefilling), run.prefilling
    for tick in run.ticks:
        assert len({c.uid for c in tick.chunks if c is not None}) <= s.prefill_rows, tick


@given(scenarios.filter(lambda s: bool(s.cuts)))
def test_no_chunk_crosses_a_segment_boundary(s: Scenario) -> None:
    run = drive(s)
    for tick in run.ticks:
        for chunk in tick.chunks:
            if chunk is not None:
                assert not any(chunk.start < c < chunk.stop for c in s.cuts), (chunk, s.cuts)


def test_queued_prompt_boundaries_must_increase_inside_the_prompt() -> None:
    assert QueuedPrompt(0, 10, boundaries=(3, 10)).chunk_stop(0, 8) == 3
    assert QueuedPrompt(0, 10, boundaries=(3, 10)).chunk_stop(3, 8) == 10
    for bad in ((3, 3), (5, 2), (0,), (11,)):
        with pytest.raises(ValueError, match="boundaries"):
            QueuedPrompt(0, 10, boundaries=bad)


def test_the_simulator_finds_a_swapped_order_and_a_missing_receive() -> None:
    tick = Tick(0, (), (TickChunk(0, 0, 4, True), None), ())
    good = [tick_ops(tick, 2, r, 2) for r in range(2)]
    assert run_ticks(good) == []
    receives = [op for op in good[1] if op.kind == "recv"]
    assert [op.what[0] for op in receives] == ["decode", "chunk"]
    swapped = [good[0], [receives[1], receives[0], *(op for op in good[1] if op.kind != "recv")]]
    assert any("receives" in p for p in run_ticks(swapped))
    missing = [good[0], [op for op in good[1] if op.kind != "recv" or op.what[0] != "chunk"]]
    assert any("deadlock" in p for p in run_ticks(missing))


def test_requests_wait_for_memory_in_order() -> None:
    state = enqueue(TickState(2), [QueuedPrompt(0, 4, 60), QueuedPrompt(1, 4, 60), QueuedPrompt(2, 0, 10)])
    admission = Admission((1, 2), (1000, 200))  # rank 1: 2 bytes per position, 200 bytes: 100 positions
    tick, state = plan_tick(state, [], 8, None, admission)
    assert tick.chunks[0] == TickChunk(0, 0, 4, True)
    tick, state = plan_tick(state, [], 8, None, admission)
    assert tick.chunks[0] is None, "request 1 does not fit beside request 0 (2 x 60 positions on rank 1)"
    assert state.queue[0].uid == 1, "and request 2, behind it, waits too"
    tick, state = plan_tick(state, [60], 8, None, admission)
    assert tick.joins == (0,) and tick.chunks[0] is None
    tick, state = plan_tick(state, [], 8, None, admission)  # request 0 has finished
    assert tick.chunks[0] == TickChunk(1, 0, 4, True)


@given(
    tokens=st.integers(1, 512),
    costs=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    starts=st.lists(st.integers(0, 100_000), min_size=2, max_size=8),
)
def test_equal_cost_chunks_never_exceed_the_first_chunks_cost(
    tokens: int, costs: tuple[float, float, float], starts: list[int]
) -> None:
    sizes = EqualCostChunks(tokens, LayerCosts(*costs))
    assert sizes.tokens_at(0) == (tokens if tokens < 32 else tokens - tokens % 8)
    budget = sizes.cost(0, tokens)
    lengths = [sizes.tokens_at(start) for start in sorted(starts)]
    for start, length in zip(sorted(starts), lengths):
        assert 1 <= length <= tokens and (length < 32 or length % 8 == 0), (start, length)
        assert length == 1 or sizes.cost(start, length) <= budget, (start, length)
    assert lengths == sorted(lengths, reverse=True), f"a later chunk is longer: {lengths}"


def test_equal_cost_chunks_shrink_where_attention_dominates() -> None:
    sizes = EqualCostChunks(64, LayerCosts(0.0, 1.0, 1e-3))  # a token costs what 1000 query-key pairs do
    assert [sizes.tokens_at(s) for s in (0, 1000, 4000)] == [64, 32, 13]
    assert EqualCostChunks(64, LayerCosts(0.0, 1.0, 0.0)).tokens_at(4000) == 64  # no attention cost: even chunks


def test_bad_plan_arguments() -> None:
    with pytest.raises(ValueError, match="chunk sizes"):
        plan_tick(TickState(2), [], 0)
    with pytest.raises(ValueError, match="positions"):
        QueuedPrompt(0, -1)
    with pytest.raises(ValueError, match="tokens"):
        EqualCostChunks(0, LayerCosts(0.0, 1.0, 0.0))
    with pytest.raises(ValueError, match="world_size"):
        TickState(0)


# Decode groups in flight ------------------------------------------------------------------------------------------

group_events = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 3)),  # per tick: requests joining, rows finishing or removed
    min_size=1,
    max_size=60,
)


@given(
    world_size=st.integers(2, 4),
    enter=st.integers(2, 9),
    leave_below=st.integers(0, 8),
    events=group_events,
    seed=st.randoms(use_true_random=False),
)
def test_decode_groups_travel_the_ranks_as_chunks_do_and_no_row_is_lost(
    world_size: int, enter: int, leave_below: int, events: list[tuple[int, int]], seed: Any
) -> None:
    """plan_groups driven as the generator drives it, rows joining and leaving at random: rank ``r`` computes in tick
    ``t + 1`` the group rank ``r - 1`` computed in tick ``t``; a group's step ends on the last rank before rank 0 takes
    it again; rows change only in idle groups; every live row stays in exactly one group; at most ``world_size``
    groups; a merge only with no step under way; groups are taken in turn (none waits while another goes twice)."""
    rule = GroupRule(world_size, enter, min(enter, max(1, leave_below)))
    state = GroupState(world_size)
    live: dict[int, int] = {SERIAL: 0}
    previous: GroupTick | None = None
    chunks = enqueue(TickState(world_size), [QueuedPrompt(u, 3 + 5 * u) for u in range(4)])  # chunks travel too
    programs: list[list[Op]] = [[] for _ in range(world_size)]
    for index, (joining, leaving) in enumerate(events):
        want = seed.random() < 0.85  # a measured rule's decision (decode_groups="auto"): now and then "one group"
        tick, after = plan_groups(state, dict(live), joining, rule, index, want)
        planned, chunks = plan_tick(chunks, [], 4)
        rows = sum(live.values()) + joining
        for rank, program in enumerate(programs):
            program += tick_ops(planned, rows, rank, world_size, tick)
        assert tick.fingerprint() == plan_groups(state, dict(live), joining, rule, index, want)[0].fingerprint()
        assert want or not (tick.split or (tick.decode[0] is not None and not tick.serial)), tick  # no new step
        busy = {g for g in state.flight if g is not None}
        if not state.serial and not tick.serial and tick.decode[0] is not None:  # no group travels the ranks alone
            assert joining or sum(1 for n in live.values() if n) >= 2, (state, live, tick)
        assert not (busy & {tick.joins_into, *tick.dropped}), (tick, state)  # only idle groups change
        for g in tick.dropped:
            assert live.pop(g) == 0
        if tick.merge:
            assert not busy and state.idle is not None
            live = {SERIAL: sum(live.values())}
        if tick.formed:
            live[cast(int, tick.joins_into)] = 0
        if joining:
            live[cast(int, tick.joins_into)] += joining
        if tick.split:
            total = live.pop(SERIAL)
            assert len(tick.split) <= min(world_size, total) and total >= enter
            live.update(
                {g: total * (k + 1) // len(tick.split) - total * k // len(tick.split) for k, g in enumerate(tick.split)}
            )
        if tick.serial:
            assert tick.decode == (SERIAL,) * world_size and set(live) == {SERIAL}
        else:
            taken = [g for g in tick.decode if g is not None]
            assert len(taken) == len(set(taken)) and set(taken) <= set(live), (tick, live)
            assert len(live) <= world_size and set(after.groups) == set(live), (after, live)
            if previous is not None and not previous.serial:
                assert tick.decode[1:] == previous.decode[:-1], (previous, tick)  # one rank further each tick
            if tick.decode[0] is not None and state.idle and not tick.dropped:
                assert tick.decode[0] in (state.idle[0], tick.joins_into), (state, tick)  # the longest waiting
        # rows finish or are removed anywhere (their rows stay until their group is idle: counted as not live)
        for _ in range(leaving):
            holding = sorted(g for g, n in live.items() if n)
            if holding:
                live[seed.choice(holding)] -= 1
        state, previous = after, tick
    # Every rank's messages, serial ticks and groups in flight alike, run through with rendezvous sends: each receive
    # takes the message it expects, and none is left on a link (nothing is in flight between ticks but what the
    # next tick computes, received in this one).
    assert run_ticks(programs, capacity=0) == []


def test_rows_that_joined_with_nothing_computed_split_before_any_step() -> None:
    """One-token prompts join with empty caches (no prefill) and a tick splits the group at once (issue 51: mlx-lm's
    ``BatchKVCache.extract`` fails on a batch cache without keys): each part holds its rows, still empty."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from pipemlx.runtime.batch.rows import Rows

    rows = Rows(mx.default_stream(mx.cpu))
    joining: list[Any] = [SimpleNamespace(uid=i, prompt=[5 + i], done=False) for i in range(5)]
    rows.join(joining, [[KVCache(), KVCache()] for _ in joining])
    parts = rows.split(2)
    assert [[r.uid for r in p.requests] for p in parts] == [[0, 1], [2, 3, 4]]
    assert [p.inputs for p in parts] == [[5, 6], [7, 8, 9]]
    for part in parts:
        assert len(part.caches) == 2 and all(c.empty() for c in part.caches)
        assert all(c.offset.tolist() == [0] * len(part.requests) for c in part.caches)


def test_a_split_in_a_tick_nobody_joins_makes_its_groups_before_using_them() -> None:
    """The serial batch splits in a tick without joins (a last group merged back, its rows still past ``enter``):
    ``BatchGenerator._regroup`` makes the split's groups before it touches the one taking rank 0 (issue 51's
    stateful run: ``KeyError`` on every rank), and rank 0's group is the split's first."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from pipemlx.runtime.batch.generator import BatchGenerator
    from pipemlx.runtime.batch.rows import Rows
    from pipemlx.schedule.batch_plan import SERIAL, GroupRule, GroupState, plan_groups

    tick, after = plan_groups(GroupState(2), {SERIAL: 8}, 0, GroupRule(most=2, enter=8, leave=6), 7)
    assert tick.split and not tick.serial and tick.joins_into is None  # the case: a split nobody joins
    stream = mx.default_stream(mx.cpu)
    rows = Rows(stream)
    joining: list[Any] = [SimpleNamespace(uid=i, prompt=[5 + i], done=False) for i in range(8)]
    rows.join(joining, [[KVCache()] for _ in joining])
    fake: Any = SimpleNamespace(stage=SimpleNamespace(compute_stream=stream), _groups={SERIAL: rows})
    BatchGenerator._regroup(fake, tick, ())  # pyright: ignore[reportPrivateUsage]
    assert sorted(fake._groups) == sorted(tick.split)
    assert sorted(u for g in fake._groups.values() for u in (r.uid for r in g.requests)) == list(range(8))
    assert tick.decode[0] == tick.split[0] and tick.finishing is None  # the pipeline fills: nobody finishes yet
    assert after.flight == tick.decode[:-1]


# decode_groups="auto": measured, not a fixed row count --------------------------------------------------------------


@pytest.mark.parametrize(
    "serial,grouped,grouping,wanted",
    [
        (None, None, False, False),  # nothing measured: stay
        (None, None, True, True),
        (1.0, None, False, True),  # one group measured, groups not: try them
        (None, 1.0, True, False),  # groups measured, one group not: try it
        (1.0, 0.90, False, True),  # groups 10% cheaper: split
        (1.0, 0.97, False, False),  # within the margin: stay one group
        (1.0, 1.20, False, False),  # groups lose: never split
        (1.0, 0.98, True, True),  # within the margin: stay groups
        (1.0, 1.02, True, False),  # groups no cheaper: merge
        (0.90, 1.0, True, False),  # one group 10% cheaper: merge
    ],
)
def test_choose_groups_switches_only_to_a_way_measured_cheaper_by_the_margin(
    serial: float | None, grouped: float | None, grouping: bool, wanted: bool
) -> None:
    assert AUTO_MARGIN == 0.05  # (the cases above are cut around it)
    assert choose_groups(serial, grouped, grouping) is wanted
    with pytest.raises(ValueError, match="margin must be in 0 .. 1"):
        choose_groups(serial, grouped, grouping, margin=1.0)


def test_group_timings_take_the_median_of_fresh_steady_ticks() -> None:
    timings = GroupTimings(fresh=100)
    for tick, cost in enumerate([5.0, 1.0]):
        timings.record(False, 16, tick, cost)
    assert timings.cost(False, 16, 2) is None  # fewer than AUTO_SAMPLES
    timings.record(False, 16, 2, 3.0)
    assert AUTO_SAMPLES == 3 and timings.cost(False, 16, 3) == 3.0  # the median, not the mean
    assert timings.cost(True, 16, 3) is None and timings.cost(False, 15, 3) is None  # per way and row count
    assert timings.cost(False, 16, 101) is None  # tick 0 is stale now: two fresh ones left
    for tick in range(3, 3 + AUTO_KEEP):
        timings.record(False, 16, tick, 2.0)
    assert len(timings.samples[(False, 16)]) == AUTO_KEEP and timings.cost(False, 16, 20) == 2.0


def test_a_measured_rule_keeps_small_batches_in_one_group_and_drains_groups_it_does_not_want() -> None:
    rule = GroupRule.of("auto", 2)
    assert rule is not None and rule.measured and rule.enter == rule.leave == 2 * AUTO_MIN_ROWS_PER_GROUP
    assert GroupRule.of("auto", 1) is None and not cast(GroupRule, GroupRule.of(3, 2)).measured
    state = GroupState(2)
    for rows in range(1, rule.enter):  # 1..15 requests at S=2: one group whatever is measured
        assert plan_groups(state, {SERIAL: rows}, 0, rule, 0, want=True)[0].serial
    assert plan_groups(state, {SERIAL: 16}, 0, rule, 0, want=False)[0].serial  # measured: one group wins
    tick, state = plan_groups(state, {SERIAL: 16}, 0, rule, 0, want=True)
    split = tick.split
    assert split and state.flight == (split[0],)
    live = {g: 8 for g in split}
    tick, state = plan_groups(state, live, 0, rule, 1, want=True)
    assert tick.decode == (split[1], split[0])  # every rank busy
    tick, state = plan_groups(state, live, 0, rule, 2, want=False)  # draining: no group takes rank 0
    assert tick.decode[0] is None and not tick.merge
    tick, state = plan_groups(state, live, 0, rule, 3, want=False)
    assert tick.merge and tick.serial and state.serial  # merged back, decoded as one group in the same tick


@pytest.mark.parametrize("groups_cost,ends_grouped", [(0.8, True), (1.3, False), (1.02, False)])
def test_auto_groups_driven_by_measured_ticks_settle_on_the_cheaper_way(groups_cost: float, ends_grouped: bool) -> None:
    """The generator's loop in miniature: 16 live rows at S=2, each steady tick's seconds per token recorded one tick
    late (as the next all-gather brings it), noise of 3%. One group costs 1.0 a token, groups ``groups_cost``: the
    batch tries groups once, then keeps the cheaper way (groups slightly slower: one group) and does not switch
    back and forth; ranks fed the same measurements decide the same ticks."""
    import random

    rule = cast(GroupRule, GroupRule.of("auto", 2))

    def drive() -> tuple[list[bool], int]:
        noise = random.Random(7)
        timings, state = GroupTimings(), GroupState(2)
        live: dict[int, int] = {SERIAL: 16}
        grouped: list[bool] = []
        switches = 0
        pending: tuple[bool, int] | None = None
        for index in range(200):
            want = timings.want(16, not state.serial, index)
            tick, state = plan_groups(state, live, 0, rule, index, want)
            if tick.merge:
                live = {SERIAL: 16}
            if tick.split:
                live = {g: 8 for g in tick.split}
            switches += bool(tick.split) + tick.merge
            steady = (not tick.split and not tick.merge) and (tick.serial or None not in tick.decode)
            if pending is not None:  # the last tick's time arrives with this tick's all-gather
                timings.record(
                    pending[0], 16, pending[1], (groups_cost if pending[0] else 1.0) * noise.uniform(1, 1.03)
                )
            pending = (not tick.serial, index) if steady else None
            grouped.append(not tick.serial)
        return grouped, switches

    grouped, switches = drive()
    assert grouped[-1] is ends_grouped and all(g is ends_grouped for g in grouped[-100:]), grouped
    assert switches <= 2, switches  # one probe (split, and a merge where groups lose), no flapping
    assert any(grouped), "groups were never tried"
    assert drive() == (grouped, switches)  # the same measurements: the same decisions


def test_auto_groups_compare_at_the_nearest_measured_row_count_so_finishing_requests_do_not_probe_anew() -> None:
    """Groups measured cheaper at 16 rows: as requests finish one by one (15, 14, ... rows) the batch stays in
    groups without probing one group at each new count; far from any measured count (8 rows), it measures again."""
    timings = GroupTimings()
    for tick in range(AUTO_SAMPLES):
        timings.record(False, 16, tick, 1.0)
        timings.record(True, 16, tick, 0.8)
    for rows in range(16, 12, -1):  # within a quarter of the rows of 16
        assert timings.want(rows, True, 10) and timings.want(rows, False, 10), rows
    assert timings.nearest(15, 10) == (1.0, 0.8) and timings.nearest(8, 10) is None
    timings.record(True, 8, 5, 0.7)  # at 8 rows only groups measured (one sample): nothing to compare
    assert not timings.want(8, False, 10)  # one group at 8 rows not measured either: it stays
    for tick in range(AUTO_SAMPLES):
        timings.record(False, 8, tick, 1.0)
    assert timings.want(8, False, 10)  # one group measured at 8, groups not yet: try them
