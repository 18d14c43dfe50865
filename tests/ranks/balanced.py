"""Rank program: split="balanced" on a real group, with measured and with given speeds.

Spec: {"layers", "speeds": [..] (given), "slow": a rank}. The slow rank sets PIPEMLX_TEST_SLOWDOWN=4 (its
measured time is multiplied by 4: a slower machine, simulated), so the measured split must favour the others.
Prints one JSON line: the measured speeds and split, the given-speeds split, the tokens and logprobs
pipemlx.generate_step gives with each (logprobs: the last rank's), and single-process mlx-lm's on the whole model.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.calibrate import measure_speeds
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config

PROMPT = mx.arange(40, dtype=mx.int32) % 200


def decoded(steps: Any) -> dict[str, Any]:
    """Tokens and each token's logprobs (their 8 largest entries, rounded; None on a rank without them)."""
    out: dict[str, Any] = {"tokens": [], "logprobs": []}
    for token, logprobs in steps:
        out["tokens"].append(int(token))
        top = None if logprobs is None else [round(v, 4) for v in sorted(logprobs.tolist(), reverse=True)[:8]]
        out["logprobs"].append(top)
    return out


def tokens_of(model: Any) -> dict[str, Any]:
    return decoded(pipemlx.generate_step(PROMPT, model, prefill_step_size=8, max_tokens=6))


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
        "reference": decoded(generate_step(PROMPT, build_model(config), prefill_step_size=8, max_tokens=6)),
    }
    mx.synchronize(generation_stream)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
