"""Concurrent requests: aggregate decode tokens/s with R = 1, 2, 4, 8 requests in flight, in one run.

    python benchmarks/concurrent_requests.py [--requests 1,2,4,8] [--prompt-tokens 32] [--tokens 33] [--json FILE]
                                             [--shapes light,bench] [--repeat 1] [--no-pin]
                                             [--no-serial] [--head-on-last] [--lend-heads K] [--decode-groups 1,auto]
                                             [--arrival-tokens 4096 --chunks 32,64,128 --chunking fixed,equal-cost]

Three ways of serving R requests on each model shape of --shapes (OpenBLAS preloaded, one core per process
unless --no-pin): pipemlx.BatchGenerator on 2 ranks (the R requests decoded together through the pipeline),
pipemlx.generate_step on 2 ranks one request after another
(left out with --no-serial), and mlx-lm's own BatchGenerator in one process holding all layers. --decode-groups
gives one batched contender per value of the generator's ``decode_groups`` (1: one group, every rank in turn;
"auto"; n: groups in flight whenever n rows are live: 2 forces them): one group against groups in flight, each
against mlx-lm's. --shapes takes the realistic shapes of first_run.py too ("qwen2.5-0.5b", "llama-3.2-1b": the
published models' configurations, random weights, full precision; a few GB per process). Decode only:
each request's tokens after its first (see ranks/concurrent_rank.py); with --repeat N each figure is the best
of N runs in one process. The batched contenders print "whole/window (load)": tokens/s over the whole decode,
over its quietest stretch of 4 tokens per request (the best such stretch of the N runs), and the 1-minute load
average before the run: the machine is shared, and other work slows every contender; "vs mlx-lm" gives both
ratios. The shapes (benchmarks/common.py SHAPES): "light" (a 512-wide, 8-layer qwen2
with a 1,024-entry vocabulary: the output head is 2% of the weights) and "bench" (the same layers with the
32,000-entry vocabulary of BENCH_CONFIG: 37%).
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

from common import BENCH_CONFIG, HERE, SHAPES, bench_env, openblas_available
from first_run import SHAPES as PUBLISHED_SHAPES

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
        report = json.loads(out.stdout.strip().splitlines()[-1])
        return (
            (float(report["tok_s"]), float(report.get("window", 0.0))) if spec.get("window") else float(report["tok_s"])
        )
    results = launch(2, command, timeout=1800, env=bench_env(openblas))
    report = json.loads(results[0].stdout.strip().splitlines()[-1])
    if spec["mode"] == "arrival":
        return report
    if spec.get("window"):
        return float(report["tok_s"]), float(report.get("window", 0.0)), report.get("groups") or {}
    return float(report["tok_s"])


def load() -> float:
    """The 1-minute load average: what else the machine is running (2 cores here)."""
    return os.getloadavg()[0]


def timed(spec: dict[str, Any], openblas: bool) -> tuple[float, float]:
    """``run_mode``'s tokens/s of ``spec`` and the load average right before it ran."""
    before = load()
    return float(run_mode(spec, openblas)), before


def windowed(spec: dict[str, Any], openblas: bool) -> tuple[float, float, float, dict[str, Any]]:
    """``run_mode``'s tokens/s of ``spec`` over the whole decode and over its quietest stretch (4 tokens per
    request), the load average right before it ran, and (pipemlx batched) its decode groups' splits, merges and
    ``decode_groups="auto"``'s measured seconds per token (``BatchGenerator.group_costs``)."""
    before = load()
    figures = run_mode({**spec, "window": True}, openblas)
    whole, window = figures[0], figures[1]
    return whole, window, before, figures[2] if len(figures) > 2 else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="1,2,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=33, help="generated tokens per request (decode: all but 1)")
    parser.add_argument("--json", type=Path)
    shapes = {**SHAPES, **PUBLISHED_SHAPES}
    parser.add_argument("--shapes", default="light,bench", help=f"model shapes, of {sorted(shapes)}")
    parser.add_argument(
        "--decode-groups",
        default="1",
        help="the batched contenders' decode_groups, comma-separated (e.g. 1,auto,2: one group, auto, forced); a "
        "trailing 'c' also compiles the decode step (1c: one group, compiled_decode=True)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="best of this many runs per figure")
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned")
    parser.add_argument("--no-serial", action="store_true", help="leave out generate_step one request at a time")
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
    groups = args.decode_groups.split(",")  # one batched contender each ("1c": decode_groups=1, compiled_decode)

    def generator_args(name: str) -> dict[str, Any]:
        value = name.removesuffix("c")
        return {"decode_groups": value if value == "auto" else int(value), "compiled_decode": name.endswith("c")}

    print(
        f"prompt {args.prompt_tokens} tokens, {args.tokens} generated per request; OpenBLAS {'on' if openblas else 'off'}; "
        f"{'unpinned' if args.no_pin else 'one core per process'}; best of {args.repeat}; tokens/s (load average)"
    )
    rows: list[dict[str, Any]] = []
    for shape in [] if args.skip_table else args.shapes.split(","):
        config = shapes[shape]
        base: dict[str, Any] = {
            "M": args.prompt_tokens,
            "tokens": args.tokens,
            "step": 256,
            "config": config,
            "repeat": args.repeat,
            "pin": not args.no_pin,
        }
        names = [f"batched S=2 groups={g}" for g in groups]
        header = f"{shape:<10} {'R':>3} " + "".join(f"{n:>24}" for n in names) + f"{'mlx-lm batch':>24}"
        header += "".join(f"{'vs mlx-lm':>12}" for _ in names)
        if not args.no_serial:
            header += f"{'one at a time':>22}"
        if args.head_on_last:
            header += f"{'head on last':>22}{'vs mlx-lm':>10}"
        if args.lend_heads:
            header += f"{f'lend_heads={args.lend_heads}':>22}{'vs mlx-lm':>10}"
        print(header)
        for r in (int(x) for x in args.requests.split(",")):
            spec = {**base, "R": r}
            batched = [windowed({**spec, "mode": "pipemlx_batch", **generator_args(g)}, openblas) for g in groups]
            single = windowed({**spec, "mode": "mlx_batch"}, openblas)
            row: dict[str, Any] = {"shape": shape, "R": r, "mlx_batch": single}
            row["pipemlx_batch"] = {str(g): b for g, b in zip(groups, batched)}  # ..., groups (splits, merges, costs)
            both = lambda f: f"{f[0]:>10.1f}/{f[1]:.1f} ({f[2]:.2f})"  # noqa: E731  # whole/window (load)
            cell = lambda figure: f"{figure[0]:>15.1f} ({figure[1]:.2f})"  # noqa: E731
            line = f"{shape:<10} {r:>3} " + "".join(both(b) for b in batched) + both(single)
            line += "".join(f"{b[0] / single[0]:>7.2f}/{b[1] / single[1]:.2f}" for b in batched)
            if not args.no_serial:
                row["pipemlx_serial"] = serial = timed({**spec, "mode": "pipemlx_serial"}, openblas)
                line += cell(serial)
            if args.head_on_last:
                row["head_on_last"] = last = timed({**spec, "mode": "pipemlx_batch", "head_on_last": True}, openblas)
                line += cell(last) + f"{last[0] / single[0]:>10.2f}"
            if args.lend_heads:
                row["lent_heads"] = lent = timed(
                    {**spec, "mode": "pipemlx_batch", "lend_heads": args.lend_heads}, openblas
                )
                line += cell(lent) + f"{lent[0] / single[0]:>10.2f}"
            rows.append(row)
            print(line, flush=True)
            for name, figure in zip(groups, batched):  # what decode_groups="auto" measured and chose (rank 0)
                if name.removesuffix("c") == "auto" and figure[3]:
                    costs = ", ".join(f"{k} {v * 1000:.2f}" for k, v in figure[3]["costs"].items())
                    print(
                        f"{'':<14}groups={name}: {figure[3]['splits']} splits, {figure[3]['merges']} merges;"
                        f" measured ms per token: {costs or 'none'}",
                        flush=True,
                    )
    arrival: dict[str, Any] = {}
    if args.arrival_tokens:
        base = {"M": args.prompt_tokens, "tokens": args.tokens, "step": 256, "config": BENCH_CONFIG}
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
