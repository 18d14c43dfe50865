"""Benchmark rank program: several cuts of one prompt prefilled in turn in one launch (less noise than launches).

Spec: {"M", "rounds", "cuts": {name: [chunk lengths]}, "config"}. Each round prefills the prompt once per cut,
in order, on a fresh cache (round 0 is a warm-up, not reported); a cut's time on a rank runs from its call
to its return, the prefill's handshake included, and the slowest rank's is reported. A cut is imposed by standing in for the auto
planner's choice (``pipemlx.runtime.prefill.choose_chunks``), so each runs through ``step_size="auto"``'s path:
the same handshake, agreement spacing and executor. Prints {"rank", "seconds": {name: [per round]}}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime import prefill as prefill_module
from pipemlx.testing import build_model


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    group = init_group()
    rank = group.rank()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    model = pipemlx.shard_model(build_model(spec["config"], seed=0), group)
    prompt = mx.random.randint(0, spec["config"]["vocab_size"], (spec["M"],), key=mx.random.key(3))
    chosen: list[tuple[int, ...]] = []
    prefill_module.choose_chunks = lambda *_: chosen[-1]  # pyright: ignore[reportAttributeAccessIssue]
    seconds: dict[str, list[float]] = {name: [] for name in spec["cuts"]}
    for round_ in range(spec["rounds"] + 1):
        for name, lengths in spec["cuts"].items():
            chosen.append(tuple(lengths))
            cache = make_prompt_cache(model)
            start = time.perf_counter()
            pipemlx.pipeline_prefill(model, prompt, cache, step_size="auto")
            if round_:
                seconds[name].append(time.perf_counter() - start)
    print(json.dumps({"rank": rank, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
