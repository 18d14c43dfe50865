"""The plan as data: chunking, ordering and progress, without MLX distributed."""

from __future__ import annotations

import pytest

from pipemlx.schedule.plan import (
    Agree,
    Compute,
    Handshake,
    Progress,
    Recv,
    Send,
    build_plan,
    build_plans,
    chunk_prompt,
)


def mlx_lm_progress(num_tokens: int, step: int) -> list[tuple[int, int]]:
    """What mlx-lm's generate_step reports before its first token (its loop, restated)."""
    calls, processed = [(0, num_tokens)], 0
    while num_tokens - processed > 1:
        processed += min(step, num_tokens - processed - 1)
        calls.append((processed, num_tokens))
    return calls


@pytest.mark.parametrize("num_tokens,step", [(1, 4), (2, 4), (5, 4), (6, 4), (100, 7), (9, 1), (3, 100)])
def test_chunks_cover_all_but_the_last_token(num_tokens: int, step: int) -> None:
    chunks = chunk_prompt(num_tokens, step)
    positions = [p for c in chunks for p in range(c.start, c.stop)]
    assert positions == list(range(num_tokens - 1))
    assert all(0 < c.length <= step for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("num_tokens,step", [(1, 4), (2, 4), (17, 4), (64, 8), (10, 100)])
def test_every_rank_reports_mlx_lm_progress(num_tokens: int, step: int, world_size: int) -> None:
    for plan in build_plans(num_tokens, step, world_size):
        assert plan.progress_sequence() == mlx_lm_progress(num_tokens, step)


def test_two_rank_plan_is_the_wavefront() -> None:
    rank0, rank1 = build_plans(num_tokens=7, step_size=3, world_size=2)
    c0, c1 = rank0.chunks
    assert rank0.actions == (
        Handshake(), Progress(0, 7),
        Compute(c0), Agree(0),
        Send(c0, 1), Compute(c1), Agree(1), Progress(3, 7),
        Send(c1, 1), Agree(2), Progress(6, 7),
        Agree(3),
    )  # fmt: skip
    assert rank1.actions == (
        Handshake(), Progress(0, 7),
        Agree(0),
        Recv(c0, 0), Compute(c0), Agree(1), Progress(3, 7),
        Recv(c1, 0), Compute(c1), Agree(2), Progress(6, 7),
        Agree(3),
    )  # fmt: skip


def test_sends_match_receives_in_order() -> None:
    plans = build_plans(num_tokens=50, step_size=4, world_size=4)
    for rank in range(3):
        sent = [(a.chunk, a.peer) for a in plans[rank].actions if isinstance(a, Send)]
        received = [(a.chunk, a.peer) for a in plans[rank + 1].actions if isinstance(a, Recv)]
        assert [c for c, _ in sent] == [c for c, _ in received] == list(plans[rank].chunks)
        assert {p for _, p in sent} == {rank + 1} and {p for _, p in received} == {rank}


def test_fingerprint_is_shared_by_ranks_and_tells_plans_apart() -> None:
    plans = build_plans(num_tokens=40, step_size=8, world_size=3)
    assert len({p.fingerprint() for p in plans}) == 1
    assert build_plan(40, 7, 3, 0).fingerprint() != plans[0].fingerprint()
    assert build_plan(41, 8, 3, 0).fingerprint() != plans[0].fingerprint()


@pytest.mark.parametrize(
    "args,error,words",
    [
        ((0, 4, 2, 0), ValueError, "empty"),
        ((5, 0, 2, 0), ValueError, "prefill_step_size must be at least 1 or 'auto', got 0"),
        ((5, -3, 2, 0), ValueError, "got -3"),
        ((5, 2.5, 2, 0), TypeError, "step_size must be an int"),
        ((5, True, 2, 0), TypeError, "step_size must be an int"),
        ((5, 4, 2, 2), ValueError, "rank must be in 0..1, got 2"),
    ],
)
def test_bad_plan_arguments(args: tuple[int, int, int, int], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        build_plan(*args)
