"""Whole layers against ``lend_mlp`` (the cut inside rank 0's last layer), cut by cut, in one launch.

    python benchmarks/lend_mlp.py [--tokens 2048] [--rounds 4] [--cuts u128,u256,128+3/4,192+3/4,256+3/4,auto]
        [--lend-heads 1,2] [--no-whole] [--native]

Two ranks (the benchmark model, OpenBLAS preloaded, one core per process). One launch holds several sharded
models of the same weights: whole layers (``lend_mlp=False``, unless ``--no-whole``), ``lend_mlp=True``, and
``lend_mlp=True, lend_heads=k`` for each ``k`` of ``--lend-heads``, and with ``--native`` mlx-lm's native
pipeline first (``model.model.pipeline(group)``, uniform cuts only); every round prefills the prompt with
each cut on each model in turn (see ranks/cuts_rank.py), so all share the machine's drift. Cuts: ``uN`` uniform N-token chunks, ``N+3/4`` N-token chunks then a tail shrinking by
3/4 (``tail_lengths``), ``auto`` each model's own ``prefill_step_size="auto"`` choice (its calibrated cost model).
Prints each cut's best and median seconds per sharding, each best against whole layers' (or ``lend_mlp``'s
with ``--no-whole``), and whether all gave the same tokens after the prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from common import BENCH_CONFIG, HERE, bench_env, describe_cut, openblas_available

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
    parser.add_argument(
        "--lend-heads",
        default="",
        help="comma-separated key-value head counts to lend too (auto: shard_model's choice)",
    )
    parser.add_argument("--no-whole", action="store_true", help="leave out the whole-layer sharding")
    parser.add_argument("--native", action="store_true", help="also mlx-lm's native pipeline (uniform cuts only)")
    args = parser.parse_args()
    names = args.cuts.split(",")
    cuts = {name: cut_of(name, args.tokens) for name in names}
    shardings: dict[str, dict[str, Any]] = {"native": {"native": True}} if args.native else {}
    if not args.no_whole:
        shardings["whole layers"] = {"lend": "none"}
    shardings["lend_mlp"] = {"lend": "mlp"}
    for heads in filter(None, args.lend_heads.split(",")):
        lent: dict[str, Any] = {"lend": "auto", "context": args.tokens}  # for this prompt
        shardings[f"lend_heads={heads}"] = lent if heads == "auto" else {"lend": int(heads)}
    spec: dict[str, Any] = {
        "M": args.tokens,
        "rounds": args.rounds,
        "cuts": cuts,
        "config": BENCH_CONFIG,
        "shardings": shardings,
    }
    results = launch(
        2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=7200, env=bench_env(openblas_available())
    )
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    tokens = reports[0]["tokens"]
    print(f"{args.tokens} tokens, S=2, {args.rounds} round(s); same tokens: {len(set(map(str, tokens.values()))) == 1}")
    base = next(iter(shardings))
    print(f"{'cut':<10} " + " ".join(f"{label + ' best / median':>30}" for label in shardings) + "   best vs " + base)
    for name in names:
        times = {
            label: [max(r["seconds"][f"{label} {name}"][i] for r in reports) for i in range(args.rounds)]
            for label in shardings
            if f"{label} {name}" in reports[0]["seconds"]
        }
        cells = " ".join(
            f"{min(times[label]):>16.3f} / {statistics.median(times[label]):<11.3f}" if label in times else f"{'-':>30}"
            for label in shardings
        )
        ratios = (
            " ".join(f"{min(times[base]) / min(t):.3f}x" for label, t in times.items() if label != base)
            if base in times
            else ""
        )
        print(f"{name:<10} {cells}   {ratios}")
    for sharding, chunks in reports[0]["auto"].items():
        print(f"auto with {sharding}: {describe_cut(chunks)}")
    for sharding, heads in reports[0]["lent_heads"].items():
        if shardings[sharding].get("lend") == "auto":
            print(f"{sharding}: {heads} key-value heads lent")


if __name__ == "__main__":
    main()
