"""Rank program of benchmarks/balanced_split.py: one split's pipelined prefill time on this rank.

Spec: {"config", "M", "step", "repeats", "split": "even" | "balanced" | [layers per rank]}
With "balanced" the ranks first measure their speeds together (pipemlx.runtime.calibrate.measure_speeds,
what shard_model(split="balanced") does) and report them. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.calibrate import measure_speeds
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    group = init_group()
    config = spec["config"]
    model = build_model(config, seed=0)
    speeds = None
    if spec["split"] == "balanced":
        speeds = measure_speeds(group, config["hidden_size"], config["intermediate_size"], mx.float32, 120.0)
        pipemlx.shard_model(model, group, split="balanced", speeds=speeds)
    else:
        pipemlx.shard_model(model, group, split=spec["split"])
    stage = stage_of(model)
    prompt = mx.random.randint(0, config["vocab_size"], (spec["M"],), key=mx.random.key(1)).astype(mx.int32)
    mx.eval(prompt)
    times: list[float] = []
    for attempt in range(1 + spec["repeats"]):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=spec["step"])
        if attempt:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    report = {"rank": stage.rank, "split": list(stage.info.split), "speeds": speeds, "prefill_s": times}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
