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
``shard_model(..., lend="mlp")``, the first rank (which also embeds) and the
middle ranks hand work to the last one, which is the lighter rank in a prefill
(its last layer only needs its cache).

Both halves are made by changing a block's class to a subclass with another
``__call__`` (its attributes, such as ``use_sliding``, stay), the way the
pipeline edges are made (:mod:`pipemlx.runtime.edges`). Which architectures
have blocks of this form is the registry's to say
(:mod:`pipemlx.models.architectures`).

Where attention is most of a layer's work (long prompts), moving the
feed-forward half is not enough. ``shard_model(...,
lend=k)`` also moves ``k`` of the lending layer's key-value heads (with
their query heads) and its output projection: the lending rank attends with
the other heads and sends ``[x, its heads' outputs]``, a wider message; the
next rank attends with the lent heads, whose cache it keeps (its first
layer's cache is then an mlx-lm ``CacheList`` of its own cache and the lent
heads'), applies the output projection to all heads' outputs in the model's
order, and goes on with the feed-forward half. Heads attend independently, so
this computes what the model does, cut elsewhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineError
from ..runtime.calibrate import feed_forward_share, group_layer_costs, last_layer_share
from ..runtime.stage import StageInfo
from ..schedule.autostep import choose_lent_heads
from ..schedule.costmodel import CostModel
from .architectures import mix_in

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


class HeadLendingBlock(nn.Module):
    """Mixin: the block's attention on its kept heads only; sends ``[x, those heads' outputs]`` (no output projection)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        me: Any = self
        return mx.concatenate([x, me.self_attn(me.input_layernorm(x), mask, cache)], axis=-1)


class HeadBorrowingBlock(nn.Module):
    """Mixin: the previous rank's last layer's lent heads, output projection and feed-forward half, then the block.

    Its input is the lending rank's ``[x, kept heads' outputs]``; its cache an
    mlx-lm ``CacheList`` of the block's own cache and the lent heads'.
    """

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        me: Any = self
        width = _output_rows(me.borrowed_o_proj)  # the hidden size: what the output projection makes
        residual, kept = x[..., :width], x[..., width:]
        own, lent = (cache[0], cache[1]) if cache is not None else (None, None)
        heads = me.borrowed_self_attn(me.borrowed_input_layernorm(residual), mask, lent)
        h = residual + me.borrowed_o_proj(mx.concatenate([kept, heads], axis=-1))
        h = h + me.borrowed_mlp(me.borrowed_post_attention_layernorm(h))
        return cast(mx.array, super().__call__(h, mask, own))  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]


class LentHeadsCache(CacheList):  # pyright: ignore[reportUntypedBaseClass]
    """A borrowing layer's cache: its own cache and the lent heads', side by side (``caches[0]``, ``caches[1]``).

    Both hold the same positions, so what mlx-lm asks of one layer's cache is the
    own cache's answer (``offset``, ``make_mask``); ``to_quantized``, batching and
    trimming act on both, as mlx-lm's ``CacheList`` does, and keep this class.
    """

    @property
    def parts(self) -> list[Any]:
        return list(cast(Any, self).caches)

    @property
    def offset(self) -> Any:
        return self.parts[0].offset

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.parts[0].make_mask(*args, **kwargs)

    @property
    def to_quantized(self) -> Callable[..., LentHeadsCache]:
        """Both caches quantized; absent (``AttributeError``, as mlx-lm's ``maybe_quantize_kv_cache`` tests with
        ``hasattr``) once they are, as a ``QuantizedKVCache`` has none."""
        parts = self.parts
        if not all(hasattr(c, "to_quantized") for c in parts):
            raise AttributeError(f"{type(parts[0]).__name__} has no to_quantized")

        def quantized(group_size: int = 64, bits: int = 4) -> LentHeadsCache:
            return LentHeadsCache(*(c.to_quantized(group_size=group_size, bits=bits) for c in parts))

        return quantized

    def extract(self, idx: int) -> LentHeadsCache:
        return LentHeadsCache(*(c.extract(idx) for c in self.parts))


ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads")
"""What an attention module needs for its heads to be split between two ranks (``lend_heads``)."""


def has_block_parts(layer: nn.Module) -> bool:
    """Whether ``layer`` holds every part of a pre-norm block (:data:`BLOCK_PARTS`)."""
    return all(part in layer for part in BLOCK_PARTS)


def lend_feed_forwards(layers: list[nn.Module], sizes: tuple[int, ...], heads: int = 0) -> None:
    """Cut the whole ``layers`` list between the halves of each rank's last layer, in place.

    ``sizes[r]`` layers per rank. The modules move, so a rank materialises only
    the weights it runs. With ``heads``, the next rank also takes that many
    key-value heads of the attention and its output projection. Raises
    :class:`PipelineError` before changing anything when a boundary layer is
    not a pre-norm block, or its attention cannot lend ``heads`` heads.
    """
    starts = [sum(sizes[:r]) for r in range(1, len(sizes))]
    lenders = [start - 1 for start in starts]
    bad = sorted({i for i in (*lenders, *starts) if not has_block_parts(layers[i])})
    if bad:
        raise PipelineError(
            f"lend: layers {bad} are not pre-norm blocks with {', '.join(BLOCK_PARTS)}; "
            "their feed-forward half cannot move to the next rank"
        )
    if heads:
        for i in lenders:
            check_head_split(layers[i], i, heads)
        _lend_heads(layers, lenders, starts, heads)
        return
    halves = [(_take(layers[i], "mlp"), _take(layers[i], "post_attention_layernorm")) for i in lenders]
    for lender in lenders:
        mix_in(layers[lender], LendingBlock)
    # Borrowing goes in front: a rank of one layer first runs what it borrowed, then its attention half.
    for borrower, (mlp, norm) in zip(starts, halves):
        layers[borrower].borrowed_mlp = mlp
        layers[borrower].borrowed_post_attention_layernorm = norm
        mix_in(layers[borrower], BorrowingBlock)


def check_head_split(layer: nn.Module, index: int, heads: int) -> None:
    """Raise :class:`PipelineError` unless ``layer``'s attention can lend ``heads`` key-value heads and keep one."""
    attention = cast(Any, layer)["self_attn"]
    missing = [part for part in ATTENTION_PARTS if not hasattr(attention, part)]
    if missing:
        raise PipelineError(
            f"lend={heads}: layer {index}'s attention ({type(attention).__name__}) has no {', '.join(missing)}; "
            "its heads cannot be split between ranks"
        )
    kv_heads = int(attention.n_kv_heads)
    if not 0 < heads < kv_heads:
        raise PipelineError(
            f"lend={heads}: layer {index}'s attention has {kv_heads} key-value heads; a rank can lend "
            f"1..{kv_heads - 1} of them and keep the rest (lending all of them is a split one layer later)"
        )


def split_heads(attention: nn.Module, kept: int) -> tuple[nn.Module, nn.Module]:
    """Two copies of ``attention``: the first ``kept`` key-value heads (with their query heads), and the others.

    Neither applies the output projection (it returns its heads' outputs side
    by side, in the model's order): the caller applies ``attention.o_proj`` to
    both halves' outputs together.
    """
    me: Any = attention
    kv_heads, query_heads = int(me.n_kv_heads), int(me.n_heads)
    per_group = query_heads // kv_heads
    head_dim = _output_rows(me.k_proj) // kv_heads

    def part(first: int, stop: int) -> nn.Module:
        piece: Any = copy.copy(attention)
        piece.q_proj = _rows(me.q_proj, first * per_group * head_dim, stop * per_group * head_dim)
        piece.k_proj = _rows(me.k_proj, first * head_dim, stop * head_dim)
        piece.v_proj = _rows(me.v_proj, first * head_dim, stop * head_dim)
        piece.o_proj = nn.Identity()
        piece.n_heads, piece.n_kv_heads = (stop - first) * per_group, stop - first
        return cast(nn.Module, piece)

    return part(0, kept), part(kept, kv_heads)


def message_width(lender: nn.Module) -> int:
    """The width of what a head-lending ``lender`` sends: the hidden state, then its kept heads' outputs."""
    attention: Any = cast(Any, lender)["self_attn"]
    value_width = _output_rows(attention.v_proj) // int(attention.n_kv_heads)
    hidden = int(cast(Any, lender)["input_layernorm"]["weight"].shape[-1])
    return hidden + int(attention.n_heads) * value_width


def _output_rows(linear: nn.Module) -> int:
    return int(cast(Any, linear)["weight"].shape[0])


def _rows(linear: nn.Module, start: int, stop: int) -> nn.Module:
    """A copy of a (possibly quantized) linear layer computing only outputs ``start:stop``."""
    piece: Any = copy.copy(linear)
    for name in ("weight", "bias", "scales", "biases"):
        if name in piece:
            piece[name] = piece[name][start:stop]
    return cast(nn.Module, piece)


def _lend_heads(layers: list[nn.Module], lenders: list[int], starts: list[int], heads: int) -> None:
    for lender, borrower in zip(lenders, starts):
        block: Any = layers[lender]
        attention: Any = block.self_attn
        kept, lent = split_heads(attention, int(attention.n_kv_heads) - heads)
        taker: Any = layers[borrower]
        taker.borrowed_self_attn = lent
        taker.borrowed_o_proj = attention.o_proj
        taker.borrowed_input_layernorm = block.input_layernorm  # both ranks normalise the layer's input
        taker.borrowed_mlp = _take(block, "mlp")
        taker.borrowed_post_attention_layernorm = _take(block, "post_attention_layernorm")
        block.self_attn = kept
    for lender in lenders:
        mix_in(layers[lender], HeadLendingBlock)
    for borrower in starts:
        mix_in(layers[borrower], HeadBorrowingBlock)


def _take(layer: nn.Module, name: str) -> nn.Module:
    """Remove child ``name`` from ``layer`` and return it."""
    children = cast(dict[str, nn.Module], layer)
    return children.pop(name)


AUTO_LEND_TOKENS = 4096  # the prompt length lend="auto" plans for when shard_model is given no context


def lendable_heads(layers: list[nn.Module], sizes: tuple[int, ...]) -> int:
    """The most key-value heads every rank's last layer can lend (:func:`check_head_split`); 0 if one cannot."""
    lenders = [sum(sizes[: r + 1]) - 1 for r in range(len(sizes) - 1)]
    counts = [
        int(getattr(attention, "n_kv_heads", 0) or 0) - 1
        if all(hasattr(attention, part) for part in ATTENTION_PARTS)
        else 0
        for attention in (cast(Any, layers[i])["self_attn"] for i in lenders)
    ]
    return max(0, min(counts, default=0))


def auto_lent_heads(
    model: nn.Module,
    layers: list[nn.Module],
    info: StageInfo,
    group: mx.distributed.Group,
    most: int,
    context: int | None,
) -> int:
    """``lend="auto"``: how many key-value heads (0 to ``most``) each cut moves, the count predicted to
    prefill ``context`` tokens (:data:`AUTO_LEND_TOKENS` if ``None``) soonest.

    Each rank times its first layer on its own (:func:`~pipemlx.runtime.calibrate.group_layer_costs`; the
    ranks keep the slowest rank's figures, one all-gather), then every candidate cut's cost model is
    simulated with its best chunking (:func:`~pipemlx.schedule.autostep.choose_lent_heads`): the same count on
    every rank. A collective: every rank must pass ``"auto"``.
    """
    costs = group_layer_costs(model, layers[info.layers.start], info, group)
    lender: Any = cast(Any, layers[info.split[0] - 1])["self_attn"]
    kv_heads = max(1, int(getattr(lender, "n_kv_heads", 1) or 1))
    cuts = [
        CostModel(
            layer=costs,
            layers=info.split,
            hidden_size=info.hidden_size or 1,
            last_layer_share=last_layer_share(model),
            lent_share=feed_forward_share(model, k / kv_heads),
            lent_pair_share=k / kv_heads,
        )
        for k in range(most + 1)
    ]
    return choose_lent_heads(context or AUTO_LEND_TOKENS, cuts)
