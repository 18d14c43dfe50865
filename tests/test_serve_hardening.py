"""The server under slow and hostile clients (issue 48): every wait bounded, every cap answered, the front's link
and HTTP listeners outliving floods and malformed input. All in one process, over loopback, in a few seconds."""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipemlx.serve.app import HttpThread, OncePerBurst, raise_descriptor_limit, read_capped
from pipemlx.serve.link import Acceptor, Link, check_key, connect
from pipemlx.serve.openai_api import ApiError
from pipemlx.serve.settings import HttpLimits

KEY = "a key of 128 bits at least"
FLOOD = 2100  # more than mlx-lm's descriptor limit of 2,048


# --- the link ---------------------------------------------------------------------------------------------------------


def test_a_weak_key_is_refused_with_the_reason() -> None:
    for weak in ["", "a", "x" * 15]:
        with pytest.raises(ValueError, match="needs 16 at least"):
            check_key(weak)
    check_key("x" * 16)


def test_a_malformed_message_breaks_that_link_and_says_why() -> None:
    """Not JSON, not an object, nested deeper than the parser goes, too long: the link's fault (the relay turns
    it into a group fault), never an exception in the front."""
    for data in [b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 200_000, b'{"t": 1' + b"0" * 10]:
        ours, theirs = socket.socketpair()
        sender = Link(Connection(theirs.detach()), b"k" * 32, b"j" * 32)
        link = Link(Connection(ours.detach()), b"j" * 32, b"k" * 32)
        assert sender.send_bytes(data)
        assert link.recv() is None
        assert link.broken and link.malformed is not None and "not a JSON object" in link.malformed
        sender.close()
        link.close()


async def trickle(
    address: tuple[str, int], count: int, first: bytes, every: float, hold: float
) -> list[tuple[float, bytes]]:
    """``count`` connections that send ``first`` and then a byte every ``every`` seconds, for ``hold`` seconds at
    most; for each, how long it stayed open after it connected (until the server cut it, or ``hold``) and what
    the server sent it."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def one() -> tuple[float, bytes]:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), 5.0)
        except (OSError, TimeoutError):
            return 0.0, b"(no connection)"
        connected = loop.time()
        heard = b""
        try:
            writer.write(first)
            while loop.time() - started < hold:
                try:
                    await writer.drain()
                    data = await asyncio.wait_for(reader.read(4096), every)
                    if data == b"":
                        break  # closed on us
                    heard += data
                except TimeoutError:
                    writer.write(b"x")
                except OSError:
                    break
            return loop.time() - connected, heard
        finally:
            writer.close()

    return list(await asyncio.gather(*(one() for _ in range(count))))


@pytest.fixture
def flood_client() -> Iterator[list[Any]]:
    """Run :func:`trickle` in a thread of its own (one event loop holding every raw socket); the result list."""
    results: list[Any] = []
    threads: list[threading.Thread] = []
    results.append(threads)
    yield results
    for thread in threads:
        thread.join(30.0)


def _start_flood(results: list[Any], *args: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(asyncio.run(trickle(*args))), daemon=True)
    thread.start()
    results[0].append(thread)
    return thread


def test_the_link_outlives_a_flood_of_trickling_peers(flood_client: list[Any]) -> None:
    """2,100 peers each send a frame header and then a byte now and then: each is cut at the whole handshake's
    deadline (not per read), at most the cap handshake at once, and rank 0 with the key connects meanwhile."""
    raise_descriptor_limit()
    acceptor = Acceptor("127.0.0.1", 0, KEY, handshake_s=1.0, max_handshakes=32)
    address = f"{acceptor.address[0]}:{acceptor.address[1]}"
    try:
        flood = _start_flood(flood_client, acceptor.address, FLOOD, struct.pack("!i", 1000), 0.3, 12.0)
        time.sleep(0.5)
        peak = 0
        link: Link | None = None
        deadline = time.monotonic() + 8.0
        while link is None and time.monotonic() < deadline:
            with acceptor.lock:
                peak = max(peak, len(acceptor.pending))
            try:
                link = connect(address, KEY, timeout=2.0)
            except (OSError, EOFError):
                time.sleep(0.1)  # the cap was full: rank 0 tries again (connect_retrying)
        assert link is not None, "rank 0 could not connect during the flood"
        front_end = acceptor.accepted.get(timeout=5.0)
        assert link.send({"t": "beat"}) and front_end.poll(5.0) and front_end.recv() == {"t": "beat"}
        flood.join(20.0)
        held = [h for h, _ in flood_client[1]]
        assert len(held) == FLOOD
        # The handshake's deadline is 1 s from the accept (a loaded machine may leave a peer in the backlog a while);
        # without it each would stay the flood's whole 12 s.
        assert max(held) < 6.0, f"a trickling peer stayed {max(held):.1f} s"
        assert peak <= 32
        assert acceptor.accepted.empty()  # none of them became a link
        link.close()
    finally:
        acceptor.close()


def test_the_link_keeps_accepting_after_too_many_open_files(capfd: pytest.CaptureFixture[str]) -> None:
    acceptor = Acceptor("127.0.0.1", 0, KEY)
    real = acceptor.sock
    failures = [0]

    class Exhausted:
        """The listener while the process has no descriptor left: accept fails, 10 times."""

        def accept(self) -> tuple[socket.socket, Any]:
            if failures[0] < 10:
                failures[0] += 1
                time.sleep(0.005)
                raise OSError(errno.EMFILE, "Too many open files")
            acceptor.sock = real
            return real.accept()

        def close(self) -> None:
            real.close()

    acceptor.sock = Exhausted()  # pyright: ignore[reportAttributeAccessIssue]
    try:
        while failures[0] == 0:  # the accept thread is past its last accept on the real listener
            time.sleep(0.01)
        link = connect(f"{acceptor.address[0]}:{acceptor.address[1]}", KEY, timeout=10.0)
        assert acceptor.accepted.get(timeout=5.0) is not None and failures[0] == 10
        link.close()
    finally:
        acceptor.close()
    err = capfd.readouterr().err
    assert err.count("cannot accept") == 1, err  # once per burst


class Relay:
    """A host in the path between rank 0 and the front: forwards the bytes both ways, keeps what it saw, and
    (``tamper``) flips one bit of the first long enough rank-0-to-front frame after the handshake."""

    def __init__(self, target: tuple[str, int], tamper: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.target, self.tamper = target, tamper
        self.seen = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        inside, _ = self.listener.accept()
        outside = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(outside, inside, False), daemon=True).start()
        self._pipe(inside, outside, self.tamper)

    def _pipe(self, source: socket.socket, sink: socket.socket, tamper: bool) -> None:
        while data := source.recv(65536):
            self.seen += data
            if tamper and len(data) > 100:  # a job-sized message, well past the handshake's short frames
                data = data[:50] + bytes([data[50] ^ 1]) + data[51:]
                tamper = False
            sink.sendall(data)
        sink.close()


@pytest.mark.parametrize("tamper", [False, True])
def test_a_relay_in_the_path_can_neither_read_nor_change_a_message(tamper: bool) -> None:
    acceptor = Acceptor("127.0.0.1", 0, KEY)
    relay = Relay(acceptor.address, tamper)
    try:
        link = connect(f"{relay.address[0]}:{relay.address[1]}", KEY, timeout=5.0)
        front_end = acceptor.accepted.get(timeout=5.0)
        secret = {"t": "token", "id": 1, "token": 4242, "text": "the prompt's secret words " * 4}
        assert link.send(secret) and front_end.poll(5.0)
        received = front_end.recv()
        assert b"secret words" not in relay.seen and b"4242" not in relay.seen  # sealed on the wire
        if tamper:  # changed undetected: never; the front counts the link as broken (a fault)
            assert received is None and front_end.broken
            assert front_end.malformed is not None and "fails authentication" in front_end.malformed
        else:
            assert received == secret
            assert front_end.send({"t": "beat"}) and link.poll(5.0) and link.recv() == {"t": "beat"}
        link.close()
    finally:
        acceptor.close()


def test_a_replayed_or_reordered_message_is_refused() -> None:
    ours, theirs = socket.socketpair()
    wire: Connection[Any, Any] = Connection(theirs.detach())
    sender = Link(Connection(os.dup(wire.fileno())), b"k" * 32, b"j" * 32)
    receiver = Link(Connection(ours.detach()), b"j" * 32, b"k" * 32)
    assert sender.send({"t": "beat", "n": 0}) and sender.send({"t": "beat", "n": 1})
    first = receiver.connection.recv_bytes()
    second = receiver.connection.recv_bytes()
    wire.send_bytes(second)  # out of order: the second message where the first is due
    assert receiver.recv() is None and receiver.broken
    fresh = Link(Connection(os.dup(receiver.connection.fileno())), b"j" * 32, b"k" * 32)
    wire.send_bytes(first)
    assert fresh.recv() == {"t": "beat", "n": 0}
    wire.send_bytes(first)  # the same message again
    assert fresh.recv() is None and fresh.malformed is not None


# --- HTTP -------------------------------------------------------------------------------------------------------------


def _app(body_timeout: float) -> Starlette:
    async def echo(request: Request) -> Response:
        try:
            raw = await read_capped(request, 1 << 20, body_timeout)
        except ApiError as error:
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        return JSONResponse({"got": len(raw)})

    return Starlette(routes=[Route("/echo", echo, methods=["POST"])])


@pytest.fixture
def server() -> Iterator[HttpThread]:
    limits = HttpLimits(header_timeout=1.0, body_timeout=1.0, idle_timeout=30, max_connections=1000)
    thread = HttpThread(_app(limits.body_timeout), "127.0.0.1", 0, limits)
    assert thread.start()
    yield thread
    thread.stop()


def _post(port: int, body: bytes = b"{}") -> tuple[int, bytes]:
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        client.request("POST", "/echo", body=body)
        response = client.getresponse()
        return response.status, response.read()
    finally:
        client.close()


def _cut_after(sock: socket.socket, trickle: bytes, every: float, limit: float) -> float:
    """Send ``trickle`` a byte every ``every`` seconds; seconds until the server closed the connection."""
    started = time.monotonic()
    sock.settimeout(every)
    for byte in trickle * 100:
        if time.monotonic() - started > limit:
            break
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - started
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return time.monotonic() - started
    return time.monotonic() - started


def test_the_header_deadline_holds_for_every_request_on_a_kept_alive_connection(server: HttpThread) -> None:
    """uvicorn's keep-alive timeout stops at the first byte: a second request trickling its headers held the
    connection for good. Now it is closed ``--header-timeout`` after the first answer."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    first = sock.recv(4096)
    assert first.startswith(b"HTTP/1.1 200"), first
    took = _cut_after(sock, b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ", 0.2, 6.0)
    assert took < 2.5, f"the second request's headers were trickled for {took:.1f} s"
    sock.close()


def test_a_body_that_trickles_gets_408(server: HttpThread) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    started = time.monotonic()
    answer = b""
    sock.settimeout(0.2)
    while time.monotonic() - started < 5.0 and b"\r\n\r\n" not in answer:
        try:
            answer += sock.recv(4096)
        except TimeoutError:
            sock.sendall(b" ")
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 2.5
    sock.close()


def test_connections_past_the_cap_get_503_and_the_flood_passes(server: HttpThread, flood_client: list[Any]) -> None:
    """2,100 connections trickling their headers: the first 1,000 are held until the header deadline, the rest are
    answered 503 at once; a client meanwhile gets its answers (trying again after a 503), and once the flood's
    deadlines passed every connection is gone."""
    raise_descriptor_limit()
    flood = _start_flood(flood_client, ("127.0.0.1", server.port), FLOOD, b"POST /echo HTTP/1.1\r\n", 0.3, 12.0)
    time.sleep(0.3)
    statuses: list[int] = []
    deadline = time.monotonic() + 8.0
    answered = 0
    while answered < 3 and time.monotonic() < deadline:
        try:
            status, body = _post(server.port, b'{"n": 1}')
        except OSError:  # refused before the request was all sent (the 503 and the close came first)
            status, body = 0, b""
        statuses.append(status)
        if status == 200:
            assert json.loads(body) == {"got": 8}
            answered += 1
        else:
            assert status == 0 or (status == 503 and json.loads(body)["error"]["code"] == "too_many_connections")
            time.sleep(0.1)
    assert answered == 3, statuses
    flood.join(20.0)
    held = [h for h, _ in flood_client[1]]
    assert len(held) == FLOOD and max(held) < 6.0, max(held)  # the header deadline is 1 s (else: 12 s)
    refused = [heard for _, heard in flood_client[1] if heard.startswith(b"HTTP/1.1 503")]
    # Past the cap: answered 503. On a slow machine the flood takes longer than the 1 s header deadline to open,
    # and slots the deadline frees take later flood connections in (then cut in their turn): about 1,020 of the
    # 1,100 past the cap were refused in such a run, so the bound is half of them (none without a cap).
    assert len(refused) >= (FLOOD - 1000) // 2, len(refused)
    assert b"too_many_connections" in refused[0]
    assert _post(server.port) == (200, b'{"got":2}')


def test_repeated_loop_errors_are_logged_once_per_burst(capsys: pytest.CaptureFixture[str]) -> None:
    handler = OncePerBurst(60.0)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(1000):
            handler(loop, {"message": "socket.accept() out of system resource", "exception": OSError(24, "EMFILE")})
    finally:
        loop.close()
    err = capsys.readouterr().err
    assert err.count("socket.accept()") == 1, err


def test_the_descriptor_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))  # what mlx-lm sets on import
        assert raise_descriptor_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(hard, soft)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


# --- what clients share -----------------------------------------------------------------------------------------------


def test_json_nested_too_deep_or_a_huge_number_gets_400() -> None:
    from starlette.testclient import TestClient

    from pipemlx.serve.app import Api
    from pipemlx.serve.book import Book
    from pipemlx.serve.settings import ServeSettings

    settings = ServeSettings(model_id="m", http=HttpLimits(api_key="key-a,key-b"))
    client = TestClient(Api(Book(settings, None), None, settings, None).app(), raise_server_exceptions=False)
    for body in [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"]:
        for key in ["key-a", "key-b"]:  # either of the server's keys is let in
            reply = client.post("/v1/completions", content=body, headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 400, reply.text
            assert "not valid JSON" in reply.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"{}", headers={"Authorization": "Bearer key"}).status_code == 401


def test_the_prefix_cache_reuses_only_its_own_partition() -> None:
    from pipemlx.serve.prefix_cache import PrefixCache

    cache = PrefixCache(1000, cut_back=False)
    prompt = list(range(10))
    assert cache.store(prompt, [], "alice")
    assert cache.plan([*prompt, 99], "alice").reuse == 10
    assert cache.plan([*prompt, 99], "").reuse == 0 and cache.plan([*prompt, 99], "bob").reuse == 0
    assert cache.store(prompt, [], "bob")  # the same tokens in another partition: kept apart, not merged
    assert len(cache.entries) == 2
    assert cache.store([*prompt, 5], [], "alice")  # extends alice's own entry only
    assert sorted(e.partition for e in cache.entries.values()) == ["alice", "bob"]


def test_the_api_key_comes_from_a_file_not_the_command_line(tmp_path: Any) -> None:
    import argparse

    from pipemlx.cli.serve import api_key

    path = tmp_path / "key"
    path.write_text("sk-from-file,sk-second\nignored\n")
    assert api_key(argparse.Namespace(api_key=None, api_key_file=path)) == "sk-from-file,sk-second"
    assert api_key(argparse.Namespace(api_key="sk-arg", api_key_file=None)) == "sk-arg"
    (tmp_path / "empty").write_text("\n")
    for bad, words in [(tmp_path / "empty", "holds no key"), (tmp_path / "none", "cannot read")]:
        with pytest.raises(SystemExit, match=words):
            api_key(argparse.Namespace(api_key=None, api_key_file=bad))


@pytest.mark.parametrize("report", [True, False])
def test_no_cached_tokens_reports_zero(report: bool) -> None:
    """``--no-cached-tokens``: the usage says 0 cached tokens whatever the ranks reused (else what they said)."""
    from pipemlx.demo import MODEL_DIR
    from pipemlx.models.loading import load_tokenizer_of
    from pipemlx.serve.book import Book, Event, Ticket
    from pipemlx.serve.relay import Relay
    from pipemlx.serve.requests import Request, RequestResult, to_json
    from pipemlx.serve.settings import ServeSettings

    tokenizer = load_tokenizer_of(MODEL_DIR)
    book = Book(ServeSettings("pipemlx-demo", http=HttpLimits(report_cached_tokens=report)), tokenizer, [4, 4])
    relay = Relay(book, 1.0)
    loop = asyncio.new_event_loop()
    try:
        prompt = list(tokenizer.encode("Mr. Bingley was"))
        job = Ticket(Request(1, prompt, 1), "completion", 0, loop, asyncio.Queue(), stream=False)
        book.start(job)
        relay._handle({"t": "admitted", "id": 1, "cached": len(prompt) - 1})  # pyright: ignore[reportPrivateUsage]
        relay._handle({"t": "token", "id": 1, "token": prompt[0]})  # pyright: ignore[reportPrivateUsage]
        ended = {"t": "ended", "id": 1, "result": to_json(RequestResult("length", len(prompt) - 1, 1, 1))}
        relay._handle(ended)  # pyright: ignore[reportPrivateUsage]
        loop.run_until_complete(asyncio.sleep(0))
        events: list[Event] = []
        while not job.events.empty():
            events.append(job.events.get_nowait())
        (last,) = [e for e in events if e.kind == "done"]
        assert last.usage is not None
        cached = last.usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == (len(prompt) - 1 if report else 0)
    finally:
        loop.close()


def test_ranks_that_cannot_be_started_are_faults_counted_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ports (``free_ports`` raising under a flood of connections), no processes: each start that fails is a
    fault, retried after a pause; past ``--max-restarts`` the front gives up with status 1 (answering 503 with
    why), never an exception out of the front."""
    from pathlib import Path

    from pipemlx.serve import supervisor
    from pipemlx.serve.book import Book
    from pipemlx.serve.settings import ProcessControl, RankOptions, ServeSettings

    attempts: list[float] = []

    def no_ports(*args: Any, **kwargs: Any) -> None:
        attempts.append(time.monotonic())
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(supervisor, "spawn_ranks", no_ports)
    monkeypatch.setattr(supervisor, "RESPAWN_PAUSE_S", 0.05)
    settings = ServeSettings("m", process=ProcessControl(fault_grace=0.1))
    book = Book(settings, None)
    options = supervisor.FrontOptions(RankOptions(Path("/nowhere"), settings), ranks=2, max_restarts=3)
    assert supervisor.Supervisor(book, options).run() == 1
    assert len(attempts) == 4  # the first start and 3 restarts, each a fault
    assert book.status == "failed" and "could not be started" in str(book.fault)
