"""Where each rank's time goes in batch ticks: an arrival while requests decode, or steady batched decode.

    python benchmarks/tick_phases.py [--arrival-tokens 2048] [--chunk 128] [--chunking equal-cost] [--requests 4]
                                     [--lend-mlp]
    python benchmarks/tick_phases.py --steady [--requests 4,8,16] [--decode-groups 1,2]
                                     [--shapes light,bench,qwen2.5-0.5b] [--ticks 40] [--warmup 10] [--sync]
                                     [--no-logprobs] [--head auto|all|split|last] [--compile-probe STEPS]
                                     [--compiled-decode off,on]
                                     [--json FILE]

Two ranks (OpenBLAS preloaded, one core per process), pipemlx.BatchGenerator (see ranks/tick_phases_rank.py).

Arrival (the default; the benchmark model): R requests decode, then a prompt of --arrival-tokens arrives. For
every tick until its first token, each rank's time per tick in each blocking phase of the tick: handing the
decode step, the chunk it received and its new chunk to MLX (``mx.async_eval`` returns once most of a graph has
run), receiving, sending, and the tick's all-gather (the rest of the compute, then the collective); "python" is
the rest (planning the tick, building the graphs, bookkeeping).

--steady: no arrival. For each shape of --shapes (benchmarks/common.py SHAPES and first_run.py's published
ones: "qwen2.5-0.5b", "llama-3.2-1b", random weights, full precision), each R of --requests and each
``decode_groups`` of --decode-groups (1: one group; 2: groups in flight from 2 live rows), R requests decode and
--ticks steady ticks are timed after --warmup. Per tick and per rank: building the layers' graph and the
samples' (Python), handing each graph to MLX (``issue: ...``), each blocking wait (``wait: ...``: the tick's
all-gather, the shared or split head's), the rest of the tick's Python, the ms per tick and per token; then the
counts per tick of collectives, point-to-point messages and syncs (``mx.eval``, ``mx.async_eval``). MLX computes
the layers on its own thread, so their compute hides in the waits; --sync synchronizes after every hand-off
and shows it apart (``compute after: ...``), at the price of the overlap (slower ticks). Run by hand, on an
otherwise idle machine, when the figures matter. --no-logprobs makes the generator as ``pipemlx serve`` does
(greedy ticks may then share the head instead of gathering the logits); --head picks ``shard_model``'s head.
--compile-probe STEPS times, on each rank after the runs, its layers' decode step for R and R/2 rows eager (mlx-lm's
cache, the graph built every step) against ``mx.compile``d over a fixed-room cache (what compiling the batch's
decode forward could save; ranks/tick_phases_rank.py ``compile_probe``). --compiled-decode off,on runs each
configuration with ``BatchGenerator(compiled_decode=...)`` off and on (the layers' decode step compiled:
pipemlx/runtime/batch/compiled.py), in one run; each run says how many of its timed ticks each rank decoded
compiled and how many traces it made.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from common import BENCH_CONFIG, HERE, SHAPES, bench_env, openblas_available
from first_run import SHAPES as PUBLISHED_SHAPES

from pipemlx.launch import launch

PROGRAM = HERE / "ranks" / "tick_phases_rank.py"


def ranks(spec: dict[str, Any]) -> list[dict[str, Any]]:
    results = launch(2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=3600, env=bench_env(True))
    return sorted((json.loads(r.stdout.strip().splitlines()[-1]) for r in results), key=lambda r: r["rank"])


def arrival(args: argparse.Namespace) -> None:
    requests = int(args.requests.split(",")[0])
    spec = {
        "R": requests,
        "M": 32,
        "arrival_tokens": args.arrival_tokens,
        "chunk": args.chunk,
        "chunking": args.chunking,
        "config": BENCH_CONFIG,
        "lend_mlp": args.lend_mlp,
    }
    reports = ranks(spec)
    print(
        f"OpenBLAS {'on' if openblas_available() else 'off'}; {requests} decoding, arrival of "
        f"{args.arrival_tokens} tokens, {args.chunking} chunks of {args.chunk}"
        + (", lend_mlp" if args.lend_mlp else "")
    )
    print(f"undisturbed ticks (ms, rank 0): {reports[0]['undisturbed_ms']}")
    print(f"arrival: {reports[0]['ticks']} ticks, first token after {reports[0]['ttft']:.2f} s")
    phases = sorted({p for r in reports for p in r["per_tick_ms"]})
    print(f"{'ms per tick':<12}" + "".join(f"{p:>12}" for p in [*phases, "python"]))
    for r in reports:
        cells = [r["per_tick_ms"].get(p, 0.0) for p in phases] + [r["python_ms"]]
        print(f"{'rank ' + str(r['rank']):<12}" + "".join(f"{c:>12.1f}" for c in cells))


def steady(args: argparse.Namespace) -> None:
    shapes = {**SHAPES, **PUBLISHED_SHAPES}
    groups = [g if g == "auto" else int(g) for g in args.decode_groups.split(",")]
    requests = [int(r) for r in args.requests.split(",")]
    print(
        f"OpenBLAS {'on' if openblas_available() else 'off'}; steady batched decode, S=2, {args.ticks} ticks "
        f"after {args.warmup}" + (", synchronized after every hand-off" if args.sync else "")
    )
    found: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        spec = {
            "mode": "steady",
            "config": shapes[shape],
            "requests": requests,
            "groups": groups,
            "M": args.prompt_tokens,
            "warmup": args.warmup,
            "ticks": args.ticks,
            "sync": args.sync,
            "lend_mlp": args.lend_mlp,
            "logprobs": not args.no_logprobs,
            "head": args.head,
            "probe": args.compile_probe,
            "compiled": [value == "on" for value in args.compiled_decode.split(",")],
        }
        reports = ranks(spec)
        for r in reports if args.compile_probe else []:
            probe = r["probe"]
            cells = ", ".join(
                f"{n} rows {p['eager_ms']:.2f} eager / {p['compiled_ms']:.2f} compiled"
                f" (outputs differ by {p['relative_difference']:.1e})"
                for n, p in probe["rows"].items()
            )
            where = f"{shape}, rank {r['rank']}'s {probe['layers']} layers at {probe['context']} positions"
            print(f"{where}, ms per step: {cells}")
        for index, run in enumerate(reports[0]["runs"]):
            both = [r["runs"][index] for r in reports]
            found.append(
                {"shape": shape, "R": run["R"], "groups": run["groups"], "compiled": run["compiled"], "ranks": both}
            )
            tokens = run["tokens_per_tick"]
            compiled = (
                ", compiled_decode: ticks compiled "
                + "/".join(str(r["compiled_steps"]) for r in both)
                + ", traces "
                + "/".join(str(r["traces"]) for r in both)
                if run["compiled"]
                else ""
            )
            print(
                f"\n{shape}, R={run['R']}, decode_groups={run['groups']}{compiled}: {run['tick_ms']:.2f} ms per tick "
                f"(rank 0), {tokens:.2f} tokens per tick, "
                + (f"{run['tick_ms'] / tokens:.2f} ms per token" if tokens else "no tokens")
            )
            if run["groups"] == "auto":  # what decode_groups="auto" measured (every rank alike) and chose
                costs = ", ".join(f"{k} {v:.2f}" for k, v in run.get("group_costs_ms", {}).items())
                print(
                    f"auto: {run.get('splits', 0)} splits, {run.get('merges', 0)} merges (warm-up included); "
                    f"measured ms per token: {costs or 'none yet (more --warmup)'}"
                )
            phases = sorted({p for r in both for p in r["per_tick_ms"]})
            width = max(12, *(len(p) + 2 for p in phases))
            print(f"{'ms per tick':<{width}}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(both))))
            for phase in [*phases, "python", "tick"]:
                cells = [
                    r["python_ms"]
                    if phase == "python"
                    else r["tick_ms"]
                    if phase == "tick"
                    else r["per_tick_ms"].get(phase, 0.0)
                    for r in both
                ]
                print(f"{phase:<{width}}" + "".join(f"{c:>10.2f}" for c in cells))
            counts = sorted({c for r in both for c in r["counts"]})
            print(f"{'per tick':<{width}}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(both))))
            for count in counts:
                print(f"{count:<{width}}" + "".join(f"{r['counts'].get(count, 0.0):>10.2f}" for r in both))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steady", action="store_true", help="steady batched decode instead of an arrival")
    parser.add_argument("--arrival-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--chunking", default="equal-cost", choices=["fixed", "equal-cost"])
    parser.add_argument("--requests", default=None, help="R (arrival: 4); --steady: comma-separated (4,8,16)")
    parser.add_argument("--lend-mlp", action="store_true", help="shard_model(..., lend='mlp')")
    parser.add_argument("--shapes", default="light,bench,qwen2.5-0.5b", help="--steady: model shapes")
    parser.add_argument("--decode-groups", default="1,2", help="--steady: decode_groups values, comma-separated")
    parser.add_argument("--ticks", type=int, default=40, help="--steady: ticks timed per configuration")
    parser.add_argument("--warmup", type=int, default=10, help="--steady: ticks run before timing")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="--steady: each request's prompt")
    parser.add_argument("--sync", action="store_true", help="--steady: synchronize after every hand-off")
    parser.add_argument(
        "--no-logprobs", action="store_true", help="--steady: BatchGenerator(logprobs=False), as serve makes it"
    )
    parser.add_argument("--head", default="auto", help="--steady: shard_model(head=...): auto, all, split, last")
    parser.add_argument(
        "--compile-probe",
        type=int,
        default=0,
        metavar="STEPS",
        help="--steady: also time each rank's layers eager against compiled over a fixed-room cache, STEPS steps",
    )
    parser.add_argument(
        "--compiled-decode",
        default="off",
        choices=["off", "on", "off,on", "on,off"],
        help="--steady: BatchGenerator(compiled_decode=...) for each configuration, comma-separated",
    )
    parser.add_argument("--json", default=None, help="--steady: write every rank's figures here")
    args = parser.parse_args()
    if args.requests is None:
        args.requests = "4,8,16" if args.steady else "4"
    (steady if args.steady else arrival)(args)


if __name__ == "__main__":
    main()
