"""The one-machine path (issue #46): pipemlx's generate_step / stream_generate / BatchGenerator on a model that was never
sharded run as mlx-lm's own do, and bad arguments give mlx-lm's errors. Single process: the reference is mlx-lm itself
on the same weights, called the same way. tests/probe_issue46.py counts the behaviours that hold."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from fakes import sharded_tiny, tokens
from mlx_lm import load
from mlx_lm.generate import BatchGenerator as MlxBatchGenerator
from mlx_lm.generate import batch_generate, generate_step, stream_generate
from mlx_lm.sample_utils import make_sampler

import pipemlx

DEMO = Path(pipemlx.__file__).parent / "demo" / "model"


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    return load(str(DEMO))


class Recorder:
    """A logits processor that records the token history and logits it was given, and changes nothing."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[float]]] = []

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        self.seen.append((history.tolist(), logits[0, :8].tolist()))  # pyright: ignore
        return logits


def _steps(function: Any, model: Any, **kwargs: Any) -> tuple[list[int], list[list[float]], Recorder]:
    recorder = Recorder()
    out = [(int(t), lp[:8].tolist()) for t, lp in function(tokens(12), model, logits_processors=[recorder], **kwargs)]
    return [t for t, _ in out], [lp for _, lp in out], recorder


def test_generate_step_on_an_unsharded_model_is_mlx_lms(demo: tuple[Any, Any]) -> None:
    model, _ = demo
    mx.random.seed(3)
    want = _steps(generate_step, model, max_tokens=6, sampler=make_sampler(temp=0.8), max_kv_size=8)
    mx.random.seed(3)
    got = _steps(pipemlx.generate_step, model, max_tokens=6, sampler=make_sampler(temp=0.8), max_kv_size=8)
    assert got[0] == want[0] and got[1] == want[1]
    assert (
        got[2].seen == want[2].seen and len(got[2].seen) >= 6
    )  # it ran here, on mlx-lm's inputs (one step ahead, as mlx-lm)
    with pytest.raises(ValueError, match="stop_tokens exist only on a sharded model"):
        pipemlx.generate_step(tokens(4), model, stop_tokens=[1])


def test_stream_generate_on_an_unsharded_model_is_mlx_lms(demo: tuple[Any, Any]) -> None:
    model, tokenizer = demo
    want = [
        (r.text, r.token, r.finish_reason) for r in stream_generate(model, tokenizer, "It is a truth", max_tokens=9)
    ]
    got = [
        (r.text, r.token, r.finish_reason)
        for r in pipemlx.stream_generate(model, tokenizer, "It is a truth", max_tokens=9)
    ]
    assert got == want and len(want) == 9
    with pytest.raises(ValueError, match="should_cancel exist only on a sharded model"):
        pipemlx.stream_generate(model, tokenizer, "It", should_cancel=lambda: False)


def test_max_tokens_zero_is_mlx_lms_error_sharded_or_not(demo: tuple[Any, Any]) -> None:
    model, tokenizer = demo
    with pytest.raises(ValueError, match="must be non-zero") as want:
        next(stream_generate(model, tokenizer, "It", max_tokens=0))
    for candidate in (model, sharded_tiny(rank=0, size=2)):  # sharded: refused before anything is sent
        with pytest.raises(ValueError) as got:
            next(pipemlx.stream_generate(candidate, tokenizer, "It", max_tokens=0))
        assert str(got.value) == str(want.value)


def test_batch_generator_on_an_unsharded_model_is_mlx_lms(demo: tuple[Any, Any], monkeypatch: Any) -> None:
    model, tokenizer = demo
    prompts = [tokenizer.encode(p) for p in ("It is a truth", "Mr. Darcy said", "She")]
    generator = pipemlx.BatchGenerator(model, max_tokens=5, stop_tokens=[7], prefill_step_size="auto")
    assert isinstance(generator, MlxBatchGenerator)
    generator.close()
    want = batch_generate(model, tokenizer, prompts, max_tokens=5)
    # mlx-lm's batch_generate() with pipemlx's generator standing in for its own, as an engine would swap them.
    monkeypatch.setattr(sys.modules["mlx_lm.generate"], "BatchGenerator", pipemlx.BatchGenerator)
    got = batch_generate(model, tokenizer, prompts, max_tokens=5)
    assert got.texts == want.texts and len(want.texts) == 3
    with pytest.raises(ValueError, match="memory_budget exist only on a sharded model"):
        pipemlx.BatchGenerator(model, memory_budget="1GB")
    with pytest.raises(ValueError, match="draft_model, num_draft_tokens exist only on a sharded model"):
        pipemlx.BatchGenerator(model, draft_model=model, num_draft_tokens=2)  # mlx-lm's batch has no speculation
