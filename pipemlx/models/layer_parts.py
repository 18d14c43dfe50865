"""Rank boundaries inside a decoder layer: one rank runs a layer's attention, the next rank its MLP.

With ``shard_model(..., boundary="attention")`` the layer at each boundary
between two ranks is cut after its attention block: the earlier rank keeps the
layer's input norm, attention and KV cache (:class:`AttentionPart`), the
later rank its post-attention norm and MLP, run right before its own first
layer (:class:`MlpThenLayer`). What crosses the wire is the residual stream
after the attention, the same shape as between layers, so the edges, the
plans and the decode are unchanged. Why: in a prefill the last rank computes
only the key and value projections of the model's very last layer, so with
whole layers it idles while the first rank sets the pace; moving one MLP's
work per boundary towards the end balances the ranks (``docs/performance.md``).

Only families whose decoder layer computes exactly
``h = x + self_attn(input_layernorm(x), mask, cache); out = h + mlp(post_attention_layernorm(h))``
can be cut this way (``Architecture.attention_boundary`` in
:mod:`pipemlx.models.architectures`); :func:`check_cut` also verifies it on
the layer itself before anything changes.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..errors import PipelineError

ATTENTION_PARTS = ("input_layernorm", "self_attn")
MLP_PARTS = ("post_attention_layernorm", "mlp")


class _Part(nn.Module):
    """A wrapper that shows the wrapped layer's plain attributes (``use_sliding``, ...) as its own."""

    layer: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # pyright: ignore[reportUnknownMemberType, reportAttributeAccessIssue, reportUnknownVariableType]
        except AttributeError:
            wrapped: Any = cast(dict[str, Any], self).get("layer")
            if name == "layer" or wrapped is None:
                raise
            return getattr(wrapped, name)


class AttentionPart(_Part):
    """The first half of a decoder layer: ``x + self_attn(input_layernorm(x))``; its MLP is dropped."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for name in MLP_PARTS:
            delattr(layer, name)
        self.layer = layer

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        layer: Any = self.layer
        return x + layer.self_attn(layer.input_layernorm(x), mask, cache)


class MlpThenLayer(_Part):
    """The second half of the previous rank's last layer, then this rank's first layer (whose cache it uses)."""

    def __init__(self, previous: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        for name in ATTENTION_PARTS:
            delattr(previous, name)
        self.previous = previous
        self.layer = layer

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        previous: Any = self.previous
        h = x + previous.mlp(previous.post_attention_layernorm(x))
        return cast(mx.array, self.layer(h, mask, cache))


def check_cut(layer: nn.Module) -> None:
    """Raise :class:`PipelineError` unless ``layer`` equals its attention part followed by its MLP part.

    Runs the layer once on a small input with no cache (nothing of the model
    changes) and compares it with the two parts computed by hand.
    """
    missing = [n for n in ATTENTION_PARTS + MLP_PARTS if not isinstance(getattr(layer, n, None), nn.Module)]
    if missing:
        raise PipelineError(f"{type(layer).__name__} has no {', '.join(missing)}: boundary='attention' cannot cut it")
    probe: Any = layer
    hidden = _hidden_size(layer)
    x = mx.random.normal((1, 2, hidden), key=mx.random.key(0)).astype(_dtype(layer))
    whole = probe(x, None, None)
    h = x + probe.self_attn(probe.input_layernorm(x), None, None)
    parts = h + probe.mlp(probe.post_attention_layernorm(h))
    if not bool(mx.array_equal(whole, parts)):
        raise PipelineError(
            f"{type(layer).__name__} does not compute x + self_attn(norm(x)) then h + mlp(norm(h)); "
            "boundary='attention' cannot cut it (use the default boundary='layer')"
        )


def cut_at_attention(kept: list[nn.Module], previous: nn.Module | None, cut_last: bool) -> list[nn.Module]:
    """This rank's layer list with boundaries inside layers.

    ``previous`` (the previous rank's last layer, or None on rank 0) runs its
    MLP part before ``kept[0]``; when ``cut_last`` (every rank but the last)
    ``kept[-1]`` keeps only its attention part. One entry per local layer
    still, so each cache stays with its attention.
    """
    parts = list(kept)
    if cut_last:
        parts[-1] = AttentionPart(parts[-1])
    if previous is not None:
        parts[0] = MlpThenLayer(previous, parts[0])
    return parts


def _hidden_size(layer: nn.Module) -> int:
    weight = getattr(getattr(layer, "input_layernorm", None), "weight", None)
    if isinstance(weight, mx.array) and weight.ndim == 1:
        return int(weight.shape[0])
    raise PipelineError(f"cannot tell the hidden size of {type(layer).__name__} from its input_layernorm")


def _dtype(layer: nn.Module) -> mx.Dtype:
    weight = getattr(getattr(layer, "input_layernorm", None), "weight", None)
    return weight.dtype if isinstance(weight, mx.array) else mx.float32
