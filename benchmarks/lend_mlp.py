"""Whole layers against ``lend_mlp`` (the cut inside rank 0's last layer), cut by cut, in one launch.

    python benchmarks/lend_mlp.py [--tokens 2048] [--rounds 4] [--cuts u128,u256,128+3/4,192+3/4,256+3/4,auto]

Two ranks (the benchmark model, OpenBLAS preloaded, one core per process). One launch holds two sharded
models of the same weights, ``shard_model(..., lend_mlp=False)`` and ``lend_mlp=True``; every round
prefills the prompt with each cut on each model in turn (see ranks/cuts_rank.py), so both share the
machine's drift. Cuts: ``uN`` uniform N-token chunks, ``N+3/4`` N-token chunks then a tail shrinking by
3/4 (``tail_lengths``), ``auto`` each model's own ``step_size="auto"`` choice (its calibrated cost model).
Prints each cut's best and median seconds with and without the cut inside the layer, their ratio, and
whether both gave the same tokens after the prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from common import BENCH_CONFIG, HERE, bench_env, openblas_available

from pipemlx.launch import launch
from pipemlx.schedule.autostep import tail_lengths, uniform_lengths

PROGRAM = HERE / "ranks" / "cuts_rank.py"


def cut_of(name: str, num_tokens: int) -> tuple[int, ...] | None:
    """``u128`` -> uniform 128; ``256+3/4`` -> 256 with a 3/4 tail; ``auto`` -> None (auto's own choice)."""
    if name == "auto":
        return None
    if name.startswith("u"):
        return uniform_lengths(num_tokens, int(name[1:]))
    step, ratio = name.split("+")
    numerator, denominator = ratio.split("/")
    cut = tail_lengths(num_tokens, int(step), int(numerator) / int(denominator))
    if cut is None:
        raise SystemExit(f"{name}: the prompt is too short for that tail")
    return cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cuts", default="u128,u256,128+3/4,192+3/4,256+3/4,auto")
    args = parser.parse_args()
    names = args.cuts.split(",")
    cuts = {name: cut_of(name, args.tokens) for name in names}
    spec: dict[str, Any] = {
        "M": args.tokens,
        "rounds": args.rounds,
        "cuts": cuts,
        "config": BENCH_CONFIG,
        "lend_mlp": [False, True],
    }
    results = launch(
        2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=7200, env=bench_env(openblas_available())
    )
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    tokens = reports[0]["tokens"]
    print(f"{args.tokens} tokens, S=2, {args.rounds} round(s); same tokens: {len(set(map(str, tokens.values()))) == 1}")
    print(f"{'cut':<10} {'whole layers best / median':>28} {'lend_mlp best / median':>24} {'best ratio':>11}")
    for name in names:
        times = {}
        for lend in (False, True):
            label = f"lend_mlp={lend} {name}"
            times[lend] = [max(r["seconds"][label][i] for r in reports) for i in range(args.rounds)]
        whole, lent = times[False], times[True]
        print(
            f"{name:<10} {min(whole):>14.3f} / {statistics.median(whole):<11.3f} "
            f"{min(lent):>10.3f} / {statistics.median(lent):<11.3f} {min(whole) / min(lent):>9.3f}x"
        )


if __name__ == "__main__":
    main()
