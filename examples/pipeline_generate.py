"""Pipelined generation on a tiny built-in model: prefill overlapped across ranks, then decode.

Run it on 2 local ranks:      python examples/pipeline_generate.py --ranks 2
Run it as one rank of a group started by mlx.launch / mpirun:  python examples/pipeline_generate.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group, launch
from pipemlx.tiny import build_model, tiny_config


def run_rank(args: argparse.Namespace) -> None:
    group = init_group()
    rank = group.rank()
    config = tiny_config("llama", num_hidden_layers=8, hidden_size=128, intermediate_size=256)
    model = pipemlx.shard_model(build_model(config, seed=0), group)
    stage = pipemlx.stage_of(model)
    prompt = mx.random.randint(0, config["vocab_size"], (args.prompt_tokens,), key=mx.random.key(1)).astype(mx.int32)

    def on_progress(processed: int, total: int) -> None:
        if rank == 0:
            print(f"\rprefill {processed}/{total} tokens", end="", flush=True)

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    pipemlx.pipeline_prefill(model, prompt, cache, step_size=args.step_size, progress_callback=on_progress)
    prefill_s = time.perf_counter() - start
    tokens = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=args.max_tokens)]
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))  # every rank done before anyone exits
    print(
        f"\n{stage.describe()}: prefill of {prompt.size} tokens in {prefill_s:.2f} s; tokens {tokens}",
        file=sys.stdout if rank == 0 else sys.stderr,
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, help="spawn this many local ranks")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--step-size", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.ranks and "MLX_RANK" not in os.environ:
        argv = [sys.executable, os.path.abspath(__file__), *[a for a in sys.argv[1:]]]
        results = launch(args.ranks, argv, timeout=600, passthrough_rank=0)
        for r in results[1:]:
            sys.stdout.write(r.stderr)
        return 0
    run_rank(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
