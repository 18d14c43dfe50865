"""Properties of the prefill plan for every prompt length, step size and world size (hypothesis).

The plans are the objects pipeline_prefill carries out (pipemlx.schedule.plan.build_plans),
run together by the simulator under several send semantics. The progress
sequence is compared with a reference model of mlx-lm's generate_step, which is
itself checked against the real generate_step in test_reference_model_is_mlx_lm.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_profiles import Case, cases, note_size

from pipemlx.schedule.plan import build_plans
from pipemlx.schedule.simulate import SimulationResult, simulate

# (capacity, await_sends): rendezvous sends, one buffered message per link, unbounded buffers, and the
# executor's way (sends issued asynchronously, waited for before the next agreement point).
SEMANTICS = [(0, False), (1, False), (None, False), (None, True)]


def generate_step_progress(num_tokens: int, step: int) -> list[tuple[int, int]]:
    """mlx-lm generate_step's prompt_progress_callback calls before its first token, restated.

    generate_step reports (0, M), then prefills in chunks of min(step, remaining - 1) while more
    than one token remains, reporting the tokens processed after each chunk.
    """
    calls = [(0, num_tokens)]
    remaining, processed = num_tokens, 0
    while remaining > 1:
        n = min(step, remaining - 1)
        processed += n
        remaining -= n
        calls.append((processed, num_tokens))
    return calls


# Steps between agreement points: every step, a few, and (with 10_000) only the last step and the close.
SPACINGS = st.sampled_from([1, 2, 3, 5, 10_000])


def run(case: Case, capacity: int | None, await_sends: bool, agree_every: int = 1) -> SimulationResult:
    note_size(case)
    plans = build_plans(case.num_tokens, case.step_size, case.world_size, agree_every)
    return simulate(plans, capacity=capacity, await_sends=await_sends, record_events=False)


@given(cases(), st.sampled_from(SEMANTICS), SPACINGS)
def test_plans_finish_without_deadlock_or_mismatch(
    case: Case, semantics: tuple[int | None, bool], agree_every: int
) -> None:
    result = run(case, *semantics, agree_every)
    assert result.ok, result.report()
    assert not result.blocked and not result.mismatches


@given(cases(), SPACINGS)
def test_progress_is_mlx_lm_progress_on_every_rank(case: Case, agree_every: int) -> None:
    result = run(case, 0, False, agree_every)
    assert result.ok, result.report()
    M = case.num_tokens
    reference = generate_step_progress(M, case.step_size)
    for rank, reported in enumerate(result.progress):
        where = f"rank {rank} of {case}"
        assert list(reported) == reference, where
        assert reported[0] == (0, M), where
        assert reported[-1] == (M - 1, M), where
        processed = [p for p, _ in reported]
        assert all(a < b for a, b in zip(processed, processed[1:])), f"{where}: not strictly increasing"
        assert len(set(processed)) == len(processed), f"{where}: duplicates"
        assert {t for _, t in reported} == {M}, f"{where}: total changes"
    assert len(set(result.progress)) == 1


@given(cases(), st.sampled_from(SEMANTICS), SPACINGS)
def test_every_position_once_in_order_with_s_minus_1_idle_slots(
    case: Case, semantics: tuple[int | None, bool], agree_every: int
) -> None:
    result = run(case, *semantics, agree_every)
    assert result.ok, result.report()
    S, positions = case.world_size, list(range(case.num_tokens - 1))
    expected_chunks = -(-(case.num_tokens - 1) // case.step_size)  # ceil((M - 1) / step)
    for rank in range(S):
        chunks = result.computed[rank]
        assert [p for c in chunks for p in range(c.start, c.stop)] == positions, f"rank {rank} of {case}"
        assert len(chunks) == expected_chunks
        assert all(0 < c.length <= case.step_size for c in chunks)
        # the wavefront: rank r computes chunk k in step k + r, so before the (k + r) // agree_every-th
        # agreement point (the simulator counts steps by agreement points)
        assert list(result.compute_steps[rank]) == [(c.index + rank) // agree_every for c in chunks]
        if agree_every == 1:  # one chunk per step at most, S - 1 idle steps (fill and drain)
            assert result.idle_slots(rank) == (S - 1 if expected_chunks else 0), f"rank {rank} of {case}"


@pytest.mark.parametrize("num_tokens,step", [(1, 4), (2, 4), (5, 4), (6, 4), (13, 3), (40, 7), (9, 1), (3, 100)])
def test_reference_model_is_mlx_lm(num_tokens: int, step: int) -> None:
    """The restated reference equals the real generate_step's callbacks (tiny random model)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from pipemlx.testing import build_model, tiny_config

    model = build_model(tiny_config("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=32), seed=0)
    calls: list[tuple[int, int]] = []
    prompt = mx.arange(num_tokens, dtype=mx.int32) % 200
    for _ in generate_step(
        prompt, model, max_tokens=1, prefill_step_size=step, prompt_progress_callback=lambda a, b: calls.append((a, b))
    ):
        pass
    assert calls[:-1] == generate_step_progress(num_tokens, step)
    assert calls[-1] == (num_tokens, num_tokens)
