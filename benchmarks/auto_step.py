"""prefill_step_size="auto" against the best fixed step: pipemlx at S=2, same model and prompt, in one run.

    python benchmarks/auto_step.py [--lengths 1024,2048,4096] [--steps 64,128,256,512] [--rounds 3]

Each round runs every fixed step and "auto" once per prompt length (each launch warms up first, the
auto launch calibrating there); the table shows median prefill seconds over the rounds and auto's
throughput as a share of the best fixed step's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, openblas_available, run_ranks


def prefill_seconds(num_tokens: int, step: int | str, openblas: bool) -> tuple[float, int]:
    spec: dict[str, Any] = {
        "mode": "pipemlx",
        "M": num_tokens,
        "step": step,
        "repeats": 2,
        "decode_tokens": 0,
        "config": BENCH_CONFIG,
    }
    reports = run_ranks(2, spec, openblas)
    seconds = statistics.median(max(r["prefill_s"][i] for r in reports) for i in range(2))
    return seconds, reports[0]["steps"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--steps", default="64,128,256,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    openblas = openblas_available()
    lengths = [int(v) for v in args.lengths.split(",")]
    steps: list[int | str] = [int(v) for v in args.steps.split(",")] + ["auto"]
    times: dict[tuple[int, str], list[float]] = {}
    chosen: dict[int, int] = {}
    for _ in range(args.rounds):
        for m in lengths:
            for step in steps:
                seconds, used = prefill_seconds(m, step, openblas)
                times.setdefault((m, str(step)), []).append(seconds)
                if step == "auto":
                    chosen[m] = used
    rows: list[dict[str, Any]] = []
    print(f"{'M':>6}  " + "  ".join(f"{str(s):>8}" for s in steps) + "   auto chose   auto vs best")
    for m in lengths:
        median = {str(s): statistics.median(times[(m, str(s))]) for s in steps}
        fixed = {s: t for s, t in median.items() if s != "auto"}
        best = min(fixed, key=fixed.__getitem__)
        share = fixed[best] / median["auto"]
        rows.append(
            {"M": m, "seconds": median, "auto_step": chosen[m], "best_fixed_step": int(best), "auto_vs_best": share}
        )
        print(
            f"{m:>6}  " + "  ".join(f"{median[str(s)]:>7.2f}s" for s in steps) + f"   {chosen[m]:>10}   {share:>11.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
