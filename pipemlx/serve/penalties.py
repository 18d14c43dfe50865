"""A request's repetition penalties: parsed from its body, carried to every rank as ints, made into processors.

OpenAI's ``presence_penalty`` and ``frequency_penalty`` (-2 to 2) and
mlx-lm's server's ``repetition_penalty`` (a multiplicative penalty, 0 or 1 for
none), each over the last ``*_context_size`` tokens (default 20, as mlx-lm's
server), become mlx-lm's ``make_logits_processors``: the answer equals a single
process's ``generate_step`` with those processors. They reach the other ranks
as int32 fields (a float as its bits) in the request's insert record
(:mod:`.broadcast`), so every rank builds the same processors (only the last
rank runs them).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # MLX only where processors are made: the HTTP side checks requests without it
    import mlx.core as mx

    LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

DEFAULT_CONTEXT = 20


def float32(value: float) -> float:
    """``value`` as a float32 holds it: what the other ranks receive of a float field."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@dataclass(frozen=True)
class Penalties:
    """A request's penalties; 0 (the default) is none. Float fields hold float32-exact values."""

    repetition_penalty: float = 0.0
    repetition_context_size: int = DEFAULT_CONTEXT
    presence_penalty: float = 0.0
    presence_context_size: int = DEFAULT_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = DEFAULT_CONTEXT

    def processors(self) -> list[LogitsProcessor] | None:
        """mlx-lm's processors for these penalties; ``None`` when there are none (a penalty of 0 is none)."""
        from mlx_lm.sample_utils import make_logits_processors  # pyright: ignore[reportUnknownVariableType]

        made: list[LogitsProcessor] = make_logits_processors(
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size,
        )
        return made or None


class PenaltyError(ValueError):
    """A penalty field of a request body is out of range; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_penalties(obj: dict[str, Any]) -> Penalties:
    """The penalties of a request body; :class:`PenaltyError` for a bad one."""
    values: dict[str, Any] = {}
    for name, low, high in (
        ("repetition_penalty", 0.0, 10.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise PenaltyError(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}", name)
        values[name] = float32(float(value))
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
            raise PenaltyError(f"'{name}' must be a whole number of at least 1, got {value!r}", name)
        values[name] = value
    return Penalties(**values)
