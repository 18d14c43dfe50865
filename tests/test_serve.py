"""`pipemlx serve --ranks 2` on the demo model, driven by the real `openai` client and by raw HTTP (httpx).

One server serves most tests (module fixture); the fault tests start their own. Every answer is checked
against one process running mlx-lm on the whole model with the same prompt tokens (greedy, or the same
seed), so a wrong token, a lost or mixed-up request, or ranks stopping at different points fail a test.
Every wait is bounded, and the server (supervisor and every rank) is always stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest
from fakes import HELIUM_TIED
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load
from serve_process import ServeProcess, serving
from test_mpi import MPI_OPTIONS, require_mpi

from pipemlx import cli
from pipemlx.cli.common import default_step_size
from pipemlx.demo import MODEL_DIR, book_text
from pipemlx.testing import build_model, save_model_dir, tiny_config

pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")

pytestmark = pytest.mark.timeout(240)

KEY = "sk-pipemlx-test"
MODEL = "pipemlx-demo"
MAX_QUEUE = 16
AUTH = {"Authorization": f"Bearer {KEY}"}


class Reference:
    """One process, the whole demo model, mlx-lm's own generate_step: what every answer must equal."""

    def __init__(self, path: Path = MODEL_DIR) -> None:
        self.model, self.tokenizer = load(str(path))
        self.eos = set(self.tokenizer.eos_token_ids)

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def text_tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        temp: float = 0.0,
        seed: int | None = None,
        penalties: dict[str, float] | None = None,
        **sampling: float,
    ) -> list[int]:
        """The tokens generated (up to and including an end-of-sequence token); ``penalties``: make_logits_processors';
        ``sampling``: make_sampler's ``top_p``, ``min_p``, ``top_k``."""
        if seed is not None:
            mx.random.seed(seed)
        out: list[int] = []
        for token, _ in generate_step(
            mx.array(prompt),
            self.model,
            max_tokens=max_tokens,
            sampler=make_sampler(temp, **sampling),  # pyright: ignore[reportArgumentType]
            logits_processors=make_logits_processors(**penalties) if penalties else None,
            prefill_step_size=default_step_size(len(prompt), 2),
        ):
            out.append(int(token))
            if token in self.eos:
                break
        return out

    def text(self, tokens: list[int]) -> str:
        detokenizer = self.tokenizer.detokenizer
        for t in tokens:
            if t in self.eos:
                break
            detokenizer.add_token(t)
        detokenizer.finalize()
        return detokenizer.text

    def answer(self, prompt: list[int], max_tokens: int, **kwargs: Any) -> str:
        return self.text(self.generate(prompt, max_tokens, **kwargs))


BROWSER_ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serving("--max-queue", str(MAX_QUEUE), "--api-key", KEY, "--allowed-origins", BROWSER_ORIGIN) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120.0)


def last_record(server: ServeProcess, seq: int | None = None, request_id: str | None = None) -> dict[str, Any]:
    """/health's record of request ``seq`` or ``request_id`` (default: the latest), once every rank finished it.

    A request a client hung up on is recorded when the ranks have stopped it, a moment after the client
    left: with ``request_id`` this waits for that record instead of taking the previous one.
    """

    def check() -> dict[str, Any] | None:
        health = server.health()
        records = health["recent"]
        if request_id is not None:
            record = next((r for r in records if r["id"] == request_id), None)
        else:
            record = records[-1] if seq is None and records else next((r for r in records if r["seq"] == seq), None)
        if record is None or any(r["last_request"] != record["seq"] for r in health["rank_status"]):
            return None
        return {**record, "rank_status": health["rank_status"]}

    return server.wait_for(f"the record of request {seq if seq is not None else '(latest)'}", check)


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)  # pyright: ignore


def stream_text(stream: Any, kind: str = "chat") -> tuple[str, str | None, Any]:
    """Join a stream's text; return it with the finish reason and the usage chunk's usage."""
    pieces: list[str] = []
    finish, usage = None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            pieces.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


# --- answers equal one process ------------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "It is a truth universally acknowledged."},
    {"role": "user", "content": "Do you like to dance, Mr. Darcy?"},
]


def test_models_and_health(server: ServeProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("some/other-model")
    health = server.health()
    assert health["status"] == "ready" and health["model"] == MODEL
    assert health["ranks"] == 2 and health["split"] == [4, 4]
    assert [r["layers"] for r in health["rank_status"]] == [[0, 3], [4, 7]]
    assert all(isinstance(r["pid"], int) and r["pid"] > 0 for r in health["rank_status"])
    assert health["queue"] == {"waiting": 0, "max": MAX_QUEUE}
    assert health["last_fault"] is None and health["prefix_cache"]["budget_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_greedy_equals_one_process(
    server: ServeProcess, client: openai.OpenAI, ref: Reference, stream: bool
) -> None:
    prompt = ref.chat_tokens(CHAT)
    expected_tokens = ref.generate(prompt, 30)
    expected = ref.text(expected_tokens)
    if stream:
        text, finish, usage = stream_text(
            chat(client, CHAT, max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True})
        )
    else:
        response = chat(client, CHAT, max_tokens=30, temperature=0)
        text, finish, usage = response.choices[0].message.content, response.choices[0].finish_reason, response.usage
        assert response.model == MODEL and response.object == "chat.completion"
    assert text == expected
    assert finish == "length" and len(expected_tokens) == 30
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 30
    assert usage.total_tokens == len(prompt) + 30


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_greedy_equals_one_process(
    server: ServeProcess, client: openai.OpenAI, ref: Reference, stream: bool
) -> None:
    prompt_text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    prompt = ref.text_tokens(prompt_text)
    expected = ref.answer(prompt, 25)
    if stream:
        text, finish, _ = stream_text(
            client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=25, temperature=0, stream=True),
            kind="completion",
        )
    else:
        response = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=25, temperature=0)
        text, finish = response.choices[0].text, response.choices[0].finish_reason
        assert response.usage is not None and response.usage.prompt_tokens == len(prompt)
    assert text == expected and finish == "length"


def test_seeded_sampling_repeats_and_equals_one_process(client: openai.OpenAI, ref: Reference) -> None:
    prompt_text = "Elizabeth walked on, and"
    prompt = ref.text_tokens(prompt_text)
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt_text, "max_tokens": 24, "temperature": 1.0}
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    again = client.completions.create(seed=1234, **kwargs).choices[0].text
    other = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert first == again
    assert first == ref.answer(prompt, 24, temp=1.0, seed=1234)
    assert other == ref.answer(prompt, 24, temp=1.0, seed=4321) and other != first


def test_top_p_samples_as_mlx_lm_does(client: openai.OpenAI, ref: Reference) -> None:
    """``top_p`` below 1 at a temperature where it changes the answer: the tokens of mlx-lm's make_sampler with the
    same seed (a sampler that drops top_p, or applies it after the temperature, gives other tokens)."""
    prompt_text = "Elizabeth walked on, and"
    prompt = ref.text_tokens(prompt_text)
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt_text, "max_tokens": 24, "temperature": 0.5, "seed": 7}
    expected = ref.answer(prompt, 24, temp=0.5, seed=7, top_p=0.5)
    assert expected != ref.answer(prompt, 24, temp=0.5, seed=7), "top_p does not matter at this pair: pick another"
    assert client.completions.create(top_p=0.5, **kwargs).choices[0].text == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_end_the_answer(client: openai.OpenAI, ref: Reference, stream: bool) -> None:
    full = ref.answer(ref.chat_tokens(CHAT), 40)
    stops = ['"', "dance"]
    cut = min(i for i in (full.find(s) for s in stops) if i >= 0)  # the greedy answer holds a quotation mark
    if stream:
        text, finish, _ = stream_text(chat(client, CHAT, max_tokens=40, temperature=0, stop=stops, stream=True))
    else:
        response = chat(client, CHAT, max_tokens=40, temperature=0, stop=stops)
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
    assert text == full[:cut] and finish == "stop"


# --- many clients -------------------------------------------------------------------------------------------------


def test_sixteen_concurrent_clients_each_get_their_own_answer(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    prompts = ["Mr. Bingley", "Lady Catherine", "Mrs. Bennet said", "Jane smiled and"]
    alone = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in prompts
    }
    for p in prompts:
        assert alone[p] == ref.answer(ref.text_tokens(p), 12)
    served_before = server.health()["requests"]["served"]

    def ask(i: int) -> tuple[str, str, str]:
        p = prompts[i % len(prompts)]
        if i % 2:
            text, _, _ = stream_text(
                client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True),
                kind="completion",
            )
            return p, text, "stream"
        response = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        return p, response.choices[0].text, response.id

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert len(answers) == 16
    for p, text, _ in answers:
        assert text == alone[p], (p, text, alone[p])
    ids = [i for _, _, i in answers if i != "stream"]
    assert len(set(ids)) == len(ids) == 8
    assert server.health()["requests"]["served"] == served_before + 16


def test_a_full_queue_answers_429_and_the_next_request_is_exact(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    body = {"model": MODEL, "prompt": "It is a truth", "max_tokens": 400, "temperature": 0, "stream": True}

    async def flood() -> tuple[list[int], list[dict[str, Any]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60.0, headers=AUTH, limits=limits) as http:
            requests = [http.build_request("POST", server.url + "/v1/completions", json=body) for _ in range(24)]
            responses = await asyncio.gather(*(http.send(r, stream=True) for r in requests))
            bodies = [json.loads(await r.aread()) for r in responses if r.status_code == 429]
            for r in responses:
                await r.aclose()  # the accepted ones hang up: cancelled, waiting or running
            return [r.status_code for r in responses], bodies

    statuses, bodies = asyncio.run(flood())
    assert set(statuses) == {200, 429}
    assert statuses.count(200) in (MAX_QUEUE, MAX_QUEUE + 1), statuses  # waiting, plus maybe the running one
    for error in bodies:
        assert error["error"]["code"] == "rate_limit_exceeded" and "queue is full" in error["error"]["message"]
        assert error["error"]["type"] == "requests"
    server.wait_for(
        "the hung-up requests to be dropped",
        lambda: (h := server.health())["queue"]["waiting"] == 0 and h["active"] is None,
        timeout=60.0,
    )
    answer = client.completions.create(model=MODEL, prompt="Mr. Darcy bowed", max_tokens=12, temperature=0)
    assert answer.choices[0].text == ref.answer(ref.text_tokens("Mr. Darcy bowed"), 12)


# --- the prefix cache ---------------------------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.25}


def ask_penalized(client: openai.OpenAI, prompt: str, max_tokens: int) -> Any:
    """A greedy completion with PENALTIES (repetition_penalty is mlx-lm's server's own field: sent as extra_body)."""
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"],
        extra_body={"repetition_penalty": PENALTIES["repetition_penalty"]},
    )


def test_penalties_equal_one_process_with_mlx_lm_processors_also_on_a_reused_prefix(
    client: openai.OpenAI, ref: Reference
) -> None:
    prompt_text = "Mr. Darcy looked at her for a moment, and then"
    prompt = ref.text_tokens(prompt_text)
    expected = ref.answer(prompt, 30, penalties=PENALTIES)
    assert expected != ref.answer(prompt, 30), "the penalties change nothing: the test loses its power"
    first = ask_penalized(client, prompt_text, 30)
    assert first.choices[0].text == expected
    # The same prompt again: all but its last token come from the prefix cache, which the penalties must see.
    again = ask_penalized(client, prompt_text, 30)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert again.choices[0].text == expected


def test_top_k_one_samples_the_greedy_answer_and_unsupported_fields_are_named(
    client: openai.OpenAI, server: ServeProcess, ref: Reference
) -> None:
    """mlx_lm.server's request fields: ``top_k: 1`` at temperature 1 leaves one token to draw, the greedy one; a
    field pipemlx cannot honour is a 400 naming it, never ignored."""
    prompt_text = "Elizabeth looked at him"
    expected = ref.answer(ref.text_tokens(prompt_text), 24)
    sampled = client.completions.create(
        model=MODEL, prompt=prompt_text, max_tokens=24, temperature=1.0, extra_body={"top_k": 1, "min_p": 0.0}
    )
    assert sampled.choices[0].text == expected
    wide = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=24, temperature=1.0, seed=3)
    assert wide.choices[0].text != expected, "temperature 1 gives the greedy answer anyway: the test loses its power"
    for field, value in (("xtc_probability", 0.5), ("tools", [{"type": "function"}]), ("adapters", "x")):
        body = {"model": MODEL, "prompt": prompt_text, field: value}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


def test_second_turn_prefills_only_its_new_tokens(server: ServeProcess, client: openai.OpenAI, ref: Reference) -> None:
    turn1 = [
        {"role": "system", "content": "Netherfield Park is let at last."},
        {"role": "user", "content": "Who has taken it?"},
    ]
    prompt1 = ref.chat_tokens(turn1)
    generated1 = ref.generate(prompt1, 16)
    first = chat(client, turn1, max_tokens=16, temperature=0)
    assert first.choices[0].message.content == ref.text(generated1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content}]
    turn2.append({"role": "user", "content": "Is he married or single?"})
    prompt2 = ref.chat_tokens(turn2)
    # What the cache holds after turn 1 (its prompt and every generated token) that turn 2's rendering shares.
    expected_cached = min(common_prefix(prompt1 + generated1, prompt2), len(prompt2) - 1)
    assert expected_cached >= len(prompt1)
    second = chat(client, turn2, max_tokens=16, temperature=0)
    usage = second.usage
    assert usage.prompt_tokens == len(prompt2)
    assert usage.prompt_tokens_details.cached_tokens == expected_cached
    record = last_record(server, request_id=second.id)
    assert record["id"] == second.id
    assert record["cached_tokens"] == expected_cached
    assert record["prefilled_tokens"] == len(prompt2) - expected_cached
    assert second.choices[0].message.content == ref.answer(prompt2, 16)  # equals a cold run


def test_a_hybrid_model_on_three_ranks_reuses_the_conversation(tmp_path: Path) -> None:
    """lfm2 at S=3: rank 1 holds only convolution layers, whose caches count no positions and cannot be cut back.

    Every rank must still keep the same prefix-cache entries (rank 1 used to keep none, so the next turn failed
    with 'ranks disagree on cache_offset'), and entries are reused only as exact prefixes.
    """
    config = tiny_config("lfm2")
    path = save_model_dir(build_model(config), config, tmp_path / "lfm2")
    ref = Reference(path)
    prompt = list(range(5, 45))
    cached: list[int] = []
    with serving("--model", str(path), ranks=3) as process:
        for _ in range(3):
            body = {"model": "lfm2", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            reply = httpx.post(process.url + "/v1/completions", json=body, timeout=60.0)
            assert reply.status_code == 200, reply.text
            generated = ref.generate(prompt, 6)
            assert reply.json()["choices"][0]["text"] == ref.text(generated)
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            prompt = [*prompt, *generated, 9, 10]
    assert cached == [0, 46, 54], cached  # each turn reuses the whole last conversation


# --- clients that hang up -----------------------------------------------------------------------------------------


def test_disconnect_mid_prefill_stops_every_rank_and_the_next_request_is_exact(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    """A client that hangs up while its prompt is prefilled stops every rank at the same chunk.

    Whether the hang-up lands before the last chunk is a race the test cannot decide (a quiet machine
    prefills a tiny model's prompt in milliseconds), so each attempt uses a fresh passage (nothing cached)
    and an attempt whose prefill ended before the cancel was seen is retried; the property is checked on
    the first attempt that did stop mid-prefill, and five attempts that never do fail the test.
    """

    def prefilling() -> int | None:
        active = server.health()["active"]
        if active and active["phase"] == "prefill" and active["prefilled_tokens"] > 0:
            return int(active["seq"])
        return None

    seen: list[dict[str, Any]] = []
    for attempt in range(5):
        start = 20000 + 9000 * attempt
        prompt = ref.text_tokens(book_text()[start : start + 9000])[:1800]
        prompt_text = ref.tokenizer.decode(prompt)
        prompt = ref.text_tokens(prompt_text)
        body = {"model": MODEL, "prompt": prompt_text, "max_tokens": 10, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60.0) as response:
            assert response.status_code == 200
            seq = server.wait_for("the long prompt's prefill to start", prefilling, every=0.005)
        record = last_record(server, seq)  # leaving the block hung up
        seen.append(record)
        if record["ended_in"] == "prefill" and record["prefilled_tokens"] < len(prompt) - 1:
            break
    else:
        pytest.fail(f"no attempt's prefill was stopped before its end: {seen}")
    assert record["finish_reason"] == "cancelled", record
    assert record["cached_tokens"] == 0 and 0 < record["prefilled_tokens"], record
    caches = [r["cache_tokens"] for r in record["rank_status"]]
    assert caches == [record["cache_tokens"]] * 2, record  # every rank stopped at the same point
    assert record["cache_tokens"] == record["cached_tokens"] + record["prefilled_tokens"]

    again = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=10, temperature=0)
    assert again.choices[0].text == ref.answer(prompt, 10)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == record["cache_tokens"]  # the agreed part is reused


def test_disconnect_mid_decode_stops_every_rank_and_the_next_request_is_exact(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    messages = [{"role": "user", "content": "What do you think of Mr. Wickham?"}]
    stream = chat(client, messages, max_tokens=300, temperature=0, stream=True)
    pieces: list[str] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) >= 3:
            break
    stream.close()
    record = last_record(server, request_id=chunk.id)
    assert record["id"] == chunk.id
    assert record["finish_reason"] == "cancelled" and record["ended_in"] == "decode", record
    assert 3 <= record["completion_tokens"] < 300, record
    caches = [r["cache_tokens"] for r in record["rank_status"]]
    assert caches == [record["prompt_tokens"] + record["completion_tokens"]] * 2, record

    prompt = ref.chat_tokens(messages)
    again = chat(client, messages, max_tokens=20, temperature=0)
    assert again.choices[0].message.content == ref.answer(prompt, 20)
    assert "".join(pieces) == ref.answer(prompt, 20)[: len("".join(pieces))]


# --- bad requests -------------------------------------------------------------------------------------------------


def quiet_health(server: ServeProcess) -> dict[str, Any]:
    """/health once nothing runs or waits and every rank finished the last request answered (a request of an
    earlier test may still be ending on the ranks after its client got the answer)."""

    def check() -> dict[str, Any] | None:
        health = server.health()
        last = max((r["seq"] for r in health["recent"]), default=None)
        settled = last is None or all(r["last_request"] == last for r in health["rank_status"])
        idle = not health["running"] and health["queue"]["waiting"] == 0
        return health if settled and idle else None

    return server.wait_for("the server to be idle", check)


def test_bad_requests_get_openai_error_bodies_and_reach_no_rank(server: ServeProcess) -> None:
    before = quiet_health(server)
    url = server.url
    long_prompt = "word " * 3000

    def post(path: str, body: Any, headers: dict[str, str] | None = None, raw: bytes | None = None) -> httpx.Response:
        h = {**AUTH, "Content-Type": "application/json", **(headers or {})}
        data = raw if raw is not None else json.dumps(body).encode()
        return httpx.post(url + path, content=data, headers=h, timeout=30.0)

    cases: list[tuple[httpx.Response, int, str | None, str]] = [
        (post("/v1/chat/completions", None, raw=b"{not json"), 400, None, "not valid JSON"),
        (post("/v1/chat/completions", {"model": MODEL}), 400, None, "'messages' is a required property"),
        (post("/v1/chat/completions", {"messages": []}), 400, None, "non-empty list"),
        (post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}), 400, None, "at least 1"),
        (post("/v1/completions", {"prompt": "x", "max_tokens": -5}), 400, None, "at least 1"),
        (post("/v1/completions", {"prompt": "x", "temperature": 9}), 400, None, "from 0 to 2"),
        (post("/v1/completions", {"prompt": long_prompt}), 400, "context_length_exceeded", "context is 2048"),
        (post("/v1/completions", {"prompt": "x", "max_tokens": 5000}), 400, "context_length_exceeded", "exceed"),
        (post("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}), 404, "model_not_found", "gpt-9"),
        (httpx.get(url + "/v1/no/such/thing", headers=AUTH), 404, "unknown_url", "no such endpoint"),
        (post("/v1/chat/completions", {"messages": CHAT}, {"Authorization": ""}), 401, "invalid_api_key", "no API key"),
        (
            post("/v1/chat/completions", {"messages": CHAT}, {"Authorization": "Bearer nope"}),
            401,
            "invalid_api_key",
            "wrong",
        ),
        (httpx.get(url + "/v1/models"), 401, "invalid_api_key", "API key"),
    ]
    for response, status, code, words in cases:
        assert response.status_code == status, (response.request.url, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert words in error["message"] and error["code"] == code, error
        assert error["type"] == "invalid_request_error", error
    after = server.health()
    assert after["requests"] == before["requests"]
    assert [r["last_request"] for r in after["rank_status"]] == [r["last_request"] for r in before["rank_status"]]

    wrong_key = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="gpt-9", messages=CHAT)  # pyright: ignore
    with pytest.raises(openai.BadRequestError):
        good.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)  # pyright: ignore


def test_a_page_of_the_cors_origin_may_call_the_api(server: ServeProcess) -> None:
    """--allowed-origins reaches rank 0's app: a browser's preflight passes (it carries no key), answers carry the
    origin; a page of another origin gets no CORS header, so its browser withholds the answer."""
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": BROWSER_ORIGIN, **preflight})
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    models = httpx.get(server.url + "/v1/models", headers={"Origin": BROWSER_ORIGIN, **AUTH})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_serve_without_the_extra_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipemlx.serve

    monkeypatch.setattr(pipemlx.serve, "missing_packages", lambda: ["uvicorn"])
    assert cli.main(["serve", "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipemlx serve: error: needs the serve extra (uvicorn missing)") and "pipemlx[serve]" in err


class _Loaded(Exception):
    """Raised by a stand-in load_sharded once it has seen its arguments."""


@pytest.mark.parametrize("flag", [[], ["--allow-unregistered"]])
def test_serve_hands_allow_unregistered_to_load_sharded(monkeypatch: pytest.MonkeyPatch, flag: list[str]) -> None:
    """One rank in this process, up to load_sharded (which stops it): the flag is passed on, off by default."""
    import pipemlx.serve

    seen: list[bool] = []

    def load_sharded(*args: Any, allow_unregistered: bool = False, **kwargs: Any) -> Any:
        seen.append(allow_unregistered)
        raise _Loaded

    monkeypatch.setattr(pipemlx.serve, "load_sharded", load_sharded)
    with pytest.raises(_Loaded):
        cli.main(["serve", "--ranks", "1", *flag])
    assert seen == [bool(flag)]


def test_serve_refuses_an_unregistered_architecture_naming_the_flag(tmp_path: Path) -> None:
    """One rank, in a subprocess (a rank that cannot load exits the process): one line, no traceback."""
    path = save_model_dir(build_model(dict(HELIUM_TIED)), HELIUM_TIED, tmp_path / "helium")
    result = subprocess.run(
        [sys.executable, "-m", "pipemlx", "serve", "--ranks", "1", "--model", str(path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("pipemlx serve: rank 0: PipelineError: mlx_lm.models.helium is not an"), (
        result.stderr
    )
    assert "--allow-unregistered to pipemlx generate / serve / bench / doctor" in result.stderr
    assert "Traceback" not in result.stderr


# --- a rank that dies or stalls -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault", ["killed", pytest.param("stalled", marks=pytest.mark.slow)]
)  # a stall: test_serve_batching
def test_a_lost_rank_gives_503_and_the_server_exits(fault: str) -> None:
    """``--no-recover``: rank 1 dies (SIGKILL) or stalls (SIGSTOP) while a streamed request decodes and another waits."""
    grace = 3.0
    process = ServeProcess("--no-recover", "--fault-grace", str(grace), "--timeout", "4")
    try:
        process.wait_ready()
        url = process.url
        lines: list[str] = []
        body = {"prompt": "It is a truth", "max_tokens": 1000, "temperature": 0, "stream": True}

        def read_stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60.0) as response:
                lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        process.wait_for(
            "the first request to decode", lambda: (process.health()["active"] or {}).get("phase") == "decode"
        )
        queued: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: queued.append(
                httpx.post(url + "/v1/completions", json={"prompt": "Jane", "max_tokens": 5}, timeout=60.0)
            ),
            daemon=True,
        )
        waiter.start()
        process.wait_for("the second request to wait", lambda: process.health()["queue"]["waiting"] == 1)
        os.kill(process.rank_pids[1], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        started = time.monotonic()

        reader.join(30.0)
        waiter.join(30.0)
        assert not reader.is_alive() and not waiter.is_alive(), "a request hung after the fault"
        events = [json.loads(line[len("data: ") :]) for line in lines if line != "data: [DONE]"]
        assert lines[-1] == "data: [DONE]"
        error = events[-1]["error"]
        assert error["code"] == "pipeline_unavailable" and error["type"] == "server_error", events[-1]
        expected = "PeerLostError" if fault == "killed" else "PipelineTimeoutError"
        assert expected in error["message"], error
        assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "pipeline_unavailable"

        tic = time.monotonic()
        late = httpx.post(url + "/v1/completions", json={"prompt": "Jane", "max_tokens": 5}, timeout=30.0)
        assert late.status_code == 503 and time.monotonic() - tic < 2.0
        health = httpx.get(url + "/health", timeout=10.0)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert expected in health.json()["last_fault"]

        status = process.proc.wait(grace + 30.0)
        assert status == 1
        assert time.monotonic() - started < grace + 4 + 20, "the server took too long to exit"
        last = process.stderr().strip().splitlines()[-1]
        assert last.startswith("pipemlx serve: exiting after a pipeline fault: ") and expected in last, last
    except BaseException:
        print(process.stderr()[-6000:])
        raise
    finally:
        process.close_after_fault(stalled=fault == "stalled")


@pytest.mark.slow  # the suite's time budget: run with -m slow
def test_serve_under_mpirun_answers_like_one_process(ref: Reference) -> None:
    """Every rank started by Open MPI's mpirun (MLX's MPI backend): the request broadcast is backend-neutral."""
    mpirun, extra_env = require_mpi()  # skips where MPI is missing, fails instead in CI (PIPEMLX_REQUIRE_HOSTS=1)
    launcher = [mpirun, *MPI_OPTIONS, "-np", "2"]
    process = ServeProcess(launcher=launcher, env={**extra_env, "PIPEMLX_BACKEND": "mpi", "PYTHONUNBUFFERED": "1"})
    try:
        health = process.wait_ready()
        assert health["ranks"] == 2 and health["split"] == [4, 4]
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0, timeout=120.0)
        text, finish, _ = stream_text(chat(client, CHAT, max_tokens=20, temperature=0, stream=True))
        assert text == ref.answer(ref.chat_tokens(CHAT), 20) and finish == "length"
        status = process.stop()
        assert status == 0, process.stderr()[-4000:]
    finally:
        process.close()
