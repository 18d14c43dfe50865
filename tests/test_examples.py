"""The examples run as written (`python examples/X.py --ranks 2`) and give single-device mlx-lm's tokens."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from pipemlx.demo import MODEL_DIR, default_prompt

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT = 180


def run_example(name: str, *args: str) -> list[dict[str, Any]]:
    """Run ``examples/<name> --ranks 2 --json args...``; return each rank's JSON report, by rank."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--ranks", "2", "--json", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stderr}"
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1], result.stdout
    return sorted(reports, key=lambda r: r["rank"])


def reference(
    prompt_ids: list[int], step_size: int, max_tokens: int, *, stop_at_eos: bool = True
) -> tuple[list[int], list[int]]:
    """Single-device mlx-lm on the demo model: greedy tokens (up to end of text), and the prefill progress."""
    model, tokenizer = load(str(MODEL_DIR))
    calls: list[int] = []
    tokens: list[int] = []
    for token, _ in generate_step(
        mx.array(prompt_ids),
        model,
        prefill_step_size=step_size,
        max_tokens=max_tokens,
        prompt_progress_callback=lambda done, total: calls.append(done),
    ):
        if stop_at_eos and int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tokens, calls[:-1]  # the last call comes with the first token, after the prefill


def demo_prompt_ids() -> list[int]:
    _, tokenizer = load(str(MODEL_DIR))
    return list(tokenizer.encode(default_prompt()))


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_pipeline_generate() -> None:
    reports = run_example("pipeline_generate.py", "--max-tokens", "16")
    assert [r["layers"] for r in reports] == [[0, 4], [4, 8]]
    expected, _ = reference(demo_prompt_ids(), reports[0]["prefill_step_size"], 16, stop_at_eos=False)
    assert len(expected) == 16
    for r in reports:
        assert r["tokens"] == expected


@pytest.mark.slow  # the suite's time budget: run with -m slow
def test_custom_split() -> None:
    reports = run_example("custom_split.py", "--split", "6,2", "--max-tokens", "16")
    assert [r["split"] for r in reports] == [[6, 2], [6, 2]]
    assert [r["layers"] for r in reports] == [[0, 6], [6, 8]]
    expected, _ = reference(demo_prompt_ids(), reports[0]["prefill_step_size"], 16, stop_at_eos=False)
    assert len(expected) == 16
    for r in reports:
        assert r["tokens"] == expected


def test_engine_loop_cancels_on_every_rank_and_serves_the_next_request() -> None:
    reports = run_example("engine_loop.py")
    requests = load_example("engine_loop.py").requests()
    _, tokenizer = load(str(MODEL_DIR))
    step = reports[0]["prefill_step_size"]
    by_rank = [{o["id"]: o for o in r["requests"]} for r in reports]
    assert [list(outcomes) for outcomes in by_rank] == [[q.id for q in requests]] * 2
    for request in requests:
        ids = list(tokenizer.encode(request.prompt))
        outcomes = [outcomes[request.id] for outcomes in by_rank]
        if request.hang_up_at is None:
            tokens, progress = reference(ids, step, request.max_tokens)
            for o in outcomes:
                assert o["status"] == "done"
                assert o["tokens"] == tokens
                assert o["progress"] == progress
        else:
            # Only the last rank asked; both stopped at the same agreement point, caches trimmed alike.
            processed = outcomes[0]["processed"]
            assert request.hang_up_at * (len(ids) - 1) <= processed < len(ids) - 1
            for o in outcomes:
                assert o["status"] == "cancelled" and o["cancelling_ranks"] == [1]
                assert o["processed"] == processed and o["cache_trimmed"] is True
                assert o["cache_offsets"] == [processed]


def test_one_engine_runs_unchanged_on_one_machine_and_on_two_ranks() -> None:
    """examples/one_engine.py: the engine's code on ``mlx_lm.load`` (one process, here: mlx-lm's own functions) and
    on ``pipemlx.load_sharded`` (2 ranks, as written): every rank's text, tokens, logprobs, processor calls and batch
    answers are the one process's."""
    example = load_example("one_engine.py")
    alone = example.engine(*load(str(MODEL_DIR))[:2])
    assert alone["chat"]["processor_calls"] == len(alone["chat"]["tokens"]) + 1  # mlx-lm's, the step after too
    for report in run_example("one_engine.py"):
        assert report["chat"] == alone["chat"], report
        assert report["batch"] == alone["batch"], report
