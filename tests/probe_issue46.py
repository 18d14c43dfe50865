"""Probe for issue #46 (one process, no ranks): how many of the issue's one-machine and bad-argument behaviours hold.

Run from a checkout: ``PYTHONPATH=$PWD python tests/probe_issue46.py``; it prints each behaviour and ``held N of M``.
Each is compared with mlx-lm 0.32.2 called the same way. The behaviours that need a live group (processors on every
rank, the batch generator's per-request options on ranks) are not probed here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from fakes import FakeGroup  # tests/fakes.py: this script runs from tests/
from mlx_lm import load
from mlx_lm.generate import BatchGenerator as MlxBatchGenerator
from mlx_lm.generate import batch_generate, generate_step, stream_generate
from mlx_lm.sample_utils import make_sampler

import pipemlx
from pipemlx.models.sharding import shard_model
from pipemlx.testing import build_model, tiny_config

DEMO = Path(pipemlx.__file__).parent / "demo" / "model"


def main() -> int:
    model, tokenizer = load(str(DEMO))
    prompt = mx.arange(12, dtype=mx.int32)

    def steps(function: Callable[..., Any]) -> Any:
        seen: list[Any] = []

        def record(history: mx.array, logits: mx.array) -> mx.array:
            seen.append(history.tolist())
            return logits

        mx.random.seed(1)
        out = [
            int(t)
            for t, _ in function(prompt, model, max_tokens=5, sampler=make_sampler(0.7), logits_processors=[record])
        ]
        return out, seen

    def texts(function: Callable[..., Any]) -> Any:
        return [r.text for r in function(model, tokenizer, "It is a truth", max_tokens=6)]

    def error_of(call: Callable[[], Any]) -> str:
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def batch_on_pipemlx() -> bool:
        prompts = [tokenizer.encode(p) for p in ("It is", "Mr. Darcy")]
        want = batch_generate(model, tokenizer, prompts, max_tokens=4).texts
        module = sys.modules["mlx_lm.generate"]
        module.BatchGenerator = pipemlx.BatchGenerator
        try:
            return batch_generate(model, tokenizer, prompts, max_tokens=4).texts == want
        finally:
            module.BatchGenerator = MlxBatchGenerator

    sharded = shard_model(build_model(tiny_config("llama")), FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    want_zero = error_of(lambda: next(stream_generate(model, tokenizer, "It", max_tokens=0)))
    checks: dict[str, Callable[[], bool]] = {
        "unsharded generate_step: mlx-lm's tokens and processor inputs": lambda: (
            steps(pipemlx.generate_step) == steps(generate_step)
        ),
        "unsharded stream_generate: mlx-lm's text": lambda: texts(pipemlx.stream_generate) == texts(stream_generate),
        "unsharded BatchGenerator: mlx-lm's": lambda: isinstance(pipemlx.BatchGenerator(model), MlxBatchGenerator),
        "mlx-lm's batch_generate() on pipemlx.BatchGenerator (unsharded)": batch_on_pipemlx,
        "stream_generate(max_tokens=0) unsharded: mlx-lm's error": lambda: (
            error_of(lambda: next(pipemlx.stream_generate(model, tokenizer, "It", max_tokens=0))) == want_zero
        ),
        "stream_generate(max_tokens=0) sharded: mlx-lm's error, before anything is sent": lambda: (
            error_of(lambda: next(pipemlx.stream_generate(sharded, tokenizer, "It", max_tokens=0))) == want_zero
        ),
    }
    held = 0
    for name, check in checks.items():
        try:
            ok = check()
        except Exception as exc:  # noqa: BLE001
            ok, name = False, f"{name} ({type(exc).__name__}: {exc})"
        held += ok
        print(("held   " if ok else "FAILED ") + name)
    print(f"held {held} of {len(checks)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
