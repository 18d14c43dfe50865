"""Cuts inside a layer (shard_model(lend="mlp"), and lend=k): the model computes what it did, the work
moves as planned.

The ranks' side (tokens equal single-device mlx-lm at S = 2 and 3, ranks that disagree) is in
tests/test_equivalence.py (the "lent" cases) and tests/test_bad_input.py.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import pytest
from fakes import FakeGroup
from mlx.utils import tree_flatten
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache, make_prompt_cache

import pipemlx
from pipemlx.models.lending import LentHeadsCache, lend_feed_forwards
from pipemlx.runtime.calibrate import CALIBRATION_LENGTHS, FAR_LENGTHS, time_layer
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.autostep import choose_lent_heads
from pipemlx.schedule.costmodel import (
    CostModel,
    LayerCosts,
    attention_pairs,
    cache_only_share,
    feed_forward_share_of,
    lent_heads_share_of,
    predict,
)
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
    with pytest.raises(pipemlx.PipelineError, match=r"lend: mlx_lm.models.gemma2.*llama, qwen2, qwen3"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="mlp")  # type: ignore[arg-type]
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


EIGHT_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4}  # head size 8: heads 1..3 can be lent


def lent_cache(model: object, starts: list[int]) -> list[object]:
    """The whole cut model's caches: a borrower keeps ``LentHeadsCache(own, lent heads')``, as a sharded rank does."""
    return lent_heads_of(make_prompt_cache(model), starts)  # type: ignore[arg-type]


def lent_heads_of(cache: list[object], starts: list[int]) -> list[object]:
    """``cache`` with each borrower's entry paired with a fresh cache of its kind for the lent heads."""
    for start in starts:
        cache[start] = LentHeadsCache(cache[start], copy.deepcopy(cache[start]))
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("split", [(3, 3), (5, 1), (1, 5), (2, 1, 3), (1, 1, 1, 1, 1, 1)])
@pytest.mark.parametrize("heads", [1, 3])
def test_lent_heads_compute_what_the_model_does(arch: str, split: tuple[int, ...], heads: int) -> None:
    config = tiny_config(arch, num_hidden_layers=6, **EIGHT_HEADS)
    whole, cut = build_model(config), build_model(config)
    layers = cut.model.layers  # type: ignore[attr-defined]
    lend_feed_forwards(layers, split, heads)
    starts = [sum(split[:r]) for r in range(1, len(split))]
    for start in starts:
        lender, borrower = layers[start - 1], layers[start]
        assert (lender.self_attn.n_kv_heads, borrower.borrowed_self_attn.n_kv_heads) == (4 - heads, heads), start
        assert isinstance(lender.self_attn.o_proj, nn.Identity) and "borrowed_mlp" in borrower
    # every weight moved, none lost; copied only the norms both sides of a cut run (the layer's input norm,
    # qwen3's per-head query and key norms)
    attention = whole.model.layers[0].self_attn  # type: ignore[attr-defined]
    shared = [whole.model.layers[0].input_layernorm] + [
        getattr(attention, n) for n in ("q_norm", "k_norm") if n in attention
    ]  # type: ignore[attr-defined]
    assert sizes_of(cut) == sizes_of(whole) + sum(map(sizes_of, shared)) * len(starts)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    whole_cache, cut_cache = make_prompt_cache(whole), lent_cache(cut, starts)
    for part in (tokens[:, :5], tokens[:, 5:9], tokens[:, 9:]):  # a prefill, more on the same caches, a decode step
        assert mx.array_equal(whole(part, cache=whole_cache), cut(part, cache=cut_cache))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_lent_heads_of_a_quantized_model_compute_what_the_model_does(arch: str) -> None:
    """The q, k and v rows of a QuantizedLinear (packed weights, scales, biases) split by heads as a Linear's."""
    config = tiny_config(arch, num_hidden_layers=6, **EIGHT_HEADS)
    whole, cut = build_model(config), build_model(config)
    for model in (whole, cut):
        nn.quantize(model, group_size=32, bits=4)
    lend_feed_forwards(cut.model.layers, (3, 3), 2)  # type: ignore[attr-defined]
    assert isinstance(cut.model.layers[2].self_attn.q_proj, nn.QuantizedLinear)  # type: ignore[attr-defined]
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    whole_cache, cut_cache = make_prompt_cache(whole), lent_cache(cut, [3])
    for part in (tokens[:, :5], tokens[:, 5:]):
        assert mx.array_equal(whole(part, cache=whole_cache), cut(part, cache=cut_cache))


def test_lending_heads_is_checked_before_anything_moves() -> None:
    model = build_model(tiny_config("llama", **EIGHT_HEADS))
    layers = model.model.layers  # type: ignore[attr-defined]
    for heads in (4, 5):
        with pytest.raises(
            pipemlx.PipelineError,
            match=r"lend=%d: layer 2's attention has 4 key-value heads; a rank can lend 1..3" % heads,
        ):
            lend_feed_forwards(layers, (3, 3), heads)
    assert "mlp" in layers[2] and "borrowed_mlp" not in layers[3] and layers[2].self_attn.n_kv_heads == 4
    with pytest.raises(TypeError, match="'lend_heads', renamed 'lend'"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none", lend_heads=1)  # type: ignore[arg-type]
    for bad in (-1, True, 1.5, "some"):
        with pytest.raises(ValueError, match="lend must be 'auto', 'none', 'mlp' or a non-negative int"):
            pipemlx.shard_model(model, FakeGroup(0, 2), lend=bad)  # type: ignore[arg-type]
    assert not hasattr(model, "_pipemlx_stage") and len(model.model.layers) == 6  # type: ignore[attr-defined]


def test_lending_heads_needs_plain_caches_at_the_cuts() -> None:
    model = build_model(tiny_config("llama_swa"))  # sliding layers keep rotating caches
    with pytest.raises(
        pipemlx.PipelineError, match=r"lend=k .*: the layers at the cuts must keep plain KVCache.*RotatingKVCache"
    ):
        pipemlx.shard_model(model, FakeGroup(0, 2), split=[2, 4], lend=1)  # type: ignore[arg-type]
    assert not hasattr(model, "_pipemlx_stage")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_lent_heads_caches_quantize_and_rotate_as_their_layers_do(arch: str) -> None:
    """kv_bits (mlx-lm's maybe_quantize_kv_cache, mid-prompt) and max_kv_size (rotating caches, past their size)."""
    config = tiny_config(arch, num_hidden_layers=6, hidden_size=256, head_dim=32, **EIGHT_HEADS)
    whole, cut = build_model(config), build_model(config)
    lend_feed_forwards(cut.model.layers, (3, 3), 2)  # type: ignore[attr-defined]
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    parts = (tokens[:, :5], tokens[:, 5:9], tokens[:, 9:10], tokens[:, 10:11], tokens[:, 11:])
    whole_cache, cut_cache = make_prompt_cache(whole), lent_heads_of(make_prompt_cache(cut), [3])
    for part in parts:
        assert mx.array_equal(whole(part, cache=whole_cache), cut(part, cache=cut_cache))
        for cache in (whole_cache, cut_cache):
            maybe_quantize_kv_cache(cache, quantized_kv_start=4, kv_group_size=32, kv_bits=4)
    assert [type(c).__name__ for c in cut_cache[3].caches] == ["QuantizedKVCache"] * 2  # type: ignore[attr-defined]
    whole_cache = make_prompt_cache(whole, max_kv_size=6)
    cut_cache = lent_heads_of(make_prompt_cache(cut, max_kv_size=6), [3])
    for part in parts:
        assert mx.array_equal(whole(part, cache=whole_cache), cut(part, cache=cut_cache))


def test_a_lent_heads_cache_masks_and_batches_as_its_layers_cache() -> None:
    own, lent = BatchKVCache([2, 0]), BatchKVCache([2, 0])
    cache = LentHeadsCache(own, lent)
    for c in (own, lent):
        c.update_and_fetch(mx.ones((2, 1, 4, 8)), mx.ones((2, 1, 4, 8)))
    assert mx.array_equal(cache.make_mask(1, return_array=True), own.make_mask(1, return_array=True))
    assert cache.offset is own.offset and not hasattr(cache, "to_quantized")  # a batch cache is not quantized
    row = cache.extract(1)
    assert isinstance(row, LentHeadsCache) and [c.offset for c in row.caches] == [4, 4]
    merged = row.merge([row, cache.extract(0)])
    assert isinstance(merged, LentHeadsCache) and merged.caches[1].left_padding.tolist() == [0, 2]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_borrowing_rank_makes_its_caches_as_mlx_lm_makes_the_whole_models(rank: int) -> None:
    model = pipemlx.shard_model(build_model(tiny_config("qwen2")), FakeGroup(rank, 2), lend=1)  # type: ignore[arg-type]
    stage = stage_of(model)
    assert (stage.info.lending.outgoing_width, stage.info.lending.incoming_width) == (
        (64 + 2 * 16, 0) if rank == 0 else (0, 64 + 2 * 16)
    )
    for max_kv_size, kind in ((None, KVCache), (16, RotatingKVCache)):
        cache = stage.new_cache(model, max_kv_size)
        first = cache[0]
        assert isinstance(first, LentHeadsCache) == (rank == 1)  # the borrower's first cache holds the lent heads'
        parts = first.caches if isinstance(first, LentHeadsCache) else [first]
        assert all(type(c) is kind for c in [*parts, *cache[1:]]), (max_kv_size, cache)
        assert all(getattr(c, "max_size", 16) == 16 for c in parts)
    assert len(stage.send_queue) == 0 and stage.broken is None


def test_the_cost_model_moves_the_lent_heads_attention_too() -> None:
    share = lent_heads_share_of(512, 256, 1536, 0.5)
    assert share == pytest.approx((3 * 1536 + 512 + 0.5 * (512 + 512)) / (1024 + 512 + 3 * 1536))
    layer = LayerCosts(chunk_s=0.001, token_s=0.01, attention_s=0.0001)
    plain = CostModel(layer, layers=(2, 2, 2), hidden_size=512)
    lent = CostModel(layer, layers=(2, 2, 2), hidden_size=512, lent_share=share, lent_pair_share=0.5)
    chunk = Chunk(3, 160, 48)
    moved = share * layer.token_s * chunk.length + 0.5 * layer.attention_s * attention_pairs(chunk)
    assert [lent.compute(r, chunk) - plain.compute(r, chunk) for r in range(3)] == pytest.approx([-moved, 0, moved])
    with pytest.raises(ValueError, match="lent_pair_share"):
        CostModel(layer, layers=(2, 2), hidden_size=512, lent_pair_share=-0.1)


def test_the_lent_heads_cache_counts_in_the_batch_admissions_bytes_per_position() -> None:
    """BatchGenerator(memory_budget=...) counts a position's bytes in the lent heads' cache on the rank keeping it."""
    from pipemlx.runtime.batch.memory import cache_bytes_per_position

    per_rank = []
    for rank in (0, 1):
        model = pipemlx.shard_model(build_model(tiny_config("llama")), FakeGroup(rank, 2), lend=1)  # type: ignore[arg-type]
        per_rank.append(cache_bytes_per_position(model, stage_of(model)))
    layer = 2 * 2 * 16 * 4  # keys and values, 2 key-value heads of 16 floats: 256 bytes per position and layer
    assert per_rank == [3 * layer - layer // 2, 3 * layer + layer // 2]


def lend_cuts(layer: LayerCosts, kv_heads: int = 4) -> list[CostModel]:
    """The benchmark model's cost models (512-d, 4 of 8 query heads' key-value heads, 1536 inner) at S=2, 4+4
    layers, lending 0..kv_heads-1 heads."""
    return [
        CostModel(
            layer,
            layers=(4, 4),
            hidden_size=512,
            last_layer_share=cache_only_share(512, 256, 1536),
            lent_share=lent_heads_share_of(512, 256, 1536, k / kv_heads)
            if k
            else feed_forward_share_of(512, 256, 1536),
            lent_pair_share=k / kv_heads,
        )
        for k in range(kv_heads)
    ]


def test_auto_lends_heads_where_attention_is_the_work_and_none_where_it_is_not() -> None:
    """Without attention the feed-forward half already over-balances 4 layers against 3.1 (more heads only move
    more); when attention is most of the work, half the heads level the 4 attentions against 3."""
    no_attention = lend_cuts(LayerCosts(chunk_s=1e-4, token_s=1e-4, attention_s=0.0))
    attention = lend_cuts(LayerCosts(chunk_s=1e-4, token_s=1e-6, attention_s=1e-6))
    assert choose_lent_heads(2048, no_attention) == 0
    assert choose_lent_heads(2048, attention) == 2
    for cuts in (no_attention, attention):
        times = [predict(2048, 128, c, agree_every=None).prefill_s for c in cuts]
        assert len(set(times)) == len(times)  # the cuts differ: the choice means something
    assert choose_lent_heads(1, attention) == 0 and choose_lent_heads(2048, attention[:1]) == 0


def test_the_ranks_time_a_layer_on_its_own_before_the_cut() -> None:
    """lend='auto''s calibration: one layer of the whole model, at position 0 and far in, nothing sent."""
    model = build_model(tiny_config("qwen2"))
    at_start, attention_chunk_s, far = time_layer(model.model.layers[0], 64, mx.float32)  # type: ignore[attr-defined]
    assert [n for n, _ in at_start] == list(CALIBRATION_LENGTHS) and [n for n, _ in far] == list(FAR_LENGTHS)
    assert min(s for _, s in [*at_start, *far]) > 0 and attention_chunk_s > 0


def test_lend_auto_is_checked_before_anything_moves() -> None:
    model = build_model(tiny_config("llama"))
    with pytest.raises(TypeError, match="'lend_mlp', renamed 'lend'"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none", lend_mlp=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lend must be .* got 'some'"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="some")  # type: ignore[arg-type]
    assert not hasattr(model, "_pipemlx_stage") and len(model.model.layers) == 6  # type: ignore[attr-defined]
    one = pipemlx.shard_model(model, FakeGroup(0, 1), context=4096)  # type: ignore[arg-type]  # lend="auto", context
    assert stage_of(one).info.lending.heads == 0 and not stage_of(one).info.lending.mlp  # one rank: no cut


def test_lend_auto_keeps_whole_layers_where_the_model_cannot_be_cut() -> None:
    """gemma2's blocks are not plain pre-norm blocks: lend="auto" (the default) keeps whole layers, no error."""
    model = pipemlx.shard_model(build_model(tiny_config("gemma2")), FakeGroup(0, 2), lend="auto")  # type: ignore[arg-type]
    assert not stage_of(model).info.lending.mlp
    sliding = pipemlx.shard_model(build_model(tiny_config("llama_swa")), FakeGroup(0, 2), split=[2, 4])  # type: ignore[arg-type]
    assert stage_of(sliding).info.lending.mlp and stage_of(sliding).info.lending.heads == 0  # no heads: rotating caches


@pytest.mark.parametrize("lend", [1, "auto"])
def test_a_callers_rotating_make_cache_with_lent_heads_gives_mlx_lm_s_tokens(lend: int | str) -> None:
    """A model whose ``make_cache`` the caller replaced (rotating caches, a sliding window) and that lends heads: the
    rank that borrows them pairs its first cache for them, and every rank gives mlx-lm's tokens (#46)."""
    from conftest import run_ranks

    spec = {"arch": "llama", "lend": lend, "M": 40, "max_tokens": 10, "window": 24}
    reports = run_ranks(2, "own_caches.py", spec, timeout=120)
    for report in reports:
        assert report["tokens"] == report["reference"], report
