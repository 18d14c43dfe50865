"""shard_model: keep a rank's contiguous slice of the decoder layers and wire its edges."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal, TypeVar, Union, cast

import mlx.core as mx
import mlx.nn as nn

from ..errors import PipelineError
from ..runtime.edges import wrap_edge
from ..runtime.stage import STAGE_ATTRIBUTE, PipelineStage, ensure_unsharded
from ..schedule.split import SPLIT_NAMES, check_world, even_split, layer_range, resolve_split
from .architectures import apply_fixups, check_architecture
from .parameters import embedding_modules, flat_parameters, has_separate_head, split_for_memory

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
    wanted = cast(list[Any], layers)
    for _, module in cast(list[tuple[str, nn.Module]], model.named_modules()):
        for key, value in cast(list[tuple[str, Any]], list(module.items())):  # pyright: ignore[reportUnknownArgumentType]
            if isinstance(value, list):
                candidate = cast(list[Any], value)
                if len(candidate) == len(wanted) and all(a is b for a, b in zip(candidate, wanted)):
                    return module, key
    raise PipelineError(f"cannot find the module that holds {type(model).__name__}.layers")


def activation_signature(model: nn.Module, kept: list[nn.Module]) -> tuple[int, mx.Dtype | None]:
    """The hidden size (0 if unknown) and the floating dtype of ``kept``'s weights, for the handshake."""
    args: Any = getattr(model, "args", None)
    hidden: Any = getattr(args, "hidden_size", None)
    if not isinstance(hidden, int):
        text_config: Any = getattr(args, "text_config", None)
        hidden = cast(dict[str, Any], text_config).get("hidden_size") if isinstance(text_config, dict) else None
    dtype = next((p.dtype for _, p in flat_parameters(kept[0]) if mx.issubdtype(p.dtype, mx.floating)), None)
    return (hidden if isinstance(hidden, int) else 0), dtype


SplitSpec = Union[Sequence[int], Literal["even", "memory"], None]
"""Layers per rank, ``"even"`` (the default), or ``"memory"`` (planned from parameter bytes and budgets)."""
MemorySpec = Union[Sequence[Union[int, str]], int, str, None]
"""Per-rank memory budgets: bytes or sizes like ``"24GB"``, one per rank or one for all."""


def choose_split(
    split: SplitSpec,
    memory: MemorySpec,
    model: nn.Module,
    owner: nn.Module,
    layers: list[nn.Module],
    world_size: int,
) -> tuple[int, ...]:
    """Layers per rank for ``split``/``memory``, checked against the model and the group.

    ``memory`` given with ``split=None`` means ``split="memory"``; with any
    other ``split`` it is an error. Raises ``ValueError``/``TypeError`` naming
    the problem, :class:`~pipemlx.schedule.memory_split.MemoryPlanError` when the
    budgets cannot hold the model.
    """
    if memory is not None and split is None:
        split = "memory"
    if memory is not None and split != "memory":
        raise ValueError(f"memory budgets are only used with split='memory', got split={split!r}")
    if isinstance(split, str) and split in SPLIT_NAMES:
        check_world(len(layers), world_size)
        if split == "even":
            return even_split(len(layers), world_size)
        return split_for_memory(model, owner, layers, world_size, memory)
    return resolve_split(split, len(layers), world_size)


def shard_model(
    model: ModelT,
    group: mx.distributed.Group,
    *,
    split: SplitSpec = None,
    memory: MemorySpec = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    allow_unregistered: bool = False,
) -> ModelT:
    """Keep this rank's layers of ``model`` in place and make it a pipeline stage; return ``model``.

    Rank ``r`` of ``group`` keeps ``split[r]`` consecutive decoder layers, rank 0
    the first ones. ``split`` is a list of layers per rank, ``"even"`` (the
    default: extra layers on the low ranks) or ``"memory"``: a split planned
    from the parameter bytes of each layer so that each rank's share is
    proportional to its budget in ``memory`` (a list of per-rank sizes, bytes
    or strings like ``"24GB"``; ``None`` means equal memory), counting what
    every rank holds besides its layers (see ``docs/loading.md``).

    Afterwards ``model.layers`` holds the local layers only (so mlx-lm's
    ``make_prompt_cache`` makes one cache per local layer, of the kind the whole
    model makes for those layers), the first local layer receives from rank
    ``r-1`` and the last sends to rank ``r+1``. Calling the model (mlx-lm's
    ``generate_step``, ``stream_generate``) then gives every rank the logits of
    the whole model. On ranks other than 0 an embedding that is not also the
    output head is replaced by a weightless stand-in (its output there is
    never used: the first layer receives its input). Only the weights this rank
    keeps are evaluated, so a lazily loaded model materialises its share only.

    ``timeout`` (seconds, ``None`` for none) is the default for every blocking
    wait of :func:`pipemlx.pipeline_prefill` and :func:`pipemlx.generate_step` on this model.
    Architectures pipemlx has not been verified on are refused, naming the
    ones it covers, unless ``allow_unregistered=True``.
    Raises ``ValueError``/``TypeError`` for a bad split, and
    :class:`PipelineError` for a model it cannot shard, before changing anything.
    """
    ensure_unsharded(model)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    owner, attribute = find_layer_list(model)
    layers = cast(list[nn.Module], owner[attribute])
    sizes = choose_split(split, memory, model, owner, layers, group.size())
    local = layer_range(sizes, group.rank())
    check_architecture(model, owner, local, allow_unregistered)
    local_caches = local_cache_factory(model, len(layers), local)
    stage = PipelineStage(group, sizes, local, len(layers), timeout)
    stage.hidden_size, stage.dtype = activation_signature(model, layers[local.start : local.stop])

    kept = layers[local.start : local.stop]
    setattr(owner, attribute, kept)
    shown = getattr(model, "layers", None)
    if not isinstance(shown, list) or [id(x) for x in shown] != [id(x) for x in kept]:  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
        setattr(owner, attribute, layers)
        raise PipelineError(f"{type(model).__name__}.layers does not show the local layers after cutting the list")
    apply_fixups(model, owner, local)
    if local_caches is not None:
        object.__setattr__(model, "make_cache", local_caches)
    if stage.world_size > 1:
        first, last = kept[0], kept[-1]
        if first is not last:
            wrap_edge(first, stage, receives=not stage.is_first, sends=False)
        wrap_edge(last, stage, receives=first is last and not stage.is_first, sends=True)
    if not stage.is_first:
        drop_input_embedding(model, owner)
    object.__setattr__(model, STAGE_ATTRIBUTE, stage)
    mx.eval(model.parameters())  # pyright: ignore[reportUnknownMemberType]
    return model


class LocalCaches:
    """``make_cache`` of a sharded model: fresh copies of the caches the whole model makes for the local layers.

    Some architectures build their cache list from global layer indices or the
    configured layer count; copying the whole model's choice for the kept
    layers is right for all of them.
    """

    def __init__(self, prototypes: list[Any]) -> None:
        self.prototypes = prototypes

    def __call__(self) -> list[Any]:
        return copy.deepcopy(self.prototypes)


def local_cache_factory(model: nn.Module, num_layers: int, local: range) -> LocalCaches | None:
    """A :class:`LocalCaches` for ``model`` if it makes its own caches (``None``: mlx-lm's default KV caches).

    Raises :class:`PipelineError` when the model's cache list does not have one
    entry per layer: the caches could not be split with the layers.
    """
    make_cache = getattr(model, "make_cache", None)
    if not callable(make_cache):
        return None
    caches: Any = make_cache()
    if not isinstance(caches, list) or len(caches) != num_layers:  # pyright: ignore[reportUnknownArgumentType]
        count = len(caches) if isinstance(caches, (list, tuple)) else "no list of"  # pyright: ignore[reportUnknownArgumentType]
        raise PipelineError(
            f"{type(model).__module__} cannot be pipelined: its make_cache() returns {count} caches for "
            f"{num_layers} layers; pipemlx needs one cache per decoder layer"
        )
    return LocalCaches(caches[local.start : local.stop])  # pyright: ignore[reportUnknownArgumentType]


class EmbeddingStandIn(nn.Module):
    """Takes an input embedding's place on a rank that never uses its output.

    On ranks other than 0 the first local layer replaces its input by the
    hidden state received from the previous rank, so the embedding's output
    only lends its shape and dtype. This returns zeros of that shape and dtype
    without holding any weight.
    """

    def __init__(self, dims: int, dtype: mx.Dtype) -> None:
        super().__init__()
        self._dims = dims
        self._dtype = dtype

    def __call__(self, x: mx.array) -> mx.array:
        return mx.zeros((*x.shape, self._dims), dtype=self._dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """Refuse: a model that uses its embedding as the output head must keep it on every rank."""
        raise PipelineError(
            "this model uses its input embedding as the output head although it has an lm_head; "
            "pipemlx dropped the embedding on this rank. Please report the model type"
        )


def drop_input_embedding(model: nn.Module, owner: nn.Module) -> None:
    """Replace ``owner``'s input embedding by an :class:`EmbeddingStandIn` unless it is also the output head."""
    if not has_separate_head(model):
        return
    for name, embedding in embedding_modules(owner):
        weights = dict(flat_parameters(embedding))
        if isinstance(embedding, nn.QuantizedEmbedding):
            dims, dtype = int(embedding.dims), weights["scales"].dtype
        else:
            dims, dtype = weights["weight"].shape[-1], weights["weight"].dtype
        setattr(owner, name, EmbeddingStandIn(dims, dtype))
