"""The plan as data: chunking, ordering and progress, without MLX distributed."""

from __future__ import annotations

import pytest

from pipemlx.schedule.plan import (
    AGREEMENTS_PER_PREFILL,
    CHUNKS_PER_RANK,
    MAX_STEP_SIZE,
    Agree,
    Compute,
    Handshake,
    Progress,
    Recv,
    Send,
    build_plan,
    build_plans,
    chunk_prompt,
    chunks_of_lengths,
    default_agreement_spacing,
    default_step_size,
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


def agreement_points(num_tokens: int, step: int, world_size: int, every: int, lengths: list[int] | None) -> int:
    """Agreement points within the steps of rank 0's plan (the closing one left out)."""
    plan = build_plan(num_tokens, step, world_size, 0, every, lengths)
    steps = len(plan.chunks) + world_size - 1 if plan.chunks else 0
    return sum(1 for a in plan.actions if isinstance(a, Agree) and a.step < steps)


@pytest.mark.parametrize("lengths", [None, [5, 3, 2, 2, 1], [4] * 30 + [1], [2] * 17])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_the_default_agreement_spacing_is_the_smallest_with_at_most_the_documented_count(
    world_size: int, lengths: list[int] | None
) -> None:
    # About AGREEMENTS_PER_PREFILL agreement points: the smallest spacing whose plan has at most that many (a
    # larger one lets a cancellation wait longer; a smaller one stops the ranks together more often).
    cases = [(m, s) for m in range(2, 140) for s in (1, 3, 8)] if lengths is None else [(sum(lengths) + 1, 0)]
    for num_tokens, step in cases:
        step = step or max(lengths or [1])
        spacing = default_agreement_spacing(num_tokens, step, world_size, lengths)
        assert agreement_points(num_tokens, step, world_size, spacing, lengths) <= AGREEMENTS_PER_PREFILL
        if spacing > 1:
            fewer = agreement_points(num_tokens, step, world_size, spacing - 1, lengths)
            assert fewer > AGREEMENTS_PER_PREFILL, (num_tokens, step, world_size, spacing)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_default_step_size_is_the_smallest_cutting_at_most_the_chunks_per_rank(world_size: int) -> None:
    # 512 tokens, or less for a short prompt: the smallest step that cuts it into at most CHUNKS_PER_RANK chunks
    # per rank (as many as it has positions, up to that), never above 512.
    wanted = CHUNKS_PER_RANK * world_size
    for num_tokens in [*range(2, 300), 4000, 4097, 20000, 100_000]:
        step = default_step_size(num_tokens, world_size)
        assert 1 <= step <= MAX_STEP_SIZE
        if step < MAX_STEP_SIZE:
            assert len(chunk_prompt(num_tokens, step)) <= wanted, (num_tokens, step)
        if step > 1:
            assert len(chunk_prompt(num_tokens, step - 1)) > wanted, (num_tokens, step)
    assert default_step_size(1, world_size) == 1  # nothing to prefill


@pytest.mark.parametrize("num_tokens,step,world_size", [(2, 4, 1), (30, 4, 2), (31, 7, 3), (100, 9, 4), (9, 1, 5)])
def test_completed_after_is_the_progress_reported_by_each_agreement_point(
    num_tokens: int, step: int, world_size: int
) -> None:
    # What a cancellation at step t says was prefilled: the last progress every rank reported after Agree(t).
    plan = build_plan(num_tokens, step, world_size, world_size - 1)
    reported: dict[int, int] = {}
    at, processed = None, 0
    for action in plan.actions:
        if isinstance(action, Progress):
            processed = action.processed
        if isinstance(action, Agree):
            if at is not None:
                reported[at] = processed
            at = action.step
    reported[at if at is not None else 0] = processed
    for t, expected in reported.items():
        assert plan.completed_after(t) == expected, (t, reported)
    assert plan.completed_after(10_000) == num_tokens - 1 and plan.completed_after(-1) == 0


def test_chunks_of_given_lengths_are_numbered_in_order_and_only_positive_ints_are_taken() -> None:
    chunks = chunks_of_lengths(8, [3, 1, 3])
    assert [(c.index, c.start, c.stop) for c in chunks] == [(0, 0, 3), (1, 3, 4), (2, 4, 7)]
    for bad in ([True, 2], [1.5, 1.5], [0, 3], [4, -1]):
        with pytest.raises(ValueError, match="chunk lengths must be positive ints"):
            chunks_of_lengths(4, bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="add up to 2, but a 4-token prompt prefills 3"):
        chunks_of_lengths(4, [1, 1])


def test_the_fingerprint_tells_spacing_and_cuts_apart_and_uses_31_bits() -> None:
    # Ranks agreeing every 2 steps and every 3, or cutting the same prompt differently, exchange other messages.
    base = build_plan(40, 8, 3, 0)
    assert base == build_plan(40, 8, 3, 0, 1)  # by default every step is an agreement point
    assert [a.step for a in base.actions if isinstance(a, Agree)] == list(range(len(base.chunks) + 3))
    spaced = {build_plan(40, 8, 3, 0, every).fingerprint() for every in (1, 2, 3, 4)}
    assert len(spaced) == 4, spaced
    cuts = [[8, 8, 8, 8, 7], [8, 7, 8, 8, 8], [7, 8, 8, 8, 8]]
    assert len({build_plan(40, 8, 3, 0, 1, c).fingerprint() for c in cuts}) == 3
    prints = [build_plan(m, 4, 2, 0).fingerprint() for m in range(2, 66)]
    assert all(0 <= p < 2**31 for p in prints) and max(prints) >= 2**30  # 64 plans all below 2**30: 2**-64


def test_agree_every_must_be_a_positive_int_and_is_kept_in_the_plan() -> None:
    assert build_plan(20, 4, 2, 1, 3).agree_every == 3
    for args, name in (
        ((2.5, 4, 2, 0), "num_tokens"),
        ((20, 4, 2.0, 0), "world_size"),
        ((20, True, 2, 0), "prefill_step_size"),
    ):
        with pytest.raises(
            TypeError,
            match=f"^{name} must be an int or 'auto', got {type(args[0 if name == 'num_tokens' else 2 if name == 'world_size' else 1]).__name__} ",
        ):
            build_plan(*args)  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        ValueError, match="^the prompt is empty \\(0 tokens\\); pipeline_prefill needs at least 1 token$"
    ):
        build_plan(0, 4, 2, 0)
    with pytest.raises(ValueError, match="^world_size must be at least 1, got 0$"):
        build_plan(5, 4, 0, 0)
    for bad in (0, -2, True, 2.0, 1.5, "2"):
        with pytest.raises(ValueError, match=f"^agree_every must be a positive int, got {bad!r}$"):
            build_plan(20, 4, 2, 0, bad)  # pyright: ignore[reportArgumentType]
