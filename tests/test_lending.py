"""Cuts inside a layer (shard_model(lend_mlp=True)): the model computes what it did, the work moves as planned.

The ranks' side (tokens equal single-device mlx-lm at S = 2 and 3, ranks that disagree) is in
tests/test_equivalence.py (the "lent" cases) and tests/test_bad_input.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from fakes import FakeGroup
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.models.lending import lend_feed_forwards
from pipemlx.schedule.costmodel import CostModel, LayerCosts, feed_forward_share_of
from pipemlx.schedule.plan import Chunk
from pipemlx.testing import build_model, tiny_config

SPLITS = [(3, 3), (5, 1), (1, 5), (2, 1, 3), (1, 1, 1, 1, 1, 1)]


def sizes_of(model: object) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", ["llama", "llama_swa", "qwen3"])
@pytest.mark.parametrize("split", SPLITS)
def test_the_whole_cut_model_computes_what_the_model_does(arch: str, split: tuple[int, ...]) -> None:
    whole, cut = build_model(tiny_config(arch)), build_model(tiny_config(arch))
    layers = cut.model.layers  # type: ignore[attr-defined]
    lend_feed_forwards(layers, split)
    starts = [sum(split[:r]) for r in range(1, len(split))]
    for start in starts:
        assert "mlp" not in layers[start - 1] and "borrowed_mlp" in layers[start], start
    assert sizes_of(cut) == sizes_of(whole)  # every weight moved, none copied or lost
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5]])
    for prefix in (tokens[:, :5], tokens[:, 5:]):  # a prefill, then more on the same caches
        whole_cache, cut_cache = make_prompt_cache(whole), make_prompt_cache(cut)
        assert mx.array_equal(whole(prefix, cache=whole_cache), cut(prefix, cache=cut_cache))


def test_architectures_not_known_to_have_plain_pre_norm_blocks_are_refused_before_anything_changes() -> None:
    model = build_model(tiny_config("gemma2"))  # norms around each half: its halves are not plain pre-norm ones
    before = len(model.model.layers)  # type: ignore[attr-defined]
    with pytest.raises(pipemlx.PipelineError, match=r"lend_mlp: mlx_lm.models.gemma2.*llama, qwen2, qwen3"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend_mlp=True)  # type: ignore[arg-type]
    assert len(model.model.layers) == before and not hasattr(model, "_pipemlx_stage")  # type: ignore[attr-defined]


def test_a_boundary_layer_without_a_feed_forward_half_is_refused() -> None:
    model = build_model(tiny_config("llama"))
    layers = model.model.layers  # type: ignore[attr-defined]
    del layers[3]["mlp"]
    with pytest.raises(pipemlx.PipelineError, match=r"layers \[3\] are not pre-norm blocks"):
        lend_feed_forwards(layers, (4, 2))
    assert "mlp" in layers[2] and "post_attention_layernorm" in layers[3]  # nothing moved


def test_the_cost_model_moves_the_feed_forward_share_of_the_per_token_cost() -> None:
    share = feed_forward_share_of(512, 256, 1536)
    assert share == pytest.approx(0.75)
    layer = LayerCosts(chunk_s=0.001, token_s=0.01, attention_s=0.0001)
    plain = CostModel(layer, layers=(2, 2, 2), hidden_size=512)
    lent = CostModel(layer, layers=(2, 2, 2), hidden_size=512, lent_share=share)
    chunk = Chunk(0, 16, 48)
    moved = share * layer.token_s * chunk.length
    assert [lent.compute(r, chunk) - plain.compute(r, chunk) for r in range(3)] == pytest.approx([-moved, 0, moved])
    with pytest.raises(ValueError, match="lent_share"):
        CostModel(layer, layers=(2, 2), hidden_size=512, lent_share=1.5)
