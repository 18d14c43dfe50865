"""``shard_model(head="split")``: each rank holds only its rows of the embedding and the output head.

One launch per world size (2 and 3) runs every case of that size on the same group; each rank computes
single-process mlx-lm itself and reports both, so every rank's tokens are compared with mlx-lm's, and the last
rank's log-probabilities too. The cases: tied and untied heads, plain and 4-bit; greedy, sampled (same seed), with
a logits processor, a one-token prompt, a second turn on the same cache (a reused prefix), ``share_logprobs`` (every
rank's logprobs compared); a cut inside a layer (``lend="mlp"``) on every case, and the prompt's embeddings summed in
blocks of 4 tokens. Per rank the bytes of
the vocabulary-sized matrices it holds are its rows' share, to the byte; mlx-lm's own ``generate_step``,
``BatchGenerator`` and a draft model are refused with errors that name ``head='split'``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn
import pytest
from conftest import run_ranks

from pipemlx.models.parameters import model_bytes_from_model
from pipemlx.models.vocab_head import row_range
from pipemlx.schedule.memory_model import fixed_bytes
from pipemlx.testing import build_model, tiny_config

GREEDY = {"M": 9, "max_tokens": 5}
STEPS: dict[str, list[dict[str, Any]]] = {
    "all": [
        GREEDY,
        {"M": 1, "max_tokens": 3},
        {"M": 21, "max_tokens": 4, "temp": 0.8, "follow": 5},
        {"M": 12, "max_tokens": 4, "processor": True},
        {"M": 6, "max_tokens": 3, "share": True},  # share_logprobs: every rank's logprobs
    ],
    "greedy": [GREEDY],
    "sampled": [GREEDY, {"M": 21, "max_tokens": 4, "temp": 0.8, "follow": 5}],
}
# name: (world size, arch, config overrides, quantized, steps)
CASES: dict[str, tuple[int, str, dict[str, Any], bool, str]] = {
    "S=2 qwen2 tied": (2, "qwen2", {}, False, "all"),
    "S=2 llama untied 4-bit": (2, "llama", {}, True, "greedy"),
    "S=3 llama untied": (3, "llama", {}, False, "sampled"),
    "S=3 qwen3 tied 4-bit": (3, "qwen3", {}, True, "greedy"),
}


@pytest.fixture(scope="module")
def reports() -> Callable[[str], list[dict[str, Any]]]:
    """``reports(case)``: every rank's report of that case; the first case of a world size launches all of them."""
    launched: dict[int, list[dict[str, Any]]] = {}

    def of(name: str) -> list[dict[str, Any]]:
        size = CASES[name][0]
        if size not in launched:
            cases = {
                n: {"arch": arch, "config": config, "seed": 3 + i, "quantize": quantized, "steps": STEPS[steps]}
                for i, (n, (s, arch, config, quantized, steps)) in enumerate(CASES.items())
                if s == size
            }
            launched[size] = run_ranks(size, "vocab_split.py", {"cases": cases}, timeout=300)
        return [r["cases"][name] for r in launched[size]]

    return of


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_and_logprobs_equal_mlx_lm(reports: Callable[[str], list[dict[str, Any]]], name: str) -> None:
    found = reports(name)
    size = CASES[name][0]
    for rank, case in enumerate(found):
        for step in case["steps"]:
            where = f"{name}, rank {rank}: {step}"
            assert step["tokens"] == step["ref_tokens"] and step["tokens"], where
            if rank == size - 1 or step.get("share"):  # every token's log-probabilities, on the last rank
                assert step["compared"] == len(step["tokens"]), where
                assert step["logprob_diff"] <= 1e-5, where
            else:
                assert step["compared"] == 0, where


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_rows_of_the_vocabulary(reports: Callable[[str], list[dict[str, Any]]], name: str) -> None:
    """The bytes of the embedding and head each rank holds are its rows' share of the whole model's, to the byte;
    what it holds outside the layers is what the memory model counts (``fixed_bytes(..., "split")``), within the
    final norm's bytes (whole on every rank; the model shares it with an untied head) and a row (the model shares
    bytes, the ranks whole rows)."""
    size, arch, config, quantized, _ = CASES[name]
    full = tiny_config(arch, **config)
    vocab, tied = full["vocab_size"], full["tie_word_embeddings"]
    model: Any = build_model(full)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    planned = model_bytes_from_model(model, model.model, model.layers)
    norm = model.model.norm.weight.nbytes
    found = reports(name)
    whole = found[0]["whole_vocab_bytes"]
    assert whole["embedding"] == planned.embedding and (whole["head"] == 0) == tied
    for rank, case in enumerate(found):
        rows = len(row_range(vocab, rank, size))
        assert case["vocab_bytes"]["embedding"] * vocab == whole["embedding"] * rows, (name, rank)
        assert case["vocab_bytes"]["head"] * vocab == whole["head"] * rows, (name, rank)
        assert case["outside_layers"] == sum(case["vocab_bytes"].values()) + norm, (name, rank)
        row = (whole["embedding"] + whole["head"]) // vocab  # the model shares bytes, the ranks whole rows
        assert abs(fixed_bytes(planned, rank, size, "split") - case["outside_layers"]) <= norm + row, (name, rank)
    assert sum(c["vocab_bytes"]["embedding"] for c in found) == whole["embedding"]
    assert sum(c["vocab_bytes"]["head"] for c in found) == whole["head"]


@pytest.mark.parametrize("name", ["S=2 qwen2 tied", "S=3 llama untied"])
def test_refused_combinations_name_the_split(reports: Callable[[str], list[dict[str, Any]]], name: str) -> None:
    for rank, case in enumerate(reports(name)):
        for key in ("mlx_lm_refused", "batch_refused", "draft_refused"):
            assert "head='split'" in case[key], (name, rank, key, case[key])
