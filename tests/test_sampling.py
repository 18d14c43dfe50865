"""Choosing tokens (pipemlx.runtime.sampling), one process: what generate_step and the batch's ticks pick and report.

Each helper is compared with what mlx-lm computes for the same logits: its ``generate_step`` normalises with
``logsumexp``, runs the logits processors in order on the tokens so far, and samples the log-probabilities with the
sampler (``make_sampler``) under the same random seed; greedy is ``argmax``. The shared head's step goes through the
real all-gather of a one-rank group.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from pipemlx.models.vocab_head import vocab_shard
from pipemlx.runtime.sampling import (
    SHARE_WIDTH,
    choose,
    greedy,
    log_probabilities,
    pick_tokens,
    processed,
    sample_rows,
    shared_head,
)
from pipemlx.runtime.stage import StageInfo
from pipemlx.testing import build_model, tiny_config

VOCAB = 50


def logits_of(rows: int, seed: int = 0) -> mx.array:
    return 3 * mx.random.normal((rows, VOCAB), key=mx.random.key(seed))


def test_greedy_and_log_probabilities_are_mlx_lms() -> None:
    logits = logits_of(4)
    assert greedy(logits).tolist() == mx.argmax(logits, axis=-1).tolist()
    assert len(set(greedy(logits).tolist())) > 1  # the rows differ: a wrong axis would show
    theirs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # mlx-lm's generate_step, row by row
    assert mx.allclose(log_probabilities(logits), theirs, atol=1e-6).item()
    assert mx.allclose(mx.logsumexp(log_probabilities(logits), axis=-1), mx.zeros((4,)), atol=1e-5).item()


def test_greedy_and_log_probabilities_work_over_the_last_axis_of_any_shape() -> None:
    """Per row means over the last axis, as mlx-lm's greedy sampler (``make_sampler(0.0)``) and softmax take it,
    for a vector and for ``[batch, positions, vocabulary]`` (mlx-lm's speculative steps) alike."""
    theirs = make_sampler(0.0)
    for shape in ((VOCAB,), (2, 3, VOCAB), (VOCAB, VOCAB)):
        logits = 3 * mx.random.normal(shape, key=mx.random.key(7))
        assert greedy(logits).tolist() == theirs(logits).tolist(), shape
        softmax = mx.log(mx.softmax(logits.astype(mx.float32), axis=-1))
        assert mx.allclose(log_probabilities(logits), softmax, atol=1e-5).item(), shape


def test_processors_run_in_order_on_the_tokens_so_far() -> None:
    context = mx.array([3, 7, 7, 11])
    logits = logits_of(1, seed=1)
    given = make_logits_processors(logit_bias={7: 4.0}, repetition_penalty=1.7, presence_penalty=0.5)
    expected = logits
    for processor in given:  # mlx-lm's generate_step's loop
        expected = processor(context, expected)
    assert mx.array_equal(processed(logits, context, given), expected).item()
    assert not mx.array_equal(expected, logits).item()  # the processors changed something
    swapped = [given[1], given[0], *given[2:]]  # order matters: the penalty scales token 7's biased logit or not
    assert not mx.allclose(processed(logits, context, swapped), expected).item()
    assert processed(logits, context, []) is logits


def test_choose_greedy_or_sampled_as_mlx_lm_draws() -> None:
    logits = logits_of(1, seed=2)
    token, logprobs = choose(logits, None)
    assert token.tolist() == mx.argmax(logits, axis=-1).tolist()
    assert mx.allclose(logprobs, logits - mx.logsumexp(logits, axis=-1, keepdims=True), atol=1e-6).item()
    sampler = make_sampler(temp=1.5, top_p=0.9)
    mx.random.seed(11)
    theirs = [sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item() for _ in range(8)]
    mx.random.seed(11)
    ours = [choose(logits, sampler)[0].item() for _ in range(8)]
    assert ours == theirs and len(set(ours)) > 1, (ours, theirs)  # sampled, not greedy


def test_rows_are_sampled_each_with_its_own_sampler() -> None:
    logprobs = log_probabilities(logits_of(3, seed=3))
    hot, cold = make_sampler(temp=2.0), make_sampler(temp=0.0)
    assert sample_rows(logprobs, [None, None, None]).tolist() == mx.argmax(logprobs, axis=-1).tolist()
    assert sample_rows(logprobs[1:2], [None]).tolist() == [mx.argmax(logprobs[1]).item()]  # a batch of one
    mx.random.seed(5)
    one_call = hot(logprobs).tolist()  # one sampler for all: one call over every row, as mlx-lm's batch draws
    mx.random.seed(5)
    assert sample_rows(logprobs, [hot, hot, hot]).tolist() == one_call
    mixed = [hot, None, cold]
    mx.random.seed(9)
    expected = [hot(logprobs[0:1]).item(), mx.argmax(logprobs[1]).item(), cold(logprobs[2:3]).item()]
    mx.random.seed(9)
    got = sample_rows(logprobs, mixed)
    assert got.shape == (3,) and got.tolist() == expected, (got.tolist(), expected)


def test_the_shared_heads_step_picks_mlx_lms_greedy_tokens_through_a_one_rank_group() -> None:
    # More rows (positions) than the hidden state is wide: the last rank's rows are taken by count, not width.
    model: Any = build_model(tiny_config("llama"), seed=4)
    width = int(model.model.norm.weight.shape[0])
    info = StageInfo(0, 1, (), range(0), 0, None, width, mx.float32)
    shard = vocab_shard(model, info)
    assert shard is not None
    inputs = mx.random.randint(0, 200, (1, width + 9), key=mx.random.key(8))
    hidden = shard.hidden(model, inputs, [None] * len(model.layers)).reshape(-1, width)
    mx.eval(hidden)
    group = mx.distributed.init()
    rows = hidden.shape[0]
    with mx.stream(mx.new_thread_unsafe_stream(mx.default_device())):
        pairs = shared_head(shard, hidden, rows, group, 10.0, str)
        zeros = shared_head(shard, None, 2, group, 10.0, str)  # a rank other than the last sends zeros
    assert pairs.shape == (rows * SHARE_WIDTH,) and zeros.shape == (2 * SHARE_WIDTH,)
    expected = mx.argmax(model(inputs)[0], axis=-1).tolist()
    assert len(set(expected)) > 1, expected
    assert pick_tokens([cast(list[float], pairs.tolist())]) == expected
    best_of_zero = mx.argmax(shard.full(mx.zeros((1, width)))[0]).item()
    assert pick_tokens([cast(list[float], zeros.tolist())]) == [best_of_zero] * 2
