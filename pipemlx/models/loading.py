"""load_sharded: load an mlx-lm model (a folder or a Hub repo id) holding only this rank's part in memory."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.utils import _get_classes, load_adapters, load_config, load_model, load_tokenizer  # pyright: ignore[reportUnknownVariableType, reportPrivateUsage]

from ..errors import renamed
from ..schedule.memory_model import HeadPolicy, Settings, check_speeds, plan_balanced, plan_context
from ..schedule.memory_split import plan_split, resolve_budgets
from ..schedule.split import layer_range, resolve_split
from .hub import cache_folder, resolve_source
from .load_wait import LoadProgress, while_ranks_load
from .memory import memory_model_from_headers
from .parameters import activation_dtype, embedding_modules
from .peer import PeerSource, Sharing, share_model
from .safetensors import decoder_prefix, read_dir_config
from .sharding import (
    AUTO_PLANNED_STEP,
    DEFAULT_TIMEOUT,
    LendSpec,
    MemorySpec,
    SplitSpec,
    find_layer_list,
    shard_model,
    split_kind,
)
from .vocab_head import HeadSpec, check_head, resolve_head
from .vocab_rows import PREREAD_ATTRIBUTE, preread_vocabulary
from .weights import (
    DONE_FILE,
    FolderSource,
    TensorInfo,
    TensorPart,
    WeightSource,
    config_of,
    fetch_rank_folder,
    is_embedding,
    rank_tensors,
)


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`Path` after checking it looks like an mlx-lm model directory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is not a directory; load_sharded needs a local mlx-lm model directory "
            "(config.json, model*.safetensors, tokenizer files)"
        )
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; it is not an mlx-lm model directory")
    if not any(root.glob("model*.safetensors")):
        raise FileNotFoundError(f"{root} has no model*.safetensors weight files")
    return root


@renamed(step_size="prefill_step_size", lend_mlp="lend", lend_heads="lend")
def load_sharded(
    path: str | os.PathLike[str],
    group: Any,
    *,
    split: SplitSpec = None,
    memory: MemorySpec = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    model_config: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    speeds: Sequence[float] | None = None,
    context: int | None = None,
    kv_bits: int | None = None,
    prefill_step_size: int | Literal["auto"] = "auto",
    head: HeadSpec = "auto",
    allow_unregistered: bool = False,
    lend: LendSpec = "auto",
    revision: str | None = None,
    adapter_path: str | os.PathLike[str] | None = None,
    sharing: Sharing | None = None,
) -> tuple[nn.Module, Any]:
    """Load the mlx-lm model ``path`` as this rank's pipeline stage; return ``(model, tokenizer)``.

    ``path`` is a model folder or, as in mlx-lm, a Hugging Face repo id
    (``mlx-community/...``, at ``revision``; default the main branch), and it
    need only be on one rank's machine: loading is one pass over one source
    (:mod:`pipemlx.models.weights`). First the ranks agree in one all-gather
    who has the model (:mod:`pipemlx.models.peer`; ``sharing`` passes that
    agreement in when the caller made it already, to read the tokenizer
    first); a rank with it reads it in place and serves it to the group until
    every rank has loaded. A rank without it reads, from a rank that has it or
    else from the Hub (HTTP range requests), the config, the tokenizer files,
    the safetensors headers, and the byte ranges of the tensors it keeps only,
    into a weight folder of its own in pipemlx's cache (a second run fetches
    nothing). The split is planned before fetching (``split="memory"`` and
    ``"balanced"`` with ``speeds`` from the headers; a ``"balanced"`` split that
    times the ranks makes every rank fetch every tensor).

    A collective, like :func:`pipemlx.shard_model`: call it on every rank of ``group`` with the same arguments. The model is
    built by mlx-lm's own ``load_model`` with lazy weights (so ``sanitize``,
    quantization and the weight checks are mlx-lm's), then
    :func:`pipemlx.shard_model` cuts it to this rank's layers and evaluates
    only the weights the rank keeps: its layers, the final norm, and its part of
    the input embedding and the output head: with ``head="split"`` (what the
    default ``"auto"`` resolves to wherever the vocabulary can be split, decided
    from the model's classes before any weight is read) only its rows of each,
    read by their byte ranges; with ``head="all"`` the whole head, and the
    embedding on rank 0 or, tied, on every rank. Weights of other ranks' layers
    are never read from disk.
    ``split``, ``memory``, ``timeout``, ``speeds``, ``context``, ``kv_bits``,
    ``prefill_step_size``, ``head``, ``allow_unregistered`` and ``lend`` are :func:`pipemlx.shard_model`'s
    (``split="memory"`` plans from the byte sizes of the layers as built). The tokenizer is mlx-lm's
    ``load_tokenizer``'s (``tokenizer_config`` passes extra settings to it); ``model_config`` overrides entries of
    ``config.json``. Weight files may be one or many, with or without ``model.safetensors.index.json``.

    Raises ``FileNotFoundError`` when ``path`` is not a model directory
    (:class:`pipemlx.models.hub.ModelNotFoundError`, one line, for a repo,
    revision or file the Hub or the offline cache lacks), and what
    :func:`pipemlx.shard_model` raises for a bad split or a model it cannot
    pipeline.
    """
    if adapter_path is not None:  # LoRA wraps the projections that lending would cut: whole layers
        if lend not in ("auto", "none"):
            raise ValueError(f"adapter_path: LoRA adapters need whole layers (lend='none'), not lend={lend!r}")
        lend = "none"
    check_head(head)
    asked = ShardArguments(split, memory, speeds, context, kv_bits, prefill_step_size, head, lend)
    # Every rank fetches and builds its part while the ranks tell each other how far they are: a slow download
    # is waited for as long as it makes progress, before the first collective with a deadline (shard_model's).
    # A rank without the model reads it from one that has it (pipemlx/models/peer.py): agreed in one all-gather,
    # served until every rank has loaded.
    with share_model(group, path, revision, timeout) if sharing is None else nullcontext(sharing) as agreed:
        model, config, root, planned = while_ranks_load(
            group,
            timeout,
            lambda progress: _fetch_and_build(
                path, group, revision, progress, asked, model_config, trust_remote_code, adapter_path, agreed.peer
            ),
        )
    shard_model(
        model,
        group,
        split=planned.split,
        memory=planned.memory,
        timeout=timeout,
        speeds=planned.speeds,
        context=planned.context,
        kv_bits=planned.kv_bits,
        prefill_step_size=planned.prefill_step_size,
        head=planned.head,
        allow_unregistered=allow_unregistered,
        lend=planned.lend,
    )
    if trust_remote_code:  # the tokenizer's code too, as mlx_lm.generate asks for it
        tokenizer_config = {**(tokenizer_config or {}), "trust_remote_code": True}
    tokenizer: Any = load_tokenizer(root, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer


@dataclass(frozen=True)
class ShardArguments:
    """:func:`shard_model`'s planning arguments, as :func:`load_sharded` passes them on (a split planned before
    fetching replaces the others)."""

    split: SplitSpec
    memory: MemorySpec
    speeds: Sequence[float] | None
    context: int | None
    kv_bits: int | None
    prefill_step_size: int | Literal["auto"]
    head: HeadSpec  # "auto" resolved before anything is read (resolve_head): the rows fetched are the ones kept
    lend: LendSpec


def _fetch_and_build(
    path: str | os.PathLike[str],
    group: Any,
    revision: str | None,
    progress: LoadProgress,
    arguments: ShardArguments,
    model_config: dict[str, Any] | None,
    trust_remote_code: bool,
    adapter_path: str | os.PathLike[str] | None = None,
    peer: PeerSource | None = None,
) -> tuple[nn.Module, dict[str, Any], Path, ShardArguments]:
    """This rank's model built lazily from its source, in one pass: the source resolved (a folder, the Hub, a
    peer), the split planned from it, this rank's tensors fetched (unless the source is local), the model built.
    No collective, no evaluation."""
    progress.cache = cache_folder(path)
    if peer is not None:
        peer.count = progress.fetched
    source: WeightSource = (
        peer if peer is not None else resolve_source(path, revision=revision, rank=group.rank(), count=progress.fetched)
    )
    progress.steps += 1
    planned: tuple[list[int] | None, tuple[TensorPart, ...]] | None = None
    root = source.metadata_root()
    if source.local:
        if isinstance(source, FolderSource) and not source.label:  # the folder the user named (not a snapshot)
            root = check_model_dir(root)
    else:  # head="auto" resolved from the config first: a split vocabulary fetches this rank's rows only
        arguments = replace(
            arguments, head=head_of_folder(arguments.head, root, group.size(), model_config, trust_remote_code)
        )
        planned, root = _fetch_rank_weights(source, group, arguments, progress, model_config, trust_remote_code)
    split, memory, speeds, context, lend = (
        getattr(arguments, f) for f in ("split", "memory", "speeds", "context", "lend")
    )
    if planned is not None and planned[0] is not None:  # decided before fetching: shard_model takes it as given
        if split in ("memory", "balanced") or memory is not None or speeds is not None:
            context = None  # it planned the split, from memory budgets that count whole layers
            lend = "none" if lend == "auto" else lend  # as shard_model's own memory plans keep them
        split, memory, speeds = planned[0], None, None
    loaded: Any = load_model(  # pyright: ignore[reportUnknownVariableType]
        root,
        lazy=True,
        strict=planned is None or planned[0] is None,  # a rank's folder holds only its tensors
        model_config=model_config,
        trust_remote_code=trust_remote_code,
    )
    model: nn.Module = loaded[0]
    config: dict[str, Any] = loaded[1]
    arguments = replace(arguments, head=resolve_head(arguments.head, model, group.size()))  # before any read
    if arguments.head == "split" and group.size() > 1:  # this rank's rows only: the whole matrices are never read
        take_fetched_rows(model, root, group.rank(), group.size())
        preread_vocabulary(model, root, group.rank(), group.size())
    if adapter_path is not None:  # mlx-lm's own, on the whole model (global layer numbers): shard_model then
        load_adapters(model, str(adapter_path))  # keeps the adapters of this rank's layers and drops the others
    if planned is not None and planned[0] is not None and not _holds_embedding(source, planned[1]):
        _unfetched_embedding_dtype(model, layer_range(planned[0], group.rank()))
    progress.steps += 1
    return (
        model,
        config,
        root,
        replace(arguments, split=split, memory=memory, speeds=speeds, context=context, lend=lend),
    )


def head_of_folder(
    head: HeadSpec,
    root: str | os.PathLike[str],
    world_size: int,
    model_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> HeadPolicy:
    """``head`` resolved for the model whose ``config.json`` is in ``root`` (:func:`resolve_head`): ``"auto"``
    from the classes mlx-lm builds from the config, lazily, no weight read (the folder need not hold any);
    the others as given."""
    check_head(head)
    if head != "auto" or world_size == 1:
        return "all" if head == "auto" else head
    config: dict[str, Any] = {**cast(dict[str, Any], load_config(Path(root))), **(model_config or {})}
    if config.get("model_file") is not None:  # a custom architecture: mlx-lm builds it (trust_remote_code)
        loaded: Any = load_model(  # pyright: ignore[reportUnknownVariableType]
            Path(root), lazy=True, strict=False, model_config=model_config, trust_remote_code=trust_remote_code
        )
        return resolve_head(head, cast(nn.Module, loaded[0]), world_size)
    # The classes from the config alone, as mlx-lm's load_model picks them: no weight file is opened (a folder
    # may hold only their headers, or none), and the parameters a module makes are lazy and never evaluated.
    model_class, args_class = _get_classes(config=config)
    return resolve_head(head, cast(nn.Module, model_class(args_class.from_dict(config))), world_size)


def take_fetched_rows(model: nn.Module, root: Path, rank: int, world_size: int) -> int:
    """Where this rank's weight folder ``root`` holds only its vocabulary rows of a tensor (``head="split"``:
    :func:`~pipemlx.models.weights.rank_tensors`), hand those rows, as loaded, to the split of the vocabulary
    (:data:`~pipemlx.models.vocab_rows.PREREAD_ATTRIBUTE`) and give the model back a parameter of the whole
    tensor's shape and dtype in their place: a lazy stand-in that nothing evaluates (the split takes the rows
    read, :func:`pipemlx.models.vocab_head.rows_of`), so that the modules keep their vocabulary size. Returns the
    count of such tensors; raises ``ValueError`` naming the tensor where the model has no such parameter or the
    rows are not this rank's."""
    try:
        record: dict[str, Any] = json.loads((root / DONE_FILE).read_text())
    except (OSError, ValueError):
        return 0  # not a rank's weight folder: a model folder, read whole
    whole_rows: dict[str, int] = dict(record.get("rows_of") or {})
    if not whole_rows:
        return 0
    fetched = {str(name): tuple(rows) for name, rows in record["tensors"] if rows is not None}
    parameters = dict(cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    kept: dict[str, mx.array] = dict(getattr(model, PREREAD_ATTRIBUTE, {}))
    stand_ins: list[tuple[str, mx.array]] = []
    for name, vocab in whole_rows.items():
        mine = (vocab * rank // world_size, vocab * (rank + 1) // world_size)
        value = parameters.get(name)
        if not isinstance(value, mx.array) or fetched.get(name) != mine or value.shape[0] != mine[1] - mine[0]:
            raise ValueError(
                f"{root} holds rows {fetched.get(name)} of {name}, which are not rank {rank}/{world_size}'s rows "
                f"{mine} of a parameter of the model (remove the folder to fetch it again)"
            )
        kept[name] = value
        stand_ins.append((name, mx.zeros((vocab, *value.shape[1:]), dtype=value.dtype)))
    model.load_weights(stand_ins, strict=False)
    object.__setattr__(model, PREREAD_ATTRIBUTE, kept)
    return len(stand_ins)


def _holds_embedding(source: WeightSource, parts: tuple[TensorPart, ...]) -> bool:
    names = [p.name for p in parts]
    prefix = decoder_prefix(source.headers())
    if prefix is None:
        return True
    wanted = {n for n in source.headers() if is_embedding(n, prefix)}
    return wanted <= set(names)


def _fetch_rank_weights(
    source: WeightSource,
    group: Any,
    arguments: ShardArguments,
    progress: LoadProgress,
    model_config: dict[str, Any] | None,
    trust_remote_code: bool,
) -> tuple[tuple[list[int] | None, tuple[TensorPart, ...]], Path]:
    """Plan the split from ``source`` and fetch this rank's tensors into its weight folder; return the split
    (``None``: left to :func:`shard_model`) with the tensor set, and the folder.

    The split is decided before fetching and passed on to :func:`shard_model`,
    so the tensors match the layers the rank keeps. An even or given split needs
    the layer count, from the model as mlx-lm builds it from the config alone
    (lazily, nothing evaluated). ``split="memory"`` and a ``"balanced"`` split
    with given ``speeds`` are planned as :func:`shard_model` plans them, from
    the parameter bytes in the safetensors headers rather than from the weights
    as built. A ``"balanced"`` split without ``speeds`` is left to
    :func:`shard_model`, which times the ranks on the model: every tensor is
    fetched.
    """
    split, memory, speeds, context, step_size = (
        arguments.split,
        arguments.memory,
        arguments.speeds,
        arguments.context,
        arguments.prefill_step_size,
    )
    headers = source.headers()
    config = config_of(source)
    kind = split_kind(split, memory, speeds)  # as shard_model reads them
    who = f"rank {group.rank()}/{group.size()}"
    if kind == "balanced" and speeds is None:
        parts = tuple(TensorPart(n) for n in sorted(headers))
        root = fetch_rank_folder(source, parts, who=who, count=progress.fetched, headers=headers)
        return (None, parts), root
    if kind == "memory" or kind == "balanced":
        step = AUTO_PLANNED_STEP if step_size == "auto" else step_size
        sizes = _planned_split(
            headers,
            config,
            source.name,
            group.size(),
            memory,
            speeds,
            context,
            arguments.kv_bits,
            step,
            cast(HeadPolicy, arguments.head),  # resolved by _fetch_and_build
        )
    else:
        loaded: Any = load_model(  # pyright: ignore[reportUnknownVariableType]
            source.metadata_root(),
            lazy=True,
            strict=False,
            model_config=model_config,
            trust_remote_code=trust_remote_code,
        )
        owner, attribute = find_layer_list(loaded[0])
        sizes = resolve_split(kind, len(cast(list[Any], owner[attribute])), group.size())
    lend_mlp = arguments.lend != "none"  # "auto" may cut inside a layer: fetch the layer before the cut too
    parts = rank_tensors(headers, config, sizes, group.rank(), lend_mlp=lend_mlp, head=arguments.head)
    root = fetch_rank_folder(source, parts, who=who, count=progress.fetched, headers=headers)
    return (list(sizes), parts), root


def _planned_split(
    headers: dict[str, TensorInfo],
    config: dict[str, Any],
    name: str,
    world: int,
    memory: MemorySpec,
    speeds: Sequence[float] | None,
    context: int | None,
    kv_bits: int | None,
    step_size: int,
    head: HeadPolicy,
) -> tuple[int, ...]:
    """A ``"memory"`` split (``speeds`` None) or a ``"balanced"`` one with given speeds, from a model's config and
    safetensors headers: what :func:`shard_model` plans from the weights as built."""
    entries = {
        k: {"dtype": v.dtype, "shape": list(v.shape), "data_offsets": [v.start, v.stop]} for k, v in headers.items()
    }
    model = memory_model_from_headers(entries, config, name)
    budgets = resolve_budgets(memory, world)
    settings = None if context is None else Settings(context, step_size, kv_bits=kv_bits, head=head)
    if speeds is not None:
        return plan_balanced(model, world, check_speeds(speeds, world), budgets, settings)
    if settings is None:
        return plan_split(model.bytes, world, budgets).split
    return plan_context(model, world, settings, budgets).split


def _unfetched_embedding_dtype(model: nn.Module, local: range) -> None:
    """Give an input embedding this rank did not fetch the dtype of its own layers' weights.

    Unfetched, the embedding keeps the float32 weights mlx-lm's modules are
    built with; :func:`shard_model` replaces it by a stand-in whose zeros take
    its dtype, and those zeros (a mask's dtype is derived from them) must have
    the dtype a load of the whole folder gives. Nothing is evaluated: the cast
    stays lazy and the stand-in drops it.
    """
    owner, attribute = find_layer_list(model)
    layers = cast(list[nn.Module], owner[attribute])
    dtype = activation_dtype(layers[local.start : local.stop])
    for _, embedding in embedding_modules(owner):
        weight: Any = getattr(embedding, "weight", None)
        if isinstance(weight, mx.array) and weight.dtype != dtype:
            embedding.weight = weight.astype(dtype)


def load_draft(path: str | os.PathLike[str]) -> nn.Module:
    """A draft model for speculative decoding, whole (every rank loads all of it): a folder or a repo id.

    mlx-lm's own ``load`` reads it, downloading a repo id as mlx-lm does.
    """
    from mlx_lm import load as mlx_load  # pyright: ignore[reportUnknownVariableType]

    loaded: Any = mlx_load(str(path))  # pyright: ignore[reportUnknownVariableType]
    return cast(nn.Module, loaded[0])


def load_tokenizer_of(root: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of the model folder ``root`` as :func:`load_sharded` loads it (its end-of-sequence ids from
    ``config.json``), without any weights: for a process that tokenizes and joins no group (``pipemlx serve``'s
    front)."""
    try:
        config = read_dir_config(root)
    except (OSError, ValueError):
        config = {}
    eos = config.get("eos_token_id") if isinstance(config, dict) else None  # pyright: ignore[reportUnnecessaryIsInstance]
    return load_tokenizer(root, {"trust_remote_code": trust_remote_code}, eos_token_ids=eos)


def model_context(root: Path) -> int | None:
    """The model's ``max_position_embeddings`` (from ``config.json``, or its ``text_config``), if it says."""
    try:
        config = read_dir_config(root)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):  # pyright: ignore[reportUnnecessaryIsInstance]
        return None
    text_config = config.get("text_config")
    for where in (config, cast(dict[str, Any], text_config) if isinstance(text_config, dict) else {}):
        value = where.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
