"""Concurrent requests: aggregate decode tokens/s with R = 1, 2, 4, 8 requests in flight, in one run.

    python benchmarks/concurrent_requests.py [--requests 1,2,4,8] [--prompt-tokens 32] [--tokens 33] [--json FILE]

Three ways of serving R requests on the benchmark model (BENCH_CONFIG, OpenBLAS preloaded, one core per
process): pipemlx.BatchGenerator on 2 ranks (the R requests decoded together through the pipeline),
pipemlx.generate_step on 2 ranks one request after another, and mlx-lm's own BatchGenerator in one process
holding all layers. Decode only: each request's tokens after its first (see ranks/concurrent_rank.py).
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


def run_mode(spec: dict[str, Any], openblas: bool) -> float:
    """Aggregate decode tokens/s of one mode: rank 0's figure (one process for mlx_batch)."""
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
    return float(json.loads(results[0].stdout.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="1,2,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=33, help="generated tokens per request (decode: all but 1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    openblas = openblas_available()
    base: dict[str, Any] = {"M": args.prompt_tokens, "tokens": args.tokens, "step": 256, "config": BENCH_CONFIG}
    print(
        f"prompt {args.prompt_tokens} tokens, {args.tokens} generated per request; OpenBLAS {'on' if openblas else 'off'}"
    )
    header = f"{'R':>3} {'batched S=2':>12} {'one at a time':>14} {'mlx-lm batch':>13} {'vs one-at-a-time':>17} {'vs mlx-lm':>10}"
    print(header)
    rows: list[dict[str, Any]] = []
    for r in (int(x) for x in args.requests.split(",")):
        batched = run_mode({**base, "R": r, "mode": "pipemlx_batch"}, openblas)
        serial = run_mode({**base, "R": r, "mode": "pipemlx_serial"}, openblas)
        single = run_mode({**base, "R": r, "mode": "mlx_batch"}, openblas)
        rows.append({"R": r, "pipemlx_batch": batched, "pipemlx_serial": serial, "mlx_batch": single})
        print(
            f"{r:>3} {batched:>12.1f} {serial:>14.1f} {single:>13.1f} {batched / serial:>17.2f} {batched / single:>10.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
