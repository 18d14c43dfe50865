"""What planning an auto prefill costs: ``choose_chunks`` and ``choose_lent_heads`` timed on calibrated-looking costs.

    python benchmarks/planning_cost.py [--lengths 100,2048,8192,32768] [--ranks 2,3] [--calls 5] [--clock cpu]

Pure Python, one process, no MLX: the cost model is shaped like the benchmark model's calibration (a 512-d 8-layer
qwen2 split evenly, a layer's seconds at 16..512 tokens at position 0, the seconds per pair far in, the last layer
projecting only keys and values) and ``choose_lent_heads`` weighs lending 0..3 of its 4 key-value heads. "first" is
a call that plans from scratch (the planning cache cleared before each), "repeat" the same call again; each figure
is the median of ``--calls`` calls, in milliseconds: wall-clock time, or with ``--clock cpu`` this process's CPU
time, steadier than the wall clock on a machine others are loading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG

from pipemlx.schedule import autostep
from pipemlx.schedule.autostep import choose_chunks, choose_lent_heads
from pipemlx.schedule.costmodel import (
    CostModel,
    LayerCosts,
    cache_only_share,
    feed_forward_share_of,
    fit_layer_costs,
    lent_heads_share_of,
)
from pipemlx.schedule.plan import Chunk
from pipemlx.schedule.split import even_split

AT_START = ((16, 3.5e-3), (32, 6e-3), (64, 9e-3), (128, 16e-3), (256, 36e-3), (512, 84e-3))
"""A layer's seconds at position 0 by chunk length, as the calibration measures the benchmark model on one core."""
ATTENTION_S = 1.52e-7  # seconds per query-key pair after the 512-token chunk
FAR_PAIRS = ((128, 1.5e-7), (256, 1.6e-7))  # seconds per pair of 128- and 256-token chunks after 4096 positions
COLLECTIVE_S = 2e-4


def shapes() -> tuple[int, int, int]:
    """The benchmark model's hidden size, key-value width and feed-forward width."""
    hidden, heads = BENCH_CONFIG["hidden_size"], BENCH_CONFIG["num_attention_heads"]
    kv_size = BENCH_CONFIG["num_key_value_heads"] * hidden // heads
    return hidden, kv_size, BENCH_CONFIG["intermediate_size"]


def layer() -> LayerCosts:
    """As :func:`pipemlx.runtime.calibrate.layer_costs` builds it from the figures above."""
    line = fit_layer_costs([(Chunk(i, 0, n), t) for i, (n, t) in enumerate(AT_START)], num_layers=1)
    return LayerCosts(line.chunk_s, line.token_s, ATTENTION_S, AT_START, FAR_PAIRS)


def cost_model(world_size: int, lent_heads: int | None = None) -> CostModel:
    """The benchmark model split over ``world_size`` ranks; lending ``lent_heads`` key-value heads (0: the
    feed-forward half) when given, whole layers otherwise."""
    hidden, kv_size, intermediate = shapes()
    kv_heads = BENCH_CONFIG["num_key_value_heads"]
    lent_share, pair_share = 0.0, 0.0
    if lent_heads is not None:
        fraction = lent_heads / kv_heads
        shares = lent_heads_share_of(hidden, kv_size, intermediate, fraction) if lent_heads else None
        lent_share = shares if shares is not None else feed_forward_share_of(hidden, kv_size, intermediate)
        pair_share = fraction
    return CostModel(
        layer=layer(),
        layers=even_split(BENCH_CONFIG["num_hidden_layers"], world_size),
        hidden_size=hidden,
        collective_s=COLLECTIVE_S,
        latency_s=COLLECTIVE_S / 2,
        last_layer_share=cache_only_share(hidden, kv_size, intermediate),
        lent_share=lent_share,
        lent_pair_share=pair_share,
    )


def clear_cache() -> None:
    """Forget what earlier calls planned (a no-op where planning keeps no cache)."""
    clear: Callable[[], None] | None = getattr(autostep, "clear_planning_cache", None)
    if clear is not None:
        clear()


def median_ms(call: Callable[[], object], calls: int, fresh: bool, clock: Callable[[], float]) -> float:
    seconds: list[float] = []
    for _ in range(calls):
        if fresh:
            clear_cache()
        start = clock()
        call()
        seconds.append(clock() - start)
    return statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--lengths", default="100,2048,8192,32768")
    parser.add_argument("--ranks", default="2,3")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    lengths = [int(v) for v in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    kv_heads = BENCH_CONFIG["num_key_value_heads"]
    print(f"median {args.clock} time of {args.calls} calls, ms; first: planning cache cleared before each call")
    print(f"{'S':>2} {'tokens':>7}  {'chunks first':>13} {'repeat':>8}  {'lent heads first':>17} {'repeat':>8}  cut")
    for world_size in (int(v) for v in args.ranks.split(",")):
        plain = cost_model(world_size)
        cuts = [cost_model(world_size, k) for k in range(kv_heads)]
        for m in lengths:

            def chunks(m: int = m, plain: CostModel = plain) -> tuple[int, ...]:
                return choose_chunks(m, plain)

            def heads(m: int = m, cuts: list[CostModel] = cuts) -> int:
                return choose_lent_heads(m, cuts)

            clear_cache()
            cut = chunks()
            row = {
                "world_size": world_size,
                "tokens": m,
                "chunks_first_ms": median_ms(chunks, args.calls, fresh=True, clock=clock),
                "chunks_repeat_ms": median_ms(chunks, args.calls, fresh=False, clock=clock),
                "heads_first_ms": median_ms(heads, args.calls, fresh=True, clock=clock),
                "heads_repeat_ms": median_ms(heads, args.calls, fresh=False, clock=clock),
                "chunks": len(cut),
                "longest": max(cut),
                "lent_heads": heads(),
            }
            rows.append(row)
            print(
                f"{world_size:>2} {m:>7}  {row['chunks_first_ms']:>13.2f} {row['chunks_repeat_ms']:>8.3f}  "
                f"{row['heads_first_ms']:>17.2f} {row['heads_repeat_ms']:>8.3f}  "
                f"{len(cut)} chunks up to {max(cut)}, {row['lent_heads']} heads lent"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
