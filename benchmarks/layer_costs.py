"""One decoder layer of the benchmark model: a chunk's time by its length and position, attention and MLP apart.

    python benchmarks/layer_costs.py [--offsets 0,1024,2048] [--lengths 32,128,256]

One process, OpenBLAS preloaded when available (run this script under the environment bench_env gives:
it re-executes itself with it), pinned to one core. For each position (the tokens already in the cache) and
chunk length: milliseconds for the whole layer, its attention half and its MLP half (mean of 5), and the
layer's milliseconds per token. Shows how attention grows with position and what short chunks cost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import mlx.core as mx
from common import BENCH_CONFIG, bench_env
from mlx_lm.models.cache import KVCache

from pipemlx.testing import build_model


def timed(run: Callable[[], mx.array], repeats: int = 5) -> float:
    mx.eval(run())  # pyright: ignore[reportUnknownMemberType]
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(run())  # pyright: ignore[reportUnknownMemberType]
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--offsets", default="0,1024,2048")
    parser.add_argument("--lengths", default="32,128,256")
    args = parser.parse_args()
    wanted = bench_env(True)
    if any(os.environ.get(k) != v for k, v in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    layer = build_model(BENCH_CONFIG, seed=0).model.layers[0]
    heads, dims = (
        BENCH_CONFIG["num_key_value_heads"],
        BENCH_CONFIG["hidden_size"] // BENCH_CONFIG["num_attention_heads"],
    )
    print(f"{'position':>8} {'tokens':>6} {'layer ms':>9} {'attention':>10} {'MLP':>6} {'ms/token':>9}")
    for offset in (int(o) for o in args.offsets.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            cache = KVCache()
            if offset:
                cache.update_and_fetch(mx.zeros((1, heads, offset, dims)), mx.zeros((1, heads, offset, dims)))
            x = mx.random.normal((1, length, BENCH_CONFIG["hidden_size"]))

            def whole() -> mx.array:
                cache.offset = offset  # every repeat writes the same positions
                return layer(x, "causal", cache)

            def attention() -> mx.array:
                cache.offset = offset
                return layer.self_attn(layer.input_layernorm(x), "causal", cache)

            def mlp() -> mx.array:
                return layer.mlp(layer.post_attention_layernorm(x))

            total = timed(whole)
            print(
                f"{offset:>8} {length:>6} {total:>9.1f} {timed(attention):>10.1f} {timed(mlp):>6.1f} {total / length:>9.3f}"
            )


if __name__ == "__main__":
    main()
