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
