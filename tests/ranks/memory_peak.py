"""Rank program: MLX's measured peak memory of a pipelined request against the memory model's prediction.

Spec: {"cases": [{"path"?: model dir (else "arch" and "config": a tiny model built here), "contexts": [C, ...],
"step", "head": "all" | "last", "kv_bits"?, "kv_group_size"?, "quantized_kv_start"?}, ...]}
Per case the model is loaded and sharded; per context: a fresh cache, the peak reset,
``pipemlx.generate_step`` (pipelined prefill of C tokens, two decoded tokens). The measured peak is MLX's
(``mx.get_peak_memory``) less what was active before but is not this model's weights (earlier cases'
leftovers, the prompt); it is reported with ``rank_memory``'s prediction. Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.models.memory import memory_model_from_config, memory_model_from_dir
from pipemlx.models.parameters import flat_parameters, model_bytes_from_model
from pipemlx.models.sharding import find_layer_list
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.memory_model import Settings, rank_memory
from pipemlx.testing import build_model, tiny_config


def held_bytes(model: Any) -> int:
    return sum(p.nbytes for _, p in flat_parameters(model))


def run_case(group: Any, case: dict[str, Any]) -> dict[str, Any]:
    head = case.get("head", "all")
    if "path" in case:
        memory = memory_model_from_dir(case["path"])
        model, _ = pipemlx.load_sharded(case["path"], group, head=head)
    else:
        config = tiny_config(case["arch"], **case.get("config", {}))
        model = build_model(config, seed=1)
        owner, attribute = find_layer_list(model)
        memory = memory_model_from_config(config, model_bytes_from_model(model, owner, owner[attribute]), 4)
        pipemlx.shard_model(model, group, head=head)
    stage = stage_of(model)
    vocab = int(getattr(getattr(model, "args"), "vocab_size", 256))
    quant: dict[str, Any] = {k: case[k] for k in ("kv_bits", "kv_group_size", "quantized_kv_start") if k in case}
    runs: list[dict[str, Any]] = []
    for context in case["contexts"]:
        prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(context)).astype(mx.int32)
        mx.eval(prompt)
        cache = make_prompt_cache(model)
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory() - held_bytes(model)
        mx.reset_peak_memory()
        steps = pipemlx.generate_step(
            prompt, model, prompt_cache=cache, prefill_step_size=case["step"], max_tokens=2, **quant
        )
        generated = [int(t) for t, _ in steps]
        mx.synchronize()
        peak = mx.get_peak_memory() - before
        settings = Settings(context, case["step"], head=head, **quant)
        predicted = rank_memory(memory, stage.info.layers, stage.rank, stage.world_size, settings)
        runs.append(
            {
                "context": context,
                "peak": peak,
                "held": held_bytes(model),
                "predicted": predicted.total,
                "weights": predicted.weights,
                "kv": predicted.kv,
                "chunk": predicted.chunk,
                "tokens": generated,
            }
        )
        del cache, steps
    return {"layers": [stage.info.layers.start, stage.info.layers.stop], "rank": stage.rank, "runs": runs}


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    cases = [run_case(group, case) for case in spec["cases"]]
    print(json.dumps({"rank": group.rank(), "cases": cases}), flush=True)


if __name__ == "__main__":
    main()
