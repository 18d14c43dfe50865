"""Speculative decoding's pieces (pipemlx/runtime/speculative.py), one process, no ranks.

Each is compared with a reference written apart from it: how many guesses a pass keeps with mlx-lm's
``speculative_generate_step`` loop (count the guesses up to the first one the samples disagree with), the common
prefix with ``os.path.commonprefix``, prompt lookup with a brute-force search of every earlier n-gram, the draft's
guesses with the model re-reading the whole history without a cache (mlx-lm's forward, greedy or the seeded
sampler), and ``num_draft_tokens="auto"`` with the documented rate model over a least-squares line from numpy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from pipemlx.runtime.draft_step import COMPILED_TOKENS
from pipemlx.runtime.protocol import MAX_GUESSES
from pipemlx.runtime.speculative import (
    AUTO_LIMIT,
    DRAFT_PREFILL_STEP,
    EXPLORE_EVERY,
    DraftLength,
    DraftModel,
    PromptLookup,
    accepted,
    common_prefix,
    proposer_of,
)
from pipemlx.schedule.batch_plan import FINGERPRINT_MODULUS
from pipemlx.testing import build_model, tiny_config

# --- accepted: the guesses a pass keeps ---------------------------------------------------------------------------


def kept_by_mlx_lm(guesses: list[int], tokens: list[int]) -> int:
    """mlx-lm's ``speculative_generate_step``: count the guesses while the sampled token at each place equals it."""
    n = 0
    while n < len(guesses) and tokens[n] == guesses[n]:
        n += 1
    return n


@given(st.data())
def test_accepted_counts_the_guesses_up_to_the_first_wrong_one(data: st.DataObject) -> None:
    k = data.draw(st.integers(0, 6))
    guesses = data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k))
    tokens = data.draw(st.lists(st.integers(0, 2), min_size=k + 1, max_size=k + 1))
    count = accepted(mx.array(guesses, dtype=mx.int32), mx.array(tokens, dtype=mx.int32))
    assert count.dtype == mx.int32 and count.shape == ()
    assert count.item() == kept_by_mlx_lm(guesses, tokens), (guesses, tokens)


@pytest.mark.parametrize(
    "guesses,tokens,expected",
    [
        ([], [5], 0),
        ([4], [4, 5], 1),
        ([4], [5, 4], 0),
        ([4, 5, 6], [4, 5, 6, 7], 3),
        ([4, 5, 6], [4, 9, 6, 7], 1),
        ([4, 5, 6], [1, 5, 6, 7], 0),
    ],
)
def test_accepted_by_hand(guesses: list[int], tokens: list[int], expected: int) -> None:
    count = accepted(mx.array(guesses, dtype=mx.int32), mx.array(tokens, dtype=mx.int32))
    assert count.dtype == mx.int32 and count.shape == () and count.item() == expected


# --- the common prefix ------------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 2), max_size=8), st.lists(st.integers(0, 2), max_size=8))
def test_common_prefix_is_os_paths(a: list[int], b: list[int]) -> None:
    expected = len(os.path.commonprefix([a, b]))
    assert common_prefix(a, b) == common_prefix(tuple(b), a) == expected


@given(st.lists(st.integers(0, 1), max_size=300), st.integers(0, 300), st.lists(st.integers(0, 1), max_size=70))
def test_common_prefix_across_blocks_is_os_paths(shared: list[int], cut: int, tail: list[int]) -> None:
    """Histories longer than a block (``PREFIX_BLOCK``, compared as slices) that share a long prefix and differ
    anywhere after it, as a draft's cache and its row's history do."""
    a, b = shared, shared[:cut] + tail
    expected = len(os.path.commonprefix([a, b]))
    assert common_prefix(a, b) == common_prefix(tuple(b), a) == expected


# --- prompt lookup ----------------------------------------------------------------------------------------------


def lookup_by_brute_force(history: list[int], max_ngram: int, k: int) -> list[int]:
    """Every n-gram length from the longest, every earlier place the history's last n tokens occur (the last
    occurrence itself excluded): what follows the latest of them."""
    if k <= 0:
        return []
    for n in range(max_ngram, 0, -1):
        if n >= len(history):
            continue
        tail = history[-n:]
        places = [s for s in range(len(history) - n) if history[s : s + n] == tail]
        if places:
            start = max(places) + n
            return history[start : start + k]
    return []


@given(st.lists(st.integers(0, 3), max_size=14), st.integers(1, 4), st.integers(-1, 5))
def test_prompt_lookup_proposes_what_followed_the_latest_match(history: list[int], max_ngram: int, k: int) -> None:
    wanted = lookup_by_brute_force(history, max_ngram, k)
    assert PromptLookup(max_ngram).propose(history, k) == wanted, (history, max_ngram, k)
    assert PromptLookup(max_ngram).propose(tuple(history), k, make_sampler(1.0), 1) == wanted  # draws nothing


@pytest.mark.parametrize(
    "history,max_ngram,k,expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, 3, [3, 4, 1]),
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, [8, 1]),  # the latest match, not the first
        ([3, 2, 7, 9, 9, 1, 2, 6, 3, 2], 2, 3, [7, 9, 9]),  # the longer n-gram wins over a later shorter one
        ([3, 2, 7, 9, 9, 1, 2, 6, 3, 2], 1, 3, [6, 3, 2]),
        ([1, 1, 1], 2, 4, [1]),  # a match overlapping the tail; cut at the history's end
        ([4, 4], 5, 3, [4]),  # n-grams longer than the history are not tried
        ([1, 2, 3], 3, 2, []),  # nothing occurred before
        ([7], 3, 2, []),
        ([], 3, 2, []),
        ([1, 2, 1, 2], 2, 0, []),
    ],
)
def test_prompt_lookup_by_hand(history: list[int], max_ngram: int, k: int, expected: list[int]) -> None:
    assert PromptLookup(max_ngram).propose(history, k) == expected


def test_prompt_lookup_fingerprint_tells_the_longest_ngram() -> None:
    assert PromptLookup(2).fingerprint() == PromptLookup(2).fingerprint() != PromptLookup(3).fingerprint()
    assert isinstance(PromptLookup(2).fingerprint(), int) and 0 <= PromptLookup(2).fingerprint() < FINGERPRINT_MODULUS


# --- proposer_of: the arguments ---------------------------------------------------------------------------------


def test_proposer_of_gives_the_proposer_asked_for() -> None:
    assert proposer_of(None, None) is None
    lookup = proposer_of(None, 3)
    assert isinstance(lookup, PromptLookup) and lookup.max_ngram == 3
    lookup = proposer_of(None, 1)  # the smallest n-gram: one token
    assert isinstance(lookup, PromptLookup) and lookup.max_ngram == 1
    model = build_model(tiny_config("llama"))
    draft = proposer_of(model, None)
    assert isinstance(draft, DraftModel) and draft.model is model


@pytest.mark.parametrize(
    "draft,lookup,error,message",
    [
        ("model", 2, ValueError, "pass draft_model or prompt_lookup, not both"),
        (None, 0, ValueError, "prompt_lookup must be a positive int (the longest n-gram matched), got 0"),
        (None, True, ValueError, "prompt_lookup must be a positive int (the longest n-gram matched), got True"),
        (None, "2", ValueError, "prompt_lookup must be a positive int (the longest n-gram matched), got '2'"),
        ("text", None, TypeError, "draft_model must be an mlx-lm model (an nn.Module), got str"),
        ("sharded", None, ValueError, "draft_model must be a whole model on every rank, not a sharded one"),
    ],
)
def test_proposer_of_names_bad_arguments(draft: Any, lookup: Any, error: type[Exception], message: str) -> None:
    if draft in ("model", "sharded"):
        model = build_model(tiny_config("llama"))
        if draft == "sharded":
            model._pipemlx_stage = object()
        draft = model
    elif draft == "text":
        draft = "a model"
    with pytest.raises(error) as raised:
        proposer_of(draft, lookup)
    assert str(raised.value) == message


# --- the draft model --------------------------------------------------------------------------------------------

VOCABULARY = 256


def guesses_without_cache(
    model: nn.Module, history: list[int], k: int, sampler: Callable[[mx.array], mx.array] | None, greedy: int
) -> list[int]:
    """Each guess from the model re-reading the whole history so far (no cache): greedy, or the sampler drawing
    from the log-probabilities, as mlx-lm's ``speculative_generate_step`` draws its draft's tokens."""
    guesses: list[int] = []
    for i in range(k):
        logits = model(mx.array([*history, *guesses], dtype=mx.int32)[None])[:, -1, :]
        if sampler is None or i < greedy:
            guesses.append(int(mx.argmax(logits, axis=-1).item()))
        else:
            guesses.append(int(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item()))
    return guesses


class Reads:
    """What a draft reads, call by call: ``("model", n)`` through mlx-lm's forward, ``("compiled", n)`` through the
    compiled one."""

    def __init__(self, draft: DraftModel) -> None:
        self.calls: list[tuple[str, int]] = []
        model, forward = draft.model, draft.forward

        def through_model(inputs: mx.array, cache: Any = None) -> mx.array:
            self.calls.append(("model", inputs.size))
            return model(inputs, cache=cache)

        draft.model = through_model  # pyright: ignore[reportAttributeAccessIssue]
        if forward is not None:

            def through_compiled(ids: mx.array, caches: Any) -> mx.array:
                self.calls.append(("compiled", ids.size))
                return forward(ids, caches)

            draft.forward = through_compiled  # pyright: ignore[reportAttributeAccessIssue]

    def take(self) -> list[tuple[str, int]]:
        calls, self.calls = self.calls, []
        return calls


def plain_draft(model: nn.Module) -> DraftModel:
    """A draft that reads with mlx-lm's own cache and forward only."""
    draft = DraftModel(model)
    draft.forward = None
    draft.cache = make_prompt_cache(model)
    return draft


def held(draft: DraftModel) -> int:
    offset: Any = draft.cache[0].offset
    return int(offset.item()) if isinstance(offset, mx.array) else int(offset)


@pytest.mark.parametrize("compiled", [False, True], ids=["mlx-lm-cache", "compiled"])
def test_draft_guesses_as_the_model_reading_the_whole_history(compiled: bool) -> None:
    """Greedy guesses over a history that keeps some guesses and rejects others: the cache is cut back to the
    longest prefix it shares with the history, the last token read again, and the guesses are the model's."""
    model = build_model(tiny_config("llama"))
    draft = DraftModel(model) if compiled else plain_draft(model)
    assert (draft.forward is not None) == compiled
    history = [(5 * i + 1) % VOCABULARY for i in range(9)]
    for step, k in enumerate([3, 3, 1, 4, 2, 3]):
        guesses = draft.propose(history, k)
        assert guesses == guesses_without_cache(model, history, k, None, 0), step
        assert draft.tokens == [*history, *guesses[:-1]] and held(draft) == len(draft.tokens), step
        kept = guesses[: step % (k + 1)]
        history = [*history, *kept, (history[-1] * 3 + step) % VOCABULARY]
    history = history[:6]  # a history that went back before what the draft holds
    assert draft.propose(history, 2) == guesses_without_cache(model, history, 2, None, 0)
    assert draft.tokens == history + draft.tokens[6:] and held(draft) == len(draft.tokens) == 7


def test_draft_reads_the_prompt_in_chunks_then_the_last_token_then_one_token_a_guess() -> None:
    model = build_model(tiny_config("llama", num_hidden_layers=2))  # long prompts: two layers are enough
    draft = plain_draft(model)
    reads = Reads(draft)
    assert draft.propose([], 3) == [] and draft.propose([1, 2], 0) == [] and draft.propose([1, 2], -1) == []
    assert reads.take() == [] and draft.tokens == []
    step = DRAFT_PREFILL_STEP
    for length, chunks in [(step + 2, [step, 1]), (2 * step + 1, [step, step]), (2 * step + 11, [step, step, 10])]:
        prompt = [(7 * i + 3) % VOCABULARY for i in range(length)]
        draft = plain_draft(model)
        reads = Reads(draft)
        guesses = draft.propose(prompt, 3)
        assert reads.take() == [("model", n) for n in [*chunks, 1, 1, 1]], length  # chunks, the last token, guesses
        assert held(draft) == len(draft.tokens) == length + 2, length
    assert guesses == guesses_without_cache(model, prompt, 3, None, 0)
    # Every guess kept and a token of its own: the last guess and that token are read together (two tokens).
    history = [*prompt, *guesses, 9]
    assert draft.propose(history, 2) == guesses_without_cache(model, history, 2, None, 0)
    assert reads.take() == [("model", 2), ("model", 1)]
    history = [*history[:-1], 11]  # the last token differs: it is read again alone
    assert draft.propose(history, 1) == guesses_without_cache(model, history, 1, None, 0)
    assert reads.take() == [("model", 1)]
    # Three tokens past what the draft holds (more than two) are read as a prompt: all but the last, then the last.
    history = [*history, 4, 5, 6]
    assert draft.propose(history, 1) == guesses_without_cache(model, history, 1, None, 0)
    assert reads.take() == [("model", 2), ("model", 1)] and held(draft) == len(history)


def test_compiled_draft_reads_a_few_tokens_through_the_compiled_forward() -> None:
    """At most :data:`COMPILED_TOKENS` at once go through the compiled forward, more through mlx-lm's."""
    model = build_model(tiny_config("llama"))
    draft = DraftModel(model)
    reads = Reads(draft)
    prompt = list(range(1, COMPILED_TOKENS + 2))  # all but the last token: exactly COMPILED_TOKENS
    assert draft.propose(prompt, 2) == guesses_without_cache(model, prompt, 2, None, 0)
    assert reads.take() == [("compiled", COMPILED_TOKENS), ("compiled", 1), ("compiled", 1)]
    history = [*draft.tokens, 8, *range(10, 10 + COMPILED_TOKENS + 1)]
    assert draft.propose(history, 1) == guesses_without_cache(model, history, 1, None, 0)
    assert reads.take() == [("model", COMPILED_TOKENS + 1), ("compiled", 1)]


def normalised(sampler: Callable[[mx.array], mx.array], seen: list[float]) -> Callable[[mx.array], mx.array]:
    """``sampler``, noting how far each of its inputs is from log-probabilities (the log of their sum)."""

    def sample(logprobs: mx.array) -> mx.array:
        seen.append(float(mx.logsumexp(logprobs, axis=-1).item()))
        return sampler(logprobs)

    return sample


@pytest.mark.parametrize("greedy", [0, 1, 3])
def test_draft_draws_with_the_sampler_from_log_probabilities_as_mlx_lm(greedy: int) -> None:
    """The first ``greedy`` guesses greedily, the rest drawn with the decode's sampler (top-p, so that the
    log-probabilities' normalisation matters) under the same seed as the reference's draws."""
    model = build_model(tiny_config("llama"))
    sampler = make_sampler(1.5, top_p=0.8)
    history = [(11 * i + 2) % VOCABULARY for i in range(12)]
    seen: list[float] = []
    for seed in range(3):
        mx.random.seed(seed)
        wanted = guesses_without_cache(model, history, 4, sampler, greedy)
        mx.random.seed(seed)
        assert plain_draft(model).propose(history, 4, normalised(sampler, seen), greedy) == wanted, seed
    assert len(seen) == 3 * (4 - min(greedy, 4)) and all(abs(s) < 1e-4 for s in seen), seen
    if greedy == 0:  # the default: every guess drawn
        mx.random.seed(5)
        wanted = guesses_without_cache(model, history, 4, sampler, 0)
        mx.random.seed(5)
        assert plain_draft(model).propose(history, 4, sampler) == wanted


def test_draft_fingerprint_tells_weights_and_shapes_apart() -> None:
    config = tiny_config("llama")
    same = DraftModel(build_model(config)).fingerprint()
    assert DraftModel(build_model(config)).fingerprint() == same
    assert isinstance(same, int) and 0 <= same < FINGERPRINT_MODULUS  # an int field of the handshake's message
    assert DraftModel(build_model(config, seed=3)).fingerprint() != same
    assert DraftModel(build_model(tiny_config("llama", num_hidden_layers=3))).fingerprint() != same


# --- num_draft_tokens: fixed or "auto" --------------------------------------------------------------------------


@pytest.mark.parametrize("setting", [1, 3, MAX_GUESSES])
def test_a_fixed_draft_length_is_kept_whatever_is_measured(setting: int) -> None:
    length = DraftLength(setting)
    assert length.fixed == setting and length.next() == setting
    for _ in range(EXPLORE_EVERY + 1):
        length.record(0, 0, 1.0)
    length.record(setting, 0, 5.0)
    assert length.next() == setting


@pytest.mark.parametrize(
    "setting,message",
    [
        (0, "num_draft_tokens must be a positive int or 'auto', got 0"),
        (-2, "num_draft_tokens must be a positive int or 'auto', got -2"),
        (True, "num_draft_tokens must be a positive int or 'auto', got True"),
        (2.0, "num_draft_tokens must be a positive int or 'auto', got 2.0"),
        ("many", "num_draft_tokens must be a positive int or 'auto', got 'many'"),
        (MAX_GUESSES + 1, f"num_draft_tokens must be at most {MAX_GUESSES} (guesses in one step), got 17"),
    ],
)
def test_bad_draft_lengths_are_named(setting: Any, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        DraftLength(setting)
    assert str(raised.value) == message


def test_auto_draft_length_tallies_passes_and_guesses() -> None:
    length = DraftLength("auto")
    assert length.fixed is None and (length.confirmed, length.tried) == (1, 2)  # the prior: p = 1/2
    assert length.passes == {} and length.plain_in_a_row == 0 and length.proposals == (0, 0.0)
    length.record(0, 0, 0.5)
    length.record(0, 0, 0.25)
    assert length.passes == {0: (2, 0.75)} and length.plain_in_a_row == 2 and (length.confirmed, length.tried) == (1, 2)
    length.record(3, 1, 1.0)  # one confirmed, then a wrong one: two tried
    assert length.passes == {0: (2, 0.75), 3: (1, 1.0)} and length.plain_in_a_row == 0
    assert (length.confirmed, length.tried) == (2, 4)
    length.record(3, 3, 2.0)  # every guess confirmed: none wrong
    assert length.passes[3] == (2, 3.0) and (length.confirmed, length.tried) == (5, 7)
    length.record(0, 0, 1.0)
    assert length.plain_in_a_row == 1
    length.record_proposal(2, 0.5)
    length.record_proposal(3, 0.25)
    assert length.proposals == (5, 0.75)


def rate_model(length: DraftLength) -> list[float]:
    """The documented expected tokens per second of each count 0..AUTO_LIMIT: ``(1 - p**(k+1)) / (1 - p)`` tokens
    over ``t0 + t1*k + (1 - p**(k+1))*k*d`` seconds, ``t0 + t1*k`` numpy's least-squares line through the mean
    seconds per count (with one count measured, a guess costs a tenth of a pass)."""
    p = min(length.confirmed / length.tried, 0.99)
    counts = sorted(length.passes)
    means = [length.passes[k][1] / length.passes[k][0] for k in counts]
    if len(counts) == 1:
        t0 = means[0] / (1 + 0.1 * counts[0])
        t1 = 0.1 * t0
    else:
        slope, intercept = np.polyfit(np.array(counts, dtype=float), np.array(means), 1)
        t1 = max(float(slope), 0.0)
        t0 = max(float(np.mean(means)) if slope < 0 else float(intercept), 1e-9)
    guesses, seconds = length.proposals
    d = seconds / guesses if guesses else t1
    return [
        (1 - p ** (k + 1)) / (1 - p) / max(t0 + t1 * k + (1 - p ** (k + 1)) * k * d, 1e-9)
        for k in range(AUTO_LIMIT + 1)
    ]


passes = st.lists(
    st.tuples(st.integers(0, AUTO_LIMIT), st.integers(0, AUTO_LIMIT), st.integers(1, 400)), min_size=1, max_size=12
)


@given(passes, st.integers(0, 12), st.integers(0, 400))
def test_auto_draft_length_maximises_the_documented_rate(
    measured: list[tuple[int, int, int]], proposed: int, proposing_ms: int
) -> None:
    length = DraftLength("auto")
    for k, confirmed, ms in measured:
        length.record(k, min(confirmed, k), ms / 1000)
    if proposed:
        length.record_proposal(proposed, proposing_ms / 1000)
    chosen = length.next()
    if not any(k for k, _, _ in measured):
        assert chosen == 2  # nothing measured with guesses yet
        return
    rates = rate_model(length)
    best = max(rates)
    if chosen == 1 and length.plain_in_a_row >= EXPLORE_EVERY and rates[0] >= best * (1 - 1e-9):
        return  # exploring (the test below)
    assert 0 <= chosen <= AUTO_LIMIT and rates[chosen] >= best * (1 - 1e-9), (chosen, rates)
    assert chosen == int(np.argmax(rates)) or rates[int(np.argmax(rates))] <= rates[chosen] * (1 + 1e-9)


@pytest.mark.parametrize(
    "measured,proposals,expected",
    [
        ([(0, 0, 0.01)], None, 2),  # only plain passes: guess two
        # One pass of the most guesses, all confirmed (p = 9/10; a guess costs a tenth of a pass): six.
        ([(AUTO_LIMIT, AUTO_LIMIT, 0.01)], None, 6),
        ([(3, 0, 0.01)] * 10, None, 0),  # p = 1/12: guessing does not pay
        # p = 7/8, the line through (2, 0.012) and (4, 0.014): 0.010 a pass and 0.001 a guess: five.
        ([(2, 2, 0.012), (4, 4, 0.014)], None, 5),
        ([(2, 2, 0.01), (4, 4, 0.02)], None, 0),  # a line through 0: the pass costs nothing, guesses cost time
        ([(2, 1, 0.02), (4, 4, 0.01)], None, AUTO_LIMIT),  # a falling line: guesses cost nothing, the mean holds
        ([(0, 0, 0.0), (2, 1, 0.0)], None, AUTO_LIMIT),  # nothing costs time: the rate's floor, no division by zero
        # p capped at 0.99 (it is 321/322), guesses proposed again at 0.02 s each: four (uncapped: eight).
        ([(AUTO_LIMIT, AUTO_LIMIT, 0.01)] * 40, (10, 0.2), 4),
    ],
)
def test_auto_draft_length_by_hand(
    measured: list[tuple[int, int, float]], proposals: tuple[int, float] | None, expected: int
) -> None:
    length = DraftLength("auto")
    for k, confirmed, seconds in measured:
        length.record(k, confirmed, seconds)
    if proposals is not None:
        length.record_proposal(*proposals)
    assert length.next() == expected
    if expected != 2 or len(measured) > 1:  # something measured with guesses: the rate model's best
        assert expected == int(np.argmax(rate_model(length)))


def test_auto_draft_length_counts_the_guesses_proposed_again() -> None:
    """Guesses proposed again after a pass whose guesses did not stand cost their measured seconds each: dear
    enough, and guessing stops paying."""
    cheap, dear = DraftLength("auto"), DraftLength("auto")
    for length in (cheap, dear):
        for k, seconds in [(1, 0.0101), (2, 0.0102), (4, 0.0104)]:
            length.record(k, k // 2, seconds)
    cheap.record_proposal(10, 0.001)
    dear.record_proposal(10, 1.0)
    assert cheap.next() >= 2 and dear.next() == 0
    assert cheap.next() == int(np.argmax(rate_model(cheap))) and dear.next() == int(np.argmax(rate_model(dear)))


def test_auto_draft_length_tries_one_guess_again_after_explore_every_plain_passes() -> None:
    length = DraftLength("auto")
    length.record(2, 0, 0.03)
    length.record(1, 0, 0.02)
    for _ in range(EXPLORE_EVERY - 1):
        length.record(0, 0, 0.01)
        assert length.next() == 0
    length.record(0, 0, 0.01)
    assert length.plain_in_a_row == EXPLORE_EVERY and length.next() == 1
    length.record(1, 0, 0.02)
    assert length.next() == 0


def test_single_count_cost_line_is_a_tenth_of_a_pass_a_guess() -> None:
    length = DraftLength("auto")
    length.record(4, 0, 1.4)
    assert length._cost_line() == pytest.approx((1.0, 0.1))  # pyright: ignore[reportPrivateUsage]
    length.record(4, 0, 1.4)
    length.record(0, 0, 1.0)
    line: Sequence[float] = length._cost_line()  # pyright: ignore[reportPrivateUsage]
    assert line == pytest.approx((1.0, 0.1))  # the line through (0, 1.0) and (4, 1.4): the means, not the sums
