"""Rank program: load_sharded model directories and compare their tokens with mlx-lm's own load.

Spec: {"models": [{"path", "split"?, "memory"?, "kv_bits"?}...], "prompt": M, "step", "max_tokens"}
For each directory every rank loads its shard with pipemlx.load_sharded,
pipeline-prefills and decodes a prompt, then loads the whole directory with
mlx_lm.load and decodes the same prompt with generate_step. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

import pipemlx
from pipemlx.launch import init_group
from pipemlx.models.parameters import embedding_modules, flat_parameters
from pipemlx.models.sharding import find_layer_list
from pipemlx.runtime.stage import stage_of


def run(entry: dict[str, Any], spec: dict[str, Any], group: Any) -> dict[str, Any]:
    path = entry["path"]
    # Whole layers: what each rank holds is compared with the plan's per-layer bytes (test_equivalence runs lend="auto").
    # The default head ("auto": a split vocabulary on these architectures), mlx-lm's generate_step on it.
    model, tokenizer = pipemlx.load_sharded(
        path, group, split=entry.get("split"), memory=entry.get("memory"), lend=entry.get("lend", "none")
    )
    stage = stage_of(model)
    owner, _ = find_layer_list(model)
    vocab = len(tokenizer.vocab)
    prompt = mx.random.randint(0, vocab, (spec["prompt"],), key=mx.random.key(9)).astype(mx.int32)
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=spec["step"])
    tokens = [int(t) for t, _ in generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"])]
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    reference, _ = load(path)
    ref_tokens = [
        int(t)
        for t, _ in generate_step(prompt, reference, prefill_step_size=spec["step"], max_tokens=spec["max_tokens"])
    ]
    mx.synchronize(generation_stream)
    return {
        "path": path,
        "split": list(stage.info.split),
        "tokens": tokens,
        "ref_tokens": ref_tokens,
        "held": sum(p.nbytes for _, p in flat_parameters(model)),
        "embeddings": [type(m).__name__ for _, m in embedding_modules(owner)],
        "head": stage.info.head,  # the default "auto" resolved
        "embedding_rows": type(getattr(getattr(owner, "embed_tokens", None), "part", None)).__name__,
        "quantized_layers": sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    reports = [run(entry, spec, group) for entry in spec["models"]]
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    print(json.dumps({"rank": group.rank(), "models": reports}), flush=True)


if __name__ == "__main__":
    main()
