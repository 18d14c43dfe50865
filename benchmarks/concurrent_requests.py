"""Concurrent requests: aggregate decode tokens/s with R = 1, 2, 4, 8 requests in flight, in one run.

    python benchmarks/concurrent_requests.py [--requests 1,2,4,8] [--prompt-tokens 32] [--tokens 33] [--json FILE]
                                             [--head-on-last] [--lend-heads K]
                                             [--arrival-tokens 4096 --chunks 32,64,128 --chunking fixed,equal-cost]

Three ways of serving R requests on the benchmark model (BENCH_CONFIG, OpenBLAS preloaded, one core per
process): pipemlx.BatchGenerator on 2 ranks (the R requests decoded together through the pipeline),
pipemlx.generate_step on 2 ranks one request after another, and mlx-lm's own BatchGenerator in one process
holding all layers. Decode only: each request's tokens after its first (see ranks/concurrent_rank.py).
With --arrival-tokens N, then: a prompt of N tokens arrives while 4 requests decode (pipemlx batched, S=2),
for each prefill_chunking in --chunking and prefill_chunk_tokens in --chunks; the 4 requests' p95 time between tokens before and while
it is prefilled, and its time to first token against its solo run.
Run by hand, on an otherwise idle machine when the figures matter. (Not named `concurrent.py`: in this
folder that name would shadow the standard library's `concurrent` package for every benchmark script.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, HERE, bench_env, openblas_available

from pipemlx.launch import launch

PROGRAM = HERE / "ranks" / "concurrent_rank.py"


def run_mode(spec: dict[str, Any], openblas: bool) -> Any:
    """Rank 0's report figure of one mode: aggregate tokens/s (one process for mlx_batch), or the arrival's report."""
    command = [sys.executable, str(PROGRAM), json.dumps(spec)]
    if spec["mode"] == "mlx_batch":
        env = {**os.environ, **bench_env(openblas)}
        env.pop("MLX_RANK", None)
        env.pop("MLX_HOSTFILE", None)
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"mlx_batch failed:\n{out.stderr[-3000:]}")
        return float(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])
    results = launch(2, command, timeout=1800, env=bench_env(openblas))
    report = json.loads(results[0].stdout.strip().splitlines()[-1])
    return report if spec["mode"] == "arrival" else float(report["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="1,2,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=33, help="generated tokens per request (decode: all but 1)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arrival-tokens", type=int, default=0, help="0: no arrival test")
    parser.add_argument("--chunks", default="32,64,128", help="prefill_chunk_tokens values of the arrival test")
    parser.add_argument("--chunking", default="fixed", help="prefill_chunking values of the arrival test")
    parser.add_argument("--skip-table", action="store_true", help="only the arrival test")
    parser.add_argument(
        "--head-on-last",
        action="store_true",
        help="also batched with argmax samplers (same tokens), which keeps the output head on the last rank",
    )
    parser.add_argument(
        "--lend-heads",
        type=int,
        default=0,
        help="also batched on a model sharded with lend_mlp=True, lend_heads=K (0: not)",
    )
    args = parser.parse_args()
    openblas = openblas_available()
    base: dict[str, Any] = {"M": args.prompt_tokens, "tokens": args.tokens, "step": 256, "config": BENCH_CONFIG}
    print(
        f"prompt {args.prompt_tokens} tokens, {args.tokens} generated per request; OpenBLAS {'on' if openblas else 'off'}"
    )
    header = f"{'R':>3} {'batched S=2':>12} {'one at a time':>14} {'mlx-lm batch':>13} {'vs one-at-a-time':>17} {'vs mlx-lm':>10}"
    if args.head_on_last:
        header += f" {'head on last':>13} {'vs mlx-lm':>10}"
    if args.lend_heads:
        header += f" {f'lend_heads={args.lend_heads}':>13} {'vs mlx-lm':>10}"
    if not args.skip_table:
        print(header)
    rows: list[dict[str, Any]] = []
    for r in [] if args.skip_table else (int(x) for x in args.requests.split(",")):
        batched = run_mode({**base, "R": r, "mode": "pipemlx_batch"}, openblas)
        serial = run_mode({**base, "R": r, "mode": "pipemlx_serial"}, openblas)
        single = run_mode({**base, "R": r, "mode": "mlx_batch"}, openblas)
        row = {"R": r, "pipemlx_batch": batched, "pipemlx_serial": serial, "mlx_batch": single}
        line = f"{r:>3} {batched:>12.1f} {serial:>14.1f} {single:>13.1f} {batched / serial:>17.2f} {batched / single:>10.2f}"
        if args.head_on_last:
            row["head_on_last"] = last = run_mode(
                {**base, "R": r, "mode": "pipemlx_batch", "head_on_last": True}, openblas
            )
            line += f" {last:>13.1f} {last / single:>10.2f}"
        if args.lend_heads:
            row["lent_heads"] = lent = run_mode(
                {**base, "R": r, "mode": "pipemlx_batch", "lend_heads": args.lend_heads}, openblas
            )
            line += f" {lent:>13.1f} {lent / single:>10.2f}"
        rows.append(row)
        print(line)
    arrival: dict[str, Any] = {}
    if args.arrival_tokens:
        chunks = [int(c) for c in args.chunks.split(",")]
        spec = {**base, "R": 4, "mode": "arrival", "arrival_tokens": args.arrival_tokens, "chunks": chunks}
        spec["chunkings"] = args.chunking.split(",")
        arrival = run_mode(spec, openblas)
        print(f"\n{args.arrival_tokens}-token prompt arriving while 4 requests decode")
        print(
            f"{'chunking':>10} {'chunk':>7} {'p95 between tokens before':>26} {'during':>8} {'ratio':>6} {'TTFT':>7} {'solo':>7} {'vs solo':>8}"
        )
        for run in arrival["runs"]:
            print(
                f"{run['chunking']:>10} {run['chunk']:>7} {run['p95_before'] * 1000:>23.1f} ms {run['p95_during'] * 1000:>5.0f} ms"
                f" {run['p95_during'] / run['p95_before']:>6.1f} {run['ttft']:>6.2f}s {run['solo']:>6.2f}s"
                f" {run['ttft'] / run['solo']:>8.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"table": rows, "arrival": arrival}, indent=2))


if __name__ == "__main__":
    main()
