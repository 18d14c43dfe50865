"""Rank program: pipeline_prefill with prefill_step_size="auto" equals single device at the step it chose.

Spec: {"lengths": [M, ...], "mismatch_rank": r or null, "cache_dir": an empty folder}. Timing a calibration raises
(the first request plans with the prior, untimed); the report says which cost model each rank holds at the end
(the refinement of the prior from the prefills' chunks) and what the calibration cache holds. With mismatch_rank, that rank passes a
fixed step while the others pass "auto": every rank must raise PipelineMismatchError; then that rank alone
asks generate_step for share_logprobs (PipelineMismatchError again), and a request after both is reported
with mlx-lm's tokens for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime import calibrate
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE, fingerprint
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def forbidden(*args: Any) -> Any:
    raise AssertionError("an auto request timed a calibration")


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ[CACHE_DIR_VARIABLE] = spec["cache_dir"]  # empty: the first request has nothing measured to read
    calibrate.time_local_layers = forbidden  # nothing may be timed before or during a request
    calibrate.time_layer = forbidden
    group = init_group()
    config = tiny_config("llama")
    reference = build_model(config)
    model = pipemlx.shard_model(build_model(config), group)
    results: list[dict[str, Any]] = []
    held_before = stage_of(model).cost_model is not None
    for length in spec["lengths"]:
        prompt = mx.random.randint(0, 256, (length,), key=mx.random.key(length)).astype(mx.int32)
        cache = make_prompt_cache(model)
        calls: list[list[int]] = []
        step = pipemlx.pipeline_prefill(
            model, prompt, cache, prefill_step_size="auto", prompt_progress_callback=lambda a, b: calls.append([a, b])
        )
        tokens = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=5)]
        ref_calls: list[list[int]] = []
        ref = [
            int(t)
            for t, _ in generate_step(
                prompt,
                reference,
                prefill_step_size=step,
                max_tokens=5,
                prompt_progress_callback=lambda a, b: ref_calls.append([a, b]),
            )
        ]
        mx.synchronize(generation_stream)
        results.append(
            {
                "M": length,
                "step": step,
                "tokens": tokens,
                "reference": ref,
                "progress": calls,
                "ref_progress": ref_calls[:-1],
            }
        )
    mismatch = logprobs_mismatch = None
    after: list[int] = []
    after_reference: list[int] = []
    if spec.get("mismatch_rank") is not None:
        fixed = group.rank() == spec["mismatch_rank"]
        try:
            pipemlx.pipeline_prefill(
                model, mx.arange(40, dtype=mx.int32), make_prompt_cache(model), prefill_step_size=8 if fixed else "auto"
            )
        except pipemlx.PipelineMismatchError as exc:
            mismatch = str(exc)
        try:  # ranks that would exchange differently sized decode messages are told before anything is sent
            list(pipemlx.generate_step(mx.arange(9, dtype=mx.int32), model, max_tokens=3, share_logprobs=fixed))
        except pipemlx.PipelineMismatchError as exc:
            logprobs_mismatch = str(exc)
        prompt = mx.arange(1, 12, dtype=mx.int32)
        after = [int(t) for t, _ in pipemlx.generate_step(prompt, model, max_tokens=4, timeout=20.0)]
        after_reference = [int(t) for t, _ in generate_step(prompt, reference, max_tokens=4)]
        mx.synchronize(generation_stream)
    cost_model = stage_of(model).cost_model
    held = fingerprint(dataclasses.asdict(cost_model)) if cost_model is not None else 0
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    print(
        json.dumps(
            {
                "rank": group.rank(),
                "results": results,
                "mismatch": mismatch,
                "logprobs_mismatch": logprobs_mismatch,
                "after": [after, after_reference],
                "held_before": held_before,
                "held": held,
                "stored": sorted(p.name.split("-")[1] for p in Path(spec["cache_dir"]).glob("calibration-*.json")),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
