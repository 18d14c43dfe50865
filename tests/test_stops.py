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


# generate_step's stops in one process (a group of one): the serial decode loop of runtime/decode.py, with and
# without guesses, where one-process mutation testing reaches it. The reference: mlx-lm's greedy generate_step.
REPEATING = [5, 17, 3, 99] * 4
"""The tiny llama (seed 5) answers it with one token eleven times, then two alternating: stop sequences of one
token repeated end at any place."""


def _model_and_reference(count: int) -> tuple[object, list[int]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import pipemlx
    from pipemlx.testing import build_model, tiny_config

    reference = build_model(tiny_config("llama"), seed=5)
    theirs = [int(t) for (t, _), _ in zip(generate_step(mx.array(REPEATING), reference), range(count))]
    return pipemlx.shard_model(build_model(tiny_config("llama"), seed=5), mx.distributed.init()), theirs


def _draft() -> object:
    from pipemlx.testing import build_model, tiny_config

    return build_model(tiny_config("llama"), seed=5)  # the model's own weights: every greedy guess holds


def _decode(
    model: object, *, k: int, break_after: int = 0, seen: list[int] | None = None, **options: object
) -> tuple[list[int], object, int]:
    """The tokens one process's ``generate_step`` yields (a draft guessing ``k`` where ``k > 0``), its
    stream (``stop``, ``decided``, ``guesses``) and the cache's offset once the stream closed."""
    import mlx.core as mx

    import pipemlx
    from pipemlx.runtime.caches import cache_offset
    from pipemlx.runtime.stage import stage_of

    cache = stage_of(model).new_cache(model, None)  # pyright: ignore[reportArgumentType]
    guessing: dict[str, object] = {"draft_model": _draft(), "num_draft_tokens": k} if k else {}
    stream = pipemlx.generate_step(mx.array(REPEATING), model, prompt_cache=cache, **guessing, **options)  # pyright: ignore
    tokens: list[int] = [] if seen is None else seen  # (``seen``: a list the caller's callbacks read)
    try:
        for token, _ in stream:
            tokens.append(int(token))
            if len(tokens) == break_after:
                break
        stream.close()
    except RuntimeError as exc:  # a callback's error, after the step that stops the decode (``stream.stop``)
        stream.error = exc  # pyright: ignore[reportAttributeAccessIssue]
    return tokens, stream, cache_offset(cache)  # pyright: ignore[reportArgumentType]


def _first_completed_at(tokens: list[int], at: int) -> list[int]:
    """The shortest stop sequence ending at ``tokens[at]`` that no earlier place of ``tokens`` completes."""
    for m in range(1, at + 2):
        tail = tokens[at - m + 1 : at + 1]
        if all(tokens[i - m + 1 : i + 1] != tail for i in range(m - 1, at)):
            return tail
    raise AssertionError("unreachable: the whole prefix is new")


@pytest.mark.parametrize("k", [0, 4])
def test_generate_step_stops_at_a_stop_token_anywhere_in_a_pass_as_mlx_lm(k: int) -> None:
    """A stop sequence first completed at each place of the answer (a pass's first, middle or last token): the
    tokens up to it, as mlx-lm's, reason ``stop``; the caches hold the prompt and every decided token, no guess
    after. ``max_tokens`` inside a pass and at its end: ``length``."""
    model, theirs = _model_and_reference(14)
    held = 0  # guesses confirmed: a stop among a pass's confirmed guesses, not only at its end
    for at in range(13):
        tokens, stream, offset = _decode(model, k=k, max_tokens=14, stop_tokens=[_first_completed_at(theirs, at)])
        stop = stream.stop  # pyright: ignore
        assert tokens == theirs[: at + 1] and (stop.reason, stop.tokens) == ("stop", at + 1), (at, tokens, stop)
        assert stream.decided == tokens and offset == len(REPEATING) + at + 1, (at, offset)  # pyright: ignore
        held += stream.guesses[1]  # pyright: ignore
    for limit in (1, 2, 5, 6, 7):  # max_tokens inside a pass, or at its end
        tokens, stream, offset = _decode(model, k=k, max_tokens=limit)
        stop = stream.stop  # pyright: ignore
        assert tokens == theirs[:limit] and (stop.reason, stop.tokens) == ("length", limit), (limit, tokens, stop)
        assert offset == len(REPEATING) + limit
    assert (held >= 13) == (k > 0), held


@pytest.mark.parametrize("k", [0, 4])
def test_generate_step_a_consumer_breaking_mid_pass_ends_after_the_pass(k: int) -> None:
    """The consumer breaks after 1 to 5 tokens: it saw mlx-lm's tokens; the decode ends as ``cancelled`` after
    the pass (without guesses: at once), and the caches hold what was decided (the pass's other tokens too)."""
    model, theirs = _model_and_reference(14)
    unseen = 0
    for after in (1, 2, 3, 4, 5):
        tokens, stream, offset = _decode(model, k=k, max_tokens=14, break_after=after)
        stop, decided = stream.stop, stream.decided  # pyright: ignore
        assert tokens == theirs[:after] and stop.reason == "cancelled" and stop.ranks == (0,), (after, stop)
        assert decided == theirs[: len(decided)] and stop.tokens == len(decided), (after, decided, stop)
        assert after <= len(decided) <= after + k, (after, decided)
        assert offset == len(REPEATING) + len(decided), (after, offset)
        unseen += len(decided) - after
    assert (unseen > 0) == (k > 0)  # with guesses, some breaks fell in the middle of a pass


@pytest.mark.parametrize("k", [0, 4])
def test_generate_step_a_failing_callback_or_a_cancel_ends_the_decode_as_this_rank_asked(k: int) -> None:
    """``should_cancel`` saying yes after 3 tokens: ``cancelled``, this rank named, the tokens mlx-lm's. It, or a
    logits processor, raising: the error reaches the consumer and the stream says ``failed``, this rank named."""
    model, theirs = _model_and_reference(14)
    seen: list[int] = []

    def cancel_after_three() -> bool:
        return len(seen) >= 3

    def broken_cancel() -> bool:
        if len(seen) >= 2:
            raise RuntimeError("should_cancel broke")
        return False

    def broken_processor(history: object, logits: object) -> object:
        if len(seen) >= 2:
            raise RuntimeError("the processor broke")
        return logits

    tokens, stream, offset = _decode(model, k=k, max_tokens=14, should_cancel=cancel_after_three, seen=seen)
    stop = stream.stop  # pyright: ignore
    assert tokens == theirs[: len(tokens)] and 3 <= len(tokens) <= 3 + k, tokens
    assert (stop.reason, stop.tokens, stop.ranks) == ("cancelled", len(tokens), (0,)), stop
    assert offset == len(REPEATING) + len(stream.decided)  # pyright: ignore
    for options, message in (
        ({"should_cancel": broken_cancel}, "should_cancel broke"),
        ({"logits_processors": [broken_processor]}, "the processor broke"),
    ):
        seen.clear()
        _, stream, offset = _decode(model, k=k, max_tokens=14, seen=seen, **options)
        stop = stream.stop  # pyright: ignore
        assert str(stream.error) == message and (stop.reason, stop.tokens, stop.ranks) == ("failed", len(seen), (0,))  # pyright: ignore
        assert seen == theirs[: len(seen)] and 2 <= len(seen) <= 2 + k, (message, seen)


@pytest.mark.parametrize("k", [0, 4])
def test_generate_step_yields_mlx_lms_log_probabilities_and_confirmed_guesses(k: int) -> None:
    """Each token's log-probabilities and, with a draft, whether it was a confirmed guess (``from_draft``): mlx-lm's
    ``generate_step`` / ``speculative_generate_step`` with the same draft. A stream left open (neither finished
    nor closed) is ended by the next request on the model, as every rank agrees (``cancelled``)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step

    import pipemlx
    from pipemlx.testing import build_model, tiny_config

    model, _ = _model_and_reference(14)
    reference = build_model(tiny_config("llama"), seed=5)
    if k:
        theirs = list(
            speculative_generate_step(mx.array(REPEATING), reference, _draft(), num_draft_tokens=k, max_tokens=12)
        )  # pyright: ignore
    else:
        theirs = [(t, lp, False) for t, lp in generate_step(mx.array(REPEATING), reference, max_tokens=12)]  # pyright: ignore
    guessing: dict[str, object] = {"draft_model": _draft(), "num_draft_tokens": k} if k else {}
    stream = pipemlx.generate_step(mx.array(REPEATING), model, max_tokens=12, **guessing)  # pyright: ignore
    mine = [(int(t), lp, stream.from_draft) for t, lp in stream]  # pyright: ignore
    assert [(t, d) for t, _, d in mine] == [(int(t), bool(d)) for t, _, d in theirs]  # pyright: ignore
    assert any(d for _, _, d in mine) == (k > 0)
    for (_, lp, _), (_, reference_lp, _) in zip(mine, theirs):  # pyright: ignore
        assert lp is not None and float(mx.max(mx.abs(lp - reference_lp)).item()) < 1e-4  # pyright: ignore
    without = pipemlx.generate_step(mx.array(REPEATING), model, max_tokens=12, logprobs=False, **guessing)  # pyright: ignore
    assert [(int(t), lp) for t, lp in without] == [(t, None) for t, _, _ in mine]  # pyright: ignore
    left_open = pipemlx.generate_step(mx.array(REPEATING), model, max_tokens=12, **guessing)  # pyright: ignore
    next(left_open)
    assert left_open.stop is None  # pyright: ignore
    again = [int(t) for t, _ in pipemlx.generate_step(mx.array(REPEATING), model, max_tokens=3)]  # pyright: ignore
    assert again == [t for t, _, _ in mine[:3]] and left_open.stop.reason == "cancelled"  # pyright: ignore
