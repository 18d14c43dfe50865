"""Rank program: fault injection during pipeline_prefill, one request after another on one group.

Spec: {"timeout": seconds, "marker": path, "requests": [request, ...]}; a request is
  {"M", "step", "fault": {"kind", "rank", "at"}} with kind one of
  none         a normal request: decode after it and compare with single-device mlx-lm
  mismatch     rank `rank` uses a prompt one token longer
  raise        rank `rank`'s progress callback raises ValueError at its `at`-th call
  cancel       rank `rank`'s should_cancel says yes at its `at`-th poll (polls: handshake, then each Agree)
  kill         rank `rank` calls os._exit(3) in its `at`-th progress call
  stall        rank `rank` sleeps 3 x timeout in its `at`-th progress call
  queue_exception  every rank leaves a send_mode(model, "queue") block by an exception after a forward pass
Kill and stall end the group: the program reports and leaves with os._exit(0) (see docs/troubleshooting.md).
Each injection writes its wall-clock time to `marker` first, for detection times.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def prompt_of(length: int) -> mx.array:
    return mx.random.randint(0, 256, (length,), key=mx.random.key(length)).astype(mx.int32)


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    rank, timeout, marker = group.rank(), spec["timeout"], Path(spec["marker"])
    config = tiny_config("llama")
    reference = build_model(config)
    model = pipemlx.shard_model(build_model(config), group)
    outcomes: list[dict[str, Any]] = []
    references: dict[tuple[int, int], list[int]] = {}  # (M, step) -> mlx-lm's tokens on the whole model
    fatal = False
    for request in spec["requests"]:
        fault = request["fault"]
        mine = fault["rank"] == rank
        kind = fault["kind"] if mine else "none"
        at = fault.get("at", 0)
        length = request["M"] + (1 if kind == "mismatch" else 0)
        prompt = prompt_of(length)
        calls: list[int] = []
        polls: list[int] = []

        def inject() -> None:
            marker.write_text(str(time.time()))

        def on_progress(processed: int, total: int) -> None:
            calls.append(processed)
            if len(calls) - 1 != at:
                return
            if kind == "raise":
                raise ValueError(f"callback of rank {rank} fails at {processed}")
            if kind == "kill":
                inject()
                os._exit(3)
            if kind == "stall":
                inject()
                time.sleep(3 * timeout)

        def should_cancel() -> bool:
            polls.append(1)
            return kind == "cancel" and len(polls) - 1 == at

        cache = make_prompt_cache(model)
        outcome: dict[str, Any] = {"request": request, "error": None}
        try:
            if fault["kind"] == "queue_exception":
                with pipemlx.send_mode(model, "queue"), stage_of(model).executing_plan():
                    model(prompt[None, :4], cache=cache)
                    raise RuntimeError("left the queue block by an exception")
            pipemlx.pipeline_prefill(
                model,
                prompt,
                cache,
                prefill_step_size=request["step"],
                prompt_progress_callback=on_progress,
                should_cancel=should_cancel,
                timeout=timeout,
                agree_every=request.get("agree_every", 1),  # the expected figures count one agreement per step
            )
        except (pipemlx.PipelineError, ValueError, RuntimeError) as exc:
            outcome.update(error=type(exc).__name__, message=str(exc), at_time=time.time())
            if isinstance(exc, pipemlx.PrefillCancelled):
                outcome.update(
                    processed=exc.processed,
                    trimmed=exc.cache_trimmed,
                    failed_ranks=exc.failed_ranks,
                    cancelling_ranks=exc.cancelling_ranks,
                )
            fatal = isinstance(exc, (pipemlx.PipelineTimeoutError, pipemlx.PeerLostError))
            if fault["kind"] == "queue_exception":
                cache = make_prompt_cache(model)  # the aborted forward pass wrote into the old one
        stage = stage_of(model)
        outcome.update(
            offsets=sorted({c.offset for c in cache}),
            queued=len(stage.send_queue),
            in_flight=len(stage.send_queue.in_flight()),
            mode=stage.mode,
            polls=len(polls),
        )
        if fatal:
            outcome["broken"] = stage.broken is not None
            try:
                pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model), prefill_step_size=request["step"])
            except pipemlx.PipelineError as exc:
                outcome["next_call"] = f"{type(exc).__name__}: {exc}"
            outcomes.append(outcome)
            break
        if outcome["error"] is None:
            outcome["tokens"] = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=6)]
            key = (length, request["step"])  # the normal requests repeat one prompt: its reference is computed once
            if key not in references:
                steps = generate_step(prompt, reference, prefill_step_size=request["step"], max_tokens=6)
                references[key] = [int(t) for t, _ in steps]
            outcome["reference"] = references[key]
            mx.synchronize(generation_stream)
        outcomes.append(outcome)
    print(json.dumps({"rank": rank, "outcomes": outcomes}), flush=True)
    if fatal:
        os._exit(0)  # a communication may still be blocked inside MLX: leave without its teardown
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))


if __name__ == "__main__":
    main()
