"""Rank program: split="balanced" on a real group, with measured and with given speeds.

Spec: {"layers", "speeds": [..] (given), "slow": a rank}. The slow rank sets PIPEMLX_TEST_SLOWDOWN=4 (its
measured time is multiplied by 4: a slower machine, simulated), so the measured split must favour the others.
Prints one JSON line: the measured speeds and split, the given-speeds split, and the tokens
pipemlx.generate_step gives with each.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import mlx.core as mx

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.calibrate import measure_speeds
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def tokens_of(model: Any) -> list[int]:
    prompt = mx.arange(40, dtype=mx.int32) % 200
    return [int(t) for t, _ in pipemlx.generate_step(prompt, model, prefill_step_size=8, max_tokens=4)]


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    if group.rank() == spec["slow"]:
        os.environ["PIPEMLX_TEST_SLOWDOWN"] = "4"
    config = tiny_config("llama", num_hidden_layers=spec["layers"])
    speeds = measure_speeds(group, 64, 128, mx.float32, 60.0)
    measured = pipemlx.shard_model(build_model(config), group, split="balanced")
    given = pipemlx.shard_model(build_model(config), group, speeds=spec["speeds"])
    report = {
        "rank": group.rank(),
        "speeds": speeds,
        "measured_split": list(stage_of(measured).info.split),
        "given_split": list(stage_of(given).info.split),
        "tokens_measured": tokens_of(measured),
        "tokens_given": tokens_of(given),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
