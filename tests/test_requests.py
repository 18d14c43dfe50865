"""The whole request on a live group: pipemlx.generate_step against one-process mlx-lm with the same cache history.

Every rank holds the sharded model and a reference (the whole model, mlx-lm's
own generate_step) and applies each request to both (tests/ranks/request_server.py).
Nothing here calls mx.synchronize or a barrier: the library must leave nothing in flight.

The tests that leave their group alive share one group per size (module fixture ``live_group``), each
starting with a request on fresh caches; the tests that end or break their group start their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest
from fakes import tokens
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from hypothesis_profiles import live_settings
from live_group import LiveGroup

import pipemlx
import pipemlx.runtime.decode as decode_module
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config

TIMEOUT = 20.0
BASE: dict[str, Any] = {"op": "request", "M": 13, "seed": 1, "step": 4, "max_tokens": 6}


def check_answers(command: dict[str, Any], answers: list[dict[str, Any]]) -> None:
    """Every rank yields the same tokens, equal to mlx-lm's, and holds what the reference holds."""
    where = f"{command} -> {answers}"
    assert len({tuple(a["tokens"]) for a in answers}) == 1, where
    for a in answers:
        # With guesses, a consumer's stop ends the request after the pass's tokens: the reference took them all.
        reference = a["ref_tokens"][: len(a["tokens"])] if command.get("draft") else a["ref_tokens"]
        assert a["tokens"] == reference, where
        if a.get("offset") is not None:
            assert a["offset"] == a["ref_offset"], where
    # Why the decode ended is the same on every rank (an abandoning rank learns it at its next call).
    if command.get("stop", {}).get("how") != "abandon":
        assert len({str(a.get("last_stop")) for a in answers}) == 1, where
    # Logits processors and samplers run on every rank, shown what mlx-lm shows them: the token histories, the
    # logits, the log-probabilities; every rank's sampler (seeded alike) draws mlx-lm's tokens.
    for a in answers:
        assert a.get("histories", []) == a.get("ref_histories", []), where
        assert_close(a.get("seen", []), a.get("ref_seen", []), where)
        draws, ref_draws = a.get("draws", []), a.get("ref_draws", [])
        assert [d[1] for d in draws] == [d[1] for d in ref_draws], where
        assert_close([d[0] for d in draws], [d[0] for d in ref_draws], where)
    if "then" in answers[0]:
        check_answers(command["then"], [a["then"] for a in answers])


def assert_close(got: list[list[float]], want: list[list[float]], where: str) -> None:
    """The same number of rows, each within 1e-4 of the reference's (the pipeline's arithmetic is split)."""
    assert len(got) == len(want), where
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and all(abs(x - y) <= 1e-4 for x, y in zip(g, w, strict=True)), (g, w, where)


SCENARIO: list[dict[str, Any]] = [
    BASE,
    {**BASE, "M": 1},
    {**BASE, "M": 30, "step": 64},
    {**BASE, "temp": 0.8, "seed": 2},
    {**BASE, "stop": {"rank": 1, "after": 2, "how": "break"}},
    {**BASE, "reuse": True, "trim_to": 10, "M": 5},
    {**BASE, "stop": {"rank": 0, "after": 3, "how": "abandon"}, "then": {**BASE, "seed": 9}},
    {**BASE, "M": 20, "cancel_prefill": {"rank": 1, "at": 3}},
    {**BASE, "reuse": True, "M": 20, "cancel_prefill": {"rank": 0, "at": 2}},
    {"op": "plain", "M": 9, "seed": 4, "step": 4, "take": 3},
    {**BASE, "raise_progress": {"rank": 1, "at": 2}},
    {**BASE, "model_error": {"rank": 0, "chunk": 1}},
    {**BASE, "reuse": True, "M": 6, "penalty": 1.3},
    {**BASE, "model_error": {"rank": -1, "chunk": 0}},
    {**BASE, "decode_error": {"rank": 1, "token": 2}},
    {**BASE, "reuse": True, "M": 3},
    {**BASE, "cancel_decode": {"rank": -1, "after": 2}},
    {**BASE, "stop": {"rank": 0, "after": 1, "how": "raise"}},
    {**BASE, "stop": {"rank": -1, "after": 4, "how": "close"}},
    {**BASE, "raise_progress": {"rank": 0, "at": 5}},
    {**BASE, "stop": {"rank": "all", "after": 2, "how": "break"}},
    {**BASE, "stop": {"rank": "all", "after": 3, "how": "raise"}},
    # mlx-lm leaves a step of this model in flight; a request on another sharded model must not read it.
    {"op": "second_model", "M": 9, "seed": 5, "step": 4, "take": 3, "max_tokens": 4},
    BASE,
    # Speculative decoding (the model guessing for itself, whole): the same stops, faults and reuse.
    {**BASE, "draft": True, "max_tokens": 9},
    {**BASE, "draft": True, "reuse": True, "M": 4, "max_tokens": 7},
    {**BASE, "draft": True, "cancel_decode": {"rank": -1, "after": 3}},
    {**BASE, "draft": True, "stop": {"rank": "all", "after": 2, "how": "break"}},
    {**BASE, "draft": True, "model_error": {"rank": 0, "chunk": 4}},
    {**BASE, "draft": True, "reuse": True, "M": 3, "max_tokens": 5},
    # A sampler and processors together, on every rank: stopped by a consumer, then on a reused prefix.
    {**BASE, "temp": 0.8, "penalty": 1.3, "seed": 3, "stop": {"rank": 0, "after": 2, "how": "break"}},
    {**BASE, "temp": 0.7, "penalty": 1.2, "seed": 4, "reuse": True, "M": 4},
]


def resolve(command: dict[str, Any], num_ranks: int) -> dict[str, Any]:
    """Rank -1 in a fault means the last rank."""
    resolved = dict(command)
    for key, value in command.items():
        if isinstance(value, dict) and value.get("rank") == -1:
            resolved[key] = {**value, "rank": num_ranks - 1}
        elif key == "then":
            resolved[key] = resolve(value, num_ranks)
    return resolved


@pytest.fixture(scope="module")
def live_group() -> Iterator[Callable[[int], LiveGroup]]:
    """``live_group(S)``: the module's group of S request servers, started on first use and replaced when a
    failed test ended it. At the end every group is closed, and every rank must exit with status 0."""
    groups: dict[int, LiveGroup] = {}

    def group_of(num_ranks: int) -> LiveGroup:
        group = groups.get(num_ranks)
        if group is None or any(proc.poll() is not None for proc in group.procs):
            if group is not None:
                group.close()
            group = groups[num_ranks] = LiveGroup(num_ranks, "request_server.py", {"timeout": TIMEOUT})
        return group

    yield group_of
    statuses = {num_ranks: group.close() for num_ranks, group in groups.items()}
    assert all(s == [0] * n for n, s in statuses.items()), f"exit statuses by group size: {statuses}"


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_request_sequence_matches_mlx_lm(live_group: Callable[[int], LiveGroup], num_ranks: int) -> None:
    group = live_group(num_ranks)
    outcomes = []
    last_stops: list[list[dict[str, Any]]] = []
    for raw in SCENARIO:
        command = resolve(raw, num_ranks)
        answers = group.ask(command)
        check_answers(command, answers)
        outcomes.append([a.get("outcome") for a in answers])
        last_stops.append(answers)
    # The stops were agreed: the failing rank re-raises its own error, the others stop cleanly.
    by_command = {i: o for i, o in enumerate(outcomes)}
    assert by_command[7] == ["cancelled"] * num_ranks
    assert by_command[10][1] == "ValueError" and by_command[10][0] == "cancelled"
    assert by_command[11][0] == "InjectedModelError" and by_command[11][1:] == ["cancelled"] * (num_ranks - 1)
    assert by_command[14][1] == "InjectedModelError" and by_command[14][0] == "done"
    # Greedy without processors, every rank shares the output head (after the first token); a sampler or a
    # logits processor keeps it on the last rank.
    shared = [[a.get("shared_head") for a in answers] for answers in last_stops]
    assert shared[0] == [True] * num_ranks
    assert shared[SCENARIO.index({**BASE, "temp": 0.8, "seed": 2})] == [False] * num_ranks
    assert shared[SCENARIO.index({**BASE, "reuse": True, "M": 6, "penalty": 1.3})] == [False] * num_ranks
    # Speculating: a pass carries several tokens; stops, faults and the agreed reasons are the same.
    first = SCENARIO.index({**BASE, "draft": True, "max_tokens": 9})
    reasons = [{a["last_stop"][0] for a in answers} for answers in last_stops[first : first + 6]]
    assert reasons == [{"length"}, {"length"}, {"cancelled"}, {"cancelled"}, {"failed"}, {"length"}], reasons
    assert outcomes[first + 4][0] == "InjectedModelError", outcomes[first + 4]
    # Every rank called the processors and the sampler, each step, with mlx-lm's inputs (check_answers compared).
    for answers in last_stops[first + 6 :]:
        assert all(len(a["histories"]) >= 3 and len(a["draws"]) == len(a["histories"]) for a in answers), answers
    every_rank = list(range(num_ranks))  # all consumers stopped at the same token: all named, on every rank
    assert [a["last_stop"] for a in last_stops[20]] == [["cancelled", 2, every_rank]] * num_ranks
    assert [a["last_stop"] for a in last_stops[21]] == [["cancelled", 3, every_rank]] * num_ranks


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_a_processor_that_raises_on_a_rank_before_the_last_fails_the_request_on_every_rank(
    live_group: Callable[[int], LiveGroup], num_ranks: int
) -> None:
    """Processors run on every rank: rank 0's raising at its 3rd call (the 3rd token's logits) raises there, before
    that token; the others yield it and then end with the agreed "failed" stop naming rank 0. The group goes on."""
    group = live_group(num_ranks)
    command = {**BASE, "penalty": 1.3, "processor_error": {"rank": 0, "at": 3}}
    answers = group.ask(command)
    assert answers[0]["outcome"] == "ValueError" and len(answers[0]["tokens"]) == 2, answers[0]
    for a in answers[1:]:
        assert a["outcome"] == "done" and a["tokens"] == a["ref_tokens"][:3], a
        assert a["tokens"][:2] == answers[0]["tokens"] == answers[0]["ref_tokens"], (a, answers[0])
    assert [a["last_stop"] for a in answers] == [["failed", 3, [0]]] * num_ranks
    assert len({a["offset"] for a in answers}) == 1, answers  # the caches stay in step
    check_answers(BASE, group.ask(BASE))


def test_prefix_reuse_cancelled_prefill_keeps_the_prefix(live_group: Callable[[int], LiveGroup]) -> None:
    """Cancel right after the handshake: the cache keeps exactly the reused prefix on every rank."""
    group = live_group(2)
    group.ask({**BASE, "M": 31})  # fresh caches: 31 prompt + 6 generated
    command = {**BASE, "reuse": True, "trim_to": 30, "M": 20, "cancel_prefill": {"rank": 1, "at": 1}}
    answers = group.ask(command)
    check_answers(command, answers)
    assert [(a["outcome"], a["prefix"], a["offset"]) for a in answers] == [("cancelled", 30, 30)] * 2
    assert [a["processed"] for a in answers] == [0, 0]


@pytest.mark.parametrize("last", ["abandon", "plain"])
def test_rank_programs_that_simply_end_exit_cleanly(last: str) -> None:
    """No barrier, no synchronize: a rank that ends with a step in flight or an open decode disturbs nobody."""
    group = LiveGroup(2, "request_server.py", {"timeout": TIMEOUT})
    group.ask(BASE)
    if last == "abandon":
        # Rank 0 keeps its generator open after 2 tokens and ends; rank 1 is still waiting for token 3.
        group.ask({**BASE, "stop": {"rank": 0, "after": 2, "how": "abandon"}}, ranks=[0])
        group.end_input()
        answer = group.read(1)
        assert answer["tokens"] == answer["ref_tokens"] and len(answer["tokens"]) == 2
        assert answer["last_stop"] == ["cancelled", 2, [0]]
    else:
        group.ask({"op": "plain", "M": 9, "seed": 4, "step": 4, "take": 3})  # mlx-lm leaves one step in flight
    assert group.close() == [0, 0]


# At S=3 a middle rank faulty: the first rank loses the one it sends to, the last the one it receives from.
# The default run keeps one case of each kind; the others run with -m slow (the suite's time budget).
FAULT_CASES = [
    ("die", 2, 1),
    ("stall", 3, 1),
    ("die", 3, 2),  # the last rank dies
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [("stall", 2, 1), ("die", 3, 1), ("die", 3, 0)]),
]


@pytest.mark.parametrize(("kind", "num_ranks", "faulty"), FAULT_CASES, ids=lambda case: str(case))
def test_decode_faults_end_in_typed_errors_within_the_bound(kind: str, num_ranks: int, faulty: int) -> None:
    timeout = 3.0
    group = LiveGroup(num_ranks, "request_server.py", {"timeout": timeout}, timeout=60)
    command = {
        "op": "fault",
        "M": 9,
        "seed": 2,
        "max_tokens": 8,
        "fault": {"kind": kind, "rank": faulty, "token": 2, "seconds": 20},
    }
    survivors = [r for r in range(num_ranks) if r != faulty]
    try:
        answers = group.ask(command, ranks=survivors)
    finally:
        group.kill()
    typed = {"PeerLostError", "PipelineTimeoutError"}
    for answer in answers:
        assert answer["outcome"] in typed, answer
        assert answer["after"] <= timeout + 2, answer  # a stall or a lost peer: an error within timeout + 2 s
    for answer in answers:
        print(
            f"S={num_ranks} rank {faulty} {kind}s at token 2: rank {answer['rank']} raised {answer['outcome']} "
            f"{answer['after']:.2f} s after its last token (timeout {timeout:g} s)"
        )
    outcomes = [a["outcome"] for a in answers]
    if kind == "die":  # at S <= 3 every survivor is a ring neighbour of the dead rank: each sees the lost connection
        assert outcomes == ["PeerLostError"] * len(survivors), answers
    else:
        assert outcomes == ["PipelineTimeoutError"] * len(survivors), answers
    group.close()


class RequestMachine(RuleBasedStateMachine):
    """Random request sequences on one live 2-rank group, each compared with mlx-lm holding the same history."""

    group: LiveGroup | None = None

    @initialize()
    def fresh(self) -> None:
        assert RequestMachine.group is not None
        self.has_cache = False
        self.offset = 0

    def ask(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        assert RequestMachine.group is not None
        answers = RequestMachine.group.ask(command)
        check_answers(command, answers)
        final = answers[0].get("then", answers[0])
        self.has_cache = final.get("offset") is not None
        self.offset = final.get("offset") or 0
        return answers

    @rule(
        m=st.integers(1, 24), step=st.sampled_from([1, 3, 8]), temp=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 9)
    )
    def new_request(self, m: int, step: int, temp: float, seed: int) -> None:
        self.ask({**BASE, "M": m, "step": step, "temp": temp, "seed": seed, "max_tokens": 4})

    @rule(rank=st.integers(0, 1), after=st.integers(1, 3), how=st.sampled_from(["break", "close", "raise", "abandon"]))
    def abandoned_on_one_rank(self, rank: int, after: int, how: str) -> None:
        command: dict[str, Any] = {**BASE, "max_tokens": 5, "stop": {"rank": rank, "after": after, "how": how}}
        if how == "abandon":
            command["then"] = {**BASE, "seed": 3, "max_tokens": 3}
        self.ask(command)

    @rule(rank=st.integers(0, 1), at=st.integers(1, 5))
    def cancel_mid_prefill(self, rank: int, at: int) -> None:
        self.ask({**BASE, "M": 17, "cancel_prefill": {"rank": rank, "at": at}})

    @precondition(lambda self: self.has_cache and self.offset > 2)
    @rule(keep=st.integers(1, 40), m=st.integers(1, 10))
    def prefix_reuse_with_trim(self, keep: int, m: int) -> None:
        self.ask({**BASE, "reuse": True, "trim_to": min(keep, self.offset - 1), "M": m, "max_tokens": 3})

    @rule(take=st.integers(1, 4))
    def plain_mlx_lm(self, take: int) -> None:
        self.ask({"op": "plain", "M": 7, "seed": 5, "step": 3, "take": take})

    @rule(rank=st.integers(0, 1), at=st.integers(1, 4))
    def raising_callback(self, rank: int, at: int) -> None:
        self.ask({**BASE, "raise_progress": {"rank": rank, "at": at}})

    @rule(m=st.integers(1, 24), reuse=st.booleans(), max_tokens=st.integers(1, 9), stop_after=st.integers(0, 4))
    def speculating(self, m: int, reuse: bool, max_tokens: int, stop_after: int) -> None:
        """Greedy with the model guessing for itself (every pass several tokens), on a fresh or a kept cache."""
        command: dict[str, Any] = {**BASE, "draft": True, "M": m, "max_tokens": max_tokens}
        if reuse and self.has_cache:
            command["reuse"] = True
        if stop_after:  # every consumer stops alike: the request ends after that pass, on every rank
            command["stop"] = {"rank": "all", "after": stop_after, "how": "break"}
        self.ask(command)


def test_request_state_machine(live_group: Callable[[int], LiveGroup]) -> None:
    RequestMachine.group = live_group(2)
    try:
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(
            RequestMachine,
            settings=live_settings(examples=6, steps=6),  # random each run, failures kept in the example database
        )
    finally:
        RequestMachine.group = None


def test_two_passes_evaluated_together_raise_a_clear_error_not_a_hang() -> None:
    """mx.eval(model(a), model(b)) would interleave the passes' messages: refused on every rank, then exact."""
    from conftest import run_ranks

    for report in run_ranks(2, "two_passes.py", {}, timeout=60):
        assert report["error"] is not None and "previous one was never evaluated" in report["error"], report
        assert report["tokens"] == report["reference"], report


@pytest.mark.parametrize(
    "num_ranks", [2, pytest.param(3, marks=pytest.mark.slow)]
)  # the suite's time budget: run with -m slow
def test_stream_generate_matches_mlx_lm_on_the_demo_model(num_ranks: int) -> None:
    """Same text, tokens and finish reasons as mlx-lm's stream_generate, at max_tokens and at an EOS token."""
    from conftest import run_ranks

    for report in run_ranks(num_ranks, "stream.py", {"max_tokens": 24, "eos_at": 7}, timeout=180):
        assert report["pipe"] == report["ref"], report
        assert report["pipe"]["finish"] == "length" and report["pipe"]["generation_tokens"] == 24
        assert report["pipe_eos"] == report["ref_eos"], report
        assert report["pipe_eos"]["finish"] == "stop", report


def test_an_error_while_a_decode_step_evaluates_leaves_the_stage_refusing_further_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An error raised while MLX evaluates a step (not while the model builds it) may leave the ranks one
    # collective apart: the stage must refuse the next request instead of exchanging garbage.
    model = pipemlx.shard_model(build_model(tiny_config("llama")), mx.distributed.init())  # one rank
    real_wait = decode_module.wait_for
    waits = 0

    def wait_then_fail(arrays: Any, timeout: float | None, what: Any) -> None:
        nonlocal waits
        waits += 1
        if waits == 3:
            raise RuntimeError("[test] the evaluation failed")
        real_wait(arrays, timeout, what)

    monkeypatch.setattr(decode_module, "wait_for", wait_then_fail)
    produced: list[int] = []
    with pytest.raises(RuntimeError, match="the evaluation failed"):
        for token, _ in pipemlx.generate_step(tokens(10), model, max_tokens=8):
            produced.append(int(token))
    assert 0 < len(produced) < 8, produced
    monkeypatch.undo()
    with pytest.raises(pipemlx.PipelineError, match="start every rank again"):
        next(pipemlx.generate_step(tokens(10), model, max_tokens=2))


def test_stream_generate_takes_mlx_lm_keywords_and_stop_tokens() -> None:
    """mlx-lm's ``draft_model`` / ``num_draft_tokens`` and generate_step's ``stop_tokens`` pass through."""
    import mlx_lm
    from mlx_lm.generate import stream_generate as mlx_stream_generate

    from pipemlx.demo import DRAFT_DIR, MODEL_DIR

    model, tokenizer = pipemlx.load_sharded(MODEL_DIR, mx.distributed.init())  # one rank
    reference, ref_tokenizer = mlx_lm.load(str(MODEL_DIR))
    prompt = "It is a truth"
    plain = [r.token for r in mlx_stream_generate(reference, ref_tokenizer, prompt, max_tokens=8)]
    ref_tokenizer.add_eos_token(plain[3])  # mlx-lm's way to stop at a token: it ends like an end of sequence

    def seen(responses: Any) -> list[tuple[str, int, int, str | None]]:
        return [(r.text, r.token, r.generation_tokens, r.finish_reason) for r in responses]

    extra = {"draft_model": None, "num_draft_tokens": 3, "input_embeddings": None}
    expected = seen(mlx_stream_generate(reference, ref_tokenizer, prompt, max_tokens=8, **extra))
    got = seen(pipemlx.stream_generate(model, tokenizer, prompt, max_tokens=8, stop_tokens=[plain[3]], **extra))
    assert got == expected and expected[-1][3] == "stop", (got, expected)
    # The demo's draft model: the same tokens as without one, some of them confirmed guesses.
    draft, _ = mlx_lm.load(str(DRAFT_DIR))
    drafted = list(pipemlx.stream_generate(model, tokenizer, prompt, max_tokens=8, draft_model=draft))
    assert [r.token for r in drafted] == plain and any(r.from_draft for r in drafted), seen(drafted)
    with pytest.raises(ValueError, match="input_embeddings is not supported"):
        next(pipemlx.stream_generate(model, tokenizer, prompt, input_embeddings=mx.zeros((1, 4, 8))))


@pytest.mark.parametrize("empty", ["", []])
def test_stream_generate_names_an_empty_prompt(empty: Any) -> None:
    """An empty text or token list is "the prompt is empty", not a dtype error (``mx.array([])`` is float32)."""
    from pipemlx.demo import MODEL_DIR

    model, tokenizer = pipemlx.load_sharded(MODEL_DIR, mx.distributed.init())  # one rank
    with pytest.raises(ValueError, match="the prompt is empty"):
        pipemlx.stream_generate(model, tokenizer, empty)


def _tiny_with_tokenizer(tmp_path: Any) -> tuple[Any, Any]:
    from mlx_lm.utils import load_tokenizer  # pyright: ignore[reportUnknownVariableType]

    from pipemlx.testing import write_tokenizer

    write_tokenizer(tmp_path, 256)
    model = pipemlx.shard_model(build_model(tiny_config("llama")), mx.distributed.init())  # one rank
    return model, load_tokenizer(tmp_path)


def test_stream_generate_cancelled_before_the_first_token_says_so(tmp_path: Any) -> None:
    """A cancel seen after the prefill but before the first token: one "cancelled" response, not an empty stream."""
    model, tokenizer = _tiny_with_tokenizer(tmp_path)
    prompt = tokens(13)
    polls = 0

    def count() -> bool:
        nonlocal polls
        polls += 1
        return False

    # With max_tokens=1, the last poll is the decode's, before token 0; every earlier one is the prefill's.
    list(pipemlx.stream_generate(model, tokenizer, prompt, max_tokens=1, prefill_step_size=4, should_cancel=count))
    first_decode_poll, polls = polls, 0

    def cancel_at_the_first_token() -> bool:
        count()
        return polls >= first_decode_poll

    responses = list(
        pipemlx.stream_generate(
            model, tokenizer, prompt, max_tokens=8, prefill_step_size=4, should_cancel=cancel_at_the_first_token
        )
    )
    assert [(r.text, r.token, r.generation_tokens, r.finish_reason, r.logprobs) for r in responses] == [
        ("", -1, 0, "cancelled", None)
    ]
    assert responses[0].prompt_tokens == 13 and responses[0].prompt_tps > 0
    # The same cancel through generate_step: it ends by itself, saying why (its return value, and .stop).
    polls = 0
    decoding = pipemlx.generate_step(
        prompt, model, max_tokens=8, prefill_step_size=4, should_cancel=cancel_at_the_first_token
    )
    with pytest.raises(StopIteration) as ended:
        next(decoding)
    assert ended.value.value == decoding.stop == decode_module.DecodeStop("cancelled", 0, (0,))
    # Cancelled after 3 tokens: each token in one response (the closing one adds none), as a solo run's first 3.
    solo = [r.token for r in pipemlx.stream_generate(model, tokenizer, prompt, max_tokens=8, prefill_step_size=4)]
    polls = 0
    later = list(
        pipemlx.stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=8,
            prefill_step_size=4,
            should_cancel=lambda: count() or polls >= first_decode_poll + 3,
        )
    )
    assert [(r.token, r.finish_reason) for r in later] == [(t, None) for t in solo[:3]] + [(-1, "cancelled")]
    assert later[-1].generation_tokens == 3 and later[-1].logprobs is None and len(set(solo)) > 2, solo
    # A cancel during the prefill still raises, and the model serves the next request.
    with pytest.raises(pipemlx.PrefillCancelled):
        list(pipemlx.stream_generate(model, tokenizer, prompt, prefill_step_size=4, should_cancel=lambda: True))
    assert [r.finish_reason for r in pipemlx.stream_generate(model, tokenizer, prompt, max_tokens=2)] == [
        None,
        "length",
    ]


def test_generate_step_takes_mlx_lms_stream_on_the_stages_device(tmp_path: Any) -> None:
    """mlx-lm's third argument, ``stream``: accepted on the stage's device (computation stays on the stage's own)."""
    from mlx_lm.generate import generate_step, generation_stream

    model, tokenizer = _tiny_with_tokenizer(tmp_path)
    prompt = tokens(10)
    # single-process mlx-lm on the same weights (_tiny_with_tokenizer's model, unsharded)
    expected = [int(t) for t, _ in generate_step(prompt, build_model(tiny_config("llama")), max_tokens=4)]
    assert len(set(expected)) > 1, expected
    assert [t for t, _ in pipemlx.generate_step(prompt, model, generation_stream, max_tokens=4)] == expected
    stage = stage_of(model)
    here = stage.compute_stream.device  # the CPU here; a GPU where MLX has one
    assert [t for t, _ in pipemlx.generate_step(prompt, model, stream=mx.new_stream(here), max_tokens=4)] == expected
    streamed = pipemlx.stream_generate(model, tokenizer, prompt, max_tokens=4, stream=generation_stream)
    assert [r.token for r in streamed][:-1] == expected[:3]

    other = mx.Device(mx.cpu if here.type == mx.gpu else mx.gpu, 0)  # the other kind of device than the stage's

    class OtherDevice:  # a stream on it cannot be made where that backend is missing: its device is enough
        device = other

    words = rf"stream is on {re.escape(str(other))}, but rank 0/1 .* computes on {re.escape(str(here))}"
    with pytest.raises(ValueError, match=words):
        pipemlx.generate_step(prompt, model, stream=OtherDevice())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream is on Device"):
        pipemlx.stream_generate(model, tokenizer, prompt, stream=OtherDevice())
    with pytest.raises(TypeError, match="stream must be an mx.Stream"):
        pipemlx.generate_step(prompt, model, stream="cpu")  # type: ignore[arg-type]
    assert len(stage.send_queue) == 0
