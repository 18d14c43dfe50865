"""shard_model: keep a rank's contiguous slice of the decoder layers and wire its edges."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Literal, TypeVar, Union, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineError, renamed
from ..runtime.caches import quantized_dims, unquantizable_layers
from ..runtime.calibrate import feed_forward_share, measure_speeds
from ..runtime.edges import wrap_edge
from ..runtime.stage import STAGE_ATTRIBUTE, Lending, PipelineStage, StageInfo, ensure_unsharded
from ..schedule.memory_model import HeadPolicy, Settings, check_speeds, plan_balanced, plan_context
from ..schedule.memory_split import resolve_budgets
from ..schedule.split import SPLIT_NAMES, check_world, even_split, layer_range, resolve_split
from .architectures import apply_fixups, check_architecture, check_lendable
from .lending import (
    HeadBorrowingBlock,
    LentHeadsCache,
    auto_lent_heads,
    lend_feed_forwards,
    lendable_heads,
    message_width,
)
from .memory import memory_model_from_config, text_config
from .parameters import (
    activation_dtype,
    embedding_modules,
    flat_parameters,
    has_separate_head,
    model_bytes_from_model,
    model_config,
    split_for_memory,
)
from .vocab_head import HeadSpec, attach_stage, check_splittable, resolve_head, split_vocabulary, vocab_shard

ModelT = TypeVar("ModelT", bound=nn.Module)

DEFAULT_TIMEOUT = 120.0
"""Seconds any blocking wait may take by default: the same in the API and every command."""
AUTO_PLANNED_STEP = 512
"""The prefill chunk a memory plan counts for ``prefill_step_size="auto"`` (the chunks auto chooses vary with the
prompt; pass the int you prefill with to plan for another)."""
LendSpec = Union[Literal["auto", "none", "mlp"], int]
"""Where the cuts between ranks fall (:func:`shard_model`'s ``lend``): ``"auto"``, ``"none"``, ``"mlp"`` or a count
of key-value heads."""


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


SplitSpec = Union[Sequence[int], Literal["even", "memory", "balanced"], None]
"""Layers per rank, ``"even"`` (the default), ``"memory"`` (planned from memory budgets) or ``"balanced"``
(layers in proportion to each rank's speed, within its budget)."""
MemorySpec = Union[Sequence[Union[float, str]], float, str, None]
"""Per-rank memory budgets: bytes (a number) or sizes like ``"24GB"``, one per rank or one for all."""


def split_kind(split: SplitSpec, memory: MemorySpec, speeds: Sequence[float] | None) -> SplitSpec:
    """``split`` as :func:`shard_model` reads it: ``speeds`` alone mean ``"balanced"``, ``memory`` alone
    ``"memory"``; raises ``ValueError`` when ``memory`` or ``speeds`` come with a split that does not use them."""
    if split is None and speeds is not None:
        split = "balanced"
    if memory is not None and split is None:
        split = "memory"
    if memory is not None and split not in ("memory", "balanced"):
        raise ValueError(f"memory budgets are only used with split='memory' or 'balanced', got split={split!r}")
    if speeds is not None and split != "balanced":
        raise ValueError(f"speeds are only used with split='balanced', got split={split!r}")
    return split


def choose_split(
    split: SplitSpec,
    memory: MemorySpec,
    model: nn.Module,
    owner: nn.Module,
    layers: list[nn.Module],
    group: mx.distributed.Group,
    *,
    speeds: Sequence[float] | None = None,
    context: int | None = None,
    kv_bits: int | None = None,
    prefill_step_size: int | Literal["auto"] = "auto",
    head: HeadPolicy = "all",
    timeout: float | None = DEFAULT_TIMEOUT,
) -> tuple[int, ...]:
    """Layers per rank for :func:`shard_model`'s ``split``/``memory``/``speeds``/``context``, checked against the
    model and the group.

    ``memory`` given with ``split=None`` means ``split="memory"``, ``speeds``
    given with ``split=None`` means ``split="balanced"``. Raises
    ``ValueError``/``TypeError`` naming the problem,
    :class:`~pipemlx.schedule.memory_split.MemoryPlanError` when the budgets
    cannot hold the model.
    """
    world_size = group.size()
    split = split_kind(split, memory, speeds)
    if not (isinstance(split, str) and split in SPLIT_NAMES):
        return resolve_split(split, len(layers), world_size)
    check_world(len(layers), world_size)
    if split == "even":
        return even_split(len(layers), world_size)
    budgets = resolve_budgets(memory, world_size)
    step = AUTO_PLANNED_STEP if prefill_step_size == "auto" else prefill_step_size
    settings = None if context is None else Settings(context, step, kv_bits=kv_bits, head=head)
    if split == "memory" and settings is None:
        return split_for_memory(model, owner, layers, world_size, memory)
    dtype = activation_dtype(layers)
    memory_model = memory_model_from_config(
        model_config(model), model_bytes_from_model(model, owner, layers), dtype.size
    )
    if split == "memory":
        assert settings is not None
        return plan_context(memory_model, world_size, settings, budgets).split
    if speeds is None:
        config = text_config(model_config(model))
        hidden, intermediate = int(config.get("hidden_size") or 0), int(config.get("intermediate_size") or 0)
        speeds = measure_speeds(group, hidden or 256, intermediate, dtype, timeout)
    return plan_balanced(memory_model, world_size, check_speeds(speeds, world_size), budgets, settings)


@renamed(step_size="prefill_step_size", lend_mlp="lend", lend_heads="lend")
def shard_model(
    model: ModelT,
    group: mx.distributed.Group,
    *,
    split: SplitSpec = None,
    memory: MemorySpec = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    allow_unregistered: bool = False,
    speeds: Sequence[float] | None = None,
    context: int | None = None,
    kv_bits: int | None = None,
    prefill_step_size: int | Literal["auto"] = "auto",
    head: HeadSpec = "auto",
    lend: LendSpec = "auto",
) -> ModelT:
    """Keep this rank's layers of ``model`` in place and make it a pipeline stage; return ``model``.

    A collective: call it on every rank of ``group`` with the same arguments. The ranks exchange nothing for a
    fixed split without lending; ``split="balanced"`` without ``speeds`` and ``lend="auto"`` (the default) time
    the ranks and all-gather the figures (``lend="auto"`` reads them from the calibration cache when every rank
    holds the same ones: :mod:`pipemlx.runtime.calibration_cache`).

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

    ``split="balanced"`` gives each rank layers in proportion to its speed:
    ``speeds`` (one number per rank, only ratios count), or measured on the
    group when not given (:func:`pipemlx.runtime.calibrate.measure_speeds`),
    within the ``memory`` budgets if given.

    ``context`` is the most tokens (prompt and generated) one request holds, as everywhere in pipemlx (``pipemlx
    serve --context``): what the model is planned for. Any option accepts it: a ``"memory"`` or ``"balanced"``
    split counts each layer's KV cache at that many tokens and one prefill chunk's peak (with ``kv_bits`` and
    ``prefill_step_size``: ``"auto"`` is counted as chunks of :data:`AUTO_PLANNED_STEP`; ``docs/planning.md``),
    and ``lend="auto"`` chooses the heads to lend for a prompt of that length (default
    :data:`pipemlx.models.lending.AUTO_LEND_TOKENS`); elsewhere it changes nothing.

    ``head`` says where the vocabulary-sized matrices (the input embedding, the output head) live. ``"split"``:
    rank ``r`` of ``S`` keeps only rows ``[V*r/S, V*(r+1)/S)`` of each (a tied one once), so that they cost each
    rank 1/S; the embeddings of a prompt are summed from every rank's rows, and greedy decoding without
    log-probabilities decides each token from every rank's best logit (``docs/design.md``). Every decoding path
    works on it, mlx-lm's own ``generate_step`` included (the whole logits are gathered there). ``"all"`` keeps
    the head on every rank (and the embedding on rank 0, and on every rank where it is the tied head).
    ``"last"`` keeps the output head on the last rank only (tied: rank 0 keeps the embedding, the last rank the
    head): only :func:`pipemlx.generate_step`, :func:`pipemlx.stream_generate` and ``lean_generate_step`` can
    decode then (mlx-lm's own ``generate_step`` is refused on the other ranks). ``"auto"`` (the default) is
    ``"split"`` wherever the model's vocabulary can be split (its logits are a plain or quantized head applied to
    the final norm's output, from a plain or quantized embedding: the registry's ``plain_head`` architectures)
    and the group has more than one rank, else ``"all"`` (:func:`pipemlx.models.vocab_head.resolve_head`); the
    stage's ``info.head`` says which was applied.

    ``lend`` chooses where the cuts between ranks fall. ``"mlp"`` cuts between the halves of each rank's last
    layer: its feed-forward half runs on the next rank (:mod:`pipemlx.models.lending`), moving that much work from
    the first ranks (which also embed) to the last one (whose last layer a prefill computes only up to its cache).
    Caches stay with their layers. Only for architectures whose blocks are plain pre-norm blocks (llama and
    mistral, qwen2, qwen3). An int ``k`` also moves ``k`` key-value heads of that layer's attention, their cache
    and its output projection to the next rank (``0`` is ``"mlp"``): where attention is most of the work (long
    prompts), this balances what whole layers and feed-forward halves cannot. The next rank's first cache is then
    a :class:`pipemlx.models.lending.LentHeadsCache`, with which ``kv_bits``, ``max_kv_size`` (with
    :func:`pipemlx.generate_step`) and :class:`pipemlx.BatchGenerator` work; the layers at each cut must keep
    plain ``KVCache`` caches (no sliding window). ``"auto"`` (the default, the fastest measured: see
    ``docs/api.md``) lends the feed-forward halves and the number of heads predicted to prefill ``context`` tokens
    soonest where the model allows (heads only where the caches at the cuts are plain), and keeps whole layers
    elsewhere, without an error, and on a split planned from ``memory`` budgets (``"memory"``, ``"balanced"``),
    whose plan counts whole layers. ``"none"`` keeps whole layers. Every rank must pass the same value (the prefill's
    handshake compares what it gave).

    ``timeout`` (seconds, ``None`` for none) is the default for every blocking
    wait on this model. Architectures pipemlx has not been verified on are
    refused, naming the ones it covers, unless ``allow_unregistered=True``.
    Raises ``ValueError``/``TypeError`` for a bad split, and
    :class:`PipelineError` for a model it cannot shard, before changing anything.
    """
    ensure_unsharded(model)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    head = resolve_head(head, model, group.size())
    if head == "split" and group.size() == 1:
        head = "all"  # one rank holds every row
    owner, attribute = find_layer_list(model)
    layers = cast(list[nn.Module], owner[attribute])
    sizes = choose_split(
        split,
        memory,
        model,
        owner,
        layers,
        group,
        speeds=speeds,
        context=context,
        kv_bits=kv_bits,
        prefill_step_size=prefill_step_size,
        head=head,
        timeout=timeout,
    )
    local = layer_range(sizes, group.rank())
    check_architecture(model, owner, local, allow_unregistered)
    check_lend(lend)
    if head == "split":
        check_splittable(model)
    if lend == "auto":  # not on a split planned from memory budgets: they count whole layers
        planned = memory is not None or speeds is not None or split in ("memory", "balanced")
        lending = len(sizes) > 1 and lendable(model) and not planned
        lend_heads: int | Literal["auto"] = "auto"
    else:
        lending = lend != "none" and len(sizes) > 1
        lend_heads = lend if isinstance(lend, int) else 0
        if lend != "none":
            check_lendable(model)
    most_heads = 0  # lend="auto": the most it may lend; none where a cut's layers keep other caches
    if lending and lend_heads == "auto" and not unplain_caches_at_cuts(model, sizes):
        most_heads = lendable_heads(layers, sizes)
    if lending and lend_heads and lend_heads != "auto":
        check_plain_caches_at_cuts(model, sizes)
    local_caches = local_cache_factory(model, len(layers), local)
    hidden_size, dtype = activation_signature(model, layers[local.start : local.stop])
    info = StageInfo(group.rank(), group.size(), sizes, local, len(layers), timeout, hidden_size, dtype, head=head)
    # Of the whole model as built (before a cut inside a layer splits an attention module), the same on every rank.
    kv_dims, unquantizable = quantized_dims(model), unquantizable_layers(model)
    unquantizable_bounded = unquantizable_layers(model, max_kv_size=1)
    bounded_caches = None
    if lending:
        if lend_heads != "auto":
            heads = lend_heads
        else:  # a collective when there is a choice: most_heads is the same on every rank
            heads = auto_lent_heads(model, layers, info, group, most_heads, context) if most_heads else 0
        info, local_caches, bounded_caches = cut_inside_layers(model, layers, info, heads, local_caches)
    info = replace(
        info,
        kv_dims=kv_dims,  # of every rank's layers: the ranks refuse a kv_group_size alike
        # Likewise kv_bits on rotating (sliding-window) caches, which a rank holding none of them must refuse too.
        unquantizable=unquantizable,
        unquantizable_bounded=unquantizable_bounded,
        vocab_shard=split_vocabulary(model, info)
        if head == "split"
        else vocab_shard(model, info)
        if head == "all" and info.world_size > 1
        else None,
        bounded_caches=bounded_caches,
        pair_caches=pair_lent_cache if lending and isinstance(layers[local.start], HeadBorrowingBlock) else None,
    )
    stage = PipelineStage(info, group)

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
    if head == "split":
        attach_stage(model, stage)
    elif not stage.is_first:
        drop_input_embedding(model, owner, keep_as_head=head == "all" or stage.is_last, stage=stage)
    if head == "last" and not stage.is_last:
        drop_output_head(model, stage)
    object.__setattr__(model, STAGE_ATTRIBUTE, stage)
    mx.eval(model.parameters(), held_arrays(model))  # pyright: ignore[reportUnknownMemberType]
    return model


def cut_inside_layers(
    model: nn.Module, layers: list[nn.Module], info: StageInfo, lend_heads: int, local_caches: LocalCaches | None
) -> tuple[StageInfo, LocalCaches | None, Callable[[int], list[Any]] | None]:
    """``lend_mlp`` (and ``lend_heads``) on the whole ``layers`` list: ``info`` with what moved, the local caches,
    and (the rank after a cut that borrows heads, on a model without caches of its own) the bounded caches."""
    sizes = info.split
    cuts = [sum(sizes[: r + 1]) for r in range(len(sizes) - 1)]
    kv_heads = int(getattr(cast(Any, layers[cuts[0] - 1])["self_attn"], "n_kv_heads", 0) or 0)
    lend_feed_forwards(layers, sizes, lend_heads)
    fraction = lend_heads / kv_heads if lend_heads else 0.0
    lending = Lending(mlp=True, share=feed_forward_share(model, fraction))
    if not lend_heads:
        return replace(info, lending=lending), local_caches, None
    widths = [message_width(layers[cut - 1]) for cut in cuts]
    lending = replace(
        lending,
        heads=lend_heads,
        pair_share=fraction,
        outgoing_width=0 if info.is_last else widths[info.rank],
        incoming_width=0 if info.is_first else widths[info.rank - 1],
    )
    info = replace(info, lending=lending)
    if info.is_first:
        return info, local_caches, None
    caches, bounded = with_lent_heads_cache(len(info.layers), local_caches)
    return info, caches, bounded


def check_lend(lend: Any) -> None:
    """Raise ``ValueError`` unless ``lend`` is ``"auto"``, ``"none"``, ``"mlp"`` or a non-negative int."""
    if lend in ("auto", "none", "mlp"):
        return
    if isinstance(lend, bool) or not isinstance(lend, int) or lend < 0:
        raise ValueError(
            f"lend must be 'auto', 'none', 'mlp' or a non-negative int (key-value heads lent with the feed-forward "
            f"half), got {lend!r}"
        )


def lendable(model: nn.Module) -> bool:
    """Whether ``model``'s blocks may be cut between their halves (``lend="auto"`` lends only then)."""
    try:
        check_lendable(model)
    except PipelineError:
        return False
    return True


def unplain_caches_at_cuts(model: nn.Module, sizes: tuple[int, ...]) -> list[tuple[int, str]]:
    """``(layer, cache class)`` of the layers at each cut whose cache is not a plain ``KVCache``."""
    caches = make_prompt_cache(model)
    cuts = [sum(sizes[: r + 1]) for r in range(len(sizes) - 1)]
    return sorted(
        {(i, type(caches[i]).__name__) for cut in cuts for i in (cut - 1, cut) if type(caches[i]) is not KVCache}
    )


def check_plain_caches_at_cuts(model: nn.Module, sizes: tuple[int, ...]) -> None:
    """Raise :class:`PipelineError` unless the layers at each cut keep a plain ``KVCache`` (``lend=k``)."""
    bad = unplain_caches_at_cuts(model, sizes)
    if bad:
        shown = ", ".join(f"layer {i} ({kind})" for i, kind in bad)
        raise PipelineError(
            f"lend=k (lending key-value heads): the layers at the cuts must keep plain KVCache caches, and {shown} do not; "
            "lend='mlp' works here"
        )


def with_lent_heads_cache(
    count: int, local_caches: LocalCaches | None
) -> tuple[LocalCaches, Callable[[int], list[Any]] | None]:
    """``make_cache`` for a rank of ``count`` layers that borrows heads: its first cache becomes
    :class:`LentHeadsCache` ``(own, lent heads')``; and, when the whole model makes no caches of its own
    (mlx-lm then bounds them by ``max_kv_size``), the bounded ones likewise (``None`` otherwise)."""
    if local_caches is None:

        def bounded(max_kv_size: int) -> list[Any]:
            return _lent_first(_default_caches(count, max_kv_size))

        return LocalCaches(_lent_first(_default_caches(count))), bounded
    return LocalCaches(_lent_first(list(local_caches.prototypes))), None


def _default_caches(count: int, max_kv_size: int | None = None) -> list[Any]:
    """What mlx-lm's ``make_prompt_cache`` makes for ``count`` layers of a model without ``make_cache``."""
    return make_prompt_cache(cast(Any, SimpleNamespace(layers=[None] * count)), max_kv_size=max_kv_size)


def pair_lent_cache(caches: list[Any]) -> None:
    """A cache list made without the borrowing rank's ``make_cache`` (a caller's own ``make_cache``, rotating caches
    for a sliding window): its first cache, still empty, paired in place with a fresh one of its kind for the lent
    heads, as :func:`with_lent_heads_cache` makes it. A filled one cannot be: the lent heads' positions are not in it."""
    first = caches[0] if caches else None
    if first is None or isinstance(first, LentHeadsCache):
        return
    if getattr(first, "offset", 0):
        raise ValueError(
            "the first cache of this rank serves the heads the previous rank lends (lend), but it was filled without "
            "them: make the caches with pipemlx's stage_of(model).new_cache(model), or shard with lend='mlp' or 'none'"
        )
    caches[0] = LentHeadsCache(first, copy.deepcopy(first))


def _lent_first(caches: list[Any]) -> list[Any]:
    """``caches`` with the first one paired with a fresh cache of its kind for the lent heads."""
    return [LentHeadsCache(caches[0], copy.deepcopy(caches[0])), *caches[1:]]


def held_arrays(model: nn.Module) -> list[mx.array]:
    """Arrays the model's modules hold, their parameters and the rest: private ones such as a RoPE's ``_freqs``.

    mlx-lm computes some of them lazily when a model is built (llama 3's RoPE
    frequencies), on the building thread's default stream, which the helper
    threads of the bounded waits cannot evaluate: :func:`shard_model`
    evaluates them on the building thread.
    """
    arrays: list[mx.array] = []
    for module in cast(list[nn.Module], model.modules()):
        held: list[Any] = [*cast(dict[str, Any], module).values(), *vars(module).values()]  # ``_freqs`` is an item
        for value in held:
            values = cast(Sequence[Any], value if isinstance(value, (list, tuple)) else (value,))
            arrays.extend(v for v in values if isinstance(v, mx.array))
    return arrays


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


def _refuse_logits(stage: PipelineStage | None) -> None:
    """Raise when logits are wanted on a rank that holds no head: mlx-lm's decoding, not pipemlx's."""
    if stage is not None and not stage.head_needed:
        return
    raise PipelineError(
        "this rank holds no output head (shard_model(..., head='last') keeps it on the last rank only): "
        "decode with pipemlx.generate_step / stream_generate, or shard with head='all' for mlx-lm's generate_step"
    )


class EmbeddingStandIn(nn.Module):
    """Takes an input embedding's place on a rank that never uses its output.

    On ranks other than 0 the first local layer replaces its input by the
    hidden state received, so this returns zeros of the embedding's shape and
    dtype without holding any weight. With ``vocab`` (a tied head dropped by
    ``head="last"``), ``as_linear`` stands in for the head the same way.
    """

    def __init__(self, dims: int, dtype: mx.Dtype, vocab: int = 0, stage: PipelineStage | None = None) -> None:
        super().__init__()
        self._dims = dims
        self._dtype = dtype
        self._vocab = vocab
        object.__setattr__(self, "_stage", stage)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.zeros((*x.shape, self._dims), dtype=self._dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """Zeros in place of logits where pipemlx never reads them; refuse elsewhere."""
        if not self._vocab:
            raise PipelineError(
                "this model uses its input embedding as the output head although it has an lm_head; "
                "pipemlx dropped the embedding on this rank. Please report the model type"
            )
        _refuse_logits(cast(Any, self)._stage)
        return mx.zeros((*x.shape[:-1], self._vocab), dtype=self._dtype)


class HeadStandIn(nn.Module):
    """Takes the output head's place on a rank that holds none (``head="last"``): zeros where unread."""

    def __init__(self, vocab: int, dtype: mx.Dtype, stage: PipelineStage) -> None:
        super().__init__()
        self._vocab = vocab
        self._dtype = dtype
        object.__setattr__(self, "_stage", stage)

    def __call__(self, x: mx.array) -> mx.array:
        _refuse_logits(cast(Any, self)._stage)
        return mx.zeros((*x.shape[:-1], self._vocab), dtype=self._dtype)


def _embedding_shape(embedding: nn.Module) -> tuple[int, int, mx.Dtype]:
    weights = dict(flat_parameters(embedding))
    if isinstance(embedding, nn.QuantizedEmbedding):
        return int(embedding.num_embeddings), int(embedding.dims), weights["scales"].dtype
    return weights["weight"].shape[0], weights["weight"].shape[-1], weights["weight"].dtype


def drop_input_embedding(
    model: nn.Module, owner: nn.Module, *, keep_as_head: bool = True, stage: PipelineStage | None = None
) -> None:
    """Replace ``owner``'s input embedding by an :class:`EmbeddingStandIn` unless it is also the output head.

    A tied head is kept when ``keep_as_head``; otherwise (``head="last"`` on a
    rank before the last) the stand-in also stands in for the head.
    """
    separate = has_separate_head(model)
    if not separate and keep_as_head:
        return
    for name, embedding in embedding_modules(owner):
        vocab, dims, dtype = _embedding_shape(embedding)
        setattr(owner, name, EmbeddingStandIn(dims, dtype, 0 if separate else vocab, stage))


def drop_output_head(model: nn.Module, stage: PipelineStage) -> None:
    """Replace every module named ``lm_head`` by a :class:`HeadStandIn` (``head="last"``, ranks before the last)."""
    for name, module in cast(list[tuple[str, nn.Module]], model.named_modules()):
        if name.rsplit(".", 1)[-1] != "lm_head" or isinstance(module, HeadStandIn):
            continue
        weights = dict(flat_parameters(module))
        weight = weights["weight"]
        dtype = weights["scales"].dtype if "scales" in weights else weight.dtype
        parent = model
        for part in name.split(".")[:-1]:
            parent = cast(nn.Module, getattr(parent, part))
        parent.lm_head = HeadStandIn(int(weight.shape[0]), dtype, stage)
