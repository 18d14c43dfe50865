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
