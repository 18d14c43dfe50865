"""shard_model: keep a rank's contiguous slice of the decoder layers and wire its edges."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .architectures import apply_fixups
from .errors import PipelineError
from .layers import wrap_edge
from .split import layer_range, resolve_split
from .stage import STAGE_ATTRIBUTE, PipelineStage, ensure_unsharded

ModelT = TypeVar("ModelT", bound=nn.Module)

DEFAULT_TIMEOUT = 120.0


def find_layer_list(model: nn.Module) -> tuple[nn.Module, str]:
    """The module and attribute name holding the list that ``model.layers`` shows.

    mlx-lm models expose their decoder layers as ``model.layers``, a property
    over ``model.model.layers``, ``model.language_model.model.layers``,
    ``model.transformer.h`` and so on; the owner is found by identity.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise PipelineError(
            f"cannot find the decoder layers of {type(model).__name__}: "
            "pipemlx needs an mlx-lm model whose `layers` is a non-empty list"
        )
    wanted: list[Any] = layers  # pyright: ignore[reportUnknownVariableType]
    for _, module in model.named_modules():
        for key, value in module.items():
            if (
                isinstance(value, list)
                and len(value) == len(wanted)  # pyright: ignore[reportUnknownArgumentType]
                and all(a is b for a, b in zip(value, wanted))  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            ):
                return module, key
    raise PipelineError(f"cannot find the module that holds {type(model).__name__}.layers")


def activation_signature(model: nn.Module, kept: list[nn.Module]) -> tuple[int, mx.Dtype | None]:
    """The hidden size (0 if unknown) and the floating dtype of ``kept``'s weights, for the handshake."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    if not isinstance(hidden, int):
        text_config = getattr(args, "text_config", None)
        hidden = text_config.get("hidden_size") if isinstance(text_config, dict) else None
    dtype = next(
        (p.dtype for _, p in tree_flatten(kept[0].parameters()) if mx.issubdtype(p.dtype, mx.floating)),  # pyright: ignore[reportUnknownVariableType, reportUnknownMemberType, reportUnknownArgumentType]
        None,
    )
    return (hidden if isinstance(hidden, int) else 0), dtype  # pyright: ignore[reportUnknownVariableType]


def shard_model(
    model: ModelT,
    group: mx.distributed.Group,
    *,
    split: Sequence[int] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> ModelT:
    """Keep this rank's layers of ``model`` in place and make it a pipeline stage; return ``model``.

    Rank ``r`` of ``group`` keeps ``split[r]`` consecutive decoder layers, rank 0
    the first ones. ``split`` defaults to an even split with the extra layers on
    the low ranks. Afterwards ``model.layers`` holds the local layers only (so
    mlx-lm's ``make_prompt_cache`` makes one cache per local layer), the first
    local layer receives from rank ``r-1`` and the last sends to rank ``r+1``.
    Calling the model (mlx-lm's ``generate_step``, ``stream_generate``) then
    gives every rank the logits of the whole model. Only the weights this rank
    keeps are evaluated: a lazily loaded model materialises its share.

    ``timeout`` (seconds, ``None`` for none) is the default for every blocking
    wait of :func:`pipemlx.pipeline_prefill` on this model.
    Raises ``ValueError``/``TypeError`` for a bad split, and
    :class:`PipelineError` for a model it cannot shard, before changing anything.
    """
    ensure_unsharded(model)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    owner, attribute = find_layer_list(model)
    layers: list[nn.Module] = owner[attribute]
    sizes = resolve_split(split, len(layers), group.size())
    local = layer_range(sizes, group.rank())
    stage = PipelineStage(group, sizes, local, len(layers), timeout)
    stage.hidden_size, stage.dtype = activation_signature(model, layers[local.start : local.stop])

    kept = layers[local.start : local.stop]
    setattr(owner, attribute, kept)
    shown = getattr(model, "layers", None)
    if not isinstance(shown, list) or [id(x) for x in shown] != [id(x) for x in kept]:  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
        setattr(owner, attribute, layers)
        raise PipelineError(f"{type(model).__name__}.layers does not show the local layers after cutting the list")
    apply_fixups(model, owner, local)
    if stage.world_size > 1:
        first, last = kept[0], kept[-1]
        if first is not last:
            wrap_edge(first, stage, receives=not stage.is_first, sends=False)
        wrap_edge(last, stage, receives=first is last and not stage.is_first, sends=True)
    object.__setattr__(model, STAGE_ATTRIBUTE, stage)
    mx.eval(model.parameters())
    return model
