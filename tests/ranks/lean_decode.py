"""Rank program: lean decoding (only the last rank applies the head) against single-device mlx-lm.

Spec: {"arch", "lengths": [M, ...], "max_tokens"}. Reports per prompt the lean tokens, the reference
(generate_step on the whole model), and the tokens of a random sampler that only the last rank seeds.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.lean_decode import lean_generate_step
from pipemlx.testing import build_model, tiny_config


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    config = tiny_config(spec["arch"])
    reference = build_model(config)
    model = pipemlx.shard_model(build_model(config), group)
    mx.random.seed(100 + group.rank())  # deliberately different on every rank
    results: list[dict[str, Any]] = []
    for length in spec["lengths"]:
        prompt = mx.random.randint(0, 256, (length,), key=mx.random.key(length)).astype(mx.int32)
        cache = make_prompt_cache(model)
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=8)
        lean = list(lean_generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"]))
        ref = [int(t) for t, _ in generate_step(prompt, reference, prefill_step_size=8, max_tokens=spec["max_tokens"])]
        cache = make_prompt_cache(model)
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=8)
        sampled = list(
            lean_generate_step(
                prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"], sampler=make_sampler(temp=1.0)
            )
        )
        offset = cache[0].offset
        # A consumer that stops early on rank 0 only: every rank stops after the same token.
        cache = make_prompt_cache(model)
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=8)
        early: list[int] = []
        for token in lean_generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"]):
            early.append(token)
            if group.rank() == 0 and len(early) == 3:
                break
        results.append(
            {"M": length, "lean": lean, "reference": ref, "sampled": sampled, "offset": offset, "early": early}
        )
    print(json.dumps({"rank": group.rank(), "results": results}), flush=True)


if __name__ == "__main__":
    main()
