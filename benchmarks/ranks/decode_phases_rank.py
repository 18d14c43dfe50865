"""Benchmark rank program: where each rank's time goes in one greedy stream's decode steps.

Spec: {"M", "tokens", "repeats", "config", "sampled"?}. Prefills an M-token prompt, then decodes ``tokens``
tokens with ``pipemlx.generate_step``, ``repeats`` times after a warm-up. Each blocking wait of a step
(``wait_for`` in pipemlx.runtime.decode and pipemlx.runtime.sampling, named by what it waits for) and the
building of the rank's part of the graph (``DecodeRun._build``) are timed by wrapping them; "python" is the rest
of the step (the message's row, reading the table, bookkeeping), "between steps" the time from the end of one
step to the start of the next (yielding the token, the consumer, polling). Prints one JSON line:
{"rank", "tokens_per_s", "per_token_ms": {phase: ms}}.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime import decode as decode_module
from pipemlx.runtime import sampling as sampling_module
from pipemlx.testing import build_model

WAITS = (
    ("computing token", "own part (compute, send)"),
    ("output head", "shared head (all-gather, half the head)"),
    ("decode step", "step message (all-gather)"),
)


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    totals: defaultdict[str, float] = defaultdict(float)
    timing = [False]
    step_ends: list[float] = []
    wait_for = decode_module.wait_for

    def timed_wait(arrays: Any, timeout: float | None, describe: Any) -> None:
        start = time.perf_counter()
        try:
            wait_for(arrays, timeout, describe)
        finally:
            if timing[0]:
                what = describe()
                label = next((name for marker, name in WAITS if marker in what), what)
                totals[label] += time.perf_counter() - start

    build, step = decode_module.DecodeRun._build, decode_module.DecodeRun._step  # pyright: ignore[reportPrivateUsage]

    def timed_build(self: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return build(self, *args)
        finally:
            if timing[0]:
                totals["building the graph"] += time.perf_counter() - start

    def timed_step(self: Any, *args: Any) -> Any:
        start = time.perf_counter()
        if timing[0] and step_ends:
            totals["between steps"] += start - step_ends[-1]
        try:
            return step(self, *args)
        finally:
            end = time.perf_counter()
            if timing[0]:
                totals["step"] += end - start
            step_ends.append(end)

    decode_module.wait_for = timed_wait  # pyright: ignore[reportAttributeAccessIssue]
    sampling_module.wait_for = timed_wait  # pyright: ignore[reportAttributeAccessIssue]
    decode_module.DecodeRun._build = timed_build  # pyright: ignore[reportPrivateUsage, reportAttributeAccessIssue]
    decode_module.DecodeRun._step = timed_step  # pyright: ignore[reportPrivateUsage, reportAttributeAccessIssue]

    group = init_group()
    model = pipemlx.shard_model(build_model(spec["config"], seed=0), group)
    prompt = mx.random.randint(0, spec["config"]["vocab_size"], (spec["M"],), key=mx.random.key(1)).astype(mx.int32)
    options: dict[str, Any] = {}
    if spec.get("sampled"):
        mx.random.seed(3)
        options = {"sampler": make_sampler(temp=0.7, top_p=0.9), "logits_processors": make_logits_processors(1.1)}
    tokens, seconds = 0, 0.0
    for repeat in range(spec["repeats"] + 1):  # the first run warms up
        cache = make_prompt_cache(model)
        pipemlx.pipeline_prefill(model, prompt[:-1], cache)
        timing[0] = repeat > 0
        step_ends.clear()
        start = time.perf_counter()
        count = sum(
            1
            for _ in pipemlx.generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["tokens"], **options)
        )
        if timing[0]:
            tokens, seconds = tokens + count, seconds + time.perf_counter() - start
        timing[0] = False
    per_token = {k: round(v / tokens * 1e3, 3) for k, v in totals.items()}
    inside = sum(v for k, v in per_token.items() if k not in ("step", "between steps"))
    per_token["python (rest of the step)"] = round(per_token.get("step", 0.0) - inside, 3)
    print(json.dumps({"rank": group.rank(), "tokens_per_s": tokens / seconds, "per_token_ms": per_token}), flush=True)


if __name__ == "__main__":
    main()
