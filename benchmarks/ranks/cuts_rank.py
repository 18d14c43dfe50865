"""Benchmark rank program: several cuts of one prompt prefilled in turn in one launch (less noise than launches).

Spec: {"M", "rounds", "cuts": {name: [chunk lengths] | null}, "config", "shardings"?: {label: {"lend_mlp",
"lend_heads"} | {"native": true}}}. Each round prefills the prompt once per cut (and per sharding: one sharded
model of the same weights each, ``shard_model(..., **sharding)``, or mlx-lm's native pipeline,
``model.model.pipeline(group)``, which runs the uniform cuts only: mlx-lm's ``generate_step`` with
``max_tokens=0`` and that ``prefill_step_size``, timed until it reports the prefill done), in order, on a
fresh cache. The ranks start each prefill together without a barrier: the one before ended in a collective on
every rank (pipemlx's closing agreement; native's first-token all-gather). (Round 0 is a warm-up, not
reported); a cut's time on a rank runs from its call to its return, the prefill's handshake included, and
the slowest rank's is reported. A cut is imposed by standing in for the auto planner's choice
(``pipemlx.runtime.prefill.choose_chunks``), so each runs through ``prefill_step_size="auto"``'s path: the same
handshake, agreement spacing and executor; a null cut is auto's own choice. Prints {"rank", "seconds":
{name: [per round]}, "tokens": {sharding: first 4 tokens after the last prefill}} (names prefixed with
the sharding's label when "shardings" is given).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.observe.metrics import PrefillClock
from pipemlx.runtime import prefill as prefill_module
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model


def sharded(config: dict[str, Any], group: mx.distributed.Group, how: dict[str, Any]) -> Any:
    """The benchmark model as pipemlx shards it (``how``: ``shard_model``'s keywords) or as mlx-lm's native pipeline."""
    model = build_model(config, seed=0)
    if not how.get("native"):
        return pipemlx.shard_model(model, group, **how)
    model.model.pipeline(group)  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]
    mx.eval(model.parameters())  # pyright: ignore[reportUnknownMemberType]
    return model


def time_native(model: Any, prompt: mx.array, step: int) -> float:
    """Seconds until mlx-lm's ``generate_step`` reports the prefill done; ``max_tokens=0`` leaves nothing in flight."""
    clock = PrefillClock(time.perf_counter())
    for _ in generate_step(prompt, model, prefill_step_size=step, max_tokens=0, prompt_progress_callback=clock):
        pass
    return clock.seconds


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    group = init_group()
    rank = group.rank()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    shardings: dict[str, dict[str, Any]] = spec.get("shardings", {"whole layers": {}})
    models = {label: sharded(spec["config"], group, how) for label, how in shardings.items()}
    prompt = mx.random.randint(0, spec["config"]["vocab_size"], (spec["M"],), key=mx.random.key(3))
    chosen: list[tuple[int, ...] | None] = []
    auto_chunks: dict[str, list[int]] = {}  # sharding -> the chunks auto chose (the last time)
    own_choice = prefill_module.choose_chunks
    current = [""]  # the sharding being prefilled

    def choose(*args: Any) -> tuple[int, ...]:
        if chosen[-1] is not None:
            return chosen[-1]
        chunks = own_choice(*args)
        auto_chunks[current[0]] = list(chunks)
        return chunks

    prefill_module.choose_chunks = choose  # pyright: ignore[reportAttributeAccessIssue]
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for round_ in range(spec["rounds"] + 1):
        for name, lengths in spec["cuts"].items():
            for sharding, model in models.items():
                label = f"{sharding} {name}" if "shardings" in spec else name
                if shardings[sharding].get("native"):
                    if name.startswith("u"):
                        taken = time_native(model, prompt, int(name[1:]))
                        if round_:
                            seconds.setdefault(label, []).append(taken)
                    continue
                chosen.append(None if lengths is None else tuple(lengths))
                current[0] = sharding
                cache = make_prompt_cache(model)
                start = time.perf_counter()
                pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size="auto")
                if round_:
                    seconds.setdefault(label, []).append(time.perf_counter() - start)
                if round_ == spec["rounds"] and name == next(iter(spec["cuts"])):
                    steps = pipemlx.generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=4)
                    tokens[sharding] = [int(t) for t, _ in steps]
    lent = {label: stage_of(m).info.lending.heads for label, m in models.items() if not shardings[label].get("native")}
    report = {"rank": rank, "seconds": seconds, "tokens": tokens, "auto": auto_chunks, "lent_heads": lent}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
