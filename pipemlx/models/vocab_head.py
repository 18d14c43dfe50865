"""This rank's rows of the output head, for greedy decodes that share the head (:mod:`pipemlx.runtime.sampling`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal, NoReturn, cast, get_args

import mlx.core as mx
import mlx.nn as nn

from ..errors import PipelineError
from ..runtime.sampling import VocabShard
from ..runtime.stage import StageInfo
from ..schedule.memory_model import HeadPolicy
from .architectures import architecture_of
from .vocab_rows import PREREAD_ATTRIBUTE

HEAD_TYPES = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
ROW_PARAMETERS = ("weight", "scales", "biases", "bias")  # a head's parameters whose first axis is the vocabulary
HeadSpec = Literal["auto", "all", "last", "split"]
"""Where the vocabulary-sized matrices live (:func:`pipemlx.shard_model`'s ``head``): ``"auto"`` (the default),
``"all"``, ``"last"`` or ``"split"``."""
HEAD_CHOICES: tuple[str, ...] = get_args(HeadSpec)
FINAL_NORMS = ("norm", "embedding_norm")
"""Names of the norm ``model.model`` ends with (lfm2's is ``embedding_norm``): it gives the hidden state's dtype."""


def vocab_shard(model: nn.Module, info: StageInfo) -> VocabShard | None:
    """``info``'s rank's share of ``model``'s output head, or ``None`` where the head cannot be shared.

    Shared only where the registry says the logits are the head applied to
    ``model.model``'s output (``Architecture.plain_head``) and the head is a
    plain (or quantized) linear map. The rows are views of the head's weights:
    no memory is added. Call it on every rank once the model is cut.
    """
    entry = architecture_of(model)
    inner = getattr(model, "model", None)
    if entry is None or not entry.plain_head or not isinstance(inner, nn.Module) or info.dtype is None:
        return None
    head = cast(Any, getattr(model, "lm_head", None))
    if head is None:  # tied: the embedding is the head
        head = getattr(inner, "embed_tokens", None)
    norm = next((getattr(inner, n) for n in FINAL_NORMS if callable(getattr(inner, n, None))), None)
    if not isinstance(head, HEAD_TYPES) or norm is None:
        return None
    vocab = int(head.weight.shape[0])
    rows = range(vocab * info.rank // info.world_size, vocab * (info.rank + 1) // info.world_size)
    part = cast(Any, copy.copy(head))
    for name in ROW_PARAMETERS:
        if name in head:
            part[name] = head[name][rows.start : rows.stop]
    mx.eval(part.parameters())  # pyright: ignore[reportUnknownMemberType]  # views of the head's buffers
    linear = isinstance(head, (nn.Linear, nn.QuantizedLinear))
    dtype = cast(mx.array, norm(mx.zeros((1, info.hidden_size), dtype=info.dtype))).dtype
    return VocabShard(
        rows=rows,
        hidden_size=info.hidden_size,
        dtype=dtype,
        hidden=_final_hidden,
        project=part if linear else part.as_linear,
        full=cast(Callable[[mx.array], mx.array], head if linear else cast(Any, head).as_linear),
    )


def _final_hidden(model: nn.Module, inputs: mx.array, cache: list[Any]) -> mx.array:
    return cast(mx.array, cast(Any, model).model(inputs, cache))


def row_range(vocab: int, rank: int, world_size: int) -> range:
    """The vocabulary rows rank ``rank`` of ``world_size`` holds or projects: ``[V*r/S, V*(r+1)/S)``."""
    return range(vocab * rank // world_size, vocab * (rank + 1) // world_size)


def rows_of(module: nn.Module, rows: range, preread: dict[str, mx.array] | None = None, path: str = "") -> nn.Module:
    """A copy of ``module`` (a head or an embedding, plain or quantized) holding only ``rows`` of its vocabulary.

    The rows are copied (``mx.array`` of the slice), not viewed: the whole matrix's buffer is freed once the
    caller drops the module it came from. A parameter whose rows were read from the weight files already
    (``preread[f"{path}.{name}"]``, :func:`pipemlx.models.vocab_rows.preread_vocabulary`) is taken from there: the
    lazily loaded whole matrix is then never read.
    """
    part = cast(Any, copy.copy(module))
    for name in ROW_PARAMETERS:
        if name in module:
            whole = cast(Any, module)[name]
            read = (preread or {}).get(f"{path}.{name}")
            fits = read is not None and read.shape == (len(rows), *whole.shape[1:]) and read.dtype == whole.dtype
            part[name] = read if fits else mx.array(whole[rows.start : rows.stop])
    if isinstance(module, nn.QuantizedEmbedding):
        part.num_embeddings = len(rows)
    return cast(nn.Module, part)


class SplitEmbedding(nn.Module):
    """An input embedding (tied: also the output head) of which this rank holds only its rows (``head="split"``).

    Each rank looks up the tokens it holds (zeros for the others) in :meth:`sum_rows`, a collective every rank calls
    with the same tokens before rank 0's forward pass reads them; the sum across the group is the embeddings, which
    rank 0 keeps (:meth:`keep`). Called in pipemlx's forward passes, rank 0 returns the prepared rows; the other ranks
    (whose first layer replaces its input with the hidden state it receives) zeros. As a linear map (a tied head) it
    returns zeros there, never read: :attr:`part` projects this rank's rows (:class:`VocabShard.project`). In mlx-lm's
    forward passes (``stage.head_needed``: its ``generate_step`` called on every rank alike) it sums the embeddings
    itself and gathers the whole logits (:func:`gather_logits`).
    """

    def __init__(self, part: nn.Module, rows: range, vocab: int, dims: int, dtype: mx.Dtype, first: bool) -> None:
        super().__init__()
        self.part = part
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_vocab", vocab)
        object.__setattr__(self, "_dims", dims)
        object.__setattr__(self, "_dtype", dtype)
        object.__setattr__(self, "_first", first)
        object.__setattr__(self, "_prepared", None)
        object.__setattr__(self, "_stage", None)

    def sum_rows(self, tokens: mx.array, group: mx.distributed.Group) -> mx.array:
        """The embeddings of ``tokens`` (1-D), lazily: this rank's rows (zeros for the tokens it does not hold)
        summed across ``group``, a collective every rank calls with the same tokens."""
        rows: range = cast(Any, self)._rows
        ids = mx.reshape(tokens, (-1,)).astype(mx.int32)
        local = ids - rows.start
        inside = (local >= 0) & (local < len(rows))
        found = cast(mx.array, self.part(mx.where(inside, local, 0)))
        return mx.distributed.all_sum(mx.where(inside[:, None], found, 0).astype(found.dtype), group=group)

    def keep(self, tokens: mx.array, embeddings: mx.array) -> None:
        """Rank 0: look ``tokens`` up in ``embeddings`` (their rows, in order) in the forward passes until the next
        call, in any order and with any repeats. The other ranks keep nothing (their output is never used)."""
        if not cast(Any, self)._first:
            return
        ids = mx.reshape(tokens, (-1,)).astype(mx.int32)
        table = mx.full((cast(int, cast(Any, self)._vocab),), -1, dtype=mx.int32)
        table[ids] = mx.arange(ids.size, dtype=mx.int32)
        object.__setattr__(self, "_prepared", (table, embeddings))

    def __call__(self, x: mx.array) -> mx.array:
        me = cast(Any, self)
        stage: Any = me._stage
        if stage is None:
            raise_split_head()
        if stage.head_needed:  # mlx-lm's forward pass, called on every rank with the same tokens
            return self._summed_now(x, stage)
        if not me._first:
            return mx.zeros((*x.shape, me._dims), dtype=me._dtype)
        prepared: tuple[mx.array, mx.array] | None = me._prepared
        if prepared is None:  # pipemlx's own passes embed first (:meth:`keep`): this one times the layers
            return mx.zeros((*x.shape, me._dims), dtype=me._dtype)
        table, rows = prepared
        return rows[mx.maximum(table[x], 0)]

    def _summed_now(self, x: mx.array, stage: Any) -> mx.array:
        """mlx-lm's forward pass (``generate_step`` / ``stream_generate`` on the sharded model, which call it on
        every rank with the same tokens): every rank's rows of ``x``'s embeddings summed, evaluated here, before any
        collective of the pass is built on it, so that every rank runs them in one order; rank 0 reads them, the
        others' first layers replace them with what they receive."""
        me = cast(Any, self)
        summed = self.sum_rows(x, stage.group)
        mx.eval(summed)  # pyright: ignore[reportUnknownMemberType]
        return mx.reshape(summed, (*x.shape, me._dims)) if me._first else mx.zeros((*x.shape, me._dims), me._dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied head's logits of ``x`` (mlx-lm's forward pass: every rank's rows, gathered); zeros where
        pipemlx never reads them (its own decodes project :attr:`part`'s rows)."""
        me = cast(Any, self)
        if me._stage is not None and me._stage.head_needed:
            return gather_logits(cast(Any, self.part).as_linear(x), me._vocab, me._stage.group)
        refuse_split_logits(me._stage)
        return mx.zeros((*x.shape[:-1], cast(int, me._vocab)), dtype=me._dtype)


class SplitHead(nn.Module):
    """An output head (``lm_head``) of which this rank holds only its rows (``head="split"``): :attr:`part`.

    Called in pipemlx's forward passes it returns zeros, never read (its decodes project :attr:`part`); in mlx-lm's
    (``stage.head_needed``) the whole logits gathered from every rank's rows (:func:`gather_logits`).
    """

    def __init__(self, part: nn.Module, vocab: int, dtype: mx.Dtype) -> None:
        super().__init__()
        self.part = part
        object.__setattr__(self, "_vocab", vocab)
        object.__setattr__(self, "_dtype", dtype)
        object.__setattr__(self, "_stage", None)

    def __call__(self, x: mx.array) -> mx.array:
        me = cast(Any, self)
        if me._stage is not None and me._stage.head_needed:  # mlx-lm's forward pass: every rank's rows, gathered
            return gather_logits(cast(mx.array, self.part(x)), me._vocab, me._stage.group)
        refuse_split_logits(me._stage)
        return mx.zeros((*x.shape[:-1], cast(int, me._vocab)), dtype=me._dtype)


def gather_logits(local: mx.array, vocab: int, group: mx.distributed.Group) -> mx.array:
    """The whole vocabulary's logits from every rank's ``local`` ones (its rows' logits of the same hidden states:
    mlx-lm's forward pass gives every rank the last rank's), lazily: one all-gather of the slices padded to one
    width, in ``local``'s dtype. A collective every rank's graph holds, evaluated when mlx-lm reads the logits."""
    world = group.size()
    if world == 1:
        return local
    width = -(-vocab // world)
    padded = mx.pad(local.astype(mx.float32), [*([(0, 0)] * (local.ndim - 1)), (0, width - local.shape[-1])])
    everyone = mx.distributed.all_gather(mx.expand_dims(padded, 0), group=group)
    pieces = [everyone[r, ..., : vocab * (r + 1) // world - vocab * r // world] for r in range(world)]
    return mx.concatenate(pieces, axis=-1).astype(local.dtype)


def raise_split_head() -> NoReturn:
    """Raise: a split embedding or head was called before :func:`attach_stage` gave it its stage (its group)."""
    raise PipelineError(
        "this rank holds only its rows of the embedding and the output head (shard_model(..., head='split')), "
        "and they are not attached to a pipeline stage yet: call the model once shard_model has returned it"
    )


def refuse_split_logits(stage: Any) -> None:
    """Raise unless ``stage`` exists (then its forward passes whose logits are not read get zeros)."""
    if stage is None:
        raise_split_head()


def check_head(head: Any) -> None:
    """Raise ``ValueError`` unless ``head`` is one of :data:`HEAD_CHOICES`."""
    if not isinstance(head, str) or head not in HEAD_CHOICES:
        raise ValueError(f"head must be 'auto', 'all', 'last' or 'split', got {head!r}")


def resolve_head(head: HeadSpec, model: nn.Module, world_size: int) -> HeadPolicy:
    """``head`` as :func:`pipemlx.shard_model` applies it to ``model`` on ``world_size`` ranks: ``"auto"`` becomes
    ``"split"`` (each rank holds 1/S of the embedding's and the head's rows) wherever the vocabulary can be split
    (:func:`check_splittable`) and there is more than one rank, else ``"all"``; the others are kept.

    The rule reads only the model's classes (not its weights: a lazily built model, or one built from the config
    alone, gives the same answer), so every rank, and a loader before it reads any weight, resolves alike.
    Raises ``ValueError`` for a ``head`` that is none of :data:`HEAD_CHOICES`.
    """
    check_head(head)
    if head != "auto":
        return head
    return "split" if world_size > 1 and _split_parts(model) is not None else "all"


def check_splittable(model: nn.Module) -> None:
    """Raise :class:`PipelineError` unless ``head="split"`` can split ``model``'s vocabulary (before any change)."""
    if _split_parts(model) is None:
        raise PipelineError(
            f"head='split' needs a model whose logits are its output head applied to the final norm's output, "
            f"with a plain (or quantized) embedding and head; {type(model).__module__} is not one: "
            "shard it with head='all' or head='last'"
        )


def _split_parts(model: nn.Module) -> tuple[nn.Module, str, nn.Module | None] | None:
    """``(owner of the embedding, its name, the separate lm_head or None)`` where the vocabulary can be split."""
    entry = architecture_of(model)
    inner = getattr(model, "model", None)
    if entry is None or not entry.plain_head or not isinstance(inner, nn.Module):
        return None
    embedding = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    norm = next((getattr(inner, n) for n in FINAL_NORMS if callable(getattr(inner, n, None))), None)
    if not isinstance(embedding, (nn.Embedding, nn.QuantizedEmbedding)) or norm is None:
        return None
    if head is not None and not isinstance(head, (nn.Linear, nn.QuantizedLinear)):
        return None
    return inner, "embed_tokens", cast(nn.Module | None, head)


def split_vocabulary(model: nn.Module, info: StageInfo) -> VocabShard:
    """``head="split"``: keep only ``info``'s rank's rows of ``model``'s embedding and output head, in place.

    The embedding becomes a :class:`SplitEmbedding`, a separate ``lm_head`` a :class:`SplitHead`; the returned
    shard projects this rank's rows and sums the embeddings of tokens (:meth:`VocabShard.embed`). Call
    :func:`attach_stage` once the stage exists. Raises :class:`PipelineError` where the model cannot be split.
    """
    check_splittable(model)
    owner, name, head = cast(tuple[nn.Module, str, "nn.Module | None"], _split_parts(model))
    embedding = cast(Any, owner[name])
    inner = cast(nn.Module, getattr(model, "model"))
    norm = next(getattr(inner, n) for n in FINAL_NORMS if callable(getattr(inner, n, None)))
    assert info.dtype is not None
    dtype = cast(mx.array, norm(mx.zeros((1, info.hidden_size), dtype=info.dtype))).dtype
    vocab = int(embedding.weight.shape[0])
    rows = row_range(vocab, info.rank, info.world_size)
    weights = embedding.scales if isinstance(embedding, nn.QuantizedEmbedding) else embedding.weight
    dims = int(embedding.dims) if isinstance(embedding, nn.QuantizedEmbedding) else int(embedding.weight.shape[-1])
    preread = cast(dict[str, mx.array], getattr(model, PREREAD_ATTRIBUTE, {}))
    kept = rows_of(embedding, rows, preread, "model.embed_tokens")
    split_embedding = SplitEmbedding(kept, rows, vocab, dims, weights.dtype, info.is_first)
    projected: Callable[[mx.array], mx.array]
    if head is None:
        projected = cast(Any, split_embedding.part).as_linear
    else:
        head_rows = row_range(int(cast(Any, head).weight.shape[0]), info.rank, info.world_size)
        head_weights = cast(Any, head)
        head_dtype = head_weights.scales.dtype if "scales" in head_weights else head_weights.weight.dtype
        kept_head = rows_of(head, head_rows, preread, "lm_head")
        split_head = SplitHead(kept_head, int(head_weights.weight.shape[0]), head_dtype)
        cast(Any, model).lm_head = split_head
        projected = cast(Callable[[mx.array], mx.array], split_head.part)
        rows = head_rows
    setattr(owner, name, split_embedding)
    if hasattr(model, PREREAD_ATTRIBUTE):
        object.__delattr__(model, PREREAD_ATTRIBUTE)
    return VocabShard(
        rows=rows,
        hidden_size=info.hidden_size,
        dtype=dtype,
        hidden=_final_hidden,
        project=projected,
        full=None,
        sum_rows=split_embedding.sum_rows,
        keep=split_embedding.keep,
        vocab=vocab if head is None else int(cast(Any, head).weight.shape[0]),
    )


def attach_stage(model: nn.Module, stage: Any) -> None:
    """Give ``model``'s split embedding and head their stage (which says when their logits are not read)."""
    for _, module in cast(list[tuple[str, nn.Module]], model.named_modules()):
        if isinstance(module, (SplitEmbedding, SplitHead)):
            object.__setattr__(module, "_stage", stage)
