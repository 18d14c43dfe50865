"""Choose how many layers each rank holds: shard_model(model, group, split=[...]).

A rank on a machine with more memory or a faster chip can take more layers.
``--split 6,2`` gives rank 0 the first six decoder layers and rank 1 the last
two; the numbers must add up to the model's layer count, one entry per rank,
at least one layer each. The tokens are the same whatever the split.

Run it on 2 local ranks:   python examples/custom_split.py --ranks 2 --split 6,2
"""

from __future__ import annotations

import argparse
import json
import os

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

import pipemlx
from pipemlx.demo import MODEL_DIR, default_prompt
from pipemlx.launch import init_group, relaunch_as_ranks
from pipemlx.runtime.stage import stage_of


def run_rank(args: argparse.Namespace) -> None:
    group = init_group()
    model, tokenizer = load(args.model, lazy=True)
    split = [int(n) for n in args.split.split(",")] if args.split else None
    pipemlx.shard_model(model, group, split=split)  # ValueError naming the problem if split does not fit
    stage = stage_of(model)
    prompt = mx.array(tokenizer.encode(default_prompt()), dtype=mx.int32)
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=args.prefill_step_size)
    steps = pipemlx.generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=args.max_tokens)
    tokens = [int(t) for t, _ in steps]  # the same on every rank; nothing is left in flight afterwards
    peak_mb = mx.get_peak_memory() / 2**20
    if args.json:
        print(
            json.dumps(
                {
                    "rank": group.rank(),
                    "split": list(stage.info.split),
                    "prefill_step_size": args.prefill_step_size,
                    "layers": [stage.info.layers.start, stage.info.layers.stop],
                    "tokens": tokens,
                }
            ),
            flush=True,
        )
        return
    print(f"{stage.describe()}: {len(model.layers)} local layers, peak memory {peak_mb:.1f} MB", flush=True)
    if group.rank() == 0:
        print(tokenizer.decode(tokens), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, help="start this many local ranks")
    parser.add_argument("--split", help="layers per rank, comma-separated (default: even)")
    parser.add_argument("--model", default=str(MODEL_DIR), help="mlx-lm model folder (default: the demo model)")
    parser.add_argument("--prefill-step-size", type=int, default=32, help="prefill chunk in tokens")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="each rank prints one JSON line (for tests)")
    args = parser.parse_args()
    if args.ranks and "MLX_RANK" not in os.environ:
        return relaunch_as_ranks(args.ranks)
    run_rank(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
