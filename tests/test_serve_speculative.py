"""`pipemlx serve --ranks 2` with speculative decoding: the demo's draft model, and prompt lookup (batched).

Every greedy answer is checked against one process running mlx-lm on the whole demo model without
speculation (the same :class:`~test_serve.Reference` as the other serve tests): guesses may change how many
tokens a pass yields, never which. A request with ``"draft": false`` guesses nothing; ``/metrics`` counts the
guessed and the confirmed tokens; a stop string that ends an answer in the middle of a pass leaves every rank's
cache, and the prefix cache, holding the tokens every rank decided, which the next turn reuses. Bad flags exit
with status 2 and one line. One server per proposer; every wait is bounded and every rank always stopped
(:mod:`serve_process`), its stderr shown on a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ROOT, ServeProcess, serving
from test_serve import MODEL, Reference
from test_serve_recovery import Client, stream

from pipemlx.demo import DRAFT_DIR
from pipemlx.launch import free_ports, write_hostfile

pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")

pytestmark = pytest.mark.timeout(180)

OPENING = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
CHAT = [
    {"role": "system", "content": "It is a truth universally acknowledged."},
    {"role": "user", "content": "Do you like to dance, Mr. Darcy?"},
]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    """The module's server: the demo's draft model guessing 3 tokens a pass."""
    with serving("--draft-model", str(DRAFT_DIR), "--num-draft-tokens", "3") as process:
        yield process


@pytest.fixture(scope="module")
def lookup() -> Iterator[ServeProcess]:
    """The prompt-lookup server: up to 4 requests batched, each guessing from its own text (3 guesses a step: with
    ``"auto"`` the count follows this machine's timings, and the tests would guess too little on a slow one), with
    ``--head split`` (each rank holds its rows of the embedding and head: every guessed position's logits
    gathered, or shared where no log-probabilities are asked for)."""
    flags = ("--prompt-lookup", "3", "--num-draft-tokens", "3", "--head", "split", "--decode-concurrency", "4")
    with serving(*flags) as process:
        yield process


@pytest.fixture(scope="module")
def batched_draft() -> Iterator[ServeProcess]:
    """The draft model in the batch: up to 4 requests decoded together, each greedy one drawing 3 guesses a step
    from its own draft cache on every rank; ``--recover``, so that a rank killed mid-pass is restarted."""
    flags = ("--draft-model", str(DRAFT_DIR), "--num-draft-tokens", "3", "--decode-concurrency", "4", "--recover")
    recovery = ("--timeout", "5", "--recover-timeout", "90", "--max-restarts", "4", "--prompt-cache-bytes", "16M")
    with serving(*flags, *recovery) as process:
        yield process


def records(server: ServeProcess, ids: list[str]) -> list[dict[str, Any]]:
    """Rank 0's /health records of requests ``ids`` once all ended (with the server's speculation settings)."""

    def check() -> list[dict[str, Any]] | None:
        health = server.health()
        recent = {r["id"]: r for r in health["recent"]}
        if not all(i in recent for i in ids):
            return None
        return [{**recent[i], "speculation": health["speculation"]} for i in ids]

    return server.wait_for(f"the records of {ids}", check)


def post(server: ServeProcess, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """One answer (not streamed); a failure shows the server's stderr."""
    try:
        response = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": MODEL, **body}, timeout=60.0)
    except httpx.HTTPError as exc:
        server.fail(f"POST /v1/{endpoint}: {type(exc).__name__}: {exc}")
        raise
    if response.status_code != 200:
        server.fail(f"POST /v1/{endpoint}: {response.status_code} {response.text}")
    return response.json()


def streamed(server: ServeProcess, body: dict[str, Any], chunks: int | None = None) -> tuple[str, str]:
    """A streamed completion's text, joined, and its id; with ``chunks``, the client leaves after that many."""
    pieces: list[str] = []
    request_id = ""
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"model": MODEL, "stream": True, **body}, timeout=60.0
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                request_id = chunk["id"]
                pieces += [c["text"] for c in chunk["choices"]]
                if chunks is not None and len(pieces) >= chunks:
                    break
    return "".join(pieces), request_id


def record(server: ServeProcess, request_id: str) -> dict[str, Any]:
    """/health's record of ``request_id`` once every rank finished it, with every rank's slot."""

    def check() -> dict[str, Any] | None:
        health = server.health()
        found = next((r for r in health["recent"] if r["id"] == request_id), None)
        if found is None or any(r["last_request"] < found["seq"] for r in health["rank_status"]):
            return None
        return {**found, "rank_status": health["rank_status"], "speculation": health["speculation"]}

    return server.wait_for(f"the record of {request_id}", check)


def scrape(server: ServeProcess) -> Samples:
    text = httpx.get(server.url + "/metrics", timeout=10.0).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def guessed(before: Samples, after: Samples) -> tuple[float, float]:
    """How much ``pipemlx_draft_tokens_{proposed,accepted}_total`` grew."""
    names = ("pipemlx_draft_tokens_proposed_total", "pipemlx_draft_tokens_accepted_total")
    proposed, accepted = (after.get((n, ()), 0.0) - before.get((n, ()), 0.0) for n in names)
    return proposed, accepted


def test_draft_answers_equal_mlx_lm_and_are_counted(server: ServeProcess, ref: Reference) -> None:
    """Chat and completion, whole and streamed: mlx-lm's greedy text; the guesses in the record and /metrics."""
    before = scrape(server)
    chat = post(server, "chat/completions", {"messages": CHAT, "max_tokens": 30, "temperature": 0})
    assert chat["choices"][0]["message"]["content"] == ref.answer(ref.chat_tokens(CHAT), 30)
    completion = post(server, "completions", {"prompt": OPENING, "max_tokens": 40, "temperature": 0})
    expected = ref.answer(ref.text_tokens(OPENING), 40)
    assert completion["choices"][0]["text"] == expected
    text, again = streamed(server, {"prompt": OPENING, "max_tokens": 40, "temperature": 0})
    assert text == expected
    seen = record(server, completion["id"])
    assert seen["draft_proposed_tokens"] > 0 and 0 < seen["draft_accepted_tokens"] <= seen["draft_proposed_tokens"]
    # The same prompt again, all but its last token reused: the draft reads the cached prefix too, guesses alike.
    repeat = record(server, again)
    assert repeat["cached_tokens"] == len(ref.text_tokens(OPENING)) - 1
    guesses = ("draft_proposed_tokens", "draft_accepted_tokens")
    assert [repeat[g] for g in guesses] == [seen[g] for g in guesses]
    proposed, accepted = guessed(before, scrape(server))
    assert proposed >= seen["draft_proposed_tokens"] and 0 < accepted <= proposed
    speculation = seen["speculation"]
    assert speculation["draft_model"] == str(DRAFT_DIR) and speculation["num_draft_tokens"] == 3
    rate = speculation["accepted_tokens"] / speculation["proposed_tokens"]
    assert abs(rate - speculation["acceptance_rate"]) < 1e-4, speculation
    assert "draft accepted" in server.stderr()  # the request's log line


def test_draft_false_opts_a_request_out(server: ServeProcess, ref: Reference) -> None:
    before = scrape(server)
    body = {"prompt": OPENING + " must be", "max_tokens": 24, "temperature": 0, "draft": False}
    answer = post(server, "completions", body)
    assert answer["choices"][0]["text"] == ref.answer(ref.text_tokens(OPENING + " must be"), 24)
    seen = record(server, answer["id"])
    assert seen["draft_proposed_tokens"] == 0 and guessed(before, scrape(server)) == (0.0, 0.0)
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": OPENING, "draft": "no"}, timeout=10.0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "draft"


def test_a_client_leaving_mid_stream_leaves_the_ranks_alike(server: ServeProcess, ref: Reference) -> None:
    """A streamed answer the client leaves after a few chunks: every rank stops after the same pass, the caches and
    prefix caches agree, and the next request (the same prompt, reused) still equals mlx-lm."""
    prompt = f"Mr. Bennet said: {OPENING}"
    _, left = streamed(server, {"prompt": prompt, "max_tokens": 400, "temperature": 0}, chunks=4)
    seen = record(server, left)
    slots = seen["rank_status"]
    assert seen["finish_reason"] == "cancelled" and seen["completion_tokens"] < 400
    assert len({(r["cache_tokens"], r["prefix_entries"]) for r in slots}) == 1, slots
    answer = post(server, "completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert answer["choices"][0]["text"] == ref.answer(ref.text_tokens(prompt), 20)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def stops_inside_passes(server: ServeProcess, ref: Reference, title: str) -> None:
    """Four answers cut by stop strings (3 characters from the 6th, 11th, 17th and 23rd), each on a prompt of its
    own (``title`` and a number before the opening): each answer is mlx-lm's up to the stop; every rank's slot
    holds the same cache and prefix-cache entries, the prompt and every token decided (which may run past the
    answer); the next turn (the answer continued) reuses them (all but the last) and equals mlx-lm; and at least
    one stop came before the end of its pass (else the test checks too little)."""
    beyond = 0  # answers whose caches hold decided tokens that the client never saw
    for i, cut in enumerate((6, 11, 17, 23)):
        prompt = ref.text_tokens(f"{title} {i + 1}. {OPENING}")
        full = ref.generate(prompt, 40)
        text = ref.text(full)
        stop = text[cut : cut + 3]
        answer = post(server, "completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop})
        assert answer["choices"][0]["text"] == text[: text.index(stop)]
        seen = record(server, answer["id"])
        slots = seen["rank_status"]
        assert len({(r["cache_tokens"], r["prefix_entries"]) for r in slots}) == 1, slots
        held = slots[0]["cache_tokens"] - len(prompt)  # every cache: the prompt and the decided tokens
        assert seen["completion_tokens"] <= held <= len(full)
        beyond += held > seen["completion_tokens"]
        follow = prompt + full[:held] + full[held : held + 2]
        again = post(server, "completions", {"prompt": follow, "max_tokens": 8, "temperature": 0})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) + held - 1, (held, seen)
        assert again["choices"][0]["text"] == ref.answer(follow, 8)
    assert beyond > 0


def test_a_stop_inside_a_pass_caches_what_every_rank_decided(server: ServeProcess, ref: Reference) -> None:
    """Stop strings cut answers after tokens of a pass whose later tokens every rank holds: the caches agree, every
    rank's prefix cache keeps them alike, and the next turn (the answer continued) reuses them and still equals
    mlx-lm. Each cut has a prompt of its own, so that no earlier entry covers the next turn."""
    stops_inside_passes(server, ref, "Chapter")


def test_prompt_lookup_answers_equal_mlx_lm(lookup: ServeProcess, ref: Reference) -> None:
    """A prompt that repeats a passage, alone in the batch, continued as mlx-lm does; ``"draft": false`` guesses
    nothing."""
    passage = ref.text(ref.generate(ref.text_tokens(OPENING), 30))
    prompt = f"Chapter 1. {OPENING}{passage}\n\n{OPENING}"
    before = scrape(lookup)
    answer = post(lookup, "completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0})
    assert answer["choices"][0]["text"] == ref.answer(ref.text_tokens(prompt), 40)
    proposed, accepted = guessed(before, scrape(lookup))
    assert 0 < accepted <= proposed
    (seen,) = records(lookup, [answer["id"]])
    assert seen["speculation"]["prompt_lookup"] == 3 and seen["draft_accepted_tokens"] == accepted
    plain = post(lookup, "completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "draft": False})
    assert plain["choices"][0]["text"] == ref.answer(ref.text_tokens(prompt), 12)
    assert guessed(before, scrape(lookup)) == (proposed, accepted)


def four_at_once(
    server: ServeProcess, ref: Reference, prompts: list[str], count: int, cut: int
) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """Four greedy requests sent at once to a batching server: the third opts out of guessing, the fourth stops at
    its expected text's ``cut``..``cut + 3`` characters. Checks each answer is mlx-lm's (up to the stop), the
    guesses held, and that the requests' records add up to /metrics' counts (the opted-out one guessed nothing).
    Returns the bodies, the texts and the records."""
    expected = [ref.answer(ref.text_tokens(p), count) for p in prompts]
    stop = expected[3][cut : cut + 3]
    bodies: list[dict[str, Any]] = [{"prompt": p, "max_tokens": count, "temperature": 0} for p in prompts]
    bodies[2]["draft"] = False
    bodies[3]["stop"] = stop
    before = scrape(server)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: post(server, "completions", body), bodies))
    texts = [a["choices"][0]["text"] for a in answers]
    assert texts[:3] == expected[:3]
    assert texts[3] == expected[3][: expected[3].index(stop)]
    proposed, accepted = guessed(before, scrape(server))
    assert 0 < accepted <= proposed
    seen = records(server, [a["id"] for a in answers])
    assert seen[2]["draft_proposed_tokens"] == 0 and seen[0]["draft_accepted_tokens"] > 0
    assert sum(r["draft_accepted_tokens"] for r in seen) == accepted
    assert sum(r["draft_proposed_tokens"] for r in seen) == proposed
    return bodies, texts, seen


def test_prompt_lookup_in_a_batch_of_four_answers_equal_mlx_lm(lookup: ServeProcess, ref: Reference) -> None:
    """``--decode-concurrency 4``: four requests at once, decoded in one batch where each guesses
    from its own prompt (one opted out, one with a stop string), continued as mlx-lm does; the guesses counted per
    request; the same four again reuse their cached prompts and answer alike."""
    passage = ref.text(ref.generate(ref.text_tokens(OPENING), 30))
    prompts = [f"{OPENING}{passage}\n\n{OPENING}", f"Chapter 2. {OPENING}{passage}\n\n{OPENING}", OPENING]
    prompts.append(f"{passage}\n\n{OPENING}{passage}\n\n{OPENING}")
    bodies, texts, _ = four_at_once(lookup, ref, prompts, 36, 14)
    # The prompts again, all at once: every cache and prefix cache held what every rank decided.
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda body: post(lookup, "completions", body), bodies))
    assert [a["choices"][0]["text"] for a in again] == texts
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in again)


def test_a_draft_in_a_batch_of_four_answers_equal_mlx_lm(batched_draft: ServeProcess, ref: Reference) -> None:
    """``--draft-model`` with ``--decode-concurrency 4``: four requests at once in one batch, three guessing from
    their own drafts (one of them cut by a stop string), one opted out; each answer mlx-lm's, the guesses counted
    per request and in /metrics."""
    prompts = [OPENING, f"Chapter 3. {OPENING}", "Mr. Darcy looked at", "Elizabeth walked on, and"]
    _, _, seen = four_at_once(batched_draft, ref, prompts, 40, 12)
    assert seen[0]["speculation"]["draft_model"] == str(DRAFT_DIR)


def test_a_stop_inside_a_pass_in_the_batch_leaves_every_rank_counting_alike(
    batched_draft: ServeProcess, ref: Reference
) -> None:
    """Stop strings that cut answers inside a pass of the batch: rank 0 answers at the stop, every rank counts the
    pass's later tokens alike (its slot's cache and prefix cache agree with the others'), the answer is mlx-lm's
    up to the stop, and the next turn (the answer continued) reuses the prompt and the decided tokens from the
    prefix cache and still equals mlx-lm."""
    stops_inside_passes(batched_draft, ref, "Volume")


def test_a_client_leaving_a_guessing_batch_leaves_the_ranks_alike(batched_draft: ServeProcess, ref: Reference) -> None:
    """A streamed answer, guessing in the batch beside another, that the client leaves after a few chunks: every
    rank drops it after the same step, the caches and prefix caches agree, the other answer is mlx-lm's, and the
    left prompt asked again (its prefix reused) still equals mlx-lm."""
    prompt = f"Mr. Bennet said: {OPENING}"
    with ThreadPoolExecutor(2) as pool:
        left = pool.submit(streamed, batched_draft, {"prompt": prompt, "max_tokens": 400, "temperature": 0}, 4)
        other = pool.submit(post, batched_draft, "completions", {"prompt": OPENING, "max_tokens": 30, "temperature": 0})
        _, left_id = left.result()
        answered = other.result()
        assert answered["choices"][0]["text"] == ref.answer(ref.text_tokens(OPENING), 30)
    seen, both = records(batched_draft, [left_id, answered["id"]])
    assert seen["finish_reason"] == "cancelled" and seen["completion_tokens"] < 400
    # Each rank's slot shows the last request it finished (either of the two): once every rank finished both,
    # the slots' caches and prefix caches agree.
    seqs = {seen["seq"], both["seq"]}

    def finished_both() -> list[dict[str, Any]] | None:
        slots: list[dict[str, Any]] = batched_draft.health()["rank_status"]
        return slots if all(r["last_request"] in seqs for r in slots) else None

    slots = batched_draft.wait_for("every rank to finish both", finished_both)
    assert len({(r["last_request"], r["cache_tokens"], r["prefix_entries"]) for r in slots}) == 1, slots
    answer = post(batched_draft, "completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert answer["choices"][0]["text"] == ref.answer(ref.text_tokens(prompt), 20)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_rank_killed_with_guesses_in_the_batch_every_stream_goes_on_as_mlx_lm(
    batched_draft: ServeProcess, ref: Reference
) -> None:
    """Four greedy streams guessing in one batch; once the shortest ended with guesses counted and two others are
    under way, the follower rank is killed (SIGKILL) mid-pass: the front restarts the ranks, every stream goes on
    and ends as mlx-lm's text, no client sees an error, and the restarted batch guesses again."""
    prompts = {"Mr. Bingley": 8, "Lady Catherine": 64, "Mrs. Bennet said": 64, "Jane smiled and": 64}
    expected = {p: ref.answer(ref.text_tokens(p), n) for p, n in prompts.items()}
    restarts = batched_draft.health()["recovery"]["restarts"]
    follower = int(batched_draft.health()["rank_status"][1]["pid"])
    before = scrape(batched_draft)
    clients = [Client(p) for p in prompts]
    threads = [threading.Thread(target=stream, args=(batched_draft.url, c, prompts[c.prompt])) for c in clients]
    for t in threads:
        t.daemon = True
        t.start()

    def under_way() -> bool:  # guesses are counted when a request ends: the short one's show the batch guessing
        going = [c for c in clients[1:] if c.chunks >= 3]
        return len(going) >= 2 and not any(c.done for c in going) and guessed(before, scrape(batched_draft))[0] > 0

    batched_draft.wait_for("the streams to be under way with guesses", under_way, 60.0, 0.01)
    os.kill(follower, signal.SIGKILL)
    for t in threads:
        t.join(120.0)
    if any(t.is_alive() for t in threads):
        batched_draft.fail("a client was still streaming 120 s after the kill")
    for c in clients:
        if c.errors or not c.done:
            batched_draft.fail(f"client {c.prompt!r} saw {c.errors} (done: {c.done})")
        assert c.text == expected[c.prompt], (c.prompt, c.text, expected[c.prompt])
    health = batched_draft.wait_for("ready again", lambda: (h := batched_draft.health())["status"] == "ready" and h)
    assert health["recovery"]["restarts"] >= restarts + 1
    batched_draft.rank_pids = [int(r["pid"]) for r in health["rank_status"]]  # what stop() kills if it must
    after = scrape(batched_draft)
    again = post(batched_draft, "completions", {"prompt": OPENING, "max_tokens": 24, "temperature": 0})
    assert again["choices"][0]["text"] == ref.answer(ref.text_tokens(OPENING), 24)
    assert guessed(after, scrape(batched_draft))[0] > 0  # the new group guesses too


def test_bad_speculation_flags_say_one_line_and_exit_2(tmp_path: Path) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    port = str(free_ports(1)[0])
    serve = [sys.executable, "-m", "pipemlx", "serve", "--port", port]
    cases: dict[str, tuple[list[str], str]] = {
        "missing draft": ([*serve, "--draft-model", str(tmp_path / "nowhere")], "cannot load the draft model"),
        "both proposers": ([*serve, "--draft-model", str(DRAFT_DIR), "--prompt-lookup", "2"], "not both"),
        "zero guesses": ([*serve, "--num-draft-tokens", "0"], "--num-draft-tokens: must be at least 1"),
        "bad n-gram": ([*serve, "--prompt-lookup", "0"], "--prompt-lookup: must be at least 1"),
    }
    hostfile = write_hostfile([f"127.0.0.1:{p}" for p in free_ports(2)], tmp_path)
    for rank in range(2):  # a folder that holds no model: every rank fails to load it and says so itself
        command = [*serve, "--draft-model", str(not_a_model), "--hostfile", str(hostfile), "--rank", str(rank)]
        cases[f"not a model, rank {rank}"] = (command, "cannot load the draft model")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True) for name, (cmd, _) in cases.items()}  # fmt: skip
    try:
        for name, proc in procs.items():
            try:
                _, err = proc.communicate(timeout=90.0)
            except subprocess.TimeoutExpired:
                for other in procs.values():
                    if other.poll() is None:
                        os.killpg(other.pid, 9)
                _, err = proc.communicate()
                pytest.fail(f"{name}: hung; stderr:\n{err.decode(errors='replace')}")
            lines = err.decode(errors="replace").strip().splitlines()
            assert proc.returncode == 2, (name, proc.returncode, lines)
            assert lines and lines[-1].startswith("pipemlx serve: error: "), (name, lines)
            assert cases[name][1] in lines[-1], (name, lines)
            if "argument" not in lines[-1]:  # argparse's own errors come after its usage lines
                assert len(lines) == 1, (name, lines)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
