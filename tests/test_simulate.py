"""The simulator's semantics on small hand-made plans: send capacity, collectives, checks, timing."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from pipemlx.schedule.plan import (
    Action,
    Agree,
    Chunk,
    Compute,
    Handshake,
    PrefillPlan,
    Progress,
    Recv,
    Send,
    build_plans,
)
from pipemlx.schedule.simulate import (
    DeadlockError,
    PlanMismatchError,
    SimulationError,
    check_plans,
    describe,
    simulate,
)

C0, C1 = Chunk(0, 0, 2), Chunk(1, 2, 4)


def plan(rank: int, actions: list[Action], world_size: int = 2) -> PrefillPlan:
    return PrefillPlan(
        num_tokens=5, step_size=2, world_size=world_size, rank=rank, chunks=(C0, C1), actions=tuple(actions)
    )


def eager_sender() -> list[PrefillPlan]:
    """Rank 0 sends both chunks before an agreement that rank 1 enters before receiving anything."""
    return [
        plan(0, [Handshake(), Compute(C0), Send(C0, 1), Compute(C1), Send(C1, 1), Agree(0), Agree(1)]),
        plan(1, [Handshake(), Agree(0), Recv(C0, 0), Compute(C0), Recv(C1, 0), Compute(C1), Agree(1)]),
    ]


@pytest.mark.parametrize("capacity,finishes", [(0, False), (1, False), (2, True), (5, True), (None, True)])
def test_send_capacity_decides_whether_eager_sends_deadlock(capacity: int | None, finishes: bool) -> None:
    result = simulate(eager_sender(), capacity=capacity)
    assert result.ok is finishes, result.report()
    if not finishes:
        stuck = {b.rank: b for b in result.blocked}
        assert isinstance(stuck[0].action, Send) and stuck[0].action.chunk == (C0 if capacity == 0 else C1)
        assert "waits for rank 1 to receive it" in stuck[0].reason
        assert isinstance(stuck[1].action, Agree) and "rank 0 is at action #" in stuck[1].reason
        with pytest.raises(DeadlockError, match=r"rank 0 is stuck on action #\d \(Send chunk \d"):
            result.raise_for_failure()


def test_awaiting_sends_at_collectives_deadlocks_eager_sends_even_unbounded() -> None:
    result = simulate(eager_sender(), capacity=None, await_sends=True)
    assert result.deadlocked
    assert "before entering it, it waits for its send(s) of chunk 0 [0:2), chunk 1 [2:4)" in result.report()


def test_real_plans_finish_and_record_every_action() -> None:
    plans = build_plans(num_tokens=11, step_size=3, world_size=3)
    result = check_plans(plans)
    assert result.ok and result.finished and not result.deadlocked
    assert len(result.events) == result.actions_done == sum(len(p.actions) for p in plans)
    for p in plans:
        executed = [e for e in result.events if e.rank == p.rank]
        assert [e.action for e in executed] == list(p.actions)
        assert [e.position for e in executed] == list(range(len(p.actions)))
    assert "finished after" in result.report()


def test_collective_mismatch_names_every_rank() -> None:
    plans = [plan(0, [Handshake(), Agree(0), Agree(1)]), plan(1, [Handshake(), Agree(1), Agree(2)])]
    result = simulate(plans)
    assert not result.ok and not result.blocked
    assert (
        result.mismatches[0] == "the ranks entered different collectives (rank 0: Agree(step 0), rank 1: Agree(step 1))"
    )
    with pytest.raises(PlanMismatchError):
        result.raise_for_failure()


def test_handshake_compares_plan_headers() -> None:
    a, b = build_plans(9, 4, 2)[0], build_plans(9, 2, 2)[1]
    result = simulate([a, b])
    assert result.mismatches[0] == "at the handshake the ranks disagree on step_size (rank 0: 4, rank 1: 2)"
    assert not simulate([a, b], check_handshake=False).ok  # and the messages disagree too


def test_wrong_chunk_received_is_a_mismatch_with_shapes() -> None:
    plans = [
        plan(0, [Handshake(), Compute(C0), Agree(0), Send(C0, 1), Agree(1)]),
        plan(1, [Handshake(), Agree(0), Recv(C1, 0), Compute(C1), Agree(1)]),
    ]
    result = simulate(plans, hidden_size=8)
    assert result.mismatches[0] == (
        "rank 1 expects chunk 1 [2:4) of shape (2, 8) from rank 0, but the next message is chunk 0 [0:2) of shape (2, 8)"
    )


def test_compute_without_its_receive_and_send_of_nothing() -> None:
    no_recv = [
        plan(0, [Handshake(), Compute(C0), Send(C0, 1), Agree(0)]),
        plan(1, [Handshake(), Compute(C0), Agree(0)]),
    ]
    assert "but it has received nothing (a missing or extra Recv)" in simulate(no_recv, capacity=None).report()
    no_compute = [plan(0, [Handshake(), Send(C0, 1), Agree(0)]), plan(1, [Handshake(), Agree(0)])]
    assert simulate(no_compute).mismatches[0] == "rank 0 sends chunk 0 [0:2) to rank 1 but its send queue is empty"


def test_leftovers_are_reported_at_the_end() -> None:
    plans = [
        plan(0, [Handshake(), Compute(C0), Send(C0, 1), Compute(C1), Agree(0)]),
        plan(1, [Handshake(), Agree(0)]),
    ]
    result = simulate(plans, capacity=None)
    assert result.finished and not result.ok
    assert result.mismatches == (
        "rank 0 sent chunk 0 [0:2) to rank 1, which never received it",
        "rank 0 queued chunk 1 [2:4) for rank 1 and never sent it (no Send)",
        "rank 1 processed 0 of the 4 prompt positions",
    )


def test_progress_must_be_known_on_all_ranks() -> None:
    single = [dataclasses.replace(build_plans(5, 2, 1)[0])]
    assert simulate(single).ok
    plans = list(build_plans(5, 2, 2))
    acts = list(plans[1].actions)
    i = acts.index(Progress(2, 5))
    acts.insert(acts.index(Compute(plans[1].chunks[0])), acts.pop(i))  # report chunk 0 before computing it
    plans[1] = dataclasses.replace(plans[1], actions=tuple(acts))
    result = simulate(plans)
    assert result.mismatches[0] == (
        "rank 1 reports progress (2, 5) but cannot know that every rank has processed 2 positions "
        "(known so far: rank 1: 0)"  # rank 0's chunk 0 is known from the agreement closing step 0
    )


class Fixed:
    """Compute takes 1 s per token on every rank, a transfer 0.5 s, a collective 0.25 s."""

    def compute(self, rank: int, chunk: Chunk) -> float:
        return float(chunk.length)

    def transfer(self, source: int, dest: int, shape: tuple[int, int]) -> float:
        return 0.5

    def collective(self, action: Action) -> float:
        return 0.25


def test_timed_run_of_two_ranks() -> None:
    plans = build_plans(num_tokens=5, step_size=2, world_size=2)
    result = simulate(plans, durations=Fixed(), capacity=0)
    spans = {(e.rank, describe(e.action)): (e.start, e.end) for e in result.events}
    assert spans[(0, "Handshake")] == spans[(1, "Handshake")] == (0.0, 0.25)
    assert spans[(0, "Compute chunk 0 [0:2)")] == (0.25, 2.25)
    assert spans[(1, "Agree(step 0)")] == (0.25, 2.5)  # rank 1 waits there for rank 0's compute
    assert spans[(1, "Recv chunk 0 [0:2) from rank 0")] == (2.5, 3.0)  # 0.5 s in transit
    assert spans[(0, "Send chunk 0 [0:2) to rank 1")] == (2.5, 3.0)  # a rendezvous send ends with its receive
    assert spans[(0, "Compute chunk 1 [2:4)")] == (3.0, 5.0)
    assert spans[(1, "Compute chunk 0 [0:2)")] == (3.0, 5.0)
    assert spans[(0, "Agree(step 1)")] == (5.0, 5.25)
    assert spans[(1, "Compute chunk 1 [2:4)")] == (5.75, 7.75)
    assert spans[(0, "Agree(step 2)")] == (5.75, 8.0)
    assert result.makespan == 8.25  # the closing Agree(3)
    unbounded = simulate(plans, durations=Fixed(), capacity=None)
    spans = {(e.rank, describe(e.action)): (e.start, e.end) for e in unbounded.events}
    assert spans[(0, "Send chunk 0 [0:2) to rank 1")] == (2.5, 2.5)  # returns at once
    assert spans[(0, "Compute chunk 1 [2:4)")] == (2.5, 4.5)
    assert spans[(0, "Agree(step 1)")] == (4.5, 5.25)
    assert unbounded.makespan == 8.25


def test_idle_slots_count_steps_without_compute() -> None:
    result = simulate(build_plans(num_tokens=10, step_size=3, world_size=4))
    assert [result.idle_slots(r) for r in range(4)] == [3, 3, 3, 3]
    assert result.steps == (7, 7, 7, 7)  # 3 chunks + 4 - 1 steps, plus the closing agreement
    assert simulate(build_plans(1, 3, 4)).idle_slots(2) == 0  # nothing to do: no steps at all


@pytest.mark.parametrize(
    "plans,capacity,words",
    [
        ([], 0, "at least one plan"),
        (list(reversed(build_plans(5, 2, 2))), 0, "plans must be given by rank"),
        (list(build_plans(5, 2, 2)), -1, "capacity must be a non-negative int or None"),
    ],
)
def test_bad_arguments(plans: list[PrefillPlan], capacity: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        simulate(plans, capacity=capacity)


def test_errors_carry_the_result() -> None:
    with pytest.raises(SimulationError) as info:
        check_plans(eager_sender(), capacity=0)
    assert info.value.result.deadlocked and str(info.value) == info.value.result.report()


PURE_MODULES = sorted(
    str(path.relative_to(Path(__file__).parent.parent / "pipemlx").with_suffix(""))
    for folder in ("schedule", "observe")  # pure planning, and the traces/timelines/figures read without MLX
    for path in (Path(__file__).parent.parent / "pipemlx" / folder).glob("*.py")
)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_python_modules_do_not_import_mlx(module: str) -> None:
    path = Path(__file__).parent.parent / "pipemlx" / f"{module}.py"
    tree = ast.parse(path.read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("mlx")], imported
