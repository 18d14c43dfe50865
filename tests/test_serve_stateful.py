"""A stateful property test through a live `pipemlx serve --ranks 2`, and its graceful stop.

:class:`ServerMachine` is a hypothesis ``RuleBasedStateMachine`` whose rules go through the whole server
(HTTP, queue, rank 0's loop, the broadcast, rank 1, the prefix cache): chat and completion requests,
streamed or not, with stop strings cut from the expected answer, prompts that extend earlier ones (a reused
prefix); clients hanging up before the first token, mid-stream, during a whole answer and while queued;
malformed and oversized bodies; wrong keys. After every step: every greedy answer that finished equals one
process running mlx-lm on the same tokens (text, finish reason, token count), no answer was a 5xx, nothing
runs or waits once the clients are gone, and the prefix cache holds no more than its budget. It is not
derandomized (the default profile draws new sequences each run). This file runs it at
``--decode-concurrency 1``; ``tests/test_serve_limits.py`` runs it at 4.

The graceful stop test then sends SIGTERM to the same server while a request streams.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from hypothesis_profiles import PROFILE
from serve_process import ServeProcess, serving
from test_serve import MODEL, Reference

pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")

pytestmark = pytest.mark.timeout(240)

KEY = "sk-pipemlx-stateful"
BODY_CAP = 65536
PREFIX_BYTES = "0.25M"  # about 128 tokens: entries are evicted during the run
LONG = 200  # max_tokens of a request that occupies a slot until its client leaves
THOROUGH = PROFILE == "thorough"  # HYPOTHESIS_PROFILE=thorough: longer runs by hand; the default keeps the suite fast
STEPS = 15 if THOROUGH else 6
EXAMPLES = 25 if THOROUGH else 3
LIMIT_ARGS = ("--max-body-bytes", str(BODY_CAP), "--max-tokens-limit", "256", "--prompt-cache-bytes", PREFIX_BYTES)
BASES = ["It is a truth universally acknowledged", "Elizabeth walked on, and", "Mr. Darcy said", "Café ñandú 😀"]
EXTENSIONS = ["", " that a single man", ", and Jane", " in possession of a good fortune", " — naïve"]


class Raw:
    """One HTTP request on a raw socket, so that a test can hang up at any byte."""

    def __init__(self, port: int, path: str, body: bytes, key: str | None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60.0)
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
        head += [f"Content-Length: {len(body)}"] + ([f"Authorization: Bearer {key}"] if key else [])
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.received = b""

    def read_until(self, marker: bytes, count: int = 1) -> bytes:
        """Read until ``marker`` has come ``count`` times, or the server closed the connection."""
        while self.received.count(marker) < count:
            data = self.sock.recv(65536)
            if not data:
                break
            self.received += data
        return self.received

    def status(self) -> int:
        head = self.read_until(b"\r\n")
        return int(head.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


def json_body(value: Any) -> bytes:
    return json.dumps(value).encode()


class ServerMachine(RuleBasedStateMachine):
    """Requests and hang-ups through one live server; see the module's docstring. Configured by :func:`run_machine`."""

    server: ServeProcess
    ref: Reference
    concurrency: int
    key: str
    answers: dict[tuple[tuple[int, ...], int], list[int]]

    def __init__(self) -> None:
        super().__init__()
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key=self.key, max_retries=0, timeout=120.0)
        self.prompts: list[str] = []
        self.statuses: list[int] = []

    # --- what a request should get ----------------------------------------------------------------------------------

    def solo(self, tokens: list[int], max_tokens: int) -> list[int]:
        key = (tuple(tokens), max_tokens)
        if key not in self.answers:
            self.answers[key] = self.ref.generate(tokens, max_tokens)
        return self.answers[key]

    def prompt(self, base: str, extension: str, reuse: bool) -> str:
        text = (self.prompts[-1] if reuse and self.prompts else base) + extension
        self.prompts.append(text)
        return text

    # --- rules --------------------------------------------------------------------------------------------------------

    REQUEST = {
        "stream": st.booleans(),
        "base": st.sampled_from(BASES),
        "extension": st.sampled_from(EXTENSIONS),
        "reuse": st.booleans(),
        "max_tokens": st.integers(1, 8),
        "stop": st.none() | st.tuples(st.integers(0, 30), st.integers(1, 3)),
    }

    @rule(**REQUEST)
    def chat_request(self, **kwargs: Any) -> None:
        self.request(chat=True, **kwargs)

    @rule(**REQUEST)
    def completion_request(self, **kwargs: Any) -> None:
        self.request(chat=False, **kwargs)

    def request(
        self, chat: bool, stream: bool, base: str, extension: str, reuse: bool, max_tokens: int,
        stop: tuple[int, int] | None,
    ) -> None:  # fmt: skip
        """A greedy request, streamed or not, maybe extending the last prompt (a reused prefix), maybe with a
        stop string cut from its expected answer; the answer must equal one process's on the same tokens."""
        text = self.prompt(base, extension, reuse)
        messages = [{"role": "user", "content": text}]
        tokens = self.ref.chat_tokens(messages) if chat else self.ref.text_tokens(text)
        generated = self.solo(tokens, max_tokens)
        full = self.ref.text(generated)
        stops = [full[stop[0] : stop[0] + stop[1]]] if stop is not None and stop[0] < len(full) else []
        expected = full[: full.find(stops[0])] if stops else full
        finish = "stop" if stops or generated[-1] in self.ref.eos else "length"
        kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stop": stops or None}
        if chat:
            kwargs["messages"] = messages
        else:
            kwargs["prompt"] = text
        endpoint = self.client.chat.completions if chat else self.client.completions
        try:
            if stream:
                answer, reason, count = self._stream(endpoint.create(stream=True, stream_options={"include_usage": True}, **kwargs), chat)  # type: ignore[call-overload]  # fmt: skip
            else:
                response = endpoint.create(**kwargs)  # type: ignore[call-overload]
                choice = response.choices[0]
                answer = choice.message.content if chat else choice.text
                reason, count = choice.finish_reason, response.usage.completion_tokens
        except openai.APIStatusError as exc:
            self.statuses.append(exc.status_code)
            assert exc.status_code == 429, exc  # the only refusal a well-formed request may get here
            return
        self.statuses.append(200)
        assert answer == expected, (answer, expected, tokens, stops)
        assert reason == finish
        if not stops:
            assert count == len(generated)

    def _stream(self, chunks: Any, chat: bool) -> tuple[str, str | None, int]:
        pieces: list[str] = []
        finish, count = None, -1
        for chunk in chunks:
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
            for choice in chunk.choices:
                pieces.append((choice.delta.content if chat else choice.text) or "")
                finish = choice.finish_reason or finish
        return "".join(pieces), finish, count

    @rule(
        where=st.sampled_from(["before the first token", "mid-stream", "during a whole answer"]),
        base=st.sampled_from(BASES),
        chat=st.booleans(),
    )
    def hang_up(self, where: str, base: str, chat: bool) -> None:
        """A client that leaves part-way: its request stops on every rank, the next ones are exact."""
        stream = where != "during a whole answer"
        body: dict[str, Any] = {"max_tokens": 40, "temperature": 0, "stream": stream}
        body.update({"messages": [{"role": "user", "content": base}]} if chat else {"prompt": base})
        raw = Raw(self.server.port, "/v1/chat/completions" if chat else "/v1/completions", json_body(body), self.key)
        try:
            if where == "mid-stream":
                raw.read_until(b"data: ", 3)
            elif where == "during a whole answer":
                time.sleep(0.05)
        finally:
            raw.close()

    @rule(chat=st.booleans())
    def hang_up_while_queued(self, chat: bool) -> None:
        """Fill every slot, queue one more, hang it up, then hang up the rest."""
        occupants: list[Raw] = []
        try:
            for i in range(self.concurrency):  # one at a time: a burst could overflow a small queue (429)
                occupants.append(self._long(f"Occupant {i} said"))
                self.server.wait_for("a slot to run", lambda: len(self.server.health()["running"]) > i)
            body: dict[str, Any] = {"max_tokens": 4}
            body.update({"messages": [{"role": "user", "content": "Queued"}]} if chat else {"prompt": "Queued"})
            queued = Raw(
                self.server.port, "/v1/chat/completions" if chat else "/v1/completions", json_body(body), self.key
            )
            self.server.wait_for("the request to queue", lambda: self.server.health()["queue"]["waiting"] >= 1)
            queued.close()
        finally:
            for raw in occupants:
                raw.close()

    def _long(self, prompt: str) -> Raw:
        body = {"prompt": prompt, "max_tokens": LONG, "temperature": 0}
        return Raw(self.server.port, "/v1/completions", json_body(body), self.key)

    @rule(
        body=st.binary(max_size=40) | st.just(b"{") | st.just(b'{"prompt": "x", "max_tokens": 1}' + b" " * BODY_CAP),
        chat=st.booleans(),
    )
    def malformed(self, body: bytes, chat: bool) -> None:
        """Bytes that are not a request (or too many of them): 400 or 413, never a 5xx."""
        raw = Raw(self.server.port, "/v1/chat/completions" if chat else "/v1/completions", body, self.key)
        try:
            status = raw.status()
        finally:
            raw.close()
        self.statuses.append(status)
        assert status == (413 if len(body) > BODY_CAP else 400), (status, body[:60])

    @rule(
        key=st.none()
        | st.from_regex(r"[A-Za-z0-9_.~+/=-]{1,40}", fullmatch=True).filter(lambda k: not k.startswith("sk-pipemlx"))
    )
    def wrong_key(self, key: str | None) -> None:
        """A missing or wrong key: 401, before anything is read or queued."""
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        response = httpx.post(self.server.url + "/v1/completions", json={"prompt": "Hi"}, headers=headers, timeout=30.0)
        self.statuses.append(response.status_code)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"

    # --- invariants ---------------------------------------------------------------------------------------------------

    @invariant()
    def no_server_error(self) -> None:
        assert all(s < 500 for s in self.statuses), self.statuses

    @invariant()
    def nothing_left_running_and_the_cache_within_budget(self) -> None:
        health = self.server.wait_for(
            "nothing running or waiting",
            lambda: (h := self.server.health())["queue"]["waiting"] == 0 and not h["running"] and h,
            timeout=60.0,
        )
        prefix = health["prefix_cache"]
        assert prefix["tokens"] <= prefix["budget_tokens"], prefix
        assert health["open_streams"] == 0


def run_machine(server: ServeProcess, ref: Reference, concurrency: int, key: str = KEY) -> None:
    """Run :class:`ServerMachine` against ``server`` (``EXAMPLES`` sequences of up to ``STEPS`` steps)."""
    machine = type(
        f"ServerMachineAt{concurrency}",
        (ServerMachine,),
        {"server": server, "ref": ref, "concurrency": concurrency, "key": key, "answers": {}},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serving("--api-key", KEY, "--decode-concurrency", "1", "--max-queue", "4", *LIMIT_ARGS) as process:
        yield process


def test_requests_and_hang_ups_through_the_server_one_at_a_time(server: ServeProcess, ref: Reference) -> None:
    run_machine(server, ref, 1)


def test_sigterm_finishes_the_running_request_refuses_new_ones_and_exits_0(
    server: ServeProcess, ref: Reference
) -> None:
    """SIGTERM mid-stream: the stream ends normally and exactly, a new request gets 503, every rank exits 0,
    and the port can be bound again at once."""
    prompt = "It is a truth universally acknowledged"
    expected = ref.answer(ref.text_tokens(prompt), 40)
    lines: list[str] = []

    def read() -> None:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60.0
        ) as response:
            lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    server.wait_for("the request to decode", lambda: (server.health()["active"] or {}).get("generated_tokens", 0) > 0)
    server.proc.send_signal(signal.SIGTERM)
    late = server.wait_for(
        "a 503 for new requests",
        lambda: (r := httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, headers=server.headers,
                                 timeout=10.0)).status_code == 503 and r,
    )  # fmt: skip
    assert late.json()["error"]["code"] == "shutting_down"
    assert httpx.get(server.url + "/health", timeout=10.0).status_code == 503
    reader.join(60.0)
    assert not reader.is_alive()
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30.0) == 0, server.stderr()[-3000:]
    for pid in server.rank_pids:
        assert not alive(pid), f"rank pid {pid} still runs"
    with socket.socket() as again:  # as uvicorn binds: SO_REUSEADDR, so connections in TIME_WAIT do not block
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", server.port))
        again.listen()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
