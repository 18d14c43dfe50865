"""Faults end in clear errors on every rank, never a hang; cancellation is agreed across ranks.

Every scenario runs on real ranks under a hard wall-clock bound that kills all
of them (run_ranks). Requests that can keep the group alive run one after the
other on one group, each followed by a normal request that must be exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_ranks

from pipemlx.schedule.plan import build_plan

M, STEP = 30, 4
TIMEOUT = 2.0
MARGIN = 3.0  # seconds of slack for a loaded 2-core machine


def agreement_points(world_size: int) -> int:
    """Handshake plus one Agree per step plus the closing Agree."""
    return 1 + build_plan(M, STEP, world_size, 0).num_steps + 1


def processed_at_poll(world_size: int, poll: int) -> int:
    """Positions every rank completed when the prefill stops at its ``poll``-th agreement point."""
    return 0 if poll == 0 else build_plan(M, STEP, world_size, 0).completed_after(poll - 1)


def survivable_requests(world_size: int) -> list[dict[str, Any]]:
    normal = {"M": M, "step": STEP, "fault": {"kind": "none", "rank": 0}}
    last_point = agreement_points(world_size) - 1
    faults: list[dict[str, Any]] = [
        {"kind": "cancel", "rank": r, "at": at}
        for r in sorted({0, world_size // 2, world_size - 1})
        for at in (0, last_point // 2, last_point)
    ]
    faults += [{"kind": "raise", "rank": r, "at": at} for r, at in ((0, 0), (world_size - 1, 3))]
    faults.append({"kind": "mismatch", "rank": world_size - 1})
    faults.append({"kind": "queue_exception", "rank": 0})
    requests: list[dict[str, Any]] = []
    for fault in faults:
        requests += [{"M": M, "step": STEP, "fault": fault}, normal]
    return requests


def assert_clean(outcome: dict[str, Any], where: str) -> None:
    assert outcome["queued"] == 0 and outcome["in_flight"] == 0, where
    assert outcome["mode"] == "immediate", where


@pytest.mark.parametrize(
    "world_size", [pytest.param(2, marks=pytest.mark.slow), 3]
)  # the suite's time budget: run with -m slow
def test_agreed_stops_leave_every_rank_consistent_and_the_next_request_exact(world_size: int, tmp_path: Path) -> None:
    requests = survivable_requests(world_size)
    spec = {"timeout": 30.0, "marker": str(tmp_path / "marker"), "requests": requests}
    reports = run_ranks(world_size, "faults.py", spec, timeout=240)
    checked = 0
    for i, request in enumerate(requests):
        fault = request["fault"]
        outcomes = [r["outcomes"][i] for r in reports]
        where = f"request {i} {fault}"
        for o in outcomes:
            assert_clean(o, where)
        if fault["kind"] == "none":
            for o in outcomes:
                assert o["error"] is None, f"{where}: {o.get('message')}"
                assert o["tokens"] == o["reference"], where
                assert o["offsets"] == [M - 1], where
        elif fault["kind"] == "cancel":
            expected = processed_at_poll(world_size, fault["at"])
            for o in outcomes:
                assert o["error"] == "PrefillCancelled", f"{where}: {o}"
                assert o["cancelling_ranks"] == [fault["rank"]] and o["failed_ranks"] == [], where
                assert o["processed"] == expected and o["trimmed"], where
                assert o["offsets"] == [expected], where
                assert o["polls"] == fault["at"] + 1, where  # every rank polled at every point up to the stop
        elif fault["kind"] == "raise":
            offsets = {tuple(o["offsets"]) for o in outcomes}
            assert len(offsets) == 1, f"{where}: caches differ across ranks {offsets}"
            (common,) = offsets
            for rank, o in enumerate(outcomes):
                if rank == fault["rank"]:
                    assert o["error"] == "ValueError" and "callback of rank" in o["message"], where
                else:
                    assert o["error"] == "PrefillCancelled", where
                    assert o["failed_ranks"] == [fault["rank"]], where
                    assert (o["processed"],) == common and o["trimmed"], where
        elif fault["kind"] == "queue_exception":
            for o in outcomes:
                assert o["error"] == "RuntimeError" and "queue block" in o["message"], where
        else:
            for o in outcomes:
                assert o["error"] == "PipelineMismatchError", where
                assert "ranks disagree on num_tokens" in o["message"] and f"{M + 1}" in o["message"], where
                assert o["offsets"] == [0], f"{where}: something was computed before the handshake failed"
        checked += 1
    assert checked == len(requests)


def fatal_run(world_size: int, kind: str, tmp_path: Path) -> tuple[list[dict[str, Any]], float]:
    victim = world_size // 2 if world_size > 2 else 1
    marker = tmp_path / "marker"
    spec = {
        "timeout": TIMEOUT,
        "marker": str(marker),
        "requests": [{"M": M, "step": STEP, "fault": {"kind": kind, "rank": victim, "at": 2}}],
    }
    expect_exit = {victim: 3} if kind == "kill" else None
    reports = run_ranks(world_size, "faults.py", spec, timeout=60, expect_exit=expect_exit)
    return reports, float(marker.read_text())


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_killed_rank_surfaces_on_every_survivor(world_size: int, tmp_path: Path) -> None:
    reports, killed_at = fatal_run(world_size, "kill", tmp_path)
    survivors = [r for r in reports if r]
    assert len(survivors) == world_size - 1
    for report in survivors:
        (outcome,) = report["outcomes"]
        assert outcome["error"] in ("PeerLostError", "PipelineTimeoutError"), outcome
        assert f"rank {report['rank']}/{world_size}" in outcome["message"]
        assert outcome["broken"], "the stage must refuse further use after a lost peer"
        assert "cannot communicate any more" in outcome["next_call"], outcome
        assert 0 <= outcome["at_time"] - killed_at <= TIMEOUT + MARGIN, outcome
        print(
            f"S={world_size} kill: rank {report['rank']} raised {outcome['error']} "
            f"{outcome['at_time'] - killed_at:.2f} s after the kill"
        )


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])  # S=2 with -m slow (time budget)
def test_a_stalled_rank_times_out_on_every_survivor(world_size: int, tmp_path: Path) -> None:
    reports, stalled_at = fatal_run(world_size, "stall", tmp_path)
    victim = world_size // 2 if world_size > 2 else 1
    for report in reports:
        (outcome,) = report["outcomes"]
        assert outcome["broken"], outcome
        assert "cannot communicate any more" in outcome["next_call"], outcome
        if report["rank"] == victim:
            assert outcome["error"] in ("PeerLostError", "PipelineTimeoutError"), outcome
            continue
        assert outcome["error"] == "PipelineTimeoutError", outcome
        assert f"no progress after {TIMEOUT:g} s" in outcome["message"]
        assert TIMEOUT - 0.5 <= outcome["at_time"] - stalled_at <= TIMEOUT + MARGIN, outcome
        print(
            f"S={world_size} stall: rank {report['rank']} raised {outcome['error']} "
            f"{outcome['at_time'] - stalled_at:.2f} s after the stall began (timeout {TIMEOUT:g} s)"
        )
