"""Rank program: a network link goes down in the middle of pipeline_prefill, or of pipemlx.generate_step.

Spec: {"timeout": s, "M", "step", "victim": rank, "at": progress call, "request": path, "cut": path,
       "wait_for_cut": s, "phase": "prefill" | "decode", "max_tokens"}
In the prefill phase, at its `at`-th progress call (in decode, at its `at`-th token), rank `victim` writes `request` (asking the test harness to take its link
down), waits until its eth0 has lost its carrier or is down (at most `wait_for_cut` s), writes the time to
`cut` and carries on. Every rank reports the error its prefill ended with and when, then leaves with
os._exit(0): a communication may still be blocked inside MLX.
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
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def link_is_down(interface: str = "eth0") -> bool:
    """True when ``interface`` (in this process's network namespace) is down or has no carrier."""
    try:
        carrier = Path(f"/sys/class/net/{interface}/carrier").read_text().strip()
    except OSError:  # reading the carrier of an interface that is down fails with EINVAL
        return True
    return carrier != "1"


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    rank, timeout = group.rank(), spec["timeout"]
    config = tiny_config("llama")
    model = pipemlx.shard_model(build_model(config), group)
    prompt = mx.random.randint(0, config["vocab_size"], (spec["M"],), key=mx.random.key(11)).astype(mx.int32)
    calls: list[int] = []

    def on_progress(processed: int, total: int) -> None:
        calls.append(processed)
        if rank == spec["victim"] and len(calls) - 1 == spec["at"]:
            cut_my_link()

    def cut_my_link() -> None:
        Path(spec["request"]).write_text(str(time.time()))
        deadline = time.monotonic() + spec["wait_for_cut"]
        while not link_is_down():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: the harness did not cut the link within {spec['wait_for_cut']} s")
            time.sleep(0.01)
        Path(spec["cut"]).write_text(str(time.time()))

    outcome: dict[str, Any] = {"rank": rank, "error": None, "link_down": None, "tokens": 0}
    try:
        if spec.get("phase", "prefill") == "prefill":
            pipemlx.pipeline_prefill(
                model,
                prompt,
                make_prompt_cache(model),
                prefill_step_size=spec["step"],
                prompt_progress_callback=on_progress,
                timeout=timeout,
                agree_every=1,
            )
        else:  # decode: the victim's link goes down at its `at`-th token
            decoded = pipemlx.generate_step(
                prompt, model, max_tokens=spec["max_tokens"], prefill_step_size=spec["step"], timeout=timeout
            )
            for _ in decoded:
                outcome["tokens"] += 1
                if rank == spec["victim"] and outcome["tokens"] == spec["at"]:
                    cut_my_link()
    except (pipemlx.PipelineError, RuntimeError) as exc:
        outcome.update(error=type(exc).__name__, message=str(exc), at_time=time.time())
    outcome["link_down"] = link_is_down()
    outcome["progress_calls"] = calls
    outcome["broken"] = stage_of(model).broken is not None
    print(json.dumps(outcome), flush=True)
    os._exit(0)  # a communication may still be blocked inside MLX: leave without its teardown


if __name__ == "__main__":
    main()
