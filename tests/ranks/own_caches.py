"""Rank program: a caller's own ``make_cache`` (rotating caches for a sliding window) on a model sharded with lent
heads, against single-device mlx-lm with the same caches.

Spec: {"arch", "lend", "M", "max_tokens", "window"}. Reports the tokens and the reference's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model, tiny_config


def rotating(model: Any, window: int) -> None:
    """The usual way to a sliding window: ``make_cache`` replaced by rotating caches, one per layer."""
    object.__setattr__(model, "make_cache", lambda: [RotatingKVCache(max_size=window, keep=4) for _ in model.layers])


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    config = tiny_config(spec["arch"])
    reference = build_model(config)
    rotating(reference, spec["window"])
    model = pipemlx.shard_model(build_model(config), group, lend=spec["lend"])
    rotating(model, spec["window"])
    prompt = mx.random.randint(0, 256, (spec["M"],), key=mx.random.key(7)).astype(mx.int32)
    ref = [int(t) for t, _ in generate_step(prompt, reference, prefill_step_size=8, max_tokens=spec["max_tokens"])]
    tokens = [
        int(t) for t, _ in pipemlx.generate_step(prompt, model, prefill_step_size=8, max_tokens=spec["max_tokens"])
    ]
    print(json.dumps({"rank": group.rank(), "tokens": tokens, "reference": ref}), flush=True)


if __name__ == "__main__":
    main()
