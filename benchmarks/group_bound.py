"""How fast can S ranks decode a batch on this machine, before any cost of pipemlx's own? A bound from the model's
compute alone.

    python benchmarks/group_bound.py [--shapes light,qwen2.5-0.5b] [--requests 8,16] [--ranks 2] [--steps 12]

A batched decode step of ``R`` rows costs far less than ``R`` one-row steps: the weights are read once per step,
whatever the rows. Pipelining trades that away. With one group in flight the ranks take turns (every rank idles
``(S-1)/S`` of a tick); with ``S`` groups in flight every rank is busy, but each of its steps carries ``R/S`` rows,
and ``S`` processes that run at once share the machine's memory bandwidth. This script times, with nothing of
pipemlx in the loop, mlx-lm's own model forward (a ``[rows, 1]`` decode step over a 64-position cache, random
weights, float32, OpenBLAS preloaded when installed), each process pinned to one core:

- **one process**: the whole model at ``R`` rows (mlx-lm's one-process batch, the issue's baseline);
- **a rank's share**: a model of ``L/S`` layers whose head has ``V/S`` rows (a rank's layers and its share of a
  split head) at ``R`` rows alone, and at ``R/S`` rows alone and with ``S-1`` twins running at once on the other
  cores (what a rank computes in a tick of ``S`` groups in flight, beside the other ranks).

and prints two bounds on pipemlx's tokens/s over the one process's (no message, no wait, no Python counted):

- one group: ``T_whole(R) / (S x T_share(R))`` (the ranks take turns);
- ``S`` groups in flight: ``T_whole(R) / (S x T_share_together(R/S))``.

Issue #52 asks for 1.3x at 8 requests and 1.6x at 16; where the bound is below a goal, no schedule of these
ranks' steps reaches it on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from common import SHAPES, bench_env, openblas_available
from first_run import SHAPES as PUBLISHED_SHAPES

CONTEXT = 64
"""Positions in every row's cache before the timed steps (a short prompt, as the batching benchmarks use)."""

PROGRAM = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from pipemlx.testing import build_model

config, rows, steps, context = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = build_model(config)
cache = make_prompt_cache(model)
mx.eval(model(mx.zeros((rows, context), dtype=mx.int32), cache=cache))
token = mx.zeros((rows, 1), dtype=mx.int32)
times = []
for n in range(steps + 3):
    start = time.perf_counter()
    mx.eval(model(token, cache=cache))
    if n >= 3:
        times.append(time.perf_counter() - start)
    for layer in cache:
        layer.trim(1)
times.sort()
print(json.dumps({"ms": 1000 * times[len(times) // 2]}))
"""


def share_of(config: dict[str, Any], ranks: int) -> dict[str, Any]:
    """A rank's share of ``config``: ``L/S`` layers (rounded up) and a head of ``V/S`` rows (the split head)."""
    layers = -(-int(config["num_hidden_layers"]) // ranks)
    return {**config, "num_hidden_layers": layers, "vocab_size": -(-int(config["vocab_size"]) // ranks)}


def timed(config: dict[str, Any], rows: int, steps: int, cores: list[int], openblas: bool) -> list[float]:
    """The median ms of a ``rows``-row decode step of ``config``, in one process per core of ``cores`` at once."""
    env = {**os.environ, **bench_env(openblas)}
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(name, None)
    args = [json.dumps(config), str(rows), str(steps), str(CONTEXT)]
    running = [
        subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-c", PROGRAM, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for core in cores
    ]
    figures: list[float] = []
    for process in running:
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"a timed process failed:\n{err[-3000:]}")
        figures.append(float(json.loads(out.strip().splitlines()[-1])["ms"]))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="light,qwen2.5-0.5b")
    parser.add_argument("--requests", default="8,16")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-openblas", action="store_true")
    args = parser.parse_args()
    shapes = {**SHAPES, **PUBLISHED_SHAPES}
    ranks, openblas = args.ranks, openblas_available() and not args.no_openblas
    if (os.cpu_count() or 1) < ranks:
        raise SystemExit(f"--ranks {ranks} needs {ranks} cores, this machine has {os.cpu_count()}")
    print(f"S={ranks}, float32, {CONTEXT}-position caches, one core per process, OpenBLAS {openblas}; ms per step")
    print(
        "| shape | R | one process, R rows | a share, R rows | a share, R/S rows alone | "
        "a share, R/S rows with twins | one group bound | S groups bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        config, share = shapes[name], share_of(shapes[name], ranks)
        for requests in (int(r) for r in args.requests.split(",")):
            part = max(1, requests // ranks)
            whole = timed(config, requests, args.steps, [0], openblas)[0]
            turns = timed(share, requests, args.steps, [0], openblas)[0]
            alone = timed(share, part, args.steps, [0], openblas)[0]
            together = max(timed(share, part, args.steps, list(range(ranks)), openblas))
            print(
                f"| {name} | {requests} | {whole:.1f} | {turns:.1f} | {alone:.1f} | {together:.1f} | "
                f"{whole / (ranks * turns):.2f}x | {whole / (ranks * together):.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
