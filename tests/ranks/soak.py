"""Rank program: many consecutive requests of random length with random cancellations on one group.

Spec: {"requests": N, "seed": s, "max_tokens_in_prompt": L, "cancel_every": k}. Every rank draws
the same sequence of requests from the seed; for a cancelled request one drawn rank says yes at a
drawn agreement point. Reports per request: cancelled or exact (tokens vs single device), and RSS.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.schedule.plan import build_plan
from pipemlx.testing import build_model, tiny_config


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    rank, size = group.rank(), group.size()
    config = tiny_config("llama")
    reference = build_model(config)
    model = pipemlx.shard_model(build_model(config), group, timeout=60)
    draw = random.Random(spec["seed"])
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i in range(spec["requests"]):
        length = draw.randint(1, spec["max_tokens_in_prompt"])
        step = draw.choice([1, 3, 8, 16, 64])
        points = 2 + build_plan(length, step, size, 0).num_steps
        cancel = draw.random() < spec["cancel_probability"]
        who, when = draw.randrange(size), draw.randrange(points)
        prompt = mx.random.randint(0, 256, (length,), key=mx.random.key(i)).astype(mx.int32)
        polls = iter(range(points))
        entry: dict[str, Any] = {"M": length, "step": step}
        cache = make_prompt_cache(model)
        try:
            pipemlx.pipeline_prefill(
                model,
                prompt,
                cache,
                prefill_step_size=step,
                should_cancel=lambda: cancel and rank == who and next(polls) == when,
            )
        except pipemlx.PrefillCancelled as exc:
            entry.update(outcome="cancelled", expected=cancel, processed=exc.processed)
        else:
            tokens = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=4)]
            expected = [int(t) for t, _ in generate_step(prompt, reference, prefill_step_size=step, max_tokens=4)]
            mx.synchronize(generation_stream)
            entry.update(outcome="exact" if tokens == expected else "WRONG", expected=not cancel or rank != who)
        entry["rss_mb"] = round(rss_mb(), 1)
        results.append(entry)
    elapsed = time.perf_counter() - start
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    print(json.dumps({"rank": rank, "seconds": elapsed, "results": results}), flush=True)


if __name__ == "__main__":
    main()
