"""A stand-in for mx.distributed.Group where no message is exchanged."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from pipemlx import shard_model
from pipemlx.testing import build_model, tiny_config


class FakeGroup:
    """Answers rank() and size(); any real communication through it fails loudly."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def sharded_tiny(rank: int = 0, size: int = 2, **config: Any) -> Any:
    """A tiny llama sharded as ``rank`` of a fake group of ``size``."""
    return shard_model(build_model(tiny_config("llama", **config)), FakeGroup(rank, size))  # type: ignore[arg-type]


def tokens(n: int) -> mx.array:
    return mx.arange(n, dtype=mx.int32) % 200
