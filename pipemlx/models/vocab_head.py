"""This rank's rows of the output head, for greedy decodes that share the head (:mod:`pipemlx.runtime.sampling`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..runtime.sampling import VocabShard
from ..runtime.stage import StageInfo
from .architectures import architecture_of

HEAD_TYPES = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
ROW_PARAMETERS = ("weight", "scales", "biases", "bias")  # a head's parameters whose first axis is the vocabulary
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
