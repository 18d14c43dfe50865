"""Where each rank's time goes per decoded token: one greedy stream, pipemlx.generate_step at S=2.

    python benchmarks/decode_phases.py [--shape light] [--tokens 128] [--repeats 3] [--sampled]

Two ranks (OpenBLAS preloaded, one core per rank), a 64-token prompt. For each rank, milliseconds per token in
each phase of a decode step (see ranks/decode_phases_rank.py): building its part of the graph, the bounded wait
for its own part (its layers, and its receive and send: on a later rank this includes waiting for the earlier
ranks), the shared head's all-gather, the step's message, the rest of the step in Python, and the time between
steps (yielding the token). Compare with ``benchmarks/decode.py``'s one-process figure for the same shape. Run
by hand on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys

from common import HERE, SHAPES, bench_env, openblas_available

from pipemlx.launch import launch

PROGRAM = HERE / "ranks" / "decode_phases_rank.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="light")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9, a repetition penalty")
    args = parser.parse_args()
    spec = {"M": 64, "tokens": args.tokens, "repeats": args.repeats, "config": SHAPES[args.shape]}
    spec["sampled"] = args.sampled
    results = launch(
        2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=1800, env=bench_env(openblas_available())
    )
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    phases = list(dict.fromkeys(k for r in reports for k in r["per_token_ms"]))
    print(f"shape {args.shape}, {'sampled' if args.sampled else 'greedy'}: ms per token")
    print(f"{'phase':<42}" + "".join(f"{'rank ' + str(r['rank']):>10}" for r in reports))
    for phase in phases:
        print(f"{phase:<42}" + "".join(f"{r['per_token_ms'].get(phase, 0.0):>10.2f}" for r in reports))
    print(f"{'tokens/s':<42}" + "".join(f"{r['tokens_per_s']:>10.1f}" for r in reports))


if __name__ == "__main__":
    main()
