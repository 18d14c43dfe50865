"""A built model's parameters, as the memory-planned split needs them (the ``nn.Module`` side).

:func:`split_for_memory` is what ``shard_model(split="memory")`` uses: the
parameter bytes of each layer of a built, possibly lazily loaded model (lazy
arrays are not evaluated: their sizes are known), planned by
:func:`pipemlx.schedule.memory_split.plan_split`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]

from ..schedule.memory_split import ModelBytes, plan_split, resolve_budgets


def flat_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """``module``'s parameters as (dotted name, array) pairs; lazy arrays stay unevaluated."""
    flat = cast(list[tuple[str, Any]], tree_flatten(module.parameters()))
    return [(name, value) for name, value in flat if isinstance(value, mx.array)]


def _nbytes(module: nn.Module) -> int:
    return sum(p.nbytes for _, p in flat_parameters(module))


def embedding_modules(owner: nn.Module) -> list[tuple[str, nn.Module]]:
    """The input embeddings held by ``owner`` (the module holding the layer list): name and module."""
    return [(k, v) for k, v in owner.items() if isinstance(v, (nn.Embedding, nn.QuantizedEmbedding))]  # pyright: ignore[reportUnknownVariableType]


def has_separate_head(model: nn.Module) -> bool:
    """Whether ``model`` has an output head of its own rather than the embedding tied to it.

    True when some module is named ``lm_head`` and no ``tie_word_embeddings``
    flag (on a model module or its ``args``) says the embedding is the head.
    """
    names = cast(list[tuple[str, Any]], model.named_modules())
    for _, module in names:
        for holder in (module, getattr(module, "args", None)):
            if getattr(holder, "tie_word_embeddings", None) is True:
                return False
    return any(name.rsplit(".", 1)[-1] == "lm_head" for name, _ in names)


def model_bytes_from_model(model: nn.Module, owner: nn.Module, layers: Sequence[nn.Module]) -> ModelBytes:
    """Parameter bytes of a built model (lazy arrays are not evaluated: their sizes are known)."""
    per_layer = tuple(_nbytes(layer) for layer in layers)
    embedding = sum(_nbytes(m) for _, m in embedding_modules(owner))
    total = _nbytes(model)
    return ModelBytes(per_layer, embedding, total - embedding - sum(per_layer), not has_separate_head(model))


def split_for_memory(
    model: nn.Module,
    owner: nn.Module,
    layers: Sequence[nn.Module],
    world_size: int,
    memory: Sequence[float | str] | float | str | None,
) -> tuple[int, ...]:
    """The memory-planned split of a built model (what ``shard_model(split="memory")`` uses)."""
    return plan_split(
        model_bytes_from_model(model, owner, layers), world_size, resolve_budgets(memory, world_size)
    ).split


def model_config(model: nn.Module) -> dict[str, Any]:
    """The config a built mlx-lm model was made from (its ``args``), as a dict."""
    args: Any = getattr(model, "args", None)
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(cast(dict[str, Any], args))
    fields = cast(dict[str, Any], vars(args))
    return {k: v for k, v in fields.items() if not k.startswith("_")}


def activation_dtype(layers: Sequence[nn.Module]) -> mx.Dtype:
    """The floating dtype of the first layer's weights (a quantized layer's scales): the activations' dtype."""
    for _, p in flat_parameters(layers[0]):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
