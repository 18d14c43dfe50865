"""Cuts inside a layer: each rank but the last lends its last layer's feed-forward half to the next rank.

A pipeline runs as fast as its slowest rank, and whole layers balance it only
to the nearest layer. A pre-norm decoder block computes

    h = x + attention(input_layernorm(x))        # writes the layer's cache
    out = h + mlp(post_attention_layernorm(h))

so the cut between two ranks can sit between its halves: the lending rank
runs the attention half of its last layer (the cache stays there) and sends
``h``; the next rank runs that layer's feed-forward half before its own first
layer. What flows between ranks keeps its shape, every layer's cache stays on
its rank, and the whole computes what the model does. With
``shard_model(..., lend_mlp=True)``, the first rank (which also embeds) and the
middle ranks hand work to the last one, which is the lighter rank in a prefill
(its last layer only needs its cache).

Both halves are made by changing a block's class to a subclass with another
``__call__`` (its attributes, such as ``use_sliding``, stay), the way the
pipeline edges are made (:mod:`pipemlx.runtime.edges`). Which architectures
have blocks of this form is the registry's to say
(:mod:`pipemlx.models.architectures`).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..errors import PipelineError

BLOCK_PARTS = ("self_attn", "input_layernorm", "mlp", "post_attention_layernorm")
"""The children a pre-norm block needs to be cut between its halves."""


class LendingBlock(nn.Module):
    """Mixin: the block's attention half only; its feed-forward half runs on the next rank."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        me: Any = self
        return x + me.self_attn(me.input_layernorm(x), mask, cache)


class BorrowingBlock(nn.Module):
    """Mixin: the previous rank's last layer's feed-forward half, then the block itself."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        me: Any = self
        h = x + me.borrowed_mlp(me.borrowed_post_attention_layernorm(x))
        return cast(mx.array, super().__call__(h, mask, cache))  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]


def has_block_parts(layer: nn.Module) -> bool:
    """Whether ``layer`` holds every part of a pre-norm block (:data:`BLOCK_PARTS`)."""
    return all(part in layer for part in BLOCK_PARTS)


def lend_feed_forwards(layers: list[nn.Module], sizes: tuple[int, ...]) -> None:
    """Cut the whole ``layers`` list between the halves of each rank's last layer, in place.

    ``sizes[r]`` layers per rank. For every rank but the last, its last layer
    keeps the attention half and the next rank's first layer takes the
    feed-forward half (the modules move: the lending block no longer holds
    them, so a rank materialises only the weights it runs). Raises
    :class:`PipelineError` before changing anything when a boundary layer is
    not a pre-norm block.
    """
    starts = [sum(sizes[:r]) for r in range(1, len(sizes))]
    lenders = [start - 1 for start in starts]
    bad = sorted({i for i in (*lenders, *starts) if not has_block_parts(layers[i])})
    if bad:
        raise PipelineError(
            f"lend_mlp: layers {bad} are not pre-norm blocks with {', '.join(BLOCK_PARTS)}; "
            "their feed-forward half cannot move to the next rank"
        )
    halves = [(_take(layers[i], "mlp"), _take(layers[i], "post_attention_layernorm")) for i in lenders]
    for lender in lenders:
        _mix(layers[lender], LendingBlock)
    # Borrowing goes in front: a rank of one layer first runs what it borrowed, then its attention half.
    for borrower, (mlp, norm) in zip(starts, halves):
        layers[borrower].borrowed_mlp = mlp
        layers[borrower].borrowed_post_attention_layernorm = norm
        _mix(layers[borrower], BorrowingBlock)


def _take(layer: nn.Module, name: str) -> nn.Module:
    """Remove child ``name`` from ``layer`` and return it."""
    children = cast(dict[str, nn.Module], layer)
    return children.pop(name)


def _mix(layer: nn.Module, mixin: type) -> None:
    """Put ``mixin``'s ``__call__`` in front of ``layer``'s, keeping its class name and module."""
    original = type(layer)
    layer.__class__ = type(original.__name__, (mixin, original), {"__module__": original.__module__})
