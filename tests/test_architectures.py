"""The architecture matrix: each mlx-lm family pipelined over S = 2 and 3 ranks equals single-device mlx-lm.

One launch per S runs every architecture (tests/ranks/arch_equivalence.py);
each (architecture, S) cell is then its own test. Splits are chosen so that
ranks start mid-pattern and some rank lacks a layer kind (sliding / full /
linear attention), which is where a cut layer list goes wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import run_ranks
from fakes import FakeGroup
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.models.architectures import ARCHITECTURES, bookkeeping_attributes, check_architecture
from pipemlx.models.sharding import find_layer_list
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, model_classes, tiny_config

# arch -> split per world size (None: even). Every architecture runs at S=2; S=3 (a middle rank that both
# receives and sends) for the layer patterns a cut can split differently and a few plain ones: a 3-rank
# launch on the 2-core CI machine costs about 3 s per architecture, a middle rank runs the same wrappers
# whatever the layers inside.
MATRIX: dict[str, dict[int, list[int] | None]] = {
    "llama": {2: None, 3: None},
    "llama_swa": {2: [2, 4], 3: None},  # s s f s s f
    "mistral": {2: None},
    "qwen2": {2: None},
    "qwen3": {2: None, 3: [1, 2, 3]},
    "qwen3_moe": {2: None},
    "gemma2": {2: None},
    "gemma3_text": {2: [2, 4], 3: None},  # s s g s s g (window 4)
    "gemma3": {2: [1, 4]},  # s g s g s, under language_model
    "phi3": {2: None},
    "gpt_oss": {2: None, 3: [1, 3, 2]},  # s f s f s f
    "deepseek_v3": {2: None},
    "qwen3_next": {2: None, 3: None},  # linear full linear full
    "lfm2": {2: None, 3: [2, 2, 1]},  # conv attn conv conv attn
    "falcon_h1": {2: None, 3: None},
    "nemotron_h_mamba_attention": {2: [4, 2], 3: None},  # M * M M * M
    "mixtral": {2: None},
    "gemma": {2: None},
    "phi": {2: None},
    "starcoder2": {2: None},
    "olmo2": {2: None},
    "granite": {2: None},
    "qwen2_moe": {2: None},
    "deepseek": {2: [1, 3]},  # dense, then MoE layers: a rank of the dense layer only
    "deepseek_v2": {2: None, 3: [1, 2, 1]},  # dense, then MoE layers
}
# "reuse": new tokens on the last prompt's cache (at S=3 qwen3_next, lfm2 and nemotron_h give a rank only
# recurrent layers, whose caches count no positions).
SPEC = {"seed": 11, "max_tokens": 5, "prompts": [[1, 4], [9, 4], [23, 4]], "reuse": [3, 4], "plain": [11, 4]}
WORLD_SIZES = (2, 3)
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def matrix_reports() -> dict[int, list[dict[str, Any]]]:
    """Every rank's report, per world size: one launch each."""
    reports: dict[int, list[dict[str, Any]]] = {}
    for size in WORLD_SIZES:
        archs = [{"arch": arch, "split": splits[size]} for arch, splits in MATRIX.items() if size in splits]
        reports[size] = run_ranks(size, "arch_equivalence.py", {**SPEC, "archs": archs}, timeout=600)
    return reports


@pytest.mark.parametrize("arch,size", [(arch, size) for arch, splits in MATRIX.items() for size in splits])
def test_architecture_matches_single_device(
    matrix_reports: dict[int, list[dict[str, Any]]], arch: str, size: int
) -> None:
    reports = matrix_reports[size]
    assert [r["rank"] for r in reports] == list(range(size))
    first_tokens: list[list[int]] | None = None
    for report in reports:
        (entry,) = [a for a in report["archs"] if a["arch"] == arch]
        where = f"{arch} rank {report['rank']}/{size} split {entry['split']}"
        if MATRIX[arch][size] is not None:
            assert entry["split"] == MATRIX[arch][size], where
        assert entry["cache_kinds"] == entry["reference_cache_kinds"], where
        for run in entry["runs"]:
            assert run["tokens"] == run["ref_tokens"], f"{where}: {run}"
            assert len(run["tokens"]) == SPEC["max_tokens"], f"{where}: {run}"
            assert run["logprob_diff"] <= LOGPROB_TOLERANCE, f"{where}: {run}"
            if run["kind"] == "pipeline" and run["offsets"]:
                assert run["offsets"] == [run["M"] - 1], f"{where}: {run}"
            if run["kind"] == "reuse":  # head="auto" splits the vocabulary where the registry allows (S>1)
                plain = ARCHITECTURES[model_classes(tiny_config(arch))[0].__module__].plain_head
                assert run["head"] == ("split" if plain else "all"), f"{where}: {run}"
                # Greedy with logprobs: a split head gathers the whole logits; "all" shares the head at S=2 (S=3
                # shares the logprobs, which keeps the head on the last rank).
                assert run["shared_head"] == (plain and size == 2 and run["head"] == "all"), f"{where}: {run}"
        tokens = [run["tokens"] for run in entry["runs"]]
        first_tokens = first_tokens or tokens
        assert tokens == first_tokens, f"{where}: ranks disagree"
        # A model that always says the same token would make this comparison weak.
        assert len({t for run in entry["runs"] for t in run["ref_tokens"]}) > 3, where


def test_matrix_covers_every_registered_architecture() -> None:
    modules = {type(build_model(tiny_config(arch))).__module__ for arch in MATRIX}
    untested = set(ARCHITECTURES) - modules
    assert not untested, f"registered but not in the matrix: {sorted(untested)}"


def test_nemotron_h_with_cacheless_blocks_is_refused_before_any_change() -> None:
    model = build_model(tiny_config("nemotron_h"))
    layers = list(model.layers)
    with pytest.raises(pipemlx.PipelineError, match=r"layers \[1, 4\] \(block types \['-'\]\) hold no cache"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    assert list(model.layers) == layers
    with pytest.raises(pipemlx.NotShardedError):
        stage_of(model)


def test_nemotron_h_of_mamba_and_attention_only_shards() -> None:
    model = pipemlx.shard_model(build_model(tiny_config("nemotron_h_mamba_attention")), FakeGroup(1, 2), lend="none")  # type: ignore[arg-type]
    assert [layer.block_type for layer in model.layers] == ["M", "*", "M"]
    assert [type(c).__name__ for c in make_prompt_cache(model)] == ["ArraysCache", "KVCache", "ArraysCache"]


EXAONE4 = {
    "model_type": "exaone4",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "rope_scaling": None,
    "sliding_window": 4,
    "sliding_window_pattern": "LLLG",
}


def test_unregistered_architecture_with_layer_bookkeeping_is_refused() -> None:
    """exaone4 keeps the indices of its first local and global layers: not registered, so refused by name."""
    model = build_model(dict(EXAONE4))
    layers = list(model.layers)
    with pytest.raises(
        pipemlx.PipelineError,
        match=r"mlx_lm.models.exaone4 is not supported by pipemlx yet: ExaoneModel keeps bookkeeping .*\(full_idx, swa_idx\)",
    ):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none", allow_unregistered=True)  # type: ignore[arg-type]
    assert list(model.layers) == layers


def test_unregistered_architecture_is_refused_naming_the_covered_ones() -> None:
    """A family the registry does not cover (hunyuan, exaone4, ...) is refused unless explicitly allowed."""
    model = build_model(dict(EXAONE4))
    layers = list(model.layers)
    with pytest.raises(
        pipemlx.PipelineError, match=r"exaone4 is not an architecture pipemlx has been verified on .*llama.*qwen3"
    ):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    assert list(model.layers) == layers


def test_registered_architectures_pass_the_bookkeeping_check() -> None:
    model = build_model(tiny_config("llama_swa"))
    owner, _ = find_layer_list(model)
    assert bookkeeping_attributes(owner) == ["fa_idx", "layer_types", "swa_idx"]
    check_architecture(model, owner, range(0, 3))
    qwen2 = build_model(tiny_config("qwen2"))
    assert bookkeeping_attributes(find_layer_list(qwen2)[0]) == []  # PipelineMixin's start_idx/end_idx are harmless


def test_make_cache_of_the_wrong_length_is_refused() -> None:
    model = build_model(tiny_config("qwen3"))

    class ShortCache(type(model)):  # type: ignore[misc]
        def make_cache(self) -> list[Any]:
            return make_prompt_cache(build_model(tiny_config("qwen3", num_hidden_layers=2)))

    ShortCache.__module__ = type(model).__module__
    model.__class__ = ShortCache
    with pytest.raises(pipemlx.PipelineError, match=r"make_cache\(\) returns 2 caches for 6 layers"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss", "falcon_h1"])
def test_local_caches_are_fresh_copies_of_the_whole_models_choice(arch: str) -> None:
    whole = make_prompt_cache(build_model(tiny_config(arch)))
    model = pipemlx.shard_model(build_model(tiny_config(arch)), FakeGroup(1, 2), lend="none", split=[1, len(whole) - 1])  # type: ignore[arg-type]
    first, second = make_prompt_cache(model), make_prompt_cache(model)
    assert [type(c) for c in first] == [type(c) for c in whole[1:]]
    assert all(a is not b for a, b in zip(first, second))
    assert [getattr(c, "max_size", None) for c in first] == [getattr(c, "max_size", None) for c in whole[1:]]
