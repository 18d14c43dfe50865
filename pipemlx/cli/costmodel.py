"""``python -m pipemlx.cli.costmodel``: the cost model's predicted prefill time and bubble fraction for 1..16 ranks.

``--calibrate TRACE`` fits the layer costs to the trace of a 1-rank run;
``--trace OUT`` writes a predicted timeline that Perfetto and
:mod:`pipemlx.observe.timeline` show. See :mod:`pipemlx.schedule.costmodel`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ..observe.timeline import simulated_trace
from ..observe.trace import samples_from_trace
from ..schedule.costmodel import CostModel, LayerCosts, fit_layer_costs, predict


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipemlx.cli.costmodel",
        description="Predicted prefill time and bubble fraction for 1..16 ranks.",
    )
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length M")
    parser.add_argument("--step", type=int, default=512, help="step size (tokens per chunk)")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the model")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size")
    parser.add_argument("--token-us", type=float, default=50.0, help="microseconds per token per layer")
    parser.add_argument("--pair-ns", type=float, default=2.0, help="nanoseconds per query-key pair per layer")
    parser.add_argument("--chunk-us", type=float, default=100.0, help="fixed microseconds per chunk per layer")
    parser.add_argument(
        "--calibrate", metavar="TRACE", help="fit the three layer costs to a 1-rank run's trace instead"
    )
    parser.add_argument(
        "--last-layer-share", type=float, default=1.0, help="cost of the model's last layer in a prefill, in layers"
    )
    parser.add_argument("--latency-us", type=float, default=100.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=1.0, help="GB/s per link")
    parser.add_argument("--collective-us", type=float, default=200.0)
    parser.add_argument("--max-ranks", type=int, default=16)
    parser.add_argument("--trace", metavar="PATH", help="also write the predicted timeline of --ranks ranks here")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the --trace prediction")
    args = parser.parse_args(argv)
    layer = LayerCosts(args.chunk_us * 1e-6, args.token_us * 1e-6, args.pair_ns * 1e-9)
    if args.calibrate:
        layer = fit_layer_costs(samples_from_trace(args.calibrate), args.layers, args.last_layer_share)
    base = CostModel(
        layer,
        (args.layers,),
        args.hidden,
        latency_s=args.latency_us * 1e-6,
        bandwidth=args.bandwidth_gbs * 1e9,
        collective_s=args.collective_us * 1e-6,
        last_layer_share=args.last_layer_share,
    )
    single = predict(args.tokens, args.step, base).prefill_s
    print(f"M={args.tokens} step={args.step} layers={args.layers} hidden={args.hidden}; per layer {layer}")
    print("ranks  prefill_s  speedup  bubble")
    for ranks in range(1, min(args.max_ranks, args.layers) + 1):
        p = predict(args.tokens, args.step, base.with_ranks(ranks))
        print(f"{ranks:5d}  {p.prefill_s:9.3f}  {single / p.prefill_s:7.2f}  {p.bubble_fraction:6.1%}")
    if args.trace:
        chosen = predict(args.tokens, args.step, base.with_ranks(args.ranks))
        with open(args.trace, "w") as f:
            json.dump(simulated_trace(chosen.result), f)
        print(f"wrote the predicted {args.ranks}-rank timeline to {args.trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
