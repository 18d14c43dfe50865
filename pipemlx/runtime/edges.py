"""Layer wrappers at a rank's edges: the first local layer receives, the last one sends.

A wrapped layer stays the very same object: its class is swapped for a
subclass that adds the receive or send around the original ``__call__``. So
the layer keeps its attributes (``use_sliding``, ``is_sliding``, ...), its
parameters keep their names (``layers.0.self_attn.q_proj.weight``), and
``isinstance`` checks against the model's own layer class still hold.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .stage import PipelineStage


class ReceivingLayer(nn.Module):
    """Mixin for the first local layer of a rank > 0: replaces its input by the previous rank's output."""

    _pipemlx_stage: PipelineStage

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(self._pipemlx_stage.receive(x), *args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType, reportUnknownVariableType]


class SendingLayer(nn.Module):
    """Mixin for the last local layer: hands its output to the stage, which sends or queues it."""

    _pipemlx_stage: PipelineStage
    _pipemlx_signature: inspect.Signature

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        output = super().__call__(x, *args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType, reportUnknownVariableType]
        if not isinstance(output, mx.array):
            raise TypeError(
                f"pipemlx expects {type(self).__name__} to return an array, got {type(output).__name__}"  # pyright: ignore[reportUnknownArgumentType]
            )
        bound = self._pipemlx_signature.bind_partial(x, *args, **kwargs)
        return self._pipemlx_stage.emit(output, bound.arguments.get("cache"))


def wrap_edge(layer: nn.Module, stage: PipelineStage, *, receives: bool, sends: bool) -> nn.Module:
    """Turn ``layer`` in place into a receiving and/or sending edge of ``stage``; return it."""
    original = type(layer)
    mixins: tuple[type, ...] = ((SendingLayer,) if sends else ()) + ((ReceivingLayer,) if receives else ())
    if not mixins:
        return layer
    name = "".join(m.__name__.removesuffix("Layer") for m in mixins) + original.__name__
    layer.__class__ = type(name, (*mixins, original), {"__module__": original.__module__})
    object.__setattr__(layer, "_pipemlx_stage", stage)
    object.__setattr__(layer, "_pipemlx_signature", _call_signature(original))
    return layer


def _call_signature(cls: type) -> inspect.Signature:
    """The signature of ``cls.__call__`` without ``self``, to find the ``cache`` argument."""
    signature = inspect.signature(cls.__call__)
    return signature.replace(parameters=list(signature.parameters.values())[1:])
