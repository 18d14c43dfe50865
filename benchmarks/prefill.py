"""Prefill benchmark: one process vs mlx-lm's native pipeline vs pipemlx at S=2, in one run.

    python benchmarks/prefill.py                    # the reference setup (512-d 8-layer qwen2, 2048 tokens, step 256)
    python benchmarks/prefill.py --sweep            # step sizes x prompt lengths
    python benchmarks/prefill.py --json out.json

Prints times, speed-ups over one process, pipemlx over mlx-lm native, and efficiency against the
ideal S*n/(n+S-1) for n chunks. Uses the OpenBLAS preload (../shared/NOTES.md) and pins each process
to one core. Run by hand on an otherwise idle machine; the numbers are only comparable within a run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, openblas_available, run_ranks, run_single


def ideal(num_tokens: int, step: int, ranks: int) -> float:
    n = math.ceil((num_tokens - 1) / step)
    return ranks * n / (n + ranks - 1)


def measure(num_tokens: int, step: int, repeats: int, decode_tokens: int, openblas: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "M": num_tokens,
        "step": step,
        "repeats": repeats,
        "decode_tokens": decode_tokens,
        "config": BENCH_CONFIG,
    }
    single = run_single({**spec, "mode": "single"}, openblas)
    native = run_ranks(2, {**spec, "mode": "native"}, openblas)
    piped = run_ranks(2, {**spec, "mode": "pipemlx"}, openblas)

    def prefill_of(reports: list[dict[str, Any]]) -> float:
        # A repeat ends when the slowest rank ends; take the median over repeats.
        per_repeat = [max(r["prefill_s"][i] for r in reports) for i in range(repeats)]
        return statistics.median(per_repeat)

    def decode_of(reports: list[dict[str, Any]]) -> float:
        return statistics.median(reports[0]["decode_tok_s"])

    t_single, t_native, t_pipe = prefill_of([single]), prefill_of(native), prefill_of(piped)
    best = ideal(num_tokens, step, 2)
    return {
        "M": num_tokens,
        "step": step,
        "single_s": t_single,
        "native_s": t_native,
        "pipemlx_s": t_pipe,
        "native_speedup": t_single / t_native,
        "pipemlx_speedup": t_single / t_pipe,
        "pipemlx_over_native": t_native / t_pipe,
        "ideal_speedup": best,
        "efficiency": (t_single / t_pipe) / best,
        "decode_single_tok_s": decode_of([single]),
        "decode_pipemlx_tok_s": decode_of(piped),
        "decode_ratio": decode_of(piped) / decode_of([single]),
    }


def sweep(lengths: list[int], steps: list[int], repeats: int, openblas: bool) -> list[dict[str, Any]]:
    """For each prompt length: one process and pipemlx at each fixed step, and pipemlx with step "auto"."""
    rows: list[dict[str, Any]] = []
    for m in lengths:
        base: dict[str, Any] = {"M": m, "repeats": repeats, "decode_tokens": 0, "config": BENCH_CONFIG}
        row: dict[str, Any] = {"M": m, "single_s": {}, "pipemlx_s": {}}
        for s in [s for s in steps if s < m]:
            single = run_single({**base, "mode": "single", "step": s}, openblas)
            piped = run_ranks(2, {**base, "mode": "pipemlx", "step": s}, openblas)
            row["single_s"][s] = statistics.median(single["prefill_s"])
            row["pipemlx_s"][s] = statistics.median(max(r["prefill_s"][i] for r in piped) for i in range(repeats))
        auto = run_ranks(2, {**base, "mode": "pipemlx", "step": "auto"}, openblas)
        row["auto_s"] = statistics.median(max(r["prefill_s"][i] for r in auto) for i in range(repeats))
        row["auto_step"] = auto[0]["steps"][-1]
        best_step = min(row["pipemlx_s"], key=row["pipemlx_s"].get)
        row["best_fixed_step"], row["best_fixed_s"] = best_step, row["pipemlx_s"][best_step]
        row["auto_vs_best"] = row["best_fixed_s"] / row["auto_s"]
        rows.append(row)
        cells = "  ".join(
            f"{s}: {row['single_s'][s] / row['pipemlx_s'][s]:.2f}x ({row['pipemlx_s'][s]:.2f}s)"
            for s in row["pipemlx_s"]
        )
        print(f"M={m:>5}  speed-up over one process at step {cells}")
        print(
            f"         auto chose {row['auto_step']}: {row['auto_s']:.2f}s = {row['auto_vs_best']:.1%} of the best "
            f"fixed step's throughput (step {best_step}, {row['best_fixed_s']:.2f}s)",
            flush=True,
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'M':>6} {'step':>5} {'single s':>9} {'native s':>9} {'pipemlx s':>9} "
        f"{'native x':>8} {'pipemlx x':>9} {'vs native':>9} {'ideal x':>7} {'effic.':>6} {'decode x':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['M']:>6} {r['step']:>5} {r['single_s']:>9.3f} {r['native_s']:>9.3f} {r['pipemlx_s']:>9.3f} "
            f"{r['native_speedup']:>8.2f} {r['pipemlx_speedup']:>9.2f} {r['pipemlx_over_native']:>9.2f} "
            f"{r['ideal_speedup']:>7.2f} {r['efficiency']:>6.1%} {r['decode_ratio']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--step", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--sweep", action="store_true", help="one process vs pipemlx: steps 64..512 x lengths, and auto"
    )
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192", help="prompt lengths for --sweep")
    parser.add_argument("--steps", default="64,128,256,512", help="fixed step sizes for --sweep")
    parser.add_argument("--no-openblas", action="store_true")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    openblas = not args.no_openblas and openblas_available()
    print(
        f"OpenBLAS preload: {'on' if openblas else 'off'}; model: {BENCH_CONFIG['hidden_size']}-d, "
        f"{BENCH_CONFIG['num_hidden_layers']} layers ({BENCH_CONFIG['model_type']})"
    )
    if args.sweep:
        lengths = [int(v) for v in args.lengths.split(",")]
        steps = [int(v) for v in args.steps.split(",")]
        rows = sweep(lengths, steps, args.repeats, openblas)
    else:
        rows = [measure(args.tokens, args.step, args.repeats, args.decode_tokens, openblas)]
        print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
