"""Plans with chunks of any lengths (prefill_step_size="auto"'s cuts) and the auto chooser, checked by simulation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipemlx.schedule.autostep import (
    DEFAULT_MAX_CHUNK_SECONDS,
    NEAR_TIE,
    RAMP_LEVELS,
    RAMPED_STEPS,
    TAIL_RATIOS,
    candidate_steps,
    choose_chunks,
    choose_lent_heads,
    clear_planning_cache,
    planning_cache_info,
    ramp_lengths,
    slowest_chunk_s,
    tail_lengths,
    uniform_lengths,
)
from pipemlx.schedule.costmodel import (
    CostModel,
    LayerCosts,
    cache_only_share,
    feed_forward_share_of,
    lent_heads_share_of,
    predict,
)
from pipemlx.schedule.plan import build_plans, chunks_of_lengths
from pipemlx.schedule.simulate import simulate


@st.composite
def cuts(draw: st.DrawFn) -> tuple[int, tuple[int, ...], int, int]:
    """A prompt length, chunk lengths that cover its prefill, a world size and an agreement spacing."""
    lengths = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=12)))
    return sum(lengths) + 1, lengths, draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 3, 100]))


@given(cuts(), st.sampled_from([0, 1, None]))
@settings(max_examples=150, deadline=None)
def test_any_cut_runs_without_deadlock_each_position_once_in_order(
    cut: tuple[int, tuple[int, ...], int, int], capacity: int | None
) -> None:
    num_tokens, lengths, world_size, agree_every = cut
    plans = build_plans(num_tokens, max(lengths), world_size, agree_every, lengths)
    result = simulate(plans, capacity=capacity, await_sends=False, record_events=False)
    assert result.ok, result.report()
    for rank in range(world_size):
        assert [p for c in result.computed[rank] for p in range(c.start, c.stop)] == list(range(num_tokens - 1))
        assert [c.length for c in result.computed[rank]] == list(lengths)
    # progress: (0, M), each chunk's end as it leaves the last rank, strictly increasing, ending at (M-1, M)
    expected = [(0, num_tokens)] + [(c.stop, num_tokens) for c in chunks_of_lengths(num_tokens, lengths)]
    assert all(list(p) == expected for p in result.progress)


def test_cuts_that_do_not_cover_the_prompt_are_refused() -> None:
    with pytest.raises(ValueError, match="add up to 9, but a 12-token prompt prefills 11"):
        build_plans(12, 5, 2, 1, (5, 4))
    with pytest.raises(ValueError, match="positive ints"):
        build_plans(12, 11, 2, 1, (11, 0))
    with pytest.raises(ValueError, match="not the largest"):
        build_plans(12, 4, 2, 1, (5, 6))


def costs(chunk_s: float, token_s: float, attention_s: float = 0.0, layers: tuple[int, ...] = (4, 4)) -> CostModel:
    return CostModel(LayerCosts(chunk_s, token_s, attention_s), layers=layers, hidden_size=512)


@given(
    st.integers(2, 5_000),
    st.floats(1e-6, 1e-2),
    st.floats(1e-7, 1e-3),
    st.floats(0.0, 1e-8),
    st.sampled_from([(4, 4), (3, 3, 2), (8,)]),
    st.floats(0.05, 5.0),
)
@settings(max_examples=25, deadline=None)
def test_auto_never_plans_a_chunk_above_the_cap_when_one_fits(
    num_tokens: int, chunk_s: float, token_s: float, attention_s: float, layers: tuple[int, ...], cap: float
) -> None:
    model = costs(chunk_s, token_s, attention_s, layers)
    lengths = choose_chunks(num_tokens, model, cap)
    assert sum(lengths) == num_tokens - 1 and min(lengths) >= 1
    prefill = num_tokens - 1
    uniform_cuts = [
        (s,) * (prefill // s) + ((prefill % s,) if prefill % s else ()) for s in candidate_steps(num_tokens)
    ]
    cheapest = min(slowest_chunk_s(num_tokens, c, model) for c in uniform_cuts)
    if cheapest <= cap:
        assert slowest_chunk_s(num_tokens, lengths, model) <= cap
    else:  # nothing fits: the cut whose slowest chunk is cheapest
        assert slowest_chunk_s(num_tokens, lengths, model) == cheapest


def test_ramps_cover_the_prompt_and_shrink_at_both_ends() -> None:
    ramp = ramp_lengths(2049, 256)
    assert ramp is not None and sum(ramp) == 2048
    assert ramp[:2] == (64, 128) and ramp[-2:] == (128, 64) and max(ramp) == 256
    assert ramp_lengths(300, 256) is None  # too short for a ramp of this step


@given(st.integers(2, 20_000), st.sampled_from([16, 32, 64, 128, 256, 512]), st.integers(0, 4), st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_ramps_of_any_depth_cover_the_prompt_with_halving_ends(
    num_tokens: int, step: int, head: int, tail: int
) -> None:
    ramp = ramp_lengths(num_tokens, step, head, tail)
    if ramp is None:
        assert (
            step >> max(head, tail) < 16
            or num_tokens - 1 - sum(step >> i for i in range(1, head + 1)) - sum(step >> i for i in range(1, tail + 1))
            < 2 * step
        )
        return
    assert sum(ramp) == num_tokens - 1 and max(ramp) == step and min(ramp) >= 1
    assert list(ramp[len(ramp) - tail :]) == [step >> i for i in range(1, tail + 1)]
    assert list(ramp[:head]) == [step >> i for i in range(head, 0, -1)]


def test_a_tail_ramp_is_chosen_when_the_drain_dominates() -> None:
    """Attention-heavy chunks and a real per-chunk cost: the last chunks shrink, the first stay large."""
    model = costs(chunk_s=3e-3, token_s=1.6e-4, attention_s=2e-7)
    model = CostModel(model.layer, layers=(4, 4), hidden_size=512, last_layer_share=0.1)
    lengths = choose_chunks(2049, model, 100.0)
    assert lengths[-1] < max(lengths) and lengths[-2] < max(lengths)
    uniform = predict(2049, max(lengths), model, agree_every=None).prefill_s
    chosen = predict(2049, max(lengths), model, chunk_lengths=lengths, agree_every=None).prefill_s
    assert chosen < uniform


def test_a_ramp_is_chosen_when_fill_and_drain_dominate() -> None:
    """Cheap per-chunk overhead, per-token cost: small end chunks shorten fill and drain, and auto takes them."""
    model = costs(chunk_s=1e-5, token_s=1e-3)
    lengths = choose_chunks(4097, model, 100.0)
    uniform = predict(4097, max(lengths), model, agree_every=None).prefill_s
    chosen = predict(4097, max(lengths), model, chunk_lengths=lengths, agree_every=None).prefill_s
    assert chosen <= uniform
    assert lengths[0] < max(lengths) or len(set(lengths)) == 1


@given(st.integers(2, 20_000), st.sampled_from([16, 32, 64, 128, 256, 512]), st.sampled_from([0.5, 0.625, 0.75, 0.9]))
@settings(max_examples=200, deadline=None)
def test_gentle_tails_cover_the_prompt_and_shrink_by_their_ratio(num_tokens: int, step: int, ratio: float) -> None:
    lengths = tail_lengths(num_tokens, step, ratio)
    if lengths is None:
        return
    assert sum(lengths) == num_tokens - 1 and max(lengths) == step and min(lengths) >= 1
    tail = list(lengths[len(lengths) - lengths[::-1].index(step) :])  # after the last full chunk
    assert tail and min(tail) >= 16 and all(t % 8 == 0 for t in tail)
    assert all(b <= a for a, b in zip([step, *tail], tail)), tail
    assert tail[0] == int(step * ratio) // 8 * 8


def test_a_gentle_tail_is_chosen_when_the_last_rank_is_lighter() -> None:
    """The benchmark model's calibrated costs (2 ranks; the last layer of the last rank only projects keys and
    values): halving the last chunks lets rank 1 bound the drain, a tail shrinking by 3/4 keeps it just busy."""
    layer = LayerCosts(chunk_s=1.58e-3, token_s=1.2e-4, attention_s=1.52e-7)
    model = CostModel(layer, layers=(4, 4), hidden_size=512, last_layer_share=1 / 12)
    lengths = choose_chunks(2049, model, 100.0)
    tail = lengths[lengths.index(max(lengths)) :]
    assert tail[-1] < max(lengths) and any(b > a // 2 for a, b in zip(tail, tail[1:]) if b < a), lengths

    def seconds(cut: tuple[int, ...]) -> float:
        return predict(2049, max(cut), model, chunk_lengths=cut, agree_every=None).prefill_s

    halving = [r for t in range(1, 5) if (r := ramp_lengths(2049, max(lengths), 0, t)) is not None]
    assert seconds(lengths) < min(seconds(r) for r in halving)


def reference_choose_chunks(
    num_tokens: int, costs: CostModel, max_chunk_seconds: float = DEFAULT_MAX_CHUNK_SECONDS
) -> tuple[int, ...]:
    """choose_chunks as it was before its cache: every candidate simulated with predict, as often as asked."""
    if num_tokens < 2:
        return ()

    def seconds(lengths: tuple[int, ...]) -> float:
        return predict(num_tokens, max(lengths), costs, chunk_lengths=lengths, agree_every=None).prefill_s

    def within_cap(lengths: tuple[int, ...]) -> bool:
        return slowest_chunk_s(num_tokens, lengths, costs) <= max_chunk_seconds

    uniform = [uniform_lengths(num_tokens, step) for step in candidate_steps(num_tokens)]
    allowed = [c for c in uniform if within_cap(c)]
    if not allowed:
        return min(uniform, key=lambda c: (slowest_chunk_s(num_tokens, c, costs), -max(c)))
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
        return best_ramped
    return best_uniform


def reference_choose_lent_heads(num_tokens: int, cuts: list[CostModel]) -> int:
    if num_tokens < 2 or len(cuts) < 2:
        return 0

    def seconds(costs: CostModel) -> float:
        lengths = reference_choose_chunks(num_tokens, costs)
        return predict(num_tokens, max(lengths), costs, chunk_lengths=lengths, agree_every=None).prefill_s

    times = [seconds(c) for c in cuts]
    return next(k for k, t in enumerate(times) if t <= (1 + NEAR_TIE) * min(times))


CALIBRATED = LayerCosts(
    chunk_s=1.58e-3,
    token_s=1.2e-4,
    attention_s=1.52e-7,
    at_start=((16, 3.5e-3), (32, 6e-3), (64, 9e-3), (128, 16e-3), (256, 36e-3), (512, 84e-3)),
    far_pairs=((128, 1.5e-7), (256, 1.6e-7)),
)
"""Shaped like the benchmark model's calibration: seconds by length at position 0, per pair far in."""


def lend_cuts(layer: LayerCosts, layers: tuple[int, ...]) -> list[CostModel]:
    """The cost models of lending 0 (the feed-forward half) to 3 of 4 key-value heads, as lend="auto" weighs them."""
    return [
        CostModel(
            layer,
            layers=layers,
            hidden_size=512,
            last_layer_share=cache_only_share(512, 256, 1536),
            lent_share=lent_heads_share_of(512, 256, 1536, k / 4) if k else feed_forward_share_of(512, 256, 1536),
            lent_pair_share=k / 4,
            collective_s=2e-4,
            latency_s=1e-4,
        )
        for k in range(4)
    ]


EQUIVALENCE_MODELS = {
    "line, S=2": (costs(chunk_s=3e-3, token_s=1.6e-4, attention_s=2e-7), DEFAULT_MAX_CHUNK_SECONDS),
    "fill and drain, S=2": (costs(chunk_s=1e-5, token_s=1e-3), DEFAULT_MAX_CHUNK_SECONDS),
    "calibrated, S=3": (CostModel(CALIBRATED, (3, 3, 2), 512, last_layer_share=1 / 12), DEFAULT_MAX_CHUNK_SECONDS),
    "calibrated, lending, S=2": (lend_cuts(CALIBRATED, (4, 4))[2], DEFAULT_MAX_CHUNK_SECONDS),
    "tight cap, S=3": (costs(1e-3, 1e-4, 1e-8, (3, 3, 2)), 0.05),
    "nothing fits, S=2": (costs(1e-3, 1e-4, 1e-8), 1e-4),
}


@pytest.mark.parametrize("name", sorted(EQUIVALENCE_MODELS))
def test_choose_chunks_picks_what_simulating_every_candidate_picks(name: str) -> None:
    """The cache and each candidate simulated once change nothing: the very lengths of the straightforward chooser,
    planned from scratch and again from the cache."""
    model, cap = EQUIVALENCE_MODELS[name]
    for num_tokens in (1, 2, 3, 17, 100, 129, 257, 700, 1025, 2049, 3000, 4097):
        clear_planning_cache()
        expected = reference_choose_chunks(num_tokens, model, cap)
        assert choose_chunks(num_tokens, model, cap) == expected, (name, num_tokens)
        assert choose_chunks(num_tokens, model, cap) == expected, (name, num_tokens)


@pytest.mark.parametrize("layers", [(4, 4), (3, 3, 2)])
def test_choose_lent_heads_counts_what_simulating_every_candidate_counts(layers: tuple[int, ...]) -> None:
    attention = LayerCosts(chunk_s=1e-4, token_s=1e-6, attention_s=1e-6)
    for layer in (CALIBRATED, attention):
        cuts = lend_cuts(layer, layers)
        for num_tokens in (100, 2048):
            clear_planning_cache()
            assert choose_lent_heads(num_tokens, cuts) == reference_choose_lent_heads(num_tokens, cuts)


def test_a_repeated_choice_comes_from_the_cache() -> None:
    """An equal cost model (not the same object) finds the choice already made; one built with lists (unhashable)
    is planned afresh, to the same lengths."""
    clear_planning_cache()
    first = choose_chunks(2049, costs(3e-3, 1.6e-4, 2e-7))
    assert planning_cache_info().misses == 1 and planning_cache_info().hits == 0
    again = choose_chunks(2049, costs(3e-3, 1.6e-4, 2e-7))
    assert again is first and planning_cache_info().hits == 1
    choose_chunks(2049, costs(3e-3, 1.6e-4, 2e-7), 1.0)  # another cap: another choice
    assert planning_cache_info().misses == 2
    listed = CostModel(LayerCosts(0.0, 0.0, 1.52e-7, list(CALIBRATED.at_start)), (4, 4), 512)  # type: ignore[arg-type]
    hashable = CostModel(LayerCosts(0.0, 0.0, 1.52e-7, CALIBRATED.at_start), (4, 4), 512)
    assert choose_chunks(2049, listed) == choose_chunks(2049, hashable)
    assert planning_cache_info().misses == 3 and planning_cache_info().currsize == 3
