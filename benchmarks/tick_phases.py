"""Where each rank's time goes in the ticks of an arrival: a long prompt prefilled while requests decode.

    python benchmarks/tick_phases.py [--arrival-tokens 2048] [--chunk 128] [--chunking equal-cost] [--requests 4]
                                     [--lend-mlp]

Two ranks (the benchmark model, OpenBLAS preloaded, one core per process), pipemlx.BatchGenerator: R requests
decode, then a prompt of --arrival-tokens arrives. For every tick until its first token, each rank's time per
tick in each blocking phase of the tick (see ranks/tick_phases_rank.py): handing the decode step, the chunk it
received and its new chunk to MLX (``mx.async_eval`` returns once most of a graph has run), receiving,
sending, and the tick's all-gather (the rest of the compute, then the collective); "python" is the rest
(planning the tick, building the graphs, bookkeeping). Run by hand, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys

from common import BENCH_CONFIG, HERE, bench_env, openblas_available

from pipemlx.launch import launch

PROGRAM = HERE / "ranks" / "tick_phases_rank.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arrival-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--chunking", default="equal-cost", choices=["fixed", "equal-cost"])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--lend-mlp", action="store_true", help="shard_model(..., lend='mlp')")
    args = parser.parse_args()
    spec = {
        "R": args.requests,
        "M": 32,
        "arrival_tokens": args.arrival_tokens,
        "chunk": args.chunk,
        "chunking": args.chunking,
        "config": BENCH_CONFIG,
        "lend_mlp": args.lend_mlp,
    }
    results = launch(2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=1800, env=bench_env(True))
    reports = sorted((json.loads(r.stdout.strip().splitlines()[-1]) for r in results), key=lambda r: r["rank"])
    print(
        f"OpenBLAS {'on' if openblas_available() else 'off'}; {args.requests} decoding, arrival of "
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


if __name__ == "__main__":
    main()
