"""The parts of ``pipemlx serve --recover`` that need no ranks: what a resumed request carries, the front's
bookkeeping of a request's tokens (answered once, whatever the group sends after), the link's handshake (a wrong
key or a silent peer refused, neither holding the front up), and the across-hosts flags' bad input (one line,
exit 2)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from pipemlx import cli
from pipemlx.demo import MODEL_DIR
from pipemlx.models.loading import load_tokenizer_of
from pipemlx.serve.book import Book, Event, Ticket
from pipemlx.serve.broadcast import Insert, Ops, decode_ops, encode_ops
from pipemlx.serve.link import FRONT_KEY_VARIABLE, Acceptor, connect
from pipemlx.serve.relay import Relay
from pipemlx.serve.requests import Request, RequestResult, SamplingParams, from_json, to_json
from pipemlx.serve.settings import EngineSettings, ServeSettings


@pytest.mark.parametrize("drawn", [1, 5, 17])
def test_a_resumed_sampler_draws_what_the_undisturbed_one_draws_next(drawn: int) -> None:
    logprobs = mx.log(mx.softmax(mx.array([[0.3, 1.2, -0.4, 0.9, 0.0, 2.1]]), axis=-1))
    whole = SamplingParams(0.8).keyed_sampler(99)
    resumed = SamplingParams(0.8).keyed_sampler(99, drawn)
    assert whole is not None and resumed is not None
    undisturbed = [int(whole(logprobs).item()) for _ in range(drawn + 20)]
    assert [int(resumed(logprobs).item()) for _ in range(20)] == undisturbed[drawn:]


@pytest.mark.parametrize(("seed", "drawn"), [(None, 0), (None, 2), (7, 0), (7, 3)])
def test_a_batched_requests_sampler_draws_mlx_lms_seeded_draws(seed: int | None, drawn: int) -> None:
    """``Batched``'s sampler for a request (``_keyed_sampler``): the draws of mlx-lm's ``make_sampler`` after
    ``mx.random.seed(seed)`` (0 where the request has none yet) and ``drawn`` draws skipped (a resumed request),
    with its filters; a greedy request has none (the batch takes the argmax)."""
    from mlx_lm.sample_utils import make_sampler

    from pipemlx.serve.schedulers import _keyed_sampler  # pyright: ignore[reportPrivateUsage]

    logprobs = mx.log(mx.softmax(mx.array([[0.3, 1.2, -0.4, 0.9, 0.0, 2.1, 0.5, 1.0]]), axis=-1))
    sampling = SamplingParams(0.9, top_p=0.95, top_k=6, seed=seed)
    mine = _keyed_sampler(Request(1, [1, 2], 8, sampling, drawn=drawn))
    assert mine is not None
    mx.random.seed(0 if seed is None else seed)
    theirs = make_sampler(0.9, top_p=0.95, top_k=6)
    expected = [int(theirs(logprobs).item()) for _ in range(drawn + 24)][drawn:]
    assert [int(mine(logprobs).item()) for _ in range(24)] == expected
    assert _keyed_sampler(Request(2, [1, 2], 8, SamplingParams(0.0, seed=seed), drawn=drawn)) is None


def test_an_insert_keeps_its_draws_through_the_broadcast() -> None:
    insert = Insert(Request(3, [1, 2, 3, 4], 9, SamplingParams(0.5, 0.75, 1234), drawn=11))  # float32-exact
    (back,) = decode_ops(encode_ops(Ops([], [insert]))).inserts
    assert back == insert and back.request.drawn == 11


class FakeLink:
    """Records what the front sends to rank 0."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True


def events_of(loop: asyncio.AbstractEventLoop, job: Ticket) -> list[Event]:
    loop.run_until_complete(asyncio.sleep(0))  # deliver what emit scheduled
    out: list[Event] = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_the_front_resumes_with_the_tokens_sent_and_answers_once() -> None:
    tokenizer = load_tokenizer_of(MODEL_DIR)
    book = Book(ServeSettings("pipemlx-demo", engine=EngineSettings(max_concurrency=4)), tokenizer, [4, 4])
    relay = Relay(book, 1.0)
    loop = asyncio.new_event_loop()
    try:
        prompt = list(tokenizer.encode("Mr. Bingley"))
        answer = list(tokenizer.encode(" was a handsome young man"))[:6]
        request = Request(1, prompt, len(answer), SamplingParams(0.8, seed=7))
        job = Ticket(request, "completion", 0, loop, asyncio.Queue(), stream=True)
        running = book.start(job)
        relay._handle({"t": "admitted", "id": 1, "cached": 0})  # pyright: ignore[reportPrivateUsage]
        for token in answer[:2]:
            relay._handle({"t": "token", "id": 1, "token": token})  # pyright: ignore[reportPrivateUsage]
        link = FakeLink()
        relay._send(link, running)  # pyright: ignore[reportPrivateUsage, reportArgumentType]
        (message,) = link.sent
        resume = from_json(Request, message["request"])
        assert resume.tokens == prompt + answer[:2] and resume.id == 1
        assert resume.max_tokens == len(answer) - 2 and resume.drawn == 2 and resume.sampling.seed == 7
        for token in answer[2:]:  # the new group goes on; the last token answers the request (length)
            relay._handle({"t": "token", "id": 1, "token": token})  # pyright: ignore[reportPrivateUsage]
        relay._handle({"t": "token", "id": 1, "token": answer[0]})  # pyright: ignore[reportPrivateUsage]
        ended = {"t": "ended", "id": 1, "result": to_json(RequestResult("length", 0, 12, 4))}
        relay._handle(ended)  # pyright: ignore[reportPrivateUsage]
        events = events_of(loop, job)
        assert [e.kind for e in events if e.kind != "text"] == ["done"]
        detokenizer = tokenizer.detokenizer  # what one stream of these tokens reads
        for token in answer:
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert "".join(e.text for e in events if e.kind == "text") == detokenizer.text
        assert events[-1].finish_reason == "length" and not book.running
        assert book.counts["served"] == 1
        relay._handle(ended)  # pyright: ignore[reportPrivateUsage]  # answered once, whatever comes after
        assert book.counts["served"] == 1 and not events_of(loop, job)
    finally:
        loop.close()


@pytest.mark.parametrize(
    "message",
    [
        {"t": "token", "id": "x", "token": 5},
        {"t": "ended", "id": 1, "result": {"outcome": "won"}},
        {"t": "admitted", "id": 1},
        {"t": "slots", "slots": [{"pid": "a"}]},
    ],
)
def test_a_malformed_message_from_rank_zero_is_a_fault(message: dict[str, Any]) -> None:
    """The front counts a message it cannot read as a fault of the group (it restarts it), never an exception of
    its own."""
    from pipemlx.serve.relay import Fault

    book = Book(ServeSettings("pipemlx-demo"), None, [4, 4])
    with pytest.raises(Fault, match="malformed"):
        Relay(book, 1.0)._handle(message)  # pyright: ignore[reportPrivateUsage]


def test_the_link_needs_the_key_and_a_silent_peer_holds_nothing_up() -> None:
    acceptor = Acceptor("127.0.0.1", 0, "right key")
    address = f"{acceptor.address[0]}:{acceptor.address[1]}"
    try:
        silent = socket.create_connection(acceptor.address)  # connects and never answers the challenge
        with pytest.raises((AuthenticationError, OSError, EOFError)):  # refused, or the front hanging up
            connect(address, "wrong key", timeout=5.0)
        started = time.monotonic()
        link = connect(address, "right key", timeout=5.0)
        assert time.monotonic() - started < 3.0  # the silent peer's handshake runs in a thread of its own
        front_end = acceptor.accepted.get(timeout=5.0)
        assert acceptor.accepted.empty()  # neither the silent peer nor the wrong key became a link
        assert link.send({"t": "hello", "split": [4, 4]})
        assert front_end.poll(5.0) and front_end.recv() == {"t": "hello", "split": [4, 4]}
        link.close()
        assert front_end.recv() is None  # the other end gone
        silent.close()
    finally:
        acceptor.close()


@pytest.fixture
def hostfile(tmp_path: Path) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([["127.0.0.1:5000"], ["10.213.9.9:5000"]]))
    return str(path)


KEY = "k" * 16  # the shortest key accepted (128 bits)


@pytest.mark.parametrize(
    "argv,key,words",
    [
        (["--worker", "--front", "127.0.0.1:7000"], KEY, "--worker needs --hostfile"),
        (["--worker", "--hostfile", "{hostfile}"], KEY, "--worker needs --front HOST:PORT"),
        (["--worker", "--hostfile", "{hostfile}", "--front", "127.0.0.1:7000"], None, "--worker needs a shared key"),
        (["--worker", "--hostfile", "{hostfile}", "--front", "127.0.0.1:7000"], "a", "it needs 16 at least"),
        (["--recover", "--hostfile", "{hostfile}", "--front-listen", "127.0.0.1:7000"], "a" * 15, "needs 16"),
        (["--worker", "--recover", "--hostfile", "{hostfile}", "--front", "127.0.0.1:7000"], KEY, "the front is its"),
        (["--front", "127.0.0.1:7000"], KEY, "--front goes with --worker"),
        (["--recover", "--front-listen", "127.0.0.1:7000"], KEY, "--front-listen goes with --recover --hostfile"),
        (["--recover", "--hostfile", "{hostfile}"], KEY, "--recover --hostfile needs --front-listen HOST:PORT"),
        (["--recover", "--hostfile", "{hostfile}", "--front-listen", "127.0.0.1:0"], KEY, "a port in 1..65535"),
        (["--recover", "--hostfile", "{hostfile}", "--front-listen", "127.0.0.1:7000"], None, "needs a shared key"),
        (["--worker", "--hostfile", "/no/such/hosts.json", "--front", "127.0.0.1:7000"], KEY, "cannot read hostfile"),
        (["--allow-shrink", "--no-recover", "--ranks", "3"], KEY, "--allow-shrink needs the front"),
        (["--allow-shrink", "--ranks", "1"], KEY, "--allow-shrink needs the front"),
        (["--recover", "--ranks", "1"], KEY, "--recover needs at least 2 ranks"),
        (["--allow-shrink", "--ranks", "2"], KEY, "--allow-shrink needs 3 ranks or more"),
        (
            ["--recover", "--allow-shrink", "--hostfile", "{hostfile}", "--front-listen", "127.0.0.1:7000"],
            KEY,
            "--allow-shrink needs 3 ranks or more",
        ),
    ],
)
def test_bad_input_across_hosts_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    hostfile: str,
    argv: list[str],
    key: str | None,
    words: str,
) -> None:
    if key is None:
        monkeypatch.delenv(FRONT_KEY_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(FRONT_KEY_VARIABLE, key)
    try:
        code = cli.main(["serve", *(a.replace("{hostfile}", hostfile) for a in argv)])
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


class TokenSink:
    """Collects the tokens a scheduler streams (rank 0's part of serving)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def progress(self, request_id: int, processed: int, total: int) -> None:
        pass

    def should_cancel(self, request_id: int) -> bool:
        return False

    def token(self, request_id: int, token: int) -> bool:
        self.tokens.append(token)
        return False


@pytest.mark.parametrize("drawn", [0, 1, 4])
def test_a_resumed_request_one_at_a_time_continues_mlx_lms_seeded_text(drawn: int) -> None:
    """``--max-concurrency 1`` (:class:`OneAtATime`), one process: a sampled request resumed after ``drawn`` tokens,
    which joined its prompt, draws what mlx-lm's ``generate_step`` under the same seed draws after them (#51: one
    key too few skipped went unnoticed where every recovery test ran at 4)."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step
    from mlx_lm.sample_utils import make_sampler

    import pipemlx
    from pipemlx.serve.rank import Rank
    from pipemlx.serve.schedulers import OneAtATime
    from pipemlx.testing import build_model, tiny_config

    config = tiny_config("llama")
    prompt, seed, total = [5, 17, 3, 99, 42], 1234, 10
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)  # below 1: a check of "> 1" would skip none
    reference = build_model(config, seed=3)
    mx.random.seed(seed)
    steps = mlx_lm_generate_step(mx.array(prompt), reference, sampler=make_sampler(0.9, top_p=0.95))
    theirs = [int(token) for (token, _), _ in zip(steps, range(total))]
    assert len(set(theirs)) > 3, theirs  # sampled: a key skipped or not changes what follows
    group = mx.distributed.init()
    model = pipemlx.shard_model(build_model(config, seed=3), group)
    rank = Rank(model, None, group, EngineSettings(prefill_step_size=4))
    request = Request(7, prompt, total, sampling).resumed(theirs[:drawn])
    assert request.drawn == drawn
    sink = TokenSink()
    result = OneAtATime(rank).run(Insert(request), sink)
    assert sink.tokens == theirs[drawn:] and result.outcome == "length", result
    assert (result.prefilled, result.generated, result.cached) == (len(prompt) + drawn, total - drawn, 0)


def test_a_request_continuing_a_cached_prefix_is_penalised_over_its_whole_prompt_as_mlx_lm() -> None:
    """One process, ``OneAtATime``: a second request reusing the first one's cached prompt runs its penalties'
    processors over the whole prompt (the reused part is in the cache, not passed to ``generate_step``), as
    mlx-lm's ``generate_step`` does over the whole prompt."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step
    from mlx_lm.sample_utils import make_logits_processors

    import pipemlx
    from pipemlx.serve.prefix_cache import PrefixCache
    from pipemlx.serve.rank import Rank
    from pipemlx.serve.schedulers import OneAtATime
    from pipemlx.testing import build_model, tiny_config

    config = tiny_config("llama")
    looping = [7, 30, 31, 228, 80, 8, 209, 8, 80, 8, 209, 8, 80]  # the model's own greedy text: it repeats itself
    first, second, total = looping, [*looping, 8, 100, 101], 8  # the first request generates 8: reused too
    penalties = {"repetition_penalty": 1.8, "presence_penalty": 1.5, "frequency_penalty": 0.7}
    processors = make_logits_processors(**penalties)  # context sizes 20, as the request's defaults
    steps = mlx_lm_generate_step(mx.array(second), build_model(config, seed=5), logits_processors=processors)
    theirs = [int(token) for (token, _), _ in zip(steps, range(total))]
    plain = mlx_lm_generate_step(mx.array(second), build_model(config, seed=5))
    assert theirs != [int(token) for (token, _), _ in zip(plain, range(total))]  # the penalties change the text
    group = mx.distributed.init()
    rank = Rank(pipemlx.shard_model(build_model(config, seed=5), group), None, group, EngineSettings())
    rank.prefix = PrefixCache(1000)
    scheduler = OneAtATime(rank)
    scheduler.run(Insert(Request(1, first, 1)), None)
    plan = rank.prefix.plan(second)
    assert plan.reuse == len(first) + 1  # the first request's prompt and its token (the model's next) are reused
    sampling = SamplingParams(**penalties)
    sink = TokenSink()
    result = scheduler.run(Insert(Request(2, second, total, sampling), plan), sink)
    assert sink.tokens == theirs and result.cached == plan.reuse and result.prefilled == len(second) - plan.reuse, (
        result
    )
    again = rank.prefix.plan(second)  # no penalties this time, the prefix reused all the same
    assert (
        again.reuse == len(second) - 1 and scheduler.run(Insert(Request(3, second, 2), again), None).outcome == "length"
    )


# --- OneAtATime.run's whole request path, one process (--max-concurrency 1) --------------------------------------


class Recorder(TokenSink):
    """A sink that notes the prefill's progress, can stop the answer after some tokens (rank 0's stop string), ask
    to cancel after some tokens, or fail on a token (a callback's own error)."""

    def __init__(self, stop_after: int = 0, cancel_after: int = -1, fail_on: int = 0, cancel_at: int = 0) -> None:
        super().__init__()
        self.progressed: list[tuple[int, int, int]] = []
        self.ids: set[int] = set()  # the request ids the calls named
        self.stop_after, self.cancel_after, self.fail_on, self.cancel_at = stop_after, cancel_after, fail_on, cancel_at

    def progress(self, request_id: int, processed: int, total: int) -> None:
        self.progressed.append((request_id, processed, total))

    def should_cancel(self, request_id: int) -> bool:
        self.ids.add(request_id)
        in_prefill = self.cancel_at > 0 and any(done >= self.cancel_at for _, done, _ in self.progressed)
        return in_prefill or 0 <= self.cancel_after <= len(self.tokens)

    def token(self, request_id: int, token: int) -> bool:
        self.ids.add(request_id)
        self.tokens.append(token)
        if len(self.tokens) == self.fail_on:
            raise RuntimeError(f"the sink broke on token {token}")
        return len(self.tokens) == self.stop_after


LOOPING_PROMPT = [7, 30, 31, 228, 80, 8, 209, 8, 80, 8, 209, 8, 80]
"""The tiny llama (seed 5)'s own greedy text: it repeats itself, so prompt lookup's guesses hold."""


def one_at_a_time(eos: list[int] = [], **engine: Any) -> tuple[Any, Any]:  # noqa: B006
    """A one-process rank (prefix cache of 1000 tokens) over the tiny llama of seed 5, and its scheduler."""
    from types import SimpleNamespace

    import pipemlx
    from pipemlx.serve.prefix_cache import PrefixCache
    from pipemlx.serve.rank import Rank
    from pipemlx.serve.schedulers import OneAtATime
    from pipemlx.testing import build_model, tiny_config

    group = mx.distributed.init()
    model = pipemlx.shard_model(build_model(tiny_config("llama"), seed=5), group)
    rank = Rank(model, SimpleNamespace(eos_token_ids=eos), group, EngineSettings(**engine))
    rank.prefix = PrefixCache(1000)
    return rank, OneAtATime(rank)


def mlx_lm_greedy(prompt: list[int], count: int, step: int = 2048) -> tuple[list[int], list[tuple[int, int]]]:
    """mlx-lm's greedy tokens for ``prompt`` and the prefill progress it reports."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    from pipemlx.testing import build_model, tiny_config

    progress: list[tuple[int, int]] = []
    steps = mlx_lm_generate_step(
        mx.array(prompt),
        build_model(tiny_config("llama"), seed=5),
        prefill_step_size=step,
        prompt_progress_callback=lambda done, total: progress.append((done, total)),
    )
    return [int(token) for (token, _), _ in zip(steps, range(count))], progress


def test_one_at_a_time_answers_as_mlx_lm_and_keeps_what_every_rank_decided() -> None:
    from pipemlx.serve.requests import OUTCOMES

    prompt = [5, 17, 3, 99, 42, 11, 60]
    theirs, progress = mlx_lm_greedy(prompt, 6, step=3)
    rank, scheduler = one_at_a_time(prefill_step_size=3)
    sink = Recorder()
    result = scheduler.run(Insert(Request(4, prompt, 6)), sink)
    assert sink.tokens == theirs and sink.ids == {4}
    assert sink.progressed == [(4, done, total) for done, total in progress]  # mlx-lm's prompt_progress_callback
    assert result == RequestResult("length", 0, result.cache_tokens, len(prompt), None, 0, 0, 6)
    ((entry_tokens, entry),) = [(list(e.tokens), e) for e in rank.prefix.entries.values()]
    assert entry_tokens == (prompt + theirs)[: result.cache_tokens] and result.cache_tokens >= len(prompt) + 5, entry
    assert (rank.last_seq, rank.last_cache_tokens, rank.last_outcome) == (
        4,
        result.cache_tokens,
        OUTCOMES.index("length"),
    )
    # The next request reuses that entry: the same tokens as mlx-lm over the whole prompt, fewer positions computed.
    longer = [*prompt, *theirs[:4], 3]
    plan = rank.prefix.plan(longer)
    assert plan.reuse == len(prompt) + 4
    theirs, _ = mlx_lm_greedy(longer, 3)
    again = scheduler.run(Insert(Request(5, longer, 3), plan), Recorder())
    assert (again.outcome, again.cached, again.prefilled, again.generated) == ("length", plan.reuse, 1, 3)
    assert scheduler.run(Insert(Request(6, longer, 3)), None) == RequestResult(
        "length", 0, again.cache_tokens, len(longer), None, 0, 0, 3
    )  # no sink (the ranks after rank 0): the same result


def test_one_at_a_time_stops_at_the_end_of_sequence_and_at_rank_zeros_stop_string() -> None:
    from pipemlx.serve.requests import OUTCOMES

    prompt = [5, 17, 3, 99, 42]
    theirs, _ = mlx_lm_greedy(prompt, 8)
    eos = next(t for i, t in enumerate(theirs) if i >= 2 and t not in theirs[:i])
    ends = theirs.index(eos) + 1
    rank, scheduler = one_at_a_time([eos])
    sink = Recorder()
    result = scheduler.run(Insert(Request(1, prompt, 8)), sink)
    assert sink.tokens == theirs[:ends] and (result.outcome, result.generated) == ("stop", ends), result
    assert rank.last_outcome == OUTCOMES.index("stop") and len(rank.prefix.entries) == 1
    rank, scheduler = one_at_a_time()
    sink = Recorder(stop_after=3)  # a stop string ends the answer on rank 0 after three tokens
    result = scheduler.run(Insert(Request(2, prompt, 8)), sink)
    assert sink.tokens == theirs[:3] and (result.outcome, result.generated) == ("stop", 3), result
    ((entry,),) = [[list(e.tokens) for e in rank.prefix.entries.values()]]
    assert entry == (prompt + theirs)[: len(entry)] and len(entry) == result.cache_tokens >= len(prompt) + 2


def test_one_at_a_time_cancelled_in_the_prefill_keeps_what_it_computed() -> None:
    from pipemlx.serve.requests import OUTCOMES

    prompt = list(range(3, 23))
    rank, scheduler = one_at_a_time(prefill_step_size=4)
    sink = Recorder(cancel_at=8)  # once 8 of the prompt's positions are in the caches
    result = scheduler.run(Insert(Request(3, prompt, 5)), sink)
    assert result.outcome == "cancelled" and sink.tokens == [] and result.error is None, result
    assert 8 <= result.prefilled < len(prompt) and result.cache_tokens == result.prefilled, result
    assert [list(e.tokens) for e in rank.prefix.entries.values()] == [prompt[: result.prefilled]]
    sink = Recorder(cancel_after=0)  # before any of it: nothing to keep
    result = scheduler.run(Insert(Request(4, prompt, 5)), sink)
    assert (result.outcome, result.prefilled, result.cache_tokens) == ("cancelled", 0, 0) and not sink.progressed
    assert rank.last_outcome == OUTCOMES.index("cancelled") and rank.last_cache_tokens == result.prefilled
    rank, scheduler = one_at_a_time()
    sink = Recorder(cancel_after=2)  # after two tokens of the answer
    result = scheduler.run(Insert(Request(3, prompt, 9)), sink)
    theirs, _ = mlx_lm_greedy(prompt, 2)
    assert result.outcome == "cancelled" and sink.tokens == theirs and result.prefilled == len(prompt), result


def test_one_at_a_time_a_callbacks_error_fails_the_request_and_keeps_nothing() -> None:
    from pipemlx.serve.requests import OUTCOMES

    prompt = [5, 17, 3, 99, 42]
    theirs, _ = mlx_lm_greedy(prompt, 2)
    rank, scheduler = one_at_a_time()
    result = scheduler.run(Insert(Request(8, prompt, 6)), Recorder(fail_on=2))
    assert result.outcome == "failed" and result.error == f"RuntimeError: the sink broke on token {theirs[1]}"
    assert result.cache_tokens == rank.last_cache_tokens >= len(prompt)  # what the cache holds, though none is kept
    assert not rank.prefix.entries and (rank.last_seq, rank.last_outcome) == (8, OUTCOMES.index("failed"))

    class BrokenProgress(Recorder):
        def progress(self, request_id: int, processed: int, total: int) -> None:
            if processed >= 8:
                raise RuntimeError("the progress broke")
            super().progress(request_id, processed, total)

    result = scheduler.run(Insert(Request(9, list(range(3, 23)), 5)), BrokenProgress())  # in the prefill
    assert (result.outcome, result.error) == ("failed", "RuntimeError: the progress broke") and not rank.prefix.entries


def test_one_at_a_time_guesses_with_prompt_lookup_unless_the_request_says_draft_false() -> None:
    theirs, _ = mlx_lm_greedy(LOOPING_PROMPT, 8)
    _, scheduler = one_at_a_time(prompt_lookup=2, num_draft_tokens=3)
    sink = Recorder()
    result = scheduler.run(Insert(Request(1, LOOPING_PROMPT, 8)), sink)
    assert sink.tokens == theirs and result.proposed >= 3 and 0 < result.accepted <= result.proposed, result
    sink = Recorder()
    plain = scheduler.run(Insert(Request(2, LOOPING_PROMPT, 8, SamplingParams(draft=False))), sink)
    assert sink.tokens == theirs and (plain.proposed, plain.accepted, plain.generated) == (0, 0, 8), plain
    # Each pass guesses num_draft_tokens: the same passes guess three times as many at 3 as at 1.
    once = one_at_a_time(prompt_lookup=2, num_draft_tokens=1)[1].run(Insert(Request(1, LOOPING_PROMPT, 8)), None)
    assert result.proposed == 3 * once.proposed, (result, once)
    # A request reusing a cached prefix guesses as one that computes it: the proposer reads the reused prefix too.
    rank, scheduler = one_at_a_time(prompt_lookup=2, num_draft_tokens=3)
    scheduler.run(Insert(Request(6, LOOPING_PROMPT[:9], 1)), None)
    plan = rank.prefix.plan([*LOOPING_PROMPT, 8])
    reused = scheduler.run(Insert(Request(7, [*LOOPING_PROMPT, 8], 8), plan), None)
    fresh = one_at_a_time(prompt_lookup=2, num_draft_tokens=3)[1].run(Insert(Request(7, [*LOOPING_PROMPT, 8], 8)), None)
    assert reused.cached == 10 and (reused.proposed, reused.accepted) == (fresh.proposed, fresh.accepted) != (0, 0)
    rank, scheduler = one_at_a_time()  # no proposer: nothing guessed
    assert scheduler.run(Insert(Request(3, LOOPING_PROMPT, 8)), None).proposed == 0
    from pipemlx.testing import build_model, tiny_config

    rank.draft = build_model(tiny_config("llama"), seed=5)  # --draft-model: the model itself, every guess holds
    sink = Recorder()
    drafted = scheduler.run(Insert(Request(4, LOOPING_PROMPT, 8)), sink)
    assert sink.tokens == theirs and drafted.proposed >= 3 and drafted.accepted == drafted.proposed, drafted
    assert scheduler.run(Insert(Request(5, LOOPING_PROMPT, 8, SamplingParams(draft=False))), None).proposed == 0


def test_one_at_a_time_applies_one_insert_and_refuses_any_other_step() -> None:
    """A step of ``OneAtATime`` holds one insert and nothing else: it runs it (the sink sees its tokens); a step
    with a remove, or two inserts, is one a rank out of step sent: refused on every rank, naming the stage."""
    from pipemlx.errors import PipelineMismatchError

    prompt = [5, 17, 3, 99, 42]
    theirs, _ = mlx_lm_greedy(prompt, 3)
    _, scheduler = one_at_a_time()
    sink = Recorder()
    ((request_id, result),) = scheduler.apply(Ops([], [Insert(Request(9, prompt, 3))]), sink)
    assert request_id == 9 and result.outcome == "length" and sink.tokens == theirs
    assert scheduler.apply(Ops([], []), sink) == []
    stage = scheduler.rank.stage.describe()
    for ops in (
        Ops([9], []),
        Ops([9], [Insert(Request(10, prompt, 3))]),
        Ops([], [Insert(Request(11, prompt, 3))] * 2),
    ):
        with pytest.raises(PipelineMismatchError) as raised:
            scheduler.apply(ops, sink)
        assert str(raised.value) == f"{stage}: a step of one request holds other operations"


class FakeDecode:
    """What ``generate_step`` returns, ending as ``run`` ends (it raises what another rank's fault raises here)."""

    guesses = (0, 0)
    decided: list[int] = []
    stop = None

    def __init__(self, run: Any) -> None:
        self.run = run

    def __iter__(self) -> Any:
        self.run()
        return iter(())

    def close(self) -> None:
        pass


def another_ranks_fault(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """``generate_step`` in ``OneAtATime`` runs the prefill until 8 positions are in, then ends as when another
    rank failed (``failed``), cancelled and kept the cache (``cancelled``) or not (``untrimmed``), disagreed
    (``mismatch``) or was lost (``lost``)."""
    import pipemlx.serve.schedulers as schedulers
    from pipemlx.errors import PipelineError, PipelineMismatchError, PrefillCancelled

    real = schedulers.generate_step

    def fake(prompt: mx.array, model: Any, **kwargs: Any) -> FakeDecode:
        def run() -> None:
            if fault == "mismatch":
                raise PipelineMismatchError("the ranks disagree")
            if fault == "lost":
                raise PipelineError("rank 1 is gone")
            seen: list[int] = []
            kwargs["prompt_progress_callback"] = lambda done, total: seen.append(done)
            kwargs["should_cancel"] = lambda: bool(seen) and seen[-1] >= 8
            try:
                for _ in real(prompt, model, **kwargs):
                    pass
            except PrefillCancelled as exc:
                failed, cancelling = ([1], None) if fault == "failed" else (None, [1])
                raise PrefillCancelled(
                    f"rank 1 {fault}",
                    processed=exc.processed,
                    cache_trimmed=exc.cache_trimmed and fault != "untrimmed",
                    failed_ranks=failed,
                    cancelling_ranks=cancelling,
                    prefix=exc.prefix,
                ) from None
            raise AssertionError("the prefill was not cancelled")

        return FakeDecode(run)

    monkeypatch.setattr(schedulers, "generate_step", fake)


@pytest.mark.parametrize("fault", ["failed", "cancelled", "untrimmed", "mismatch", "lost"])
def test_one_at_a_time_ends_a_request_as_another_ranks_fault_says(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Another rank's fault, as this rank sees it: a failure there fails the request and keeps nothing; a cancel
    there keeps the prompt's positions every rank computed (none when the caches could not be cut back); a
    disagreement fails it and drops the prefix cache; a lost rank is raised to the server (it restarts the group)."""
    from pipemlx.errors import PipelineError

    prompt = list(range(3, 23))
    rank, scheduler = one_at_a_time(prefill_step_size=4)
    scheduler.run(Insert(Request(1, [9, 9, 9], 1)), None)  # an entry in the prefix cache
    before = [list(e.tokens) for e in rank.prefix.entries.values()]
    another_ranks_fault(monkeypatch, fault)
    if fault == "lost":
        with pytest.raises(PipelineError, match="rank 1 is gone"):
            scheduler.run(Insert(Request(2, prompt, 5)), Recorder())
        return
    result = scheduler.run(Insert(Request(2, prompt, 5, partition="tenant")), Recorder())
    entries = [(list(e.tokens), e.partition) for e in rank.prefix.entries.values()]
    if fault == "mismatch":
        assert (result.outcome, result.error, entries) == ("failed", "PipelineMismatchError: the ranks disagree", [])
        return
    assert result.prefilled >= 8 and result.outcome == ("failed" if fault == "failed" else "cancelled"), result
    assert result.error == ("PrefillCancelled: rank 1 failed" if fault == "failed" else None), result
    kept = [(prompt[: result.prefilled], "tenant")] if fault == "cancelled" else []
    assert entries == [(tokens, "") for tokens in before] + kept


@pytest.mark.parametrize("reason", ["failed", "cancelled", "stop", "length"])
def test_one_at_a_time_ends_a_decode_as_every_rank_agreed(monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    """A decode that ends without raising here ends the request as the ranks agreed: another rank's callback
    failed (``failed``), its consumer cancelled (``cancelled``), an end of sequence, or ``max_tokens``."""
    import pipemlx.serve.schedulers as schedulers
    from pipemlx.runtime.decode import DecodeStop

    decode = FakeDecode(lambda: None)
    decode.stop = DecodeStop(reason, 0, (1,) if reason in ("failed", "cancelled") else ())  # type: ignore[assignment]
    monkeypatch.setattr(schedulers, "generate_step", lambda *args, **kwargs: decode)
    rank, scheduler = one_at_a_time()
    result = scheduler.run(Insert(Request(3, [5, 17, 3], 4)), Recorder())
    assert result.outcome == reason and result.generated == 0, result


def test_one_at_a_time_counts_an_uncounted_cache_by_what_every_rank_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose layers are all recurrent (a middle rank of a hybrid model) has caches that count no positions:
    it reports, and keeps, what every rank decided (the prompt and the answer), as the counted ranks do."""
    import pipemlx.serve.schedulers as schedulers
    from pipemlx.runtime.caches import UNCOUNTED

    prompt = [5, 17, 3, 99, 42]
    rank, scheduler = one_at_a_time()
    counted = scheduler.run(Insert(Request(1, prompt, 4)), None)
    monkeypatch.setattr(schedulers, "counted_offset", lambda cache: UNCOUNTED)
    rank.prefix.clear()
    result = scheduler.run(Insert(Request(2, prompt, 4)), None)
    assert result.cache_tokens == counted.cache_tokens == rank.last_cache_tokens, (result, counted)
    assert [len(e.tokens) for e in rank.prefix.entries.values()] == [counted.cache_tokens]
