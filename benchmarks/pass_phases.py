"""Where each rank's time goes in a pass of speculative decoding: the demo model and its draft at S=2, greedy.

    python benchmarks/pass_phases.py [--tokens 128] [--repeats 2] [--lookup 3] [--no-pin] [--sync]

On the demo prompt, pipemlx.generate_step plain, with the draft in serial passes (k=2, k=3) and in pipelined
passes (k=3), and with prompt lookup in serial passes (k=3). For each contender and each rank, milliseconds per
pass and per decoded token in each phase (see ranks/pass_phases_rank.py): the proposals (on the rank that makes
them: the last rank in serial passes, rank 0 in pipelined ones), building the graph, issuing the send, each wait
(in serial passes a rank's own part is one wait: receiving the previous rank's hidden states, its layers, its
send, and on the last rank the verification; pipelined passes wait for the receive apart), the head, the pass's
agreement (all-gather), cutting the caches back, Python, and the time between passes; then tokens per pass, the
guesses confirmed, and where each rank waits most. --sync evaluates each receive apart as soon as it is built,
so that a serial pass's own part holds the rank's layers alone (the schedule changes a little: the last rank's
draft makes its guesses ahead only after the receive). OpenBLAS preloaded, each rank pinned to its own core; run by
hand on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from common import HERE, bench_env, openblas_available

from pipemlx.demo import DRAFT_DIR, MODEL_DIR
from pipemlx.launch import launch

PROGRAM = HERE / "ranks" / "pass_phases_rank.py"


def table(label: str, rows: list[dict[str, Any]]) -> None:
    """One contender's phases, per rank: ms per pass and per token; then the counts and the waits."""
    phases = sorted({p for r in rows for p in r["ms"]}, key=lambda p: -max(r["ms"].get(p, 0.0) for r in rows))
    first = rows[0]
    tokens, passes = first["tokens"], max(first["passes"], 1)
    proposed, confirmed = int(first.get("proposed", 0)), int(first.get("confirmed", 0))
    print(f"\n{label}: {tokens / passes:.2f} tokens a pass, {first['tokens'] / first['seconds']:.1f} tokens/s", end="")
    print(f", guesses confirmed {confirmed}/{proposed}" if proposed else "")
    print(
        f"{'phase (ms)':<52}"
        + "".join(f"{'r' + str(i) + ' /pass':>11}{'r' + str(i) + ' /tok':>10}" for i in range(len(rows)))
    )
    for phase in phases:
        cells = "".join(
            f"{r['ms'].get(phase, 0.0) / max(r['passes'], 1):>11.2f}{r['ms'].get(phase, 0.0) / r['tokens']:>10.2f}"
            for r in rows
        )
        print(f"{phase:<52}{cells}")
    total = "".join(
        f"{r['seconds'] * 1e3 / max(r['passes'], 1):>11.2f}{r['seconds'] * 1e3 / r['tokens']:>10.2f}" for r in rows
    )
    print(f"{'total':<52}{total}")
    waits: list[str] = []
    for i, r in enumerate(rows):
        top = sorted(((v, p) for p, v in r["ms"].items() if p.startswith("wait")), reverse=True)[:2]
        waits.append(f"rank {i} waits: " + ", ".join(f"{p[6:]} {v / max(r['passes'], 1):.1f} ms/pass" for v, p in top))
    print(" / ".join(waits))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lookup", type=int, default=3, help="prompt lookup's longest n-gram")
    parser.add_argument("--no-pin", action="store_true")
    help = "evaluate each receive of the previous rank's hidden states apart: its wait, then the layers alone"
    parser.add_argument("--sync", action="store_true", help=help)
    args = parser.parse_args()
    spec = {
        "draft": str(DRAFT_DIR),
        "prompt": (MODEL_DIR.parent / "prompt.txt").read_text(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "lookup": args.lookup,
        "pin": not args.no_pin,
        "sync": args.sync,
    }
    results = launch(
        2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=1800, env=bench_env(openblas_available())
    )
    reports = sorted((json.loads(r.stdout.strip().splitlines()[-1]) for r in results), key=lambda r: r["rank"])
    print(f"demo model, S=2, greedy, {args.tokens} tokens, {args.repeats} runs after a warm-up (per rank: r0, r1)")
    for label in (k for k in reports[0] if k != "rank"):
        table(label, [r[label] for r in reports])


if __name__ == "__main__":
    main()
