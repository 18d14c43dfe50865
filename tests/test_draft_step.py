"""The draft's compiled one-token forward (pipemlx/runtime/draft_step.py) against mlx-lm's own forward.

One process, no ranks: for every architecture of the tiny configs, a draft that reads through the compiled
forward (where the architecture allows one) proposes the guesses of a draft that reads with mlx-lm's cache and
forward, over a history that outgrows the fixed cache's first room and keeps changing under it (the cache is
cut back and read again, as after rejected guesses).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from pipemlx.runtime.draft_step import ROOM_STEP, FixedKVCache, compiled_forward
from pipemlx.runtime.speculative import DraftModel
from pipemlx.testing import BASE_CONFIGS, build_model, tiny_config

COMPILED = {"llama", "qwen3", "qwen2", "mistral"}
"""Architectures that must get the compiled forward (plain KV caches, the offset read as mlx-lm's models do)."""


def plain_draft(model: nn.Module) -> DraftModel:
    """A draft over ``model`` that reads with mlx-lm's cache and forward: the reference."""
    draft = DraftModel(model)
    draft.forward = None
    draft.cache = make_prompt_cache(model)
    return draft


@pytest.mark.parametrize("arch", sorted(BASE_CONFIGS))
def test_compiled_draft_guesses_as_mlx_lm_forward(arch: str) -> None:
    config = tiny_config(arch)
    model = build_model(config)
    vocabulary = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    compiled, reference = DraftModel(model), plain_draft(model)
    if arch in COMPILED:
        assert compiled.forward is not None, arch
        assert all(isinstance(c, FixedKVCache) for c in compiled.cache)
    history = [(7 * i + 3) % vocabulary for i in range(ROOM_STEP - 6)]
    for step in range(14):  # past the first room: the fixed cache grows, and is traced again
        wanted: list[int] = reference.propose(history, 3)
        assert compiled.propose(history, 3) == wanted, (arch, step)
        # Keep some guesses and a token of our own: both drafts cut back what they guessed past it.
        history = [*history, *wanted[: step % 3], (history[-1] * 5 + step) % vocabulary]
    assert compiled.tokens == reference.tokens


class Wrapped(nn.Module):
    """A tiny llama behind a forward of the subclass's own, with the llama's caches."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.args = getattr(inner, "args")

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.inner)


class OffsetAsInt(Wrapped):
    """A model that reads its cache's offset as a Python int: a compiled trace cannot, so it keeps mlx-lm's."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        offset = cache[0].offset if cache else 0
        start = int(offset.item()) if isinstance(offset, mx.array) else int(offset)
        return self.inner(inputs, cache=cache) + 0.0 * start


class WithoutMask(Wrapped):
    """A model that attends to every position the cache returns: the fixed cache's unused room would show."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        inner: Any = self.inner
        h = inner.model.embed_tokens(inputs)
        for layer, layer_cache in zip(inner.model.layers, cache or [None] * len(inner.model.layers)):
            h = layer(h, None if inputs.shape[1] == 1 else "causal", layer_cache)
        return inner.lm_head(inner.model.norm(h))


@pytest.mark.parametrize("wrapper", [OffsetAsInt, WithoutMask])
def test_a_model_the_fixed_cache_does_not_suit_keeps_mlx_lm_forward(wrapper: type[nn.Module]) -> None:
    model = wrapper(build_model(tiny_config("llama")))  # pyright: ignore[reportCallIssue]
    assert compiled_forward(model) is None
    draft = DraftModel(model)
    assert draft.forward is None and not any(isinstance(c, FixedKVCache) for c in draft.cache)
    history = list(range(1, 40))
    assert draft.propose(history, 3) == plain_draft(model).propose(history, 3)


def test_a_draft_whose_weights_were_replaced_is_traced_again() -> None:
    """A compiled trace holds the weights it saw: after ``model.update`` the guesses follow the new weights."""
    model = build_model(tiny_config("llama"))
    history = list(range(1, 40))
    before = DraftModel(model)
    before.propose(history, 3)
    model.update(build_model(tiny_config("llama"), seed=5).parameters())
    after = DraftModel(model)
    assert after.forward is not None and after.forward is not before.forward
    assert after.propose(history, 3) == plain_draft(model).propose(history, 3)
