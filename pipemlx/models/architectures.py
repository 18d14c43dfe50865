"""Per-architecture fixups, in one place.

Cutting a model's layer list down to a rank's local layers is all most mlx-lm
architectures need (the cache list, which some architectures build from
global layer indices, is handled for every architecture by
:func:`pipemlx.models.sharding.shard_model`). Some keep bookkeeping about the *whole*
list in the module that holds it: a per-layer type list, the index of the
first layer of a kind whose cache gives the attention mask, a repeating
sliding/global pattern counted from layer 0. Those must describe the local
layers afterwards. Each such architecture has one entry here, keyed by the
module that defines its ``Model`` class; an architecture whose model cannot be
pipelined has a check that raises :class:`PipelineError` naming the reason.

An architecture that is not registered but keeps such bookkeeping (an
attribute named like ``fa_idx``, ``layer_types``, ``*_pattern``) is refused
with an error rather than run with wrong masks (:func:`check_architecture`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineError

Fixup = Callable[[Any, range], None]
"""Adjust ``owner`` (the module holding the layer list, already cut) for the layers in ``local``."""
Check = Callable[[Any, Any, range], None]
"""Raise :class:`PipelineError` if ``(model, owner)`` cannot be pipelined keeping the layers in ``local``."""

BOOKKEEPING = re.compile(r"(?:idx|index|indices)$|^_?first_|layer_types|_pattern$|attn_idxs")
"""Names of owner attributes that describe the whole layer list (a fixup must adjust them)."""
HARMLESS = frozenset({"start_idx", "end_idx"})  # mlx-lm's PipelineMixin bookkeeping: layers[0:None] is all local layers


@dataclass(frozen=True)
class Architecture:
    """What pipelining one mlx-lm architecture needs.

    ``pre_norm_blocks``: its decoder blocks compute ``h = x + self_attn(input_layernorm(x))`` and then
    ``h + mlp(post_attention_layernorm(h))``, so a cut may sit between the halves
    (``shard_model(..., lend="mlp")``, :mod:`pipemlx.models.lending`).

    ``plain_head``: its logits are ``lm_head(model.model(...))``, or the embedding applied as a linear map
    where it has no ``lm_head`` (tied), with nothing after it (no scaling or soft-capping), so greedy decodes
    may share the head among the ranks (:mod:`pipemlx.runtime.sampling`).
    """

    fixup: Fixup | None = None
    check: Check | None = None
    pre_norm_blocks: bool = False
    plain_head: bool = False


def _first(layers: list[Any], predicate: Callable[[Any], bool], default: int | None) -> int | None:
    """Index of the first layer satisfying ``predicate``, else ``default``."""
    return next((i for i, layer in enumerate(layers) if predicate(layer)), default)


def _llama(owner: Any, local: range) -> None:
    """llama (and mistral): ``layer_types`` and the cache indices of its first full and sliding layers."""
    owner.layer_types = list(owner.layer_types[local.start : local.stop])
    owner.fa_idx = _first(owner.layers, lambda layer: not layer.use_sliding, 0)
    owner.swa_idx = _first(owner.layers, lambda layer: layer.use_sliding, None)


def _gpt_oss(owner: Any, local: range) -> None:
    """gpt-oss: ``layer_types`` picks each layer's mask; ``ga_idx``/``swa_idx`` the caches they come from.

    A rank without a layer of one kind still builds that mask (from cache 0);
    no layer uses it, so it is never evaluated.
    """
    owner.layer_types = list(owner.layer_types[local.start : local.stop])
    owner.ga_idx = _first(owner.layer_types, lambda kind: kind == "full_attention", 0)
    owner.swa_idx = _first(owner.layer_types, lambda kind: kind == "sliding_attention", 0)


def _qwen3_next(owner: Any, local: range) -> None:
    """qwen3-next: the first linear-attention (ArraysCache) and full-attention layers give the masks.

    ``None`` for a kind the rank does not hold, as mlx-lm's own ``pipeline`` does.
    """
    owner.ssm_idx = _first(owner.layers, lambda layer: layer.is_linear, None)
    owner.fa_idx = _first(owner.layers, lambda layer: not layer.is_linear, None)


def _mask_from_first(h: mx.array, cache: list[Any], kinds: list[bool], kind: bool, **kwargs: Any) -> Any:
    """The attention mask from the cache of the first layer whose kind is ``kind``; ``None`` if there is none."""
    index = _first(kinds, lambda k: k == kind, None)
    make: Any = create_attention_mask  # pyright: ignore[reportUnknownVariableType]
    return None if index is None else make(h, cache[index], **kwargs)


def _ssm_mask_from_first(h: mx.array, cache: list[Any], kinds: list[bool], kind: bool) -> Any:
    """The state-space mask from the cache of the first layer whose kind is ``kind``; ``None`` if there is none."""
    index = _first(kinds, lambda k: k == kind, None)
    make: Any = create_ssm_mask  # pyright: ignore[reportUnknownVariableType]
    return None if index is None else make(h, cache[index])


def mix_in(owner: Any, forward: type) -> None:
    """Give ``owner`` the ``__call__`` of ``forward`` (a mixin) in front of its own, keeping its class name, module
    and attributes (once: an owner that has it already is left as it is)."""
    original: type = type(owner)  # pyright: ignore[reportUnknownVariableType]
    if not issubclass(original, forward):
        owner.__class__ = type(original.__name__, (forward, original), {"__module__": original.__module__})


class _LocalGemma3Model(nn.Module):
    """Gemma 3's text model over a cut layer list.

    mlx-lm's ``Gemma3Model`` tells global from sliding layers by position and
    takes the masks from caches at fixed positions, wrong once the list starts
    at another layer. This forward asks each layer (``self_attn.is_sliding``)
    and takes each mask from the first local layer of that kind.
    """

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        me: Any = self
        h = input_embeddings if input_embeddings is not None else me.embed_tokens(inputs)
        h *= mx.array(me.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        layers: list[Any] = me.layers
        cache = [None] * len(layers) if cache is None else cache
        sliding = [bool(layer.self_attn.is_sliding) for layer in layers]
        global_mask = _mask_from_first(h, cache, sliding, False)
        sliding_mask = _mask_from_first(h, cache, sliding, True, window_size=me.window_size)
        for layer, c, is_sliding in zip(layers, cache, sliding):
            h = layer(h, sliding_mask if is_sliding else global_mask, c)
        return me.norm(h)


class _LocalLfm2Model(nn.Module):
    """LFM2's model over a cut layer list.

    mlx-lm's ``Lfm2Model`` takes the convolution mask from a cache at a fixed
    index, even on a rank without convolution layers, where the call fails.
    This forward builds each mask from the first local layer of its kind, and
    only when there is one.
    """

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        me: Any = self
        h = input_embeddings if input_embeddings is not None else me.embed_tokens(inputs)
        layers: list[Any] = me.layers
        cache = [None] * len(layers) if cache is None else cache
        attention = [bool(layer.is_attention_layer) for layer in layers]
        attn_mask = _mask_from_first(h, cache, attention, True)
        conv_mask = _ssm_mask_from_first(h, cache, attention, False)
        for layer, c, is_attention in zip(layers, cache, attention):
            h = layer(h, attn_mask if is_attention else conv_mask, cache=c)
        return me.embedding_norm(h)


class _LocalNemotronHModel(nn.Module):
    """Nemotron-H's backbone over a cut layer list of Mamba (``M``) and attention (``*``) blocks.

    With no cacheless blocks the cache index of a layer is its position; each
    mask comes from the first local layer of its kind, and only when there is one.
    """

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        me: Any = self
        h = me.embeddings(inputs)
        layers: list[Any] = me.layers
        cache = [None] * len(layers) if cache is None else cache
        attention = [layer.block_type == "*" for layer in layers]
        attn_mask = _mask_from_first(h, cache, attention, True)
        ssm_mask = _ssm_mask_from_first(h, cache, attention, False)
        for layer, c, is_attention in zip(layers, cache, attention):
            h = layer(h, mask=attn_mask if is_attention else ssm_mask, cache=c)
        return me.norm_f(h)


class _BatchMaskGemma2Attention(nn.Module):
    """Gemma 2's attention, with a batch cache's mask lined up with its grouped-query scores.

    mlx-lm's gemma2 attention computes scores of shape ``[B, kv_heads,
    repeats, L, S]``; a batch cache's mask ``[B, 1, L, S]`` then lines up its
    batch axis with ``kv_heads``. This gives the mask its missing axis; any
    other mask passes unchanged.
    """

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        me: Any = self
        if isinstance(mask, mx.array) and mask.ndim == 4 and me.repeats > 1:
            mask = mx.expand_dims(mask, 2)
        return cast(mx.array, super().__call__(x, mask, cache))  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]


def _gemma2(owner: Any, local: range) -> None:
    """gemma2: batch masks (pipemlx.BatchGenerator's decode steps) fit its grouped-query attention."""
    for layer in owner.layers:
        mix_in(layer.self_attn, _BatchMaskGemma2Attention)


def _gemma3(owner: Any, local: range) -> None:
    """gemma3 text: a forward that reads each layer's kind instead of its position."""
    mix_in(owner, _LocalGemma3Model)


def _lfm2(owner: Any, local: range) -> None:
    """lfm2: a forward that builds the attention and convolution masks only for kinds the rank holds."""
    mix_in(owner, _LocalLfm2Model)


def _nemotron_h_check(model: Any, owner: Any, local: range) -> None:
    """nemotron-h: MLP/MoE blocks hold no cache, so the cache list is shorter than the layer list."""
    kinds = [layer.block_type for layer in owner.layers]
    cacheless = [i for i, kind in enumerate(kinds) if kind not in ("M", "*")]
    if cacheless:
        raise PipelineError(
            f"{type(model).__module__} cannot be pipelined: its layers {cacheless} "
            f"(block types {sorted({kinds[i] for i in cacheless})}) hold no cache, so its cache list "
            f"({len(kinds) - len(cacheless)} entries) does not line up with its {len(kinds)} layers; "
            "pipemlx needs one cache per decoder layer"
        )


def _nemotron_h(owner: Any, local: range) -> None:
    """nemotron-h of Mamba and attention blocks only: a forward that builds masks for the kinds the rank holds."""
    mix_in(owner, _LocalNemotronHModel)


ARCHITECTURES: MappingProxyType[str, Architecture] = MappingProxyType(
    {
        # Nothing to adjust: verified by tests/test_architectures.py.
        "mlx_lm.models.qwen2": Architecture(pre_norm_blocks=True, plain_head=True),
        "mlx_lm.models.qwen3": Architecture(pre_norm_blocks=True, plain_head=True),
        "mlx_lm.models.qwen3_moe": Architecture(plain_head=True),
        "mlx_lm.models.phi3": Architecture(plain_head=True),
        "mlx_lm.models.deepseek_v3": Architecture(plain_head=True),
        "mlx_lm.models.falcon_h1": Architecture(),  # logits scaled
        "mlx_lm.models.mixtral": Architecture(plain_head=True),
        "mlx_lm.models.gemma": Architecture(plain_head=True),
        "mlx_lm.models.phi": Architecture(),  # unverified
        "mlx_lm.models.starcoder2": Architecture(plain_head=True),
        "mlx_lm.models.olmo2": Architecture(plain_head=True),
        "mlx_lm.models.granite": Architecture(),  # logits scaled
        "mlx_lm.models.qwen2_moe": Architecture(plain_head=True),
        "mlx_lm.models.deepseek": Architecture(plain_head=True),
        "mlx_lm.models.deepseek_v2": Architecture(plain_head=True),
        # Bookkeeping over the whole layer list.
        "mlx_lm.models.llama": Architecture(fixup=_llama, pre_norm_blocks=True, plain_head=True),
        "mlx_lm.models.gpt_oss": Architecture(fixup=_gpt_oss, plain_head=True),
        "mlx_lm.models.gemma3_text": Architecture(fixup=_gemma3, plain_head=True),
        # Not bookkeeping: mlx-lm's attention mishandles batch masks (found by the batch engine's tests).
        "mlx_lm.models.gemma2": Architecture(fixup=_gemma2),  # logits soft-capped
        "mlx_lm.models.gemma3": Architecture(fixup=_gemma3),  # a wrapper around gemma3_text
        "mlx_lm.models.lfm2": Architecture(fixup=_lfm2, plain_head=True),
        "mlx_lm.models.qwen3_next": Architecture(fixup=_qwen3_next, plain_head=True),
        "mlx_lm.models.nemotron_h": Architecture(fixup=_nemotron_h, check=_nemotron_h_check),
    }
)


def architecture_of(model: nn.Module) -> Architecture | None:
    """The registry entry for ``model``'s architecture, if any."""
    return ARCHITECTURES.get(type(model).__module__)


def bookkeeping_attributes(owner: nn.Module) -> list[str]:
    """Names of ``owner``'s attributes that look like bookkeeping over the whole layer list."""
    items = cast(list[tuple[str, Any]], list(owner.items()))  # pyright: ignore[reportUnknownArgumentType]
    names = set(vars(owner)) | {k for k, v in items if not isinstance(v, (nn.Module, mx.array))}
    return sorted(n for n in names if BOOKKEEPING.search(n) and n not in HARMLESS)


def check_architecture(model: nn.Module, owner: nn.Module, local: range, allow_unregistered: bool = False) -> None:
    """Raise :class:`PipelineError` if ``model`` cannot be pipelined; call before changing anything.

    Architectures missing from the registry are refused unless ``allow_unregistered`` (for experiments);
    even then one that keeps bookkeeping over its whole layer list is refused.
    """
    entry = architecture_of(model)
    if entry is None and not allow_unregistered:
        known = ", ".join(sorted(m.rsplit(".", 1)[-1] for m in ARCHITECTURES))
        raise PipelineError(
            f"{type(model).__module__} is not an architecture pipemlx has been verified on (it covers: {known}); "
            "pass allow_unregistered=True to shard_model (or load_sharded), or --allow-unregistered to "
            "pipemlx generate / serve / bench / doctor, to try it anyway"
        )
    if entry is None:
        suspicious = bookkeeping_attributes(owner)
        if suspicious:
            raise PipelineError(
                f"{type(model).__module__} is not supported by pipemlx yet: {type(owner).__name__} keeps "
                f"bookkeeping over its whole layer list ({', '.join(suspicious)}) that would be wrong for a "
                "rank's slice of the layers; add a fixup for it to pipemlx/models/architectures.py"
            )
        return
    if entry.check is not None:
        entry.check(model, owner, local)


def check_lendable(model: nn.Module) -> None:
    """Raise :class:`PipelineError` unless ``model``'s blocks may be cut between their halves (``lend``)."""
    entry = architecture_of(model)
    if entry is None or not entry.pre_norm_blocks:
        able = ", ".join(sorted(m.rsplit(".", 1)[-1] for m, a in ARCHITECTURES.items() if a.pre_norm_blocks))
        raise PipelineError(
            f"lend: {type(model).__module__}'s blocks are not verified to be plain pre-norm blocks (attention "
            f"half, then feed-forward half), so their feed-forward half cannot move to the next rank; it can for: "
            f"{able}"
        )


def apply_fixups(model: nn.Module, owner: nn.Module, local: range) -> None:
    """Run the fixup registered for ``model``'s architecture, if any, on the already cut ``owner``."""
    entry = architecture_of(model)
    if entry is not None and entry.fixup is not None:
        entry.fixup(owner, local)
