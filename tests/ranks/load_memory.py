"""Rank program: peak memory of load_sharded against a full mlx-lm load, and the tokens of both.

Spec: {"path", "split"?, "memory"?, "head"?, "prompt": M, "step", "max_tokens", "full": bool}
(``head="split"``: the tokens come from pipemlx.generate_step, mlx-lm's refusing a split head.)
Each rank measures the growth of its peak resident set (VmHWM, reset through
/proc/self/clear_refs) while load_sharded runs, then pipeline-prefills and
decodes a prompt; then (``full``) it drops the sharded model, measures the
peak growth of mlx-lm's own full ``load`` and decodes the same prompt with it.
Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load, load_tokenizer

import pipemlx
from pipemlx.launch import init_group
from pipemlx.models.parameters import flat_parameters
from pipemlx.models.safetensors import model_bytes_from_dir
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.memory_model import fixed_bytes


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def start_measuring() -> int:
    """Reset the peak resident set to the current one; return the current one (bytes)."""
    gc.collect()
    mx.clear_cache()
    Path("/proc/self/clear_refs").write_text("5")
    return status_kb("VmRSS") * 1024


def peak_growth(baseline: int) -> int:
    return status_kb("VmHWM") * 1024 - baseline


def settle(group: Any) -> None:
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    path = Path(spec["path"])
    load_tokenizer(path)  # imports and warms the tokenizer code, so the measurement sees weights only
    baseline = start_measuring()
    mx.reset_peak_memory()
    # Whole layers: what each rank holds is compared with the plan's per-layer bytes.
    head = spec.get("head", "all")
    model, tokenizer = pipemlx.load_sharded(
        path, group, split=spec.get("split"), memory=spec.get("memory"), lend=spec.get("lend", "none"), head=head
    )
    sharded_peak = peak_growth(baseline)
    mlx_peak = mx.get_peak_memory()  # MLX's own allocations alone (no thread stacks, no Python)
    held = sum(p.nbytes for _, p in flat_parameters(model))
    stage = stage_of(model)
    planned = model_bytes_from_dir(path)
    share = sum(planned.layers[stage.info.layers.start : stage.info.layers.stop])
    fixed = fixed_bytes(planned, stage.rank, stage.world_size, head)

    prompt = mx.random.randint(0, int(model.args.vocab_size), (spec["prompt"],), key=mx.random.key(5)).astype(mx.int32)
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=spec["step"])
    steps = generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"])  # mlx-lm's own
    tokens = [int(t) for t, _ in steps]
    settle(group)
    report: dict[str, Any] = {
        "rank": stage.rank,
        "size": stage.world_size,
        "split": list(stage.info.split),
        "layers": [stage.info.layers.start, stage.info.layers.stop],
        "sharded_peak": sharded_peak,
        "mlx_peak": mlx_peak,
        "held": held,
        "share": share,
        "fixed": fixed,
        "model_total": planned.total,
        "embedding": type(model.model.embed_tokens).__name__,
        "tokens": tokens,
        "tokenizer_vocab": len(tokenizer.vocab),
    }
    if spec.get("full", True):
        del model, cache
        baseline = start_measuring()
        full, _ = load(str(path))
        report["full_peak"] = peak_growth(baseline)
        report["ref_tokens"] = [
            int(t)
            for t, _ in generate_step(prompt, full, prefill_step_size=spec["step"], max_tokens=spec["max_tokens"])
        ]
        mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
