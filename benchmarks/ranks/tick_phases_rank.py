"""Benchmark rank program: where each rank's time goes in the ticks of an arrival (a long prompt while R decode).

Spec: {"R", "M" (the decoding requests' prompts), "arrival_tokens", "chunk", "chunking", "config"}.
R requests decode; after 10 undisturbed ticks, 10 more are timed; then an ``arrival_tokens`` prompt is
inserted and every tick until its first token is timed. Each phase of
``pipemlx.runtime.batch.tick.TickRunner.run`` that blocks (handing a graph to MLX, or the tick's all-gather)
is timed by wrapping ``TickRunner._issue`` and ``batch_tick.wait_for``; the rest of a tick is Python
(planning, building graphs, bookkeeping). Prints one JSON line:
{"rank", "ticks", "ttft", "undisturbed_ms": [...], "per_tick_ms": {phase: ms}, "python_ms"}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

import mlx.core as mx

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.batch import tick as batch_tick
from pipemlx.testing import build_model

PHASES = {
    "running the decode step": "decode",
    "computing the chunk it received": "held chunk",
    "computing its new chunk": "new chunk",
    "sending its chunk": "send",
}


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    marks: list[tuple[str, float]] = []
    issue, wait_for = batch_tick.TickRunner._issue, batch_tick.wait_for  # pyright: ignore[reportPrivateUsage]

    def timed_issue(self: Any, arrays: Any, tick: int | None, what: str) -> None:
        start = time.perf_counter()
        issue(self, arrays, tick, what)
        marks.append((PHASES.get(what, "receive"), time.perf_counter() - start))

    def timed_wait(arrays: Any, timeout: float | None, describe: Any) -> None:
        start = time.perf_counter()
        wait_for(arrays, timeout, describe)
        marks.append(("all-gather", time.perf_counter() - start))

    batch_tick.TickRunner._issue = timed_issue  # pyright: ignore[reportPrivateUsage]
    batch_tick.wait_for = timed_wait
    group = init_group()
    rank = group.rank()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    model = pipemlx.shard_model(
        build_model(spec["config"], seed=0), group, lend="mlp" if spec.get("lend_mlp") else "none"
    )
    vocab = spec["config"]["vocab_size"]
    prompts = [mx.random.randint(0, vocab, (spec["M"],), key=mx.random.key(100 + i)).tolist() for i in range(spec["R"])]
    long_prompt = mx.random.randint(0, vocab, (spec["arrival_tokens"],), key=mx.random.key(7)).tolist()
    engine = pipemlx.BatchGenerator(
        model,
        max_tokens=-1,
        prefill_step_size=256,
        prefill_chunk_tokens=spec["chunk"],
        prefill_chunking=spec["chunking"],
        timeout=120.0,
    )
    decoding = engine.insert(prompts)  # pyright: ignore[reportArgumentType]
    while len(engine.active_uids) < len(decoding):
        engine.next()
    for _ in range(10):
        engine.next()
    undisturbed: list[float] = []
    for _ in range(10):
        start = time.perf_counter()
        engine.next()
        undisturbed.append(time.perf_counter() - start)
    marks.clear()
    (uid,) = engine.insert([long_prompt], max_tokens=2)  # pyright: ignore[reportArgumentType]
    start = time.perf_counter()
    ticks = 0
    while True:
        ticks += 1
        if any(r.uid == uid for r in engine.next()):
            break
    ttft = time.perf_counter() - start
    engine.remove([*decoding, uid])
    totals: dict[str, float] = defaultdict(float)
    for phase, seconds in marks:
        totals[phase] += seconds
    report = {
        "rank": rank,
        "ticks": ticks,
        "ttft": ttft,
        "undisturbed_ms": [round(1000 * s, 1) for s in undisturbed],
        "per_tick_ms": {phase: round(1000 * s / ticks, 1) for phase, s in totals.items()},
        "python_ms": round(1000 * (ttft - sum(totals.values())) / ticks, 1),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
