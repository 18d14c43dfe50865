"""``pipemlx bench``'s rank program: one rank of one side of the benchmark (``python -m pipemlx.cli.bench_rank SPEC``).

``SPEC`` is a JSON object from :mod:`.bench`: model, prompt_tokens,
prefill_step_size, max_tokens, timeout, lend, mode (``"single"``: one process, mlx-lm's
``generate_step``; ``"pipeline"``: a rank of a pipemlx pipeline, prefilled with
``pipeline_prefill`` and decoded with ``pipemlx.generate_step``) and, for the
pipeline, an optional trace_dir. Rank 0 prints its figures (those of
:mod:`pipemlx.observe.metrics`) as one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from ..launch import init_group
from ..models.loading import load_sharded
from ..observe.metrics import PrefillClock, decode_tokens_per_s, prefill_tokens_per_s
from ..runtime.generate import generate_step as pipemlx_generate_step
from ..runtime.prefill import pipeline_prefill

WARMUP_TOKENS = 3
WARMUP_STEP = 256  # with prefill_step_size="auto": the warm-up prompt is 2 such chunks (its chunks refine the prior)
MLX_LM_STEP = 2048
"""One process's step when the pipeline's is "auto": mlx-lm's default ``prefill_step_size``, what its users get."""


def _timed_tokens(tokens: Iterator[tuple[Any, Any]]) -> tuple[list[int], float]:
    """Run a token generator: the tokens, and the seconds from the first to the last."""
    out: list[int] = []
    first = last = 0.0
    for i, (token, _) in enumerate(tokens):
        last = time.perf_counter()
        if i == 0:
            first = last
        out.append(int(token))
    return out, last - first


def _measure(
    model: nn.Module, prompt: mx.array, spec: dict[str, Any], pipelined: bool, trace: str | None
) -> dict[str, Any]:
    step, max_tokens = spec["prefill_step_size"], spec["max_tokens"]
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    if pipelined:
        pipeline_prefill(model, prompt, cache, prefill_step_size=step, timeout=spec["timeout"], trace_dir=trace)
        prefill_s = time.perf_counter() - start
        # The logprobs are never read: a split head (the default) then decides greedy tokens from each rank's best.
        decoded = pipemlx_generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=max_tokens, logprobs=False)
        tokens, decode_s = _timed_tokens(decoded)
    else:
        clock = PrefillClock(start)
        generator = generate_step(
            prompt,
            model,
            prompt_cache=cache,
            prefill_step_size=MLX_LM_STEP if step == "auto" else step,
            max_tokens=max_tokens,
            prompt_progress_callback=clock,
        )
        tokens, decode_s = _timed_tokens(generator)
        prefill_s = clock.seconds
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prefill_tokens_per_s(prompt.size, prefill_s),
        "decode_tokens_per_s": decode_tokens_per_s(len(tokens), decode_s),
        "tokens": tokens,
    }


def bench_rank(spec: dict[str, Any]) -> None:
    """One rank of one side of the benchmark; rank 0 prints its figures as a JSON line."""
    pipelined = spec["mode"] == "pipeline"
    group = init_group() if pipelined else None
    if group is not None:
        model, _ = load_sharded(
            spec["model"],
            group,
            timeout=spec["timeout"],
            context=spec["prompt_tokens"] + spec["max_tokens"],
            lend=spec.get("lend", "auto"),
            allow_unregistered=spec.get("allow_unregistered", False),
        )
    else:
        loaded: Any = load(spec["model"])
        model = loaded[0]
    vocab = int(getattr(model, "args").vocab_size)
    prompt = mx.random.randint(0, vocab, (spec["prompt_tokens"],), key=mx.random.key(0)).astype(mx.int32)
    warmup = {**spec, "max_tokens": WARMUP_TOKENS}
    warm_step = WARMUP_STEP if spec["prefill_step_size"] == "auto" else spec["prefill_step_size"]
    _measure(model, prompt[: min(prompt.size, 2 * warm_step + 1)], warmup, pipelined, None)
    figures = _measure(model, prompt, spec, pipelined, spec.get("trace_dir"))
    if group is None or group.rank() == 0:
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    bench_rank(json.loads(sys.argv[1]))
