"""Per-architecture fixups, in one place.

Cutting a model's layer list down to a rank's local layers is all most mlx-lm
architectures need. Some keep bookkeeping about the *whole* list (a per-layer
type list, the index of the first layer of a kind whose cache gives the
attention mask): those entries must describe the local layers afterwards.
Each such architecture has one function here, keyed by the module that
defines its ``Model`` class.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import mlx.nn as nn

Fixup = Callable[[Any, range], None]
"""Adjust ``owner`` (the module holding the layer list) after it keeps only the layers in ``local``."""


def _first_index(flags: list[bool], default: int | None) -> int | None:
    return next((i for i, flag in enumerate(flags) if flag), default)


def _llama(owner: Any, local: range) -> None:
    """llama keeps ``layer_types`` and the cache indices of its first full and sliding layers."""
    owner.layer_types = list(owner.layer_types[local.start : local.stop])
    sliding = [bool(layer.use_sliding) for layer in owner.layers]
    owner.fa_idx = _first_index([not s for s in sliding], 0)
    owner.swa_idx = _first_index(sliding, None)


FIXUPS: MappingProxyType[str, Fixup] = MappingProxyType(
    {
        "mlx_lm.models.llama": _llama,
    }
)


def apply_fixups(model: nn.Module, owner: nn.Module, local: range) -> None:
    """Run the fixup registered for ``model``'s architecture, if any."""
    fixup = FIXUPS.get(type(model).__module__)
    if fixup is not None:
        fixup(owner, local)
