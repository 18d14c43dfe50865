"""Prefill benchmark: one process vs mlx-lm's native pipeline vs pipemlx at S=2, each at its own best setting.

    python benchmarks/prefill.py                        # 2048 and 8192 tokens, the table below
    python benchmarks/prefill.py --lengths 2048 --repeats 3 --json out.json

For every prompt length, in one run: one process at steps 256, 512 and 2048; mlx-lm's native pipeline
(``model.model.pipeline(group)``) at steps 128, 256 and 512; pipemlx at the same fixed steps and with
``step_size="auto"``. Each time is the median over the repeats of the slowest rank's prefill (after one
warm-up), as ``pipemlx.observe.metrics`` defines it. The table gives each contender's time, its speed-up
over one process at one process's fastest step, over native at native's fastest step, and as a fraction
of the bound for perfect overlap: one process's best time divided by the share of the work the busiest
rank holds (the last layer counted at the share a prefill computes of it, see
``pipemlx.schedule.costmodel``), i.e. no bubble and no communication. The 512-d 8-layer qwen2 with random
weights, one core per process, OpenBLAS preloaded (../shared/NOTES.md); run by hand on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, openblas_available, run_ranks, run_single

from pipemlx.runtime.calibrate import last_layer_share
from pipemlx.schedule.split import even_split
from pipemlx.testing import build_model

SINGLE_STEPS = (256, 512, 2048)
PIPELINE_STEPS = (128, 256, 512)


def overlap_bound(ranks: int) -> float:
    """Speed-up with perfect overlap: all the work over the busiest rank's share of it."""
    layers = even_split(BENCH_CONFIG["num_hidden_layers"], ranks)
    share = last_layer_share(build_model(dict(BENCH_CONFIG)))
    work = [float(n) for n in layers]
    work[-1] -= 1.0 - share
    return sum(work) / max(work)


def median_prefill(reports: list[dict[str, Any]]) -> float:
    """A repeat ends when the slowest rank ends; the median over repeats."""
    repeats = len(reports[0]["prefill_s"])
    return statistics.median(max(r["prefill_s"][i] for r in reports) for i in range(repeats))


def measure(num_tokens: int, repeats: int, openblas: bool) -> list[dict[str, Any]]:
    """One row per contender and setting, all measured in this call."""
    base: dict[str, Any] = {"M": num_tokens, "repeats": repeats, "decode_tokens": 0, "config": BENCH_CONFIG}
    rows: list[dict[str, Any]] = []
    for step in SINGLE_STEPS:
        if step < num_tokens:
            rows.append(
                {
                    "who": "one process",
                    "setting": step,
                    "s": median_prefill([run_single({**base, "mode": "single", "step": step}, openblas)]),
                }
            )
    for step in PIPELINE_STEPS:
        rows.append(
            {
                "who": "native",
                "setting": step,
                "s": median_prefill(run_ranks(2, {**base, "mode": "native", "step": step}, openblas)),
            }
        )
    for step in PIPELINE_STEPS:
        rows.append(
            {
                "who": "pipemlx",
                "setting": step,
                "s": median_prefill(run_ranks(2, {**base, "mode": "pipemlx", "step": step}, openblas)),
            }
        )
    auto = run_ranks(2, {**base, "mode": "pipemlx", "step": "auto"}, openblas)
    rows.append({"who": "pipemlx", "setting": f"auto ({auto[0]['steps'][-1]})", "s": median_prefill(auto)})
    return rows


def print_table(num_tokens: int, rows: list[dict[str, Any]], bound: float) -> None:
    single = min(r["s"] for r in rows if r["who"] == "one process")
    native = min(r["s"] for r in rows if r["who"] == "native")
    best = {who: min((r for r in rows if r["who"] == who), key=lambda r: r["s"]) for who in ("one process", "native")}
    print(f"\n{num_tokens} tokens, S=2; bound for perfect overlap {bound:.2f}x")
    print(f"{'contender':<12} {'setting':>12} {'seconds':>8} {'vs one process':>15} {'vs native':>10} {'of bound':>9}")
    for r in rows:
        mark = " *" if r is best.get(r["who"]) else ""
        speedup = single / r["s"]
        print(
            f"{r['who']:<12} {str(r['setting']):>12} {r['s']:>8.2f} {speedup:>14.2f}x {native / r['s']:>9.2f}x "
            f"{speedup / bound:>8.0%}{mark}"
        )
    print("(* the contender's fastest setting; ratios against one process's and native's fastest)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,8192", help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-openblas", action="store_true")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    openblas = not args.no_openblas and openblas_available()
    bound = overlap_bound(2)
    print(
        f"OpenBLAS preload: {'on' if openblas else 'off'}; model: {BENCH_CONFIG['hidden_size']}-d, "
        f"{BENCH_CONFIG['num_hidden_layers']} layers ({BENCH_CONFIG['model_type']}); {args.repeats} repeats"
    )
    results: dict[int, list[dict[str, Any]]] = {}
    for num_tokens in (int(v) for v in args.lengths.split(",")):
        results[num_tokens] = measure(num_tokens, args.repeats, openblas)
        print_table(num_tokens, results[num_tokens], bound)
    if args.json:
        args.json.write_text(json.dumps({"bound": bound, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
