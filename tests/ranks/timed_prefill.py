"""Rank program: a traced, timed pipeline_prefill, optionally preceded by a single-process calibration.

Reads a JSON spec from argv[1]; prints one JSON line.

Spec: {"arch", "config"?, "seed", "M", "step", "trace_dir", "repeats"?, "calibrate"?}
- ``repeats`` pipelined prefills, the i-th traced into ``trace_dir/run<i>``;
- with calibrate, right before each of them every rank times the *whole* model (all layers, no
  pipeline, no communication) on chunks of varied lengths covering the prompt, and the agreement
  collective (an all_gather of two ints). All ranks calibrate at the same time, next to the
  pipelined run, so that the machine is loaded alike in both.
Reported: the executed plan's actions (as the simulator describes them), progress calls,
calibration samples, collective time, and each prefill's wall time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
import pipemlx.runtime.prefill
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.plan import Chunk, PrefillPlan
from pipemlx.schedule.simulate import describe
from pipemlx.testing import build_model, tiny_config


def barrier(group: mx.distributed.Group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))


def calibration_chunks(num_tokens: int, step: int) -> list[Chunk]:
    """Positions 0..M-2 in chunks of step/2, step, 3*step/2, ... in turn: lengths vary so a fit can tell
    the per-chunk cost from the per-token cost."""
    lengths = (max(step // 2, 1), step, step + step // 2)
    chunks: list[Chunk] = []
    start = 0
    while start < num_tokens - 1:
        stop = min(start + lengths[len(chunks) % 3], num_tokens - 1)
        chunks.append(Chunk(len(chunks), start, stop))
        start = stop
    return chunks


def calibrate(model: Any, tokens: mx.array, chunks: list[Chunk]) -> list[float]:
    """Seconds the whole model takes in this process on each chunk, in turn."""
    cache = make_prompt_cache(model)
    seconds: list[float] = []
    for c in chunks:
        begin = time.perf_counter()
        model(tokens[None, c.start : c.stop], cache=cache)
        mx.eval([x.state for x in cache])
        seconds.append(time.perf_counter() - begin)
    return seconds


def time_collective(group: mx.distributed.Group, rounds: int = 30) -> float:
    """Mean seconds of an all_gather of two int32s: what one agreement point exchanges."""
    barrier(group)
    begin = time.perf_counter()
    for i in range(rounds):
        mx.eval(mx.distributed.all_gather(mx.array([i, 0], dtype=mx.int32), group=group))
    return (time.perf_counter() - begin) / rounds


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    if spec.get("pin") and hasattr(os, "sched_setaffinity"):
        # one core per rank: a rank busy-polling for a message then cannot take CPU from a computing one
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[group.rank() % len(cores)]})
    config = tiny_config(spec["arch"], **spec.get("config", {}))
    tokens = mx.random.randint(0, config["vocab_size"], (spec["M"],), key=mx.random.key(spec["seed"])).astype(mx.int32)
    repeats = spec.get("repeats", 1)
    report: dict[str, Any] = {"rank": group.rank(), "size": group.size()}

    executed: list[PrefillPlan] = []
    original = pipemlx.runtime.prefill.build_plan

    def recording_build_plan(*args: Any) -> PrefillPlan:
        plan = original(*args)
        executed.append(plan)
        return plan

    pipemlx.runtime.prefill.build_plan = recording_build_plan  # the executor's own plan, recorded as it is built

    whole = build_model(config, seed=spec["seed"]) if spec.get("calibrate") else None
    chunks = calibration_chunks(tokens.size, spec["step"])
    calibrations: list[list[float]] = []
    collectives: list[float] = []
    # Whole layers unless the spec says: the measured plan replayed against the cost model's prediction.
    model = pipemlx.shard_model(build_model(config, seed=spec["seed"]), group, lend=spec.get("lend", "none"))
    stage = stage_of(model)
    report["split"] = list(stage.info.split)
    report["hidden_size"] = config["hidden_size"]
    calls: list[list[int]] = []
    times: list[float] = []
    for i in range(repeats):
        if whole is not None:  # calibrate between the pipelined runs, so both see the same load
            barrier(group)
            calibrations.append(calibrate(whole, tokens, chunks))
            collectives.append(time_collective(group))
        cache = make_prompt_cache(model)
        calls.clear()
        barrier(group)
        begin = time.perf_counter()
        pipemlx.pipeline_prefill(
            model,
            tokens,
            cache,
            prefill_step_size=spec["step"],
            prompt_progress_callback=lambda a, b: calls.append([a, b]),
            trace_dir=str(Path(spec["trace_dir"]) / f"run{i}"),
        )
        times.append(time.perf_counter() - begin)
    report["prefill_s"] = times
    if whole is not None:
        report["calibration_chunks"] = [[c.start, c.stop] for c in chunks]
        report["calibrations"] = calibrations  # seconds per chunk, one list per pass (before run i)
        report["collective_s"] = collectives
    report["progress"] = calls
    report["plan_actions"] = [describe(a) for a in executed[-1].actions]
    report["plans_built"] = len(executed)
    barrier(group)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
