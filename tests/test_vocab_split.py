"""``shard_model(head="split")``: each rank holds only its rows of the embedding and the output head.

One launch per world size (2 and 3) runs every case of that size on the same group; each rank computes
single-process mlx-lm itself and reports both, so every rank's tokens are compared with mlx-lm's, and the last
rank's log-probabilities too (every rank's where a sampler or a processor runs there). The cases: tied and untied heads, plain and 4-bit; greedy, sampled (same seed), with
a logits processor, a one-token prompt, a second turn on the same cache (a reused prefix), ``share_logprobs`` (every
rank's logprobs compared); a cut inside a layer (``lend="mlp"``) on every case, and the prompt's embeddings summed in
blocks of 4 tokens; speculation (a draft model of other weights, prompt lookup: each verify pass's logits for k+1
positions from every rank's rows); ``BatchGenerator`` with requests joining while others decode, one with a logits
processor, against each request's solo mlx-lm run. Per rank the bytes of the vocabulary-sized matrices it holds are
its rows' share, to the byte; mlx-lm's own ``generate_step`` and ``stream_generate`` on the split model equal
mlx-lm's on the whole model.
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
DRAFT = {"M": 9, "max_tokens": 6, "speculate": "draft"}  # a draft model of other weights: some guesses rejected
LOOKUP = {"M": 14, "max_tokens": 6, "speculate": "lookup", "follow": 4}  # prompt_lookup=2, a second turn
# logprobs=False, greedy: after the first step each rank's best logit and its id decide the token, in the step's
# all-gather (the whole logits are never gathered); a second turn on the same cache.
LEAN = {"M": 10, "max_tokens": 6, "lean": True, "follow": 3}
STEPS: dict[str, list[dict[str, Any]]] = {
    "all": [
        GREEDY,
        {"M": 1, "max_tokens": 3},
        {"M": 21, "max_tokens": 4, "temp": 0.8, "follow": 5},
        {"M": 12, "max_tokens": 4, "processor": True},
        {"M": 6, "max_tokens": 3, "share": True},  # share_logprobs: every rank's logprobs
        DRAFT,
        LEAN,
    ],
    "greedy": [GREEDY, LEAN],
    "sampled": [GREEDY, {"M": 21, "max_tokens": 4, "temp": 0.8, "follow": 5}, DRAFT, LOOKUP],
}
# BatchGenerator on the split model: requests inserted while others decode, one with a logits processor.
BATCH = [
    {"M": 7, "max_tokens": 8, "insert_at": 0},
    {"M": 19, "max_tokens": 6, "insert_at": 2, "processor": True},
    {"M": 5, "max_tokens": 5, "insert_at": 3},
]
# name: (world size, arch, config overrides, quantized, steps, batched)
CASES: dict[str, tuple[int, str, dict[str, Any], bool, str, bool]] = {
    "S=2 qwen2 tied": (2, "qwen2", {}, False, "all", True),
    "S=2 llama untied 4-bit": (2, "llama", {}, True, "greedy", False),
    "S=3 llama untied": (3, "llama", {}, False, "sampled", False),
    "S=3 qwen3 tied 4-bit": (3, "qwen3", {}, True, "greedy", True),
}


@pytest.fixture(scope="module")
def reports() -> Callable[[str], list[dict[str, Any]]]:
    """``reports(case)``: every rank's report of that case; the first case of a world size launches all of them."""
    launched: dict[int, list[dict[str, Any]]] = {}

    def of(name: str) -> list[dict[str, Any]]:
        size = CASES[name][0]
        if size not in launched:
            cases = {
                n: {
                    "arch": arch,
                    "config": config,
                    "seed": 3 + i,
                    "quantize": quantized,
                    "steps": STEPS[steps],
                    "batch": BATCH if batched else [],
                    "lean_batch": s == 3,  # BatchGenerator(logprobs=False): greedy ticks share the split head
                }
                for i, (n, (s, arch, config, quantized, steps, batched)) in enumerate(CASES.items())
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
            # Every token's log-probabilities on the last rank; on every rank with share_logprobs, a sampler or a
            # processor (each rank's sampler and processors run on the gathered logits, as mlx-lm's would).
            # Each rank's best logit decides the token exactly when the logprobs are not wanted (and only then).
            assert step["shared_head"] == bool(step.get("lean")), where
            if step.get("lean"):
                assert step["compared"] == 0, where  # None on every rank
            elif rank == size - 1 or step.get("share") or step.get("temp") or step.get("processor"):
                assert step["compared"] == len(step["tokens"]), where
                assert step["logprob_diff"] <= 1e-5, where
            else:
                assert step["compared"] == 0, where
            assert step.get("speculated") == bool(step.get("speculate")), where  # the verify passes ran


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[5]])
def test_batched_requests_equal_mlx_lm_on_every_rank(reports: Callable[[str], list[dict[str, Any]]], name: str) -> None:
    """BatchGenerator on the split model: each request's tokens equal its solo mlx-lm run on every rank; its
    logprobs too, on the last rank for every token and on every rank for the request with a processor. At S=3 with
    ``logprobs=False``: no logprobs, and the greedy ticks decide by each rank's best logit (the shared head). Each
    with one group and again with decode groups in flight (``decode_groups=2``)."""
    found = reports(name)
    lean = CASES[name][0] == 3  # logprobs=False: every response's logprobs None, greedy ticks share the head
    for rank, case, grouped in [(rank, case, g) for rank, case in enumerate(found) for g in (False, True)]:
        batch = case["batch_groups" if grouped else "batch"]  # decode groups in flight, or one group
        assert (batch["most_groups"] >= 2) == grouped, (name, rank, batch["most_groups"])
        assert len(batch["requests"]) == len(BATCH), (name, rank)
        # Greedy ticks (request 1, with a processor, has left) decide by each rank's best logit only when lean.
        assert (batch["shared_head_ticks"] > 0) == lean, (name, rank, batch["shared_head_ticks"])
        for i, (request, got) in enumerate(zip(BATCH, batch["requests"], strict=True)):
            where = f"{name}, rank {rank}, request {i}: {got}"
            assert got["tokens"] == got["ref_tokens"] and len(got["tokens"]) == request["max_tokens"], where
            if lean:
                assert got["compared"] == 0, where
            elif rank == len(found) - 1 or request.get("processor"):
                assert got["compared"] == len(got["tokens"]) and got["logprob_diff"] <= 1e-5, where


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_rows_of_the_vocabulary(reports: Callable[[str], list[dict[str, Any]]], name: str) -> None:
    """The bytes of the embedding and head each rank holds are its rows' share of the whole model's, to the byte;
    what it holds outside the layers is what the memory model counts (``fixed_bytes(..., "split")``), within the
    final norm's bytes (whole on every rank; the model shares it with an untied head) and a row (the model shares
    bytes, the ranks whole rows)."""
    size, arch, config, quantized, _, _ = CASES[name]
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


@pytest.mark.parametrize("name", list(CASES))
def test_mlx_lm_generate_step_and_stream_generate_on_the_split_model_equal_mlx_lm(
    reports: Callable[[str], list[dict[str, Any]]], name: str
) -> None:
    """mlx-lm's own generate_step (two turns on one cache, prefilled in chunks of 4) and stream_generate called on
    the split model on every rank: each forward pass sums the embeddings and gathers the logits from every rank's
    rows, so every rank's tokens and log-probabilities equal the whole model's in one process."""
    for rank, case in enumerate(reports(name)):
        got = case["mlx_lm"]
        where = f"{name}, rank {rank}: {got}"
        assert got["tokens"] == got["ref_tokens"] and len(got["tokens"]) == 8, where
        assert got["compared"] == 8 and got["logprob_diff"] <= 1e-5, where
        assert got["stream_tokens"] == got["ref_stream_tokens"] and len(got["stream_tokens"]) == 3, where
