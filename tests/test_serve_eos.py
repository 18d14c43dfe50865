"""The end of sequence ends a request on the ranks in the step that yields it, with the front (the default) and
without it: no decode step after it, every rank agreeing it stopped, and the prefix cache holding exactly the
answered tokens.

The model is a copy of the demo model whose end-of-sequence token is the comma, so that greedy answers end early
and mid-text. Before the ranks knew the end of sequence under the front, it reached them only as the front's
cancel coming back over the link, racing the next decode step: rank 0 decoded past it and the ranks disagreed
on why the request ended. Each answer is compared with one process running mlx-lm on the whole model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import ServeProcess
from test_serve import Reference

from pipemlx.demo import MODEL_DIR

pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["Mr. Bingley", "It is a truth universally acknowledged", "Jane smiled and"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def comma_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("comma-eos") / "model"
    shutil.copytree(MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    comma = Reference().tokenizer.encode(",")
    assert len(comma) == 1
    config["eos_token_id"] = comma[0]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["front", "rank0"])
def server(request: pytest.FixtureRequest, comma_model: Path) -> Iterator[ServeProcess]:
    """The front process (the default) and rank 0 serving HTTP itself (``--no-recover``)."""
    extra = () if request.param == "front" else ("--no-recover",)
    process = ServeProcess("--model", str(comma_model), "--prompt-cache-bytes", "64M", *extra)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
        process.close()


def settled(server: ServeProcess, request_id: str) -> dict[str, Any]:
    """/health once every rank finished ``request_id``: its record and every rank's slot."""

    def check() -> dict[str, Any] | None:
        health = server.health()
        record = next((r for r in health["recent"] if r["id"] == request_id), None)
        if record is None or any(s["last_request"] != record["seq"] for s in health["rank_status"]):
            return None
        return {"record": record, "ranks": health["rank_status"], "prefix": health["prefix_cache"]}

    return server.wait_for(f"every rank to finish {request_id}", check)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_end_of_sequence_ends_the_step_on_every_rank(server: ServeProcess, comma_model: Path, prompt: str) -> None:
    reference = Reference(comma_model)
    tokens = reference.text_tokens(prompt)
    expected = reference.generate(tokens, MAX_TOKENS)
    assert expected[-1] in reference.eos, "the prompt must reach the end of sequence within MAX_TOKENS"
    body = {"model": "model", "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    assert answer["choices"][0]["text"] == reference.text(expected[:-1])
    assert answer["usage"]["completion_tokens"] == len(expected)
    seen = settled(server, answer["id"])
    # The decode steps: one token each (no speculation), none after the end of sequence, on rank 0 too.
    assert seen["record"]["decoded_tokens"] == len(expected), seen
    # Every rank ended it the same way, its cache holding exactly the prompt and the answer.
    assert [s["outcome"] for s in seen["ranks"]] == ["stop"] * len(seen["ranks"]), seen
    assert {s["cache_tokens"] for s in seen["ranks"]} == {len(tokens) + len(expected)}, seen
    # The prefix cache keeps exactly that: the next turn reuses all of it, and no position past it.
    follow_up = tokens + expected + reference.text_tokens(" and")
    body = {"model": "model", "prompt": follow_up, "max_tokens": 2, "temperature": 0}
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) + len(expected), again
