"""`pipemlx serve --ranks 2 --decode-concurrency 4`: requests decoded together, each answer equal to one process.

One batching server serves most tests (module fixture); the fault test starts its own. Every answer is
compared with one process running mlx-lm on the whole model with the same prompt tokens (greedy, or the same
seed), so a token from another request's row, a request lost or served twice, or ranks applying a removal at
different steps fails a test. Every wait is bounded, and the server (supervisor and every rank) is always
stopped, its stderr shown when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from serve_process import ServeProcess, serving
from test_serve import CHAT, MODEL, PENALTIES, Reference, ask_penalized, chat, stream_text

from pipemlx import cli
from pipemlx.demo import book_text

pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")

pytestmark = pytest.mark.timeout(240)

KEY = "sk-pipemlx-batch"
CONCURRENCY = 4
PROMPTS = ["Mr. Bingley", "Lady Catherine", "Mrs. Bennet said", "Jane smiled and"]


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serving("--decode-concurrency", str(CONCURRENCY), "--max-queue", "32", "--api-key", KEY) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120.0)


def wait_idle(server: ServeProcess) -> dict[str, Any]:
    return server.wait_for(
        "the server to be idle",
        lambda: (h := server.health())["active"] is None and h["queue"]["waiting"] == 0 and h,
        timeout=60.0,
    )


def test_sixteen_concurrent_clients_batched_each_equal_one_process(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    """16 clients at once, half streamed, different lengths: at most 4 run together, each answer is its own."""

    def ask(i: int) -> tuple[int, str, str | None, Any]:
        prompt, max_tokens = PROMPTS[i % len(PROMPTS)], 8 + i
        request: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if i % 2:
            stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **request)
            text, finish, usage = stream_text(stream, kind="completion")
            return i, text, finish, usage
        response = client.completions.create(**request)
        return i, response.choices[0].text, response.choices[0].finish_reason, response.usage

    served_before = server.health()["requests"]["served"]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    for i, text, finish, usage in answers:
        prompt = ref.text_tokens(PROMPTS[i % len(PROMPTS)])
        expected = ref.generate(prompt, 8 + i)
        assert text == ref.text(expected), (i, text, ref.text(expected))
        assert finish == ("stop" if expected[-1] in ref.eos else "length"), (i, finish)
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(expected), (i, usage)
        assert usage.total_tokens == len(prompt) + len(expected)
    health = wait_idle(server)
    assert health["requests"]["served"] == served_before + 16
    assert health["max_concurrency"] == CONCURRENCY
    assert 2 <= health["peak_running"] <= CONCURRENCY, health["peak_running"]


def test_streams_with_stop_strings_and_seeds_under_concurrency(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    """Chat streams ending at a stop string, seeded sampled ones and greedy ones, all in flight together."""
    full = ref.answer(ref.chat_tokens(CHAT), 40)
    stops = ['"', "dance"]
    cut = min(i for i in (full.find(s) for s in stops) if i >= 0)
    sampled_prompt = "Elizabeth walked on, and"

    def stopped(_: int) -> tuple[str, str | None]:
        text, finish, _ = stream_text(chat(client, CHAT, max_tokens=40, temperature=0, stop=stops, stream=True))
        return text, finish

    def sampled(seed: int) -> str:
        stream = client.completions.create(
            model=MODEL, prompt=sampled_prompt, max_tokens=24, temperature=1.0, seed=seed, stream=True
        )
        return stream_text(stream, kind="completion")[0]

    def greedy(_: int) -> str:
        return chat(client, CHAT, max_tokens=30, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        stops_done = [pool.submit(stopped, i) for i in range(3)]
        samples = {seed: pool.submit(sampled, seed) for seed in (1234, 4321)}
        greedy_done = [pool.submit(greedy, i) for i in range(3)]
        for future in stops_done:
            assert future.result() == (full[:cut], "stop")
        sampled_tokens = ref.text_tokens(sampled_prompt)
        for seed, future in samples.items():
            assert future.result() == ref.answer(sampled_tokens, 24, temp=1.0, seed=seed), seed
        for future in greedy_done:
            assert future.result() == ref.answer(ref.chat_tokens(CHAT), 30)
    assert samples[1234].result() != samples[4321].result()


def test_a_client_hanging_up_mid_stream_leaves_the_others_exact(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    """One of four streams hangs up after 3 pieces: it is removed on every rank, the other three finish exactly."""
    messages = [{"role": "user", "content": "What do you think of Mr. Wickham?"}]
    cancelled_before = server.health()["requests"]["cancelled"]
    left: list[str] = []

    def hang_up() -> str:
        stream = chat(client, messages, max_tokens=300, temperature=0, stream=True)
        pieces: list[str] = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if len(pieces) >= 3:
                left.append(chunk.id)
                break
        stream.close()
        return "".join(pieces)

    def stay(i: int) -> str:
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=40, temperature=0, stream=True)
        return stream_text(stream, kind="completion")[0]

    with ThreadPoolExecutor(4) as pool:
        staying = [pool.submit(stay, i) for i in range(3)]
        partial = pool.submit(hang_up).result()
        for i, future in enumerate(staying):
            assert future.result() == ref.answer(ref.text_tokens(PROMPTS[i]), 40), i
    assert ref.answer(ref.chat_tokens(messages), 20).startswith(partial)

    def record() -> dict[str, Any] | None:
        health = server.health()
        return next((r for r in health["recent"] if r["id"] == left[0]), None)

    cancelled = server.wait_for("the hung-up request's record", record)
    assert cancelled["finish_reason"] == "cancelled" and cancelled["ended_in"] == "decode", cancelled
    assert 3 <= cancelled["completion_tokens"] < 300, cancelled
    health = wait_idle(server)
    assert health["requests"]["cancelled"] == cancelled_before + 1
    # Every rank applied the same removals and finishes: they agree on the last request and its cache length.
    ranks = health["rank_status"]
    assert len({(r["last_request"], r["cache_tokens"]) for r in ranks}) == 1, ranks
    again = chat(client, messages, max_tokens=20, temperature=0)  # the pipeline is still exact
    assert again.choices[0].message.content == ref.answer(ref.chat_tokens(messages), 20)


def test_a_server_sharded_with_lent_heads_and_a_split_vocabulary_batches_answers_equal_to_one_process(
    ref: Reference,
) -> None:
    """--lend 1: rank 1 keeps its first layer's cache and the lent head's, batched as one; --head split: each rank
    holds its rows of the embedding and head (every tick's embeddings summed and logits gathered from them); four
    clients at once (greedy, and chat streams that reuse each other's prefix) get one process's answers.
    --decode-groups 2: whenever two requests decode, they do in decode groups in flight (docs/batching.md)."""
    with serving(
        "--decode-concurrency", str(CONCURRENCY), "--lend", "1", "--head", "split", "--decode-groups", "2"
    ) as process:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0, timeout=120.0)

        def ask(i: int) -> str:
            if i % 2:
                return chat(client, CHAT, max_tokens=10 + i, temperature=0).choices[0].message.content
            request = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12 + i, "temperature": 0}
            return client.completions.create(**request).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        for i, text in enumerate(answers):
            prompt = ref.chat_tokens(CHAT) if i % 2 else ref.text_tokens(PROMPTS[i % len(PROMPTS)])
            assert text == ref.answer(prompt, 10 + i if i % 2 else 12 + i), i
        assert wait_idle(process)["peak_running"] >= 2


def test_max_concurrency_zero_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--decode-concurrency", "0"])
    assert caught.value.code == 2
    assert "argument --decode-concurrency: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "many"])
def test_decode_groups_other_than_auto_or_a_positive_int_are_refused(
    capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--decode-groups", bad])
    assert caught.value.code == 2
    assert f"argument --decode-groups: expected 'auto' or a positive int, got {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("fault", [pytest.param("killed", marks=pytest.mark.slow), "stalled"])  # a kill: test_serve
def test_a_lost_follower_fails_every_request_in_flight_and_the_server_exits(fault: str) -> None:
    """``--no-recover``: rank 1 dies (SIGKILL) or stalls (SIGSTOP) while three streams decode together and one waits: every client
    gets a 503, the server exits."""
    grace = 2.0
    process = ServeProcess("--no-recover", "--decode-concurrency", "3", "--fault-grace", str(grace), "--timeout", "4")
    try:
        process.wait_ready()
        url = process.url
        streams: list[list[str]] = [[], [], []]

        def read(i: int) -> None:
            body = {"prompt": PROMPTS[i], "max_tokens": 1500, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60.0) as response:
                streams[i].extend(line for line in response.iter_lines() if line)

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(3)]
        for reader in readers:
            reader.start()

        def all_decoding() -> bool:
            running = process.health()["running"]
            return len(running) == 3 and all(r["phase"] == "decode" for r in running)

        process.wait_for("three requests to decode together", all_decoding)
        queued: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: queued.append(
                httpx.post(url + "/v1/completions", json={"prompt": "Jane", "max_tokens": 5}, timeout=60.0)
            ),
            daemon=True,
        )
        waiter.start()
        process.wait_for("the fourth request to wait", lambda: process.health()["queue"]["waiting"] == 1)
        os.kill(process.rank_pids[1], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        expected = "PeerLostError" if fault == "killed" else "PipelineTimeoutError"

        for thread in [*readers, waiter]:
            thread.join(30.0)
            assert not thread.is_alive(), "a request hung after the fault"
        for lines in streams:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            error = json.loads(lines[-2][len("data: ") :])["error"]
            assert error["code"] == "pipeline_unavailable" and expected in error["message"], error
        assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "pipeline_unavailable"
        health = httpx.get(url + "/health", timeout=10.0)
        assert health.status_code == 503 and expected in health.json()["last_fault"]
        assert process.proc.wait(grace + 30.0) == 1
        last = process.stderr().strip().splitlines()[-1]
        assert last.startswith(f"pipemlx serve: exiting after a pipeline fault: {expected} in batch step"), last
    except BaseException:
        print(process.stderr()[-6000:])
        raise
    finally:
        process.close_after_fault(stalled=fault == "stalled")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_batched_requests_reuse_the_prefix_cache(server: ServeProcess, client: openai.OpenAI, ref: Reference) -> None:
    """A batched request's prompt is kept for later ones: three concurrent follow-ups prefill only what is new."""
    system = {"role": "system", "content": "Netherfield Park is let at last, said Mrs. Bennet to her husband."}
    first = [system, {"role": "user", "content": "Who has taken it?"}]
    prompt1 = ref.chat_tokens(first)
    answer = chat(client, first, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content == ref.answer(prompt1, 8)
    questions = ["Is he married or single?", "What is his name?", "How can it affect them?"]

    def follow_up(question: str) -> Any:
        return chat(client, [system, {"role": "user", "content": question}], max_tokens=12, temperature=0)

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(follow_up, questions))
    for question, reply in zip(questions, replies):
        prompt = ref.chat_tokens([system, {"role": "user", "content": question}])
        assert reply.choices[0].message.content == ref.answer(prompt, 12), question  # equals a cold run
        # The first request's prompt (all but its last token, which fed the first decode step) was kept.
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached >= common_prefix(prompt1[:-1], prompt) > len(ref.chat_tokens([system])) // 2, (question, cached)
        assert cached <= len(prompt) - 1


def test_penalized_requests_batched_with_others_equal_one_process(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    """Penalized and plain requests in one batch, twice (the second time from the prefix cache): each exact."""
    prompt_text = "Mr. Darcy looked at her for a moment, and then"
    prompt = ref.text_tokens(prompt_text)
    expected = ref.answer(prompt, 30, penalties=PENALTIES)
    plain = ref.answer(ref.text_tokens(PROMPTS[0]), 20)
    for round in range(2):
        with ThreadPoolExecutor(3) as pool:
            penalized = [pool.submit(ask_penalized, client, prompt_text, 30) for _ in range(2)]
            others = pool.submit(
                client.completions.create, model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0
            )
            for future in penalized:
                assert future.result().choices[0].text == expected, round
            assert others.result().choices[0].text == plain, round
    cached = ask_penalized(client, prompt_text, 30)
    assert cached.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert cached.choices[0].text == expected


def test_a_batched_answer_is_kept_for_the_next_turn(
    server: ServeProcess, client: openai.OpenAI, ref: Reference
) -> None:
    """A finished request's conversation (prompt and answer) is kept: the next turn prefills only what it adds."""
    turn1 = [{"role": "user", "content": "Is Netherfield Park let at last, my dear?"}]
    prompt1 = ref.chat_tokens(turn1)
    generated1 = ref.generate(prompt1, 10)
    first = chat(client, turn1, max_tokens=10, temperature=0)
    assert first.choices[0].message.content == ref.text(generated1)
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content}]
    turn2.append({"role": "user", "content": "Who has taken it?"})
    prompt2 = ref.chat_tokens(turn2)
    # The batch hands back the prompt and every answer token, the last too (as mlx-lm's BatchGenerator does).
    expected = min(common_prefix(prompt1 + generated1, prompt2), len(prompt2) - 1)
    assert expected > len(prompt1), "the next turn does not share the answer: the test loses its power"
    second = chat(client, turn2, max_tokens=10, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == expected, second.usage
    assert second.choices[0].message.content == ref.answer(prompt2, 10)  # equals a cold run


@pytest.mark.slow  # the suite's time budget: run with -m slow
def test_a_prefill_cut_short_on_three_ranks_keeps_what_every_rank_prefilled(ref: Reference) -> None:
    """A client hangs up while its long prompt is prefilled through 3 ranks, whose caches then hold different
    lengths (rank 0 is chunks ahead of rank 2): every rank keeps only the agreed part, so the same prompt again
    reuses it and answers exactly (keeping each rank's own length made the ranks' prefix caches differ, and the
    next request failed the whole pipeline with PipelineMismatchError)."""
    messages = [{"role": "user", "content": book_text()[:1200]}]
    prompt = ref.chat_tokens(messages)
    with serving("--decode-concurrency", "2", "--prefill-step-size", "16", ranks=3) as process:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", process.url + "/v1/chat/completions", json=body, timeout=60.0):

            def prefilling() -> bool:
                running = process.health()["running"]
                return bool(running) and running[0]["prefilled_tokens"] >= 64

            process.wait_for("the prefill to be under way", prefilling, every=0.01)
        cut = process.wait_for("the hung-up request's record", lambda: process.health()["recent"] or None)[-1]
        assert cut["finish_reason"] == "cancelled" and cut["ended_in"] == "prefill", cut
        ranks = process.health()["rank_status"]
        assert len({r["prefix_entries"] for r in ranks}) == 1, ranks
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0, timeout=120.0)
        again = chat(client, messages, max_tokens=4, temperature=0)
        assert again.choices[0].message.content == ref.answer(prompt, 4)
        assert 64 <= again.usage.prompt_tokens_details.cached_tokens < len(prompt) - 1, again.usage
