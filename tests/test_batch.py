"""pipemlx.BatchGenerator: requests decoded together through the pipeline, each equal to its solo run."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import run_ranks
from fakes import FakeGroup

import pipemlx
from pipemlx.testing import build_model, tiny_config

REQUESTS: list[dict[str, Any]] = [
    {"M": 7, "max_tokens": 12, "insert_at": 0},
    {"M": 23, "max_tokens": 10, "insert_at": 2},
    {"M": 41, "max_tokens": 9, "insert_at": 5},
]
REMOVE = {"index": 1, "at": 6}  # request 1 has yielded 4 of its 10 tokens when it is removed


def expected_tokens(solo: list[int], stops: list[int], limit: int | None = None) -> tuple[list[int], str | None]:
    """A request's solo tokens cut at its first stop token (inclusive) or at ``limit`` (a removal)."""
    tokens = solo[:limit]
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], "stop"
    return tokens, "length" if limit is None else None


@pytest.mark.parametrize("arch,world_size,stop_at", [("llama", 2, None), ("qwen3", 3, None), ("llama", 2, [2, 3])])
def test_batched_requests_equal_their_solo_runs(arch: str, world_size: int, stop_at: list[int] | None) -> None:
    spec = {"arch": arch, "requests": REQUESTS, "remove": [REMOVE], "steps": 16, "step_size": 8, "stop_at": stop_at}
    reports = run_ranks(world_size, "batch.py", spec, timeout=90)
    for report in reports:
        assert report == {**reports[0], "rank": report["rank"]}, "ranks disagree"
    report = reports[0]
    solo, stops = report["solo"], report["stops"]
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        removed_after = REMOVE["at"] - REQUESTS[i]["insert_at"] if i == REMOVE["index"] else None
        assert (tokens, finish) == expected_tokens(solo[i], stops, removed_after), (i, tokens, finish, solo[i])
    if stop_at is None:
        # Rows per step: 1 alone, then 2, then 3; the removal, then each request leaving at its max_tokens.
        assert report["rows"] == [1, 1, 2, 2, 2, 3, 2, 2, 2, 2, 2, 2, 1, 1, 0, 0], report["rows"]
    else:
        assert "stop" in report["finish"], report
    assert report["left"] == 0


INTERLEAVED: list[dict[str, Any]] = [
    {"M": 7, "max_tokens": 14, "insert_at": 0},
    {"M": 30, "max_tokens": 6, "insert_at": 1},  # removed mid-prefill
    {"M": 23, "max_tokens": 8, "insert_at": 2},  # removed mid-decode
    {"M": 41, "max_tokens": 6, "insert_at": 5},  # prefilled in 5 slices while the others decode
]
INTERLEAVED_REMOVALS = [{"index": 1, "at": 3}, {"index": 2, "at": 8}]


def test_prompts_prefilled_between_decode_steps_equal_their_solo_runs() -> None:
    spec = {
        "requests": INTERLEAVED,
        "remove": INTERLEAVED_REMOVALS,
        "steps": 20,
        "step_size": 8,
        "prefill_budget": 8,
    }
    report = run_ranks(2, "batch.py", spec, timeout=90)[0]
    solo = report["solo"]
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    # Request 1: 2 slices (16 of 29 positions) when removed, no token. Request 2: queued behind it, then
    # 3 slices (steps 3-5; it joins in the step of its last slice), tokens in steps 5-7. Request 3: queued
    # behind 2, slices in steps 6-10, tokens in steps 10-15. Request 0: tokens in steps 0-13.
    assert report["tokens"][1] == [] and report["finish"][1] is None
    assert report["tokens"][2] == solo[2][:3] and report["finish"][2] is None
    for i in (0, 3):
        assert report["tokens"][i] == solo[i] and report["finish"][i] == "length", (i, report)
    # Request 0 decoded in every step while the others' prompts were being prefilled.
    assert report["rows"][:17] == [1, 1, 1, 1, 1, 2, 2, 2, 1, 1, 2, 2, 2, 2, 1, 1, 0], report["rows"]
    assert report["partial"][:11] == [0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0], report["partial"]
    assert report["left"] == 0


PREFIXED: list[dict[str, Any]] = [
    {"M": 9, "max_tokens": 8, "insert_at": 0},
    {"M": 33, "max_tokens": 7, "insert_at": 0},  # 16 positions reused, 17 inserted
    {"M": 25, "max_tokens": 6, "insert_at": 2},  # 24 positions reused: only its last token is inserted
    {"M": 12, "max_tokens": 6, "insert_at": 3},  # 8 reused, joining while the others decode
]


def test_requests_with_reused_prefixes_equal_solo_runs_of_their_whole_prompts() -> None:
    spec = {
        "requests": PREFIXED,
        "remove": [],
        "steps": 12,
        "step_size": 8,
        "prefixes": {"1": 16, "2": 24, "3": 8},
    }
    reports = run_ranks(2, "batch.py", spec, timeout=90)
    assert reports[1]["tokens"] == reports[0]["tokens"], "ranks disagree"
    report = reports[0]
    solo = report["solo"]
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        assert tokens == solo[i] and finish == "length", (i, tokens, solo[i])
    assert report["left"] == 0


def test_a_killed_rank_fails_the_batch_on_the_survivor() -> None:
    spec = {
        "requests": REQUESTS[:2],
        "remove": [],
        "steps": 8,
        "step_size": 8,
        "timeout": 5.0,
        "kill": {"rank": 1, "at": 4},
    }
    reports = run_ranks(2, "batch.py", spec, timeout=60, expect_exit={1: 3})
    survivor = reports[0]
    assert survivor["error"] in ("PeerLostError", "PipelineTimeoutError"), survivor
    assert "rank 0/2" in survivor["message"]
    assert survivor["waited"] <= 5.0 + 3.0, survivor


def fake_engine(**kwargs: Any) -> pipemlx.BatchGenerator:
    """A generator on rank 0 of a fake 2-rank group: for what happens before anything is sent."""
    model = pipemlx.shard_model(build_model(tiny_config("llama")), FakeGroup(0, 2))  # type: ignore[arg-type]
    return pipemlx.BatchGenerator(model, **kwargs)


def test_bad_arguments_raise_before_anything_changes() -> None:
    engine = fake_engine(max_tokens=5)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.insert([[1, 2], []])
    with pytest.raises(ValueError, match="as many max_tokens"):
        engine.insert([[1, 2], [3]], max_tokens=[4])
    with pytest.raises(ValueError, match="as many max_tokens, samplers and caches"):
        engine.insert([[1, 2]], caches=[None, None])
    with pytest.raises(ValueError, match=r"caches\[0\] must be a list of 3 layer caches"):
        engine.insert([[1, 2]], caches=[[]])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.insert([[1, 2]], max_tokens=0)
    assert len(engine) == 0 and engine.insert([[1, 2], [3]]) == [0, 1]
    for bad in ({"prefill_budget": 0}, {"prefill_step_size": 0}, {"max_tokens": 0}, {"timeout": -1.0}):
        with pytest.raises(ValueError):
            fake_engine(**bad)


def test_queued_requests_are_removed_without_communication() -> None:
    engine = fake_engine()
    uids = engine.insert([[1, 2, 3], [4, 5], [6]], max_tokens=[3, 4, 5])
    assert engine.queued_uids == uids and engine.active_uids == [] and len(engine) == 3
    engine.remove([uids[1], 99])
    assert engine.queued_uids == [uids[0], uids[2]] and engine.prefilled(uids[0]) == 0
    engine.remove(uids)
    assert len(engine) == 0 and engine.next() == []
