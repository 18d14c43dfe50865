"""Pipelined generation in a few lines: load, shard, prefill across ranks, decode with pipemlx.generate_step.

Uses the demo model pipemlx ships (a small llama trained on Pride and Prejudice)
unless --model names another mlx-lm model folder.

Run it on 2 local ranks:         python examples/pipeline_generate.py --ranks 2
Run it as one rank of a group started by mlx.launch / mpirun:  python examples/pipeline_generate.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

import pipemlx
from pipemlx.demo import MODEL_DIR, book_text, default_prompt
from pipemlx.launch import init_group, relaunch_as_ranks
from pipemlx.runtime.stage import stage_of


def run_rank(args: argparse.Namespace) -> None:
    group = init_group()
    rank = group.rank()
    model, tokenizer = load(args.model, lazy=True)  # lazy: each rank materialises only its own layers
    pipemlx.shard_model(model, group)
    if args.prompt_tokens:  # a long prompt: the start of the novel the demo model was trained on
        text = book_text()[: 8 * args.prompt_tokens]  # about 2.8 characters per token: enough text
        prompt = mx.array(tokenizer.encode(text)[: args.prompt_tokens], dtype=mx.int32)
    else:
        prompt = mx.array(tokenizer.encode(default_prompt()), dtype=mx.int32)

    def on_progress(processed: int, total: int) -> None:  # called on every rank, with the same numbers
        if rank == 0 and not args.json:
            print(f"\rprefill {processed}/{total} tokens", end="", flush=True)

    cache = make_prompt_cache(model)  # one cache per *local* layer
    start = time.perf_counter()
    pipemlx.pipeline_prefill(
        model, prompt, cache, prefill_step_size=args.prefill_step_size, prompt_progress_callback=on_progress
    )
    prefill_s = time.perf_counter() - start

    # Decoding: pipemlx.generate_step takes mlx-lm's arguments; the cache already holds the prompt but
    # its last token, so the new tokens are just that one. Every rank gets the same tokens, every wait is
    # bounded, and nothing is left in flight when it ends: no synchronize, no barrier before exiting.
    steps = pipemlx.generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=args.max_tokens)
    tokens = [int(token) for token, _ in steps]

    stage = stage_of(model)
    if args.json:
        print(
            json.dumps(
                {
                    "rank": rank,
                    "layers": [stage.info.layers.start, stage.info.layers.stop],
                    "prefill_step_size": args.prefill_step_size,
                    "tokens": tokens,
                }
            ),
            flush=True,
        )
    else:  # rank 0 on stdout, the others on stderr: the same tokens everywhere
        out = sys.stdout if rank == 0 else sys.stderr
        print(f"\n{stage.describe()}: prefill of {prompt.size} tokens in {prefill_s:.2f} s; tokens {tokens}", file=out)
        if rank == 0:
            print(tokenizer.decode(tokens), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, help="start this many local ranks")
    parser.add_argument("--model", default=str(MODEL_DIR), help="mlx-lm model folder (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default: the demo prompt, 231 tokens)")
    parser.add_argument("--prefill-step-size", type=int, default=32, help="prefill chunk in tokens")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--json", action="store_true", help="each rank prints one JSON line (for tests)")
    args = parser.parse_args()
    if args.ranks and "MLX_RANK" not in os.environ:
        return relaunch_as_ranks(args.ranks)
    run_rank(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
