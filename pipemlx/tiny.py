"""Tiny random-weight mlx-lm models, built from a config: for tests, demos and benchmarks.

No model hub is needed. Weights are drawn from a seeded generator, so every
process that builds the same config with the same seed holds the same model.
2-D weights are scaled up (normal x 0.15) so that greedy decoding of a random
model does not collapse onto one repeated token.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

BASE_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
})
WEIGHT_SCALE = 0.15


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """A small config for mlx-lm architecture ``arch``, with ``overrides`` applied."""
    if arch not in BASE_CONFIGS:
        raise ValueError(f"no tiny config for {arch!r}; known: {sorted(BASE_CONFIGS)}")
    return {**BASE_CONFIGS[arch], **overrides}


def build_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """The mlx-lm ``Model`` for ``config`` with seeded random weights, evaluated."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # pyright: ignore[reportAssignmentType]
    keys = mx.random.split(key, len(params))
    drawn = [
        (name, (mx.random.normal(p.shape, key=keys[i]) * WEIGHT_SCALE).astype(p.dtype) if p.ndim >= 2 else p)
        for i, (name, p) in enumerate(params)
    ]
    model.update(tree_unflatten(drawn))  # pyright: ignore[reportArgumentType]
    mx.eval(model.parameters())
    return model
