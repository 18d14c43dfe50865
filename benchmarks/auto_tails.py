"""How a prefill's last chunks are cut: uniform, a halving tail, a gentler tail and auto's choice, in one launch.

    python benchmarks/auto_tails.py [--tokens 2048] [--step 256] [--rounds 8]
    python benchmarks/auto_tails.py --tokens 8192 --calibrations 4   # auto's choice from 4 calibrations

Two ranks (the benchmark model, OpenBLAS preloaded, one core per process). Every round prefills the same
prompt once per cut, in turn, in one launch (see ranks/cuts_rank.py), so the cuts share the machine's
drift; the table shows each cut's best and median seconds, its chunks' tail and the cost model's
prediction (the group's calibrated costs). The cuts: uniform 128 and ``--step``, ``--step`` with a
halving tail of 3 (``ramp_lengths``), with tails shrinking by 5/8 and 3/4 (``tail_lengths``), and
``prefill_step_size="auto"``'s own choice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from common import BENCH_CONFIG, HERE, bench_env, describe_cut, openblas_available

from pipemlx.launch import launch
from pipemlx.schedule.autostep import choose_chunks, ramp_lengths, tail_lengths, uniform_lengths
from pipemlx.schedule.costmodel import CostModel, LayerCosts, predict

PROGRAM = HERE / "ranks" / "cuts_rank.py"
CALIBRATE = HERE / "ranks" / "calibrate_rank.py"


def calibrated_costs(openblas: bool) -> CostModel:
    """The group's cost model as prefill_step_size="auto" calibrates it (one launch)."""
    results = launch(
        2, [sys.executable, str(CALIBRATE), json.dumps({"config": BENCH_CONFIG})], timeout=600, env=bench_env(openblas)
    )
    fields: dict[str, Any] = json.loads(results[0].stdout.strip().splitlines()[-1])
    layer_fields = fields.pop("layer")
    layer = LayerCosts(**{**layer_fields, "at_start": tuple(map(tuple, layer_fields.get("at_start", ())))})
    return CostModel(layer, layers=tuple(fields.pop("layers")), **fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--step", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calibrations", type=int, default=0, help="only calibrate this many times, print auto's cut")
    args = parser.parse_args()
    openblas = openblas_available()
    m = args.tokens
    if args.calibrations:  # only how auto cuts, calibration by calibration (one launch each)
        for _ in range(args.calibrations):
            costs = calibrated_costs(openblas)
            far = ", ".join(f"{n} tokens {s * 1e9:.0f}" for n, s in costs.layer.far_pairs)
            cut = describe_cut(list(choose_chunks(m, costs)))
            print(f"ns per pair far in: {far}; after 512: {costs.layer.attention_s * 1e9:.0f}; auto: {cut}")
        return
    costs = calibrated_costs(openblas)
    cuts: dict[str, tuple[int, ...]] = {
        "uniform 128": uniform_lengths(m, 128),
        f"uniform {args.step}": uniform_lengths(m, args.step),
    }
    for name, cut in (
        (f"{args.step}, halving tail", ramp_lengths(m, args.step, 0, 3)),
        (f"{args.step}, 5/8 tail", tail_lengths(m, args.step, 0.625)),
        (f"{args.step}, 3/4 tail", tail_lengths(m, args.step, 0.75)),
    ):
        if cut is not None:
            cuts[name] = cut
    cuts["auto"] = choose_chunks(m, costs)
    spec = {"M": m, "rounds": args.rounds, "cuts": cuts, "config": BENCH_CONFIG}
    results = launch(2, [sys.executable, str(PROGRAM), json.dumps(spec)], timeout=3600, env=bench_env(openblas))
    reports = [json.loads(r.stdout.strip().splitlines()[-1])["seconds"] for r in results]
    print(f"{m} tokens, S=2, OpenBLAS {'on' if openblas else 'off'}; {args.rounds} rounds in one launch")
    print(f"{'cut':<22}{'best s':>8}{'median s':>10}{'predicted':>11}  last chunks")
    for name, cut in cuts.items():
        times = [max(per_rank) for per_rank in zip(*(r[name] for r in reports))]
        predicted = predict(m, max(cut), costs, chunk_lengths=cut, agree_every=None).prefill_s
        tail = ",".join(map(str, cut[-6:]))
        print(
            f"{name:<22}{min(times):>8.3f}{statistics.median(times):>10.3f}{predicted:>11.3f}  ...{tail} ({len(cut)} chunks)"
        )


if __name__ == "__main__":
    main()
