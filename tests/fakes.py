"""A stand-in for mx.distributed.Group where no message is exchanged."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from pipemlx import shard_model
from pipemlx.testing import build_model, tiny_config

# helium is not in pipemlx's registry: a model that needs allow_unregistered=True.
HELIUM_TIED = {
    "model_type": "helium",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "attention_bias": False,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


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
    return shard_model(build_model(tiny_config("llama", **config)), FakeGroup(rank, size), lend="none")  # type: ignore[arg-type]


def tokens(n: int) -> mx.array:
    return mx.arange(n, dtype=mx.int32) % 200


def load_without_exchange(group: Any, timeout: float | None, load: Any, what: str = "") -> Any:
    """``load_sharded``'s progress exchange for a :class:`FakeGroup`, which cannot all-gather: the load alone."""
    from pipemlx.models.load_wait import LoadProgress

    return load(LoadProgress())
