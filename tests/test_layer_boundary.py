"""boundary="attention": rank boundaries inside a decoder layer give single-device mlx-lm's tokens.

One launch per S runs every family that supports it (tests/ranks/arch_equivalence.py): pipelined prefill
+ pipemlx's decode, and plain mlx-lm generate_step on the sharded model, against one process.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import run_ranks
from fakes import FakeGroup

import pipemlx
from pipemlx.errors import PipelineError
from pipemlx.models.layer_parts import AttentionPart, MlpThenLayer, check_cut
from pipemlx.testing import build_model, tiny_config

# arch -> split per world size (None: even).
FAMILIES: dict[str, dict[int, list[int] | None]] = {
    "llama": {2: None, 3: [1, 2, 3]},
    "llama_swa": {2: [2, 4], 3: None},  # sliding and full layers on both sides of a cut
    "qwen2": {2: None, 3: None},
    "qwen3": {2: [3, 3], 3: [2, 1, 3]},
    "phi3": {2: None, 3: None},
}
SPEC = {"seed": 5, "max_tokens": 5, "prompts": [[1, 4], [9, 4], [23, 4]], "plain": [11, 4]}
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for size in (2, 3):
        archs = [{"arch": a, "split": s[size], "boundary": "attention"} for a, s in FAMILIES.items()]
        out[size] = run_ranks(size, "arch_equivalence.py", {**SPEC, "archs": archs}, timeout=600)
    return out


@pytest.mark.parametrize("size", (2, 3))
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_cut_layers_match_single_device(reports: dict[int, list[dict[str, Any]]], arch: str, size: int) -> None:
    first: list[list[int]] | None = None
    for report in reports[size]:
        (entry,) = [a for a in report["archs"] if a["arch"] == arch]
        rank = report["rank"]
        where = f"{arch} rank {rank}/{size} split {entry['split']}"
        classes = entry["layer_classes"]
        assert ("MlpThenLayer" in classes[0]) == (rank > 0), f"{where}: {classes}"
        assert ("AttentionPart" in classes[-1]) == (rank < size - 1), f"{where}: {classes}"
        assert sum("AttentionPart" in c or "MlpThenLayer" in c for c in classes[1:-1]) == 0, f"{where}: {classes}"
        assert entry["cache_kinds"] == entry["reference_cache_kinds"], where
        for run in entry["runs"]:
            assert run["tokens"] == run["ref_tokens"], f"{where}: {run}"
            assert len(run["tokens"]) == SPEC["max_tokens"], f"{where}: {run}"
            assert run["logprob_diff"] <= LOGPROB_TOLERANCE, f"{where}: {run}"
            if run["kind"] == "pipeline" and run["offsets"]:
                assert run["offsets"] == [run["M"] - 1], f"{where}: {run}"
        tokens = [run["tokens"] for run in entry["runs"]]
        first = first or tokens
        assert tokens == first, f"{where}: ranks disagree"
        assert len({t for run in entry["runs"] for t in run["ref_tokens"]}) > 3, where


def test_each_rank_keeps_only_its_part_of_the_cut_layer() -> None:
    config = tiny_config("qwen2")
    first = pipemlx.shard_model(build_model(config, seed=0), FakeGroup(0, 2), boundary="attention")
    second = pipemlx.shard_model(build_model(config, seed=0), FakeGroup(1, 2), boundary="attention")
    cut = first.layers[-1]
    assert isinstance(cut, AttentionPart)
    assert "mlp" not in cut.layer and "self_attn" in cut.layer
    head = second.layers[0]
    assert isinstance(head, MlpThenLayer)
    assert "self_attn" not in head.previous and "mlp" in head.previous
    assert len(first.layers) + len(second.layers) == config["num_hidden_layers"]


def test_families_without_a_plain_block_are_refused() -> None:
    with pytest.raises(PipelineError, match="boundary='attention' is not available for mlx_lm.models.gemma2"):
        pipemlx.shard_model(build_model(tiny_config("gemma2"), seed=0), FakeGroup(0, 2), boundary="attention")
    with pytest.raises(ValueError, match="boundary must be one of"):
        pipemlx.shard_model(build_model(tiny_config("qwen2"), seed=0), FakeGroup(0, 2), boundary="mlp")  # pyright: ignore[reportArgumentType]


def test_a_layer_that_is_not_attention_then_mlp_is_refused() -> None:
    """The check runs the layer: a block computing anything else (here: MLP on the input) fails it."""
    layer: Any = build_model(tiny_config("qwen2"), seed=0).layers[0]

    class Parallel(type(layer)):  # type: ignore[misc]
        def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
            return x + self.self_attn(self.input_layernorm(x), mask, cache) + self.mlp(self.input_layernorm(x))

    layer.__class__ = Parallel
    with pytest.raises(PipelineError, match="cannot cut it"):
        check_cut(layer)
