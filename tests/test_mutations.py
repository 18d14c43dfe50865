"""Deliberately broken plans: the simulator must report each as a deadlock or a mismatch, readably.

Each mutation starts from the real plans of pipemlx.schedule.plan.build_plans and breaks
them the way a bug in the schedule would; hypothesis chooses the prompt, step
size, world size, rank and send semantics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_profiles import Case, cases

from pipemlx.schedule.plan import (
    Action,
    Agree,
    Compute,
    PrefillPlan,
    Progress,
    Recv,
    Send,
    build_plan,
    build_plans,
    chunk_prompt,
)
from pipemlx.schedule.simulate import DeadlockError, PlanMismatchError, SimulationResult, simulate

SEMANTICS = [(0, False), (1, False), (None, False), (None, True)]
semantics = st.sampled_from(SEMANTICS)


def with_actions(plan: PrefillPlan, actions: list[Action]) -> PrefillPlan:
    return dataclasses.replace(plan, actions=tuple(actions))


def replace_rank(
    plans: tuple[PrefillPlan, ...], rank: int, edit: Callable[[list[Action]], list[Action]]
) -> list[PrefillPlan]:
    return [with_actions(p, edit(list(p.actions))) if p.rank == rank else p for p in plans]


def run(plans: list[PrefillPlan], sem: tuple[int | None, bool], **options: bool) -> SimulationResult:
    return simulate(plans, capacity=sem[0], await_sends=sem[1], record_events=False, **options)


def sender_case(data: st.DataObject) -> tuple[Case, int]:
    """A case with >= 2 ranks and >= 1 chunk, and a rank that sends (not the last)."""
    case = data.draw(cases(min_ranks=2, min_chunks=1))
    return case, data.draw(st.integers(0, case.world_size - 2), label="rank")


@given(st.data(), semantics)
def test_seed_bug_queued_sends_never_issued(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    """The seed's bug: the compute queues its output but the plan never issues the send."""
    case, rank = sender_case(data)
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)
    broken = replace_rank(plans, rank, lambda acts: [a for a in acts if not isinstance(a, Send)])
    result = run(broken, sem)
    assert result.deadlocked, result.report()
    receiver = next(b for b in result.blocked if b.rank == rank + 1)
    assert isinstance(receiver.action, Recv) and receiver.action.chunk.index == 0
    assert f"rank {rank}'s send queue holds chunk 0" in str(receiver), str(receiver)
    assert "computed but never sent" in result.report()
    with pytest.raises(DeadlockError, match=rf"rank {rank + 1} is stuck on action #\d+ \(Recv chunk 0 "):
        result.raise_for_failure()


@given(st.data(), semantics)
def test_last_queued_send_never_issued(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    case, rank = sender_case(data)
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)

    def drop_last_send(acts: list[Action]) -> list[Action]:
        last = max(i for i, a in enumerate(acts) if isinstance(a, Send))
        return acts[:last] + acts[last + 1 :]

    result = run(replace_rank(plans, rank, drop_last_send), sem)
    assert result.deadlocked, result.report()
    last = case.num_chunks - 1
    assert f"send queue holds chunk {last} " in result.report(), result.report()


@given(st.data(), semantics)
def test_rank_with_one_chunk_fewer(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    """One rank's plan lacks the last chunk's receive, compute and send."""
    case = data.draw(cases(min_ranks=2, min_chunks=1))
    rank = data.draw(st.integers(0, case.world_size - 1), label="rank")
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)
    last = plans[rank].chunks[-1]

    def drop_last_chunk(acts: list[Action]) -> list[Action]:
        return [a for a in acts if not (isinstance(a, (Send, Recv, Compute)) and a.chunk == last)]

    result = run(replace_rank(plans, rank, drop_last_chunk), sem)
    assert not result.ok, result.report()
    assert result.blocked or result.mismatches
    text = result.report()
    assert (
        f"chunk {last.index} [{last.start}:{last.stop})" in text  # a send or receive of it is stuck or unmatched
        or f"rank {rank} processed {last.start} of the {case.num_tokens - 1} prompt positions" in text
        or f"but cannot know that every rank has processed {last.stop} positions" in text  # progress check
    ), text
    with pytest.raises((DeadlockError, PlanMismatchError)):
        result.raise_for_failure()


@given(st.data(), semantics)
def test_rank_planning_one_chunk_fewer_is_caught_at_the_handshake(
    data: st.DataObject, sem: tuple[int | None, bool]
) -> None:
    """A rank that built its plan for a prompt one chunk shorter; without the handshake the messages disagree."""
    case = data.draw(cases(min_ranks=2, min_chunks=2))
    rank = data.draw(st.integers(0, case.world_size - 1), label="rank")
    plans = list(build_plans(case.num_tokens, case.step_size, case.world_size))
    shorter = case.num_tokens - plans[0].chunks[-1].length
    plans[rank] = build_plan(shorter, case.step_size, case.world_size, rank)
    result = run(plans, sem)
    assert not result.ok and not result.blocked
    assert "at the handshake the ranks disagree on num_tokens" in result.mismatches[0]
    assert f"rank {rank}: {shorter}" in result.mismatches[0]
    unchecked = run(plans, sem, check_handshake=False)
    assert not unchecked.ok, unchecked.report()


@given(st.data(), semantics)
def test_ranks_disagreeing_on_the_step_size(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    case = data.draw(cases(min_ranks=2))
    other = data.draw(st.integers(1, 8191), label="other step (before skipping the case's)")
    other += other >= case.step_size  # any step size in 1..8192 but the case's, without rejecting draws
    S = case.world_size
    how_many = data.draw(st.integers(1, S - 1), label="ranks with the other step")
    odd = set(data.draw(st.permutations(range(S)))[:how_many])
    plans = [build_plan(case.num_tokens, other if r in odd else case.step_size, S, r) for r in range(S)]
    result = run(plans, sem)
    assert not result.ok and "at the handshake the ranks disagree on step_size" in result.mismatches[0]
    listed = ", ".join(f"rank {r}: {other if r in odd else case.step_size}" for r in range(S))
    assert listed in result.mismatches[0]
    with pytest.raises(PlanMismatchError, match="disagree on step_size"):
        result.raise_for_failure()
    # Without the handshake the messages themselves disagree, unless both step sizes cut the prompt alike.
    same_chunks = chunk_prompt(case.num_tokens, case.step_size) == chunk_prompt(case.num_tokens, other)
    unchecked = run(plans, sem, check_handshake=False)
    assert unchecked.ok == same_chunks, unchecked.report()


@given(st.data(), semantics)
def test_send_issued_after_the_agreement_its_receiver_waits_behind(
    data: st.DataObject, sem: tuple[int | None, bool]
) -> None:
    case, rank = sender_case(data)
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)

    def send_late(acts: list[Action]) -> list[Action]:
        out: list[Action] = []
        held: list[Action] = []
        for a in acts:
            if isinstance(a, Send):
                held.append(a)
                continue
            out.append(a)
            if isinstance(a, Agree):
                out += held
                held = []
        return out + held

    result = run(replace_rank(plans, rank, send_late), sem)
    assert result.deadlocked, result.report()
    assert any(b.rank == rank + 1 and isinstance(b.action, Recv) for b in result.blocked), result.report()
    assert any(b.rank == rank and isinstance(b.action, Agree) for b in result.blocked), result.report()


@given(st.data(), semantics)
def test_progress_reported_before_the_agreement(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    """Rank 0 reporting a chunk before the agreement point that tells it the last rank is done."""
    case = data.draw(cases(min_ranks=2, min_chunks=1))
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)

    def report_early(acts: list[Action]) -> list[Action]:
        for i in range(2, len(acts)):
            if isinstance(acts[i], Progress) and isinstance(acts[i - 1], Agree):
                acts[i - 1], acts[i] = acts[i], acts[i - 1]
        return acts

    result = run(replace_rank(plans, 0, report_early), sem)
    assert not result.ok and not result.blocked
    first = plans[0].chunks[0].stop
    assert f"rank 0 reports progress ({first}, {case.num_tokens}) but cannot know" in result.mismatches[0]


@given(st.data(), semantics)
def test_rank_skipping_the_closing_agreement(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    case = data.draw(cases(min_ranks=2))
    rank = data.draw(st.integers(0, case.world_size - 1), label="rank")
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)
    result = run(replace_rank(plans, rank, lambda acts: acts[:-1]), sem)
    assert result.deadlocked, result.report()
    assert f"rank {rank} has finished its plan" in result.report()
    assert {b.rank for b in result.blocked} == set(range(case.world_size)) - {rank}


@given(st.data(), semantics)
def test_chunks_computed_out_of_order(data: st.DataObject, sem: tuple[int | None, bool]) -> None:
    case = data.draw(cases(min_chunks=2))
    plans = build_plans(case.num_tokens, case.step_size, case.world_size)
    acts = list(plans[0].actions)
    first, second = (i for i, a in enumerate(acts) if isinstance(a, Compute) and a.chunk.index in (0, 1))
    acts[first], acts[second] = acts[second], acts[first]
    result = run([with_actions(plans[0], acts), *plans[1:]], sem)
    assert not result.ok
    assert "rank 0 computes chunk 1" in result.mismatches[0]
    assert "positions must be computed in order" in result.mismatches[0]
