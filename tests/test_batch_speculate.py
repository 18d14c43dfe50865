"""pipemlx.runtime.batch.speculate: the pieces of prompt lookup in a BatchGenerator, in this process.

The rows' cut (``cut_rows``) is checked against mlx-lm's own single-request caches: after a step with guesses and
the cut, each row's next logits equal a solo run's over the tokens the row kept. The whole generator against mlx-lm's
BatchGenerator runs in tests/test_batch.py (``test_prompt_lookup_in_the_batch_...``).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import pytest
from fakes import FakeGroup
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

import pipemlx
from pipemlx.runtime.batch.draft import JOIN_TOKENS, BatchDraft
from pipemlx.runtime.batch.requests import BatchRequest, Decided
from pipemlx.runtime.batch.speculate import (
    AUTO_GUESSES,
    AUTO_PROBE_EVERY,
    AUTO_WARMUP,
    BatchSpeculation,
    StepCosts,
    choose_guesses,
    common_cut,
    cut_rows,
    emitted,
    expected_tokens,
    padded_inputs,
    speculable,
)
from pipemlx.runtime.stops import StopSet
from pipemlx.testing import build_model, tiny_config


def test_a_row_keeps_its_guesses_up_to_the_first_its_samples_disagree_with_then_its_own_sample() -> None:
    assert emitted([], [7]) == [7]
    assert emitted([4, 5, 6], [4, 5, 6, 9]) == [4, 5, 6, 9]  # every guess held, and the token after them
    assert emitted([4, 5, 6], [4, 8, 6, 9]) == [4, 8]  # the second failed: its own token instead
    assert emitted([4, 5], [3, 5, 1]) == [3]  # none held: one token, as without guesses
    rows, width = padded_inputs([10, 20, 30], [[1, 2], [], [3]])
    assert width == 3 and rows == [[10, 1, 2], [20, 0, 0], [30, 3, 0]]
    assert padded_inputs([10], [[]]) == ([[10]], 1)


def solo_logits(model: Any, tokens: list[int]) -> mx.array:
    """mlx-lm's logits after ``tokens`` on a fresh single-request cache (one forward pass)."""
    return model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1]


@pytest.mark.parametrize("kept", [(3, 1, 2), (1, 1, 1), (4, 4, 4), (2, 4, 1), (4, 4, 1), (1, 4, 1), (1, 3, 1)])
def test_rows_cut_back_per_row_decode_on_as_solo_runs_of_what_they_kept(kept: tuple[int, int, int]) -> None:
    """Three rows of different lengths (left-padded) feed 4 positions each; each keeps ``kept[i]`` of them (their
    next token and ``kept[i] - 1`` guesses). After the cut every row's next step gives the logits of a solo run
    over its prompt and kept tokens, and its extracted cache holds exactly those positions. Rows left-padded by
    0, 5 and 2: (4, 4, 1) moves row 2 alone right; (1, 4, 1) row 1 alone left into its padding; (1, 3, 1) row 1
    left by 2 (rows 0 and 2 stay), the others every row that rejected more than the fewest."""
    model = build_model(tiny_config("llama"))
    prompts = [list(range(5, 14)), list(range(40, 44)), list(range(70, 77))]
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=cache)
        caches.append(cache)
    batch = [c[0].merge([cache[layer] for cache in caches]) for layer, c in enumerate(zip(*caches))]
    fed = [[p[-1], 200 + i, 210 + i, 220 + i] for i, p in enumerate(prompts)]
    model(mx.array(fed), cache=batch)
    rejected = [4 - k for k in kept]
    assert common_cut(rejected, batch[0].left_padding.tolist()) == {(1, 4, 1): 3, (1, 3, 1): 3}.get(kept, min(rejected))
    cut_rows(batch, rejected)
    following = [[100 + i] for i in range(3)]
    logits = model(mx.array(following), cache=batch)[:, -1]
    for i, prompt in enumerate(prompts):
        history = prompt[:-1] + fed[i][: kept[i]]
        assert batch[0].extract(i).offset == len(history) + 1  # and the token fed after the cut
        want = solo_logits(model, history + following[i])
        assert mx.allclose(logits[i], want, atol=1e-4).item(), (i, kept)


def test_the_common_cut_keeps_the_most_rows_in_place_that_every_row_can_reach() -> None:
    assert common_cut([3, 3, 0, 3], [0, 0, 0, 0]) == 0  # no row can move left: the fewest rejected
    assert common_cut([3, 3, 0, 3], [0, 0, 3, 0]) == 3  # row 2 moves left by 3 into its padding, 3 rows stay
    assert common_cut([3, 3, 0, 3], [0, 0, 2, 0]) == 0  # its padding is too short
    assert common_cut([2, 1, 1, 0], [9, 9, 9, 9]) == 1 and common_cut([2, 2, 1, 1], [9, 9, 9, 9]) == 1  # tie: smaller
    assert common_cut([1, 1], [0, 0]) == 1


def test_only_plain_kv_caches_are_cut_back_per_row() -> None:
    assert speculable([KVCache(), KVCache()]) and not speculable([]) and not speculable([RotatingKVCache(8)])
    with pytest.raises(TypeError, match="BatchRotatingKVCache"):
        cut_rows([BatchRotatingKVCache(8, [0, 1])], [1, 0])


def request(uid: int, prompt: list[int], max_tokens: int = 20, sampler: Any = None) -> BatchRequest:
    made = BatchRequest(uid, prompt, max_tokens, sampler, StopSet.of((), "stop").matcher(), (), [], None, ())
    made.decided = Decided(prompt[-1], None, None)
    return made


def test_auto_chooses_the_count_that_gives_the_most_tokens_per_second() -> None:
    """choose_guesses against counts worked out by hand: the rows' expected tokens over the step's cost."""
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 3) == 1.875 and expected_tokens(1.0, 4) == 5
    costs = StepCosts()
    for seconds in (0.5, 1.5, 1.0):
        costs.observe(1, seconds)
        assert choose_guesses([(0.9, 4)] * 8, costs, 4) == 0  # fewer than AUTO_WARMUP plain steps timed: none
    costs.observe(2, 4.0)  # kept as its ratio to the plain steps' running mean then: 0.5, 0.75, 0.8125
    costs.observe(1, 1.0)
    assert costs.plain_count == AUTO_WARMUP and costs.estimate(1) == 1.0 and costs.ratios == {2: [4.0 / 0.8125]}
    costs = StepCosts(1.0, AUTO_WARMUP)
    assert costs.estimate(3) == 3.0  # the prior: a plain step per position, until a wider step is timed
    assert choose_guesses([(0.5, 4)] * 8, costs, 4) == 0  # 1.5 tokens / 2 loses: no guess before a probe
    assert choose_guesses([(1.0, 4)] * 8, costs, 4) == 0  # even certain guesses only break even
    costs.observe(2, 2.0)  # a step with one guess cost two plain steps: each position costs a plain step
    assert costs.estimate(5) == 5.0 and costs.estimate(1) == 1.0
    assert choose_guesses([(0.5, 4)] * 8, costs, 4) == 0  # guesses that hold half the time lose
    assert choose_guesses([(0.99, 4)] * 8, costs, 4) == 0  # all but certain: 4.9 tokens for 5 still lose
    costs = StepCosts.fixed({2: 1.1, 4: 1.3})  # wide steps nearly free (a big model on a fast device)
    assert costs.estimate(3) == pytest.approx(1.2) and costs.estimate(5) == pytest.approx(1.4)
    assert choose_guesses([(0.8, 4)] * 8, costs, 4) == 4
    assert choose_guesses([(0.05, 4)] * 8, costs, 4) == 0  # 1.05 tokens for 1.1: plain wins
    mixed = [(0.8, 4), (0.0, 0), (0.0, 0), (0.0, 0)]  # one row guesses, three have nothing to feed
    assert choose_guesses(mixed, costs, 4) == 3  # 5.95 / 1.3 beats 6.36 / 1.4, 5.44 / 1.2, 4.8 / 1.1, 4 / 1
    assert choose_guesses(mixed, costs, 1) == 1  # at most the generator's count
    costs = StepCosts(2.0, AUTO_WARMUP)  # a plain step 2 s: a wider one counts as its ratio to that
    for seconds in (3.0, 30.0, 2.8, 3.2, 3.0, 3.0):  # one slow step among them does not decide
        costs.observe(2, seconds)
    assert costs.ratios[2] == [15.0, 1.4, 1.6, 1.5, 1.5] and costs.estimate(2) == 1.5
    costs.observe(1, 6.0)  # the running mean moves a quarter of the way
    assert costs.plain == 3.0 and costs.estimate(2) == 1.5


def test_auto_guesses_while_they_pay_and_probes_again_after_steps_without() -> None:
    """BatchSpeculation.plan with "auto": the rows' tallies (prior 1/2) and the steps' costs choose the count for
    every row alike; rows that fail drive it to 0, and after AUTO_PROBE_EVERY steps without it tries one guess;
    sampled rows, rows that opted out and rows near max_tokens guess nothing (or less)."""
    speculation = BatchSpeculation(1, "auto")
    good, bad = request(0, [1, 2, 3, 1, 2, 3, 1]), request(1, [4, 5, 6, 4, 5, 6, 4])
    for r in (good, bad):
        speculation.enrol(r.uid)
    assert speculation.plan([good, bad], None) == [[], []]  # no plain step timed: none
    assert speculation.guesses(good, None) == [2, 3, 1]  # what followed the last earlier 1 (of 4 asked)
    for _ in range(AUTO_WARMUP):
        speculation.costs.observe(1, 1.0)
    assert speculation.plan([good, bad], None) == [[], []]  # a wider step not timed: costs a plain step a position
    speculation.costs.observe(2, 1.2)  # cheap positions
    for _ in range(6):
        speculation.record(good.uid, 3, 3)
        speculation.record(bad.uid, 3, 0)
    assert speculation.tallies[good.uid].acceptance > 0.9 and speculation.tallies[bad.uid].acceptance < 0.2
    assert speculation.plan([good, bad], None) == [[2, 3, 1], [5, 6, 4]]  # the good row's gain pays for both
    for _ in range(10):
        speculation.record(good.uid, 3, 0)
    for _ in range(3):
        speculation.costs.observe(2, 2.0)
    plans = [speculation.plan([good, bad], None) for _ in range(AUTO_PROBE_EVERY)]
    assert plans == [[[], []]] * (AUTO_PROBE_EVERY - 1) + [[[2], [5]]]  # every guess fails: off, then a probe
    assert speculation.chosen[0] == AUTO_PROBE_EVERY + 1 and speculation.idle == 0  # (and the two before any)
    plans = [speculation.plan([good, bad], None) for _ in range(2 * AUTO_PROBE_EVERY)]  # probes keep losing:
    assert plans == [[[], []]] * (2 * AUTO_PROBE_EVERY - 1) + [[[2], [5]]]  # the next waits twice as long
    speculation.costs.observe(2, 1.05)  # wider steps turn cheap (three of the five latest): guesses pay again
    speculation.costs.observe(2, 1.05)
    speculation.costs.observe(2, 1.05)
    for _ in range(3):
        speculation.record(good.uid, 3, 3)
    assert speculation.plan([good, bad], None) != [[], []] and speculation.probe_every == AUTO_PROBE_EVERY
    assert speculation.proposed == 75 and speculation.confirmed == 27
    assert speculation.guesses(request(2, [1, 2, 1], sampler=lambda x: x), None) == []  # not enrolled, sampled
    speculation.enrol(3)
    assert speculation.guesses(request(3, [1, 2, 1]), lambda x: x) == []  # the generator's default samples
    near = request(3, [1, 2, 3, 1, 2, 3], max_tokens=3)
    near.answer = [1]
    assert speculation.guesses(near, None) == [2]  # 2 tokens left: the next one and one guess
    fixed = BatchSpeculation(2, 3)
    fixed.enrol(0)
    for _ in range(20):
        fixed.record(0, 3, 0)
    assert fixed.plan([good], None) == [[2, 3, 1]]  # a fixed count never changes
    assert AUTO_GUESSES == 4


def mlx_lm_greedy(model: Any, tokens: list[int], count: int) -> list[int]:
    """mlx-lm's ``generate_step`` continuing ``tokens`` greedily on ``model``: its first ``count`` tokens."""
    steps = generate_step(mx.array(tokens), model, max_tokens=count)
    return [int(t) for t, _ in steps]


def test_a_draft_row_draws_the_drafts_greedy_continuation_and_only_the_count_auto_chose() -> None:
    """BatchSpeculation with a draft model: each row's guesses are the draft's greedy continuation of the row's
    history (as mlx-lm's ``generate_step`` gives it on the draft alone), capped by the row's room; with "auto"
    the count is chosen before the drafts draw, and a row's draft cache is dropped when it leaves."""
    draft = build_model(tiny_config("llama"))
    fixed = BatchSpeculation(None, 3, draft)
    rows = [request(0, [5, 9, 2, 7]), request(1, [3, 3, 8], max_tokens=3), request(2, [4, 1], sampler=lambda x: x)]
    for r in rows:
        fixed.enrol(r.uid)
    plan = fixed.plan(rows, None)
    assert plan[0] == mlx_lm_greedy(draft, [5, 9, 2, 7], 3)
    assert plan[1] == mlx_lm_greedy(draft, [3, 3, 8], 2)  # max_tokens 3: the next token and 2 guesses
    assert plan[2] == [] and cast(Any, fixed.drafts).uids == [0, 1]  # a sampled row draws nothing, has no draft
    rows[0].answer = [plan[0][0], 11]  # the row moved on (its first guess held, then its own token 11)
    assert fixed.plan(rows[:1], None) == [mlx_lm_greedy(draft, [5, 9, 2, 7, plan[0][0], 11], 3)]
    fixed.forget({0, 1})
    assert len(cast(Any, fixed.drafts)) == 0 and fixed.of(0) == (0, 0)
    auto = BatchSpeculation(None, "auto", draft)
    auto.costs = StepCosts.fixed({w: 1 + 0.1 * (w - 1) for w in range(2, 6)})
    row = request(0, [5, 9, 2, 7])
    auto.enrol(0)
    for _ in range(8):
        auto.record(0, 2, 1)  # half hold: 1.75 tokens for 1.2 steps beats 1.5 / 1.1 and 1.875 / 1.3
    assert choose_guesses([(auto.tallies[0].acceptance, AUTO_GUESSES)], auto.costs, AUTO_GUESSES) == 2
    assert auto.plan([row], None) == [mlx_lm_greedy(draft, [5, 9, 2, 7], 2)]
    # A probe draws one row's guess: the row whose draft has the least to read (a step's width costs the same
    # whichever rows guess). Its draft first reads its row's backlog (here its prompt), so the tick is not timed
    # (caught_up) and the next step probes again, the draft now current, so that the probe's cost is measured.
    probing = BatchSpeculation(None, "auto", draft)
    probing.costs = StepCosts(1.0, AUTO_WARMUP)  # no wider step timed: a plain step a position, no guesses
    long, short = request(0, list(range(3, 40))), request(1, list(range(50, 60)))
    probing.enrol(0)
    probing.enrol(1)
    idle = [probing.plan([long, short], None) for _ in range(AUTO_PROBE_EVERY - 1)]
    assert idle == [[[], []]] * (AUTO_PROBE_EVERY - 1) and len(cast(Any, probing.drafts)) == 0
    assert probing.plan([long, short], None) == [[], mlx_lm_greedy(draft, short.prompt, 1)] and probing.caught_up
    short.answer = [7]
    again = probing.plan([long, short], None)
    assert again == [[], mlx_lm_greedy(draft, [*short.prompt, 7], 1)] and not probing.caught_up
    assert probing.plan([long, short], None) == [[], []] and probing.probe_every == 2 * AUTO_PROBE_EVERY
    assert cast(Any, probing.drafts).uids == [1]  # the long row's draft never read its prompt
    # A row whose draft reads its history over several steps (join_tokens a step) guesses nothing meanwhile, and
    # every such step is one whose time the generator leaves out (caught_up), guesses or not.
    slow = BatchSpeculation(None, 2, draft)
    cast(Any, slow.drafts).join_tokens = 5
    row = request(0, list(range(3, 15)))  # 11 tokens to read before its first guess: 5, 5, then 1 and it joins
    slow.enrol(0)
    steps = [(slow.plan([row], None), slow.caught_up) for _ in range(4)]
    first = [mlx_lm_greedy(draft, row.prompt, 2)]
    assert steps == [([[]], True), ([[]], True), (first, True), (first, False)]  # (then a step of its own)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_batched_draft_guesses_each_rows_greedy_continuation_as_rows_come_and_go(data: st.DataObject) -> None:
    """BatchDraft over rounds in which each row keeps some of its guesses and adds a token of its own, rows leave
    and join, and some rounds ask only some rows: every row's guesses are mlx-lm's greedy continuation of its
    history on the draft alone (an independent reference), whatever its cache went through (cut back per row,
    padded reads, rows moved); rows that join read at most ``join_tokens`` of their histories a draw, together,
    and guess nothing until they have read them all."""
    draft = build_model(tiny_config("llama"))
    batch = BatchDraft(draft, join_tokens=data.draw(st.sampled_from([4, 9, JOIN_TOKENS])))
    histories: dict[int, list[int]] = {}
    next_uid = 0
    for _ in range(8):
        if len(histories) < 3 or data.draw(st.booleans()):  # a row joins
            histories[next_uid] = data.draw(st.lists(st.integers(1, 255), min_size=1, max_size=20))
            next_uid += 1
        if len(histories) > 1 and data.draw(st.booleans()):  # a row leaves
            gone = data.draw(st.sampled_from(sorted(histories)))
            del histories[gone]
            batch.drop({gone})
        asked = {u: (h, data.draw(st.integers(1, 3))) for u, h in histories.items() if data.draw(st.booleans())}
        waiting = {u for u in asked if u not in batch.uids}
        guesses = batch.propose(asked)
        # The joins read at most join_tokens together (and a row that joined, its last token in the batched step).
        assert sum(batch.read.get(u, 0) for u in waiting) <= batch.join_tokens + len(waiting)
        for uid, (history, count) in asked.items():
            if uid not in batch.uids:  # still reading its history to join: no guesses yet
                assert uid not in guesses and batch.backlog(uid, history) > 1
                histories[uid] = history + [data.draw(st.integers(1, 255))]
                continue
            assert guesses[uid] == mlx_lm_greedy(draft, history, count), (uid, history)
            kept = data.draw(st.integers(0, count))  # the pass kept this many guesses, then its own token
            histories[uid] = history + guesses[uid][:kept] + [data.draw(st.integers(1, 255))]
        assert sorted(batch.uids) == sorted(u for u in batch.uids if u in histories)


def fake_generator(**kwargs: Any) -> Any:
    model = pipemlx.shard_model(build_model(tiny_config("llama")), FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    return pipemlx.BatchGenerator(model, **{"prefill_step_size": 8, "prefill_chunking": "fixed", **kwargs})


def test_bad_speculation_settings_raise_before_anything_is_sent() -> None:
    for bad, named in (
        ({"prompt_lookup": 0}, "prompt_lookup must be a positive int"),
        ({"prompt_lookup": True}, "prompt_lookup must be a positive int"),
        ({"prompt_lookup": 2, "num_draft_tokens": 0}, "num_draft_tokens must be an int from 1 to 16 or 'auto'"),
        ({"prompt_lookup": 2, "num_draft_tokens": 17}, "num_draft_tokens must be an int from 1 to 16 or 'auto'"),
        ({"prompt_lookup": 2, "num_draft_tokens": "many"}, "num_draft_tokens must be an int"),
        ({"prompt_lookup": 2, "draft_model": build_model(tiny_config("llama"))}, "pass draft_model or prompt_lookup"),
        ({"draft_model": fake_generator().model}, "draft_model must be a whole model on every rank"),
        ({"draft_model": build_model(tiny_config("llama")), "num_draft_tokens": 0}, "num_draft_tokens must be"),
        ({"draft_model": build_model(tiny_config("lfm2"))}, r"draft_model's layers keep \['ArraysCache'\] caches"),
    ):
        with pytest.raises(ValueError, match=named):
            fake_generator(**bad)
    generator = fake_generator()
    with pytest.raises(ValueError, match=r"draft must be one bool per prompt \(2\)"):
        generator.insert([[1, 2], [3]], draft=[True])
    with pytest.raises(ValueError, match="draft must be one bool per prompt"):
        generator.insert([[1, 2]], draft=[1])
    assert len(generator) == 0 and generator.guesses == (0, 0)
