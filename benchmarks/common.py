"""Shared setup for the benchmarks: the model, the OpenBLAS preload, core pinning, running ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipemlx.launch import launch

HERE = Path(__file__).parent
RANK_PROGRAM = HERE / "ranks" / "bench_rank.py"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

# The reference setup of the project's performance targets: a 512-d, 8-layer qwen2.
BENCH_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


# Shaped like the models people run: the same layers with a 1,024-entry vocabulary, so the output head is 2% of the
# weights (Llama-3-8B 6.5%, Qwen2.5-72B 1.7%) where BENCH_CONFIG's 32,000-entry head is 37%.
LIGHT_HEAD_CONFIG: dict[str, Any] = {**BENCH_CONFIG, "vocab_size": 1024}

# A second family for the prefill defaults: llama with grouped-query attention (2 key-value heads of 8) and a
# feed-forward 4x the width (qwen2's above is 3x).
LLAMA_GQA_CONFIG: dict[str, Any] = {
    **LIGHT_HEAD_CONFIG,
    "model_type": "llama",
    "intermediate_size": 2048,
    "num_key_value_heads": 2,
    "rope_theta": 500000.0,
}

SHAPES: dict[str, dict[str, Any]] = {"light": LIGHT_HEAD_CONFIG, "bench": BENCH_CONFIG, "llama": LLAMA_GQA_CONFIG}
"""The model shapes the benchmarks report: "light" (head 2% of the weights, 1k vocabulary) and "bench" (head 37%,
32k vocabulary) side by side in the decode and batching benchmarks, the realistic one first; "llama" (grouped-query
attention, a wider feed-forward) as a second family for the prefill defaults."""


def bench_env(openblas: bool) -> dict[str, str]:
    """Environment for a benchmark process: OpenBLAS preloaded with one thread when available."""
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if openblas and Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    return env


def run_single(spec: dict[str, Any], openblas: bool) -> dict[str, Any]:
    """Run the rank program as one plain process (no group) and return its report."""
    env = {**os.environ, **bench_env(openblas)}
    env.pop("MLX_RANK", None)
    env.pop("MLX_HOSTFILE", None)
    out = subprocess.run(
        [sys.executable, str(RANK_PROGRAM), json.dumps(spec)], env=env, capture_output=True, text=True, timeout=1800
    )
    if out.returncode != 0:
        raise RuntimeError(f"single-process benchmark failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ranks(num_ranks: int, spec: dict[str, Any], openblas: bool) -> list[dict[str, Any]]:
    """Run the rank program on ``num_ranks`` local ranks and return every rank's report."""
    results = launch(
        num_ranks, [sys.executable, str(RANK_PROGRAM), json.dumps(spec)], timeout=1800, env=bench_env(openblas)
    )
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


def openblas_available() -> bool:
    return Path(OPENBLAS).exists()


def describe_cut(chunks: list[int]) -> str:
    """``128 + 64,32,16 tail`` style summary of an auto cut: its largest chunk and the ramps at its ends."""
    if not chunks:
        return ""
    step = max(chunks)
    head = [c for c in chunks[: chunks.index(step)]]
    tail: list[int] = []
    for c in reversed(chunks):
        if c == step:
            break
        tail.insert(0, c)
    parts = [str(step)]
    if head:
        parts.insert(0, ",".join(map(str, head)) + " +")
    if tail:
        parts.append("+ " + ",".join(map(str, tail)))
    return " ".join(parts)
