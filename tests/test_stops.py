"""The one stop matcher (pipemlx.runtime.stops), which generate_step and BatchGenerator share, stops where mlx-lm's
``StopSequences`` automaton stops, for any stop sequences and any stream of tokens (hypothesis); an mlx-lm
``StopSequences`` given to ``BatchGenerator.insert`` is read back as the same sequences."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import StopSequences

from pipemlx.runtime.stops import StopSet
from pipemlx.schedule.batch_plan import fingerprint

SEQUENCES = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=4)
STREAM = st.lists(st.integers(0, 4), max_size=30)


@given(sequences=SEQUENCES, stream=STREAM)
def test_the_matcher_stops_where_mlx_lm_stops(sequences: list[list[int]], stream: list[int]) -> None:
    theirs = StopSequences(sequences)
    ours = StopSet.of(sequences)
    assert StopSet.given(theirs).sequences == ours.sequences == {tuple(s) for s in sequences}
    matcher, reference = ours.matcher(), theirs.matcher()
    for i, token in enumerate(stream):
        ahead = copy.copy(reference)  # where mlx-lm's stops if the rest of the stream follows: first_stop's answer
        expected = next((j + 1 for j, t in enumerate(stream[i:]) if ahead.advance(t)), len(stream) - i)
        assert matcher.first_stop(stream[i:]) == expected
        assert matcher.advance(token) == reference.advance(token) == matcher.stopped


def test_empty_sequences_are_refused_by_name_and_skipped_in_mlx_lm_s() -> None:
    with pytest.raises(ValueError, match="^stop_sequences holds an empty sequence"):
        StopSet.of([[1], []], "stop_sequences")
    assert StopSet.given(StopSequences([[], [3], 5])).sequences == {(3,), (5,)}
    assert (StopSet.of([7, (8, 9)]) | StopSet.of([[7]])).sequences == {(7,), (8, 9)}


def test_a_fresh_matcher_has_not_stopped_and_the_plain_path_checks_by_argument_name() -> None:
    # A decode that fails in its first step reads `stopped` before any token was taken: it must be False.
    assert StopSet.of([1]).matcher().stopped is False
    assert StopSet.of([1]).ends([]) is False and StopSet().ends([]) is False
    # given() without mlx-lm's StopSequences: token ids and sequences, as of() reads them, its errors naming its
    # own argument by default (BatchGenerator.insert's stop_sequences), of()'s the generator's stop_tokens.
    assert StopSet.given([7, (8, 9)]).sequences == {(7,), (8, 9)}
    assert sorted(StopSet.given([[4, 5], 6])) == [(4, 5), (6,)]
    with pytest.raises(ValueError, match="^stop_sequences holds an empty sequence"):
        StopSet.given([[1], []])
    with pytest.raises(ValueError, match="^stop_tokens holds an empty sequence"):
        StopSet.of([[]])
    with pytest.raises(ValueError, match="^draft holds an empty sequence"):
        StopSet.given([()], "draft")


@given(sequences=SEQUENCES, other=SEQUENCES)
def test_the_fingerprint_the_ranks_compare_is_the_documented_encoding_of_the_sorted_sequences(
    sequences: list[list[int]], other: list[list[int]]
) -> None:
    ours, theirs = StopSet.of(sequences), StopSet.of(other)
    # Each sequence's tokens + 1, then 0, in sorted order, folded as batch_plan.fingerprint folds any parts.
    parts = [t for s in sorted({tuple(s) for s in sequences}) for t in (*(x + 1 for x in s), 0)]
    assert ours.fingerprint() == fingerprint(parts)
    assert StopSet.of(list(reversed(sequences))).fingerprint() == ours.fingerprint()  # order does not matter
    if ours.sequences != theirs.sequences:  # different stops are told apart (up to a hash collision)
        assert ours.fingerprint() != theirs.fingerprint()
