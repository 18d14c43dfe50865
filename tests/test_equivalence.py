"""Pipelined prefill + decode equal to single-device mlx-lm, on every rank.

Each rank runs the reference itself (the whole model, mlx-lm's generate_step
with the same prefill_step_size) and the pipeline, and reports both; here we
compare tokens, progress-callback sequences and cache lengths rank by rank.

One launch per world size runs every case of that size (each architecture, each uneven split), one after
the other on the same group; each case is then its own test, checked on its own reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import run_ranks

STEP = 8
# 1 and 2 tokens, step-1, step, step+1 (as prompt lengths), many chunks, fewer chunks than ranks.
PROMPT_LENGTHS = [1, 2, STEP - 1, STEP, STEP + 1, STEP + 2, 2 * STEP + 1, 6 * STEP + 3]


def scenario(num_ranks: int) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"kind": "plain", "M": 12, "step": 4}]
    steps += [{"kind": "pipeline", "M": m, "step": STEP} for m in PROMPT_LENGTHS]
    steps += [
        {"kind": "pipeline", "M": 6, "step": 1},
        {"kind": "pipeline", "M": 30, "step": 64},
        {"kind": "plain", "M": 12, "step": 4},
        {"kind": "queue_exception"},
        {"kind": "plain", "M": 20, "step": 8},
    ]
    if num_ranks == 2:  # the default step too ("auto": calibrated once per architecture, then cached)
        steps.append({"kind": "auto", "M": 40})
    return steps


def check_reports(reports: list[dict[str, Any]], num_ranks: int) -> int:
    """Assert every rank matched the reference; return the number of comparisons made."""
    assert [r["rank"] for r in reports] == list(range(num_ranks))
    compared = 0
    for report in reports:
        for step in report["steps"]:
            where = f"rank {report['rank']}/{num_ranks}, {step}"
            if step["kind"] == "queue_exception":
                assert step["mode_after"] == "immediate", where
                assert step["queued_after"] == 0, where
                is_last = report["rank"] == num_ranks - 1
                assert step["queued_inside"] == (0 if is_last else 1), where
                continue
            assert step["tokens"] == step["ref_tokens"], where
            # logprobs: the last rank has every token's (pipemlx.generate_step gives them there only), each within
            # 1e-4 of the reference's, on every rank that has them
            if report["rank"] == num_ranks - 1:
                assert step["logprobs_compared"] == len(step["tokens"]) > 0, where
            if step["logprobs_compared"]:
                assert step["logprob_diff"] <= 1e-4, where
            if step["kind"] == "auto":  # its own cut: (0, M), each chunk's end, strictly increasing, to M-1
                ends = [p for p, _ in step["progress"]]
                assert ends[0] == 0 and ends[-1] == step["M"] - 1 and ends == sorted(set(ends)), where
                compared += 1
                continue
            assert step["progress"] == step["ref_progress"], where
            if step["kind"] == "pipeline":
                assert step["cache_offsets"] == [step["M"] - 1], where
            compared += 1
    first = reports[0]["steps"]
    for report in reports[1:]:
        assert [s.get("tokens") for s in report["steps"]] == [s.get("tokens") for s in first]
    return compared


ARCHS = ["llama", "qwen3"]
SPLITS = [[1, 5], [5, 1], [4, 1, 1], [1, 1, 4]]
UNEVEN_STEPS: list[dict[str, Any]] = [{"kind": "pipeline", "M": m, "step": 4} for m in (1, 5, 23)]
UNEVEN_STEPS.append({"kind": "plain", "M": 9, "step": 4})


# shard_model(lend="mlp"): each rank's last layer's feed-forward half runs on the next rank. Sliding layers
# (llama_swa: each layer picks its mask by its use_sliding attribute), a rank of one layer that both borrows and
# lends ([2, 1, 3]), a last rank of one layer ([2, 2, 1]).
LENT = [("llama_swa", [2, 4]), ("qwen3", [3, 3]), ("llama", [2, 1, 3]), ("qwen2", [2, 2, 1])]


# shard_model(lend=1): one of the tiny models' two key-value heads moves too (the
# rank after the cut keeps its cache in a CacheList), with pipemlx's and mlx-lm's decoding and auto's cut.
LENT_HEADS = [("llama", [3, 3]), ("qwen3", [2, 1, 3]), ("qwen2", [2, 2, 1])]
LENT_HEADS_STEPS: list[dict[str, Any]] = [
    *UNEVEN_STEPS,
    {"kind": "pipemlx", "M": 14, "step": 4},
    {"kind": "auto", "M": 40},
]


# The same cut with quantized and with bounded caches (the lent heads' cache quantizes and rotates with the
# layer's own): head size 32, so that kv_group_size 32 divides it. (Not llama: its Model has a make_cache, so
# mlx-lm does not bound its caches.)
LENT_HEADS_KV = [("qwen2", [3, 2]), ("qwen3", [2, 1, 3])]
QUANTIZED_4 = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 6}  # after the second chunk
LENT_HEADS_KV_STEPS: list[dict[str, Any]] = [
    {"kind": "pipemlx", "M": 23, "step": 4, "args": QUANTIZED_4},
    {"kind": "plain", "M": 18, "step": 5, "args": {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}},
    {"kind": "pipemlx", "M": 20, "step": 4, "args": {"max_kv_size": 8}},  # the caches rotate in the prefill
    {"kind": "pipemlx", "M": 7, "step": 3, "args": {"max_kv_size": 9}},  # and while decoding
]


# lend="auto" (the default, given here on splits where it has a choice): the ranks time a layer, agree on the count, and compute single-device mlx-lm's tokens.
LENT_HEADS_AUTO = [("llama", [3, 3]), ("qwen3", [2, 2, 2])]
# The same with the layer's costs given (chunk_s, token_s, attention_s) instead of timed, so that the count is known:
# a layer whose cost is all per token gains nothing from moving attention heads (each lent head only widens the
# messages): 0; one whose cost is mostly attention (query-key pairs) moves one of its 2 heads to balance: 1.
LENT_HEADS_GIVEN_COSTS = [("tokens only", [0.0, 1e-5, 0.0], 0), ("mostly attention", [0.0, 1e-6, 1e-5], 1)]


def cases_of_size(num_ranks: int) -> dict[str, dict[str, Any]]:
    """Every case that runs on ``num_ranks`` ranks, by name: the architectures, then the uneven splits."""
    cases = {
        arch: {"arch": arch, "seed": 3, "max_tokens": 6, "steps": scenario(num_ranks)}
        for arch, n in FULL_SCENARIOS
        if n == num_ranks
    }
    for split in SPLITS:
        if len(split) == num_ranks:
            cases[f"split {split}"] = {
                "arch": "llama",
                "seed": 5,
                "max_tokens": 5,
                "split": split,
                "steps": UNEVEN_STEPS,
            }
    wide = {"hidden_size": 128}  # head size 32 (qwen3 sets its own)
    lent: list[tuple[str, str, list[int], int | str, list[dict[str, Any]], int, dict[str, Any]]] = [
        *(("lent", arch, split, "mlp", UNEVEN_STEPS, 7, {}) for arch, split in LENT),
        *(("lent heads", arch, split, 1, LENT_HEADS_STEPS, 9, {}) for arch, split in LENT_HEADS),
        *(("lent heads auto", arch, split, "auto", UNEVEN_STEPS, 13, {}) for arch, split in LENT_HEADS_AUTO),
        *(
            (
                "lent heads kv",
                arch,
                split,
                1,
                LENT_HEADS_KV_STEPS,
                11,
                {**wide, "head_dim": 32} if arch == "qwen3" else wide,
            )
            for arch, split in LENT_HEADS_KV
        ),
    ]
    if num_ranks == 2:
        for name, costs, _ in LENT_HEADS_GIVEN_COSTS:
            cases[f"lent heads auto, {name}"] = {
                "arch": "llama",
                "seed": 13,
                "max_tokens": 5,
                "split": [3, 3],
                "lend": "auto",
                "layer_costs": costs,
                "steps": UNEVEN_STEPS,
            }
    for kind, arch, split, heads, steps, seed, config in lent:
        if len(split) == num_ranks:
            cases[f"{kind} {arch} {split}"] = {
                "arch": arch,
                "config": config,
                "seed": seed,
                "max_tokens": 5,
                "split": split,
                "lend": heads,
                "steps": steps,
            }
    return cases


@pytest.fixture(scope="module")
def case_reports() -> Callable[[int, str], list[dict[str, Any]]]:
    """``case_reports(S, name)``: every rank's report of that case; the first call for S launches all its cases."""
    launched: dict[int, list[dict[str, Any]]] = {}

    def reports(num_ranks: int, name: str) -> list[dict[str, Any]]:
        if num_ranks not in launched:
            spec = {"cases": cases_of_size(num_ranks)}
            launched[num_ranks] = run_ranks(num_ranks, "equivalence.py", spec, timeout=480)
        return [{"rank": r["rank"], "steps": r["cases"][name]} for r in launched[num_ranks]]

    return reports


# Every architecture at S=2 and 3; at S=4 (middle ranks receiving and sending) llama only, for CI time.
FULL_SCENARIOS = [(arch, n) for n in (2, 3) for arch in ARCHS] + [("llama", 4)]


@pytest.mark.parametrize(  # S=4 runs with -m slow (the suite's time budget)
    "arch,num_ranks", [pytest.param(*s, marks=pytest.mark.slow) if s[1] == 4 else s for s in FULL_SCENARIOS]
)
def test_pipeline_matches_single_device(
    case_reports: Callable[[int, str], list[dict[str, Any]]], arch: str, num_ranks: int
) -> None:
    reports = case_reports(num_ranks, arch)
    assert check_reports(reports, num_ranks) == num_ranks * (len(scenario(num_ranks)) - 1)


@pytest.mark.parametrize("split", SPLITS)
def test_uneven_splits_match_single_device(
    case_reports: Callable[[int, str], list[dict[str, Any]]], split: list[int]
) -> None:
    reports = case_reports(len(split), f"split {split}")
    assert check_reports(reports, len(split)) == len(split) * len(UNEVEN_STEPS)


@pytest.mark.parametrize("arch,split", LENT)
def test_cuts_inside_a_layer_match_single_device(
    case_reports: Callable[[int, str], list[dict[str, Any]]], arch: str, split: list[int]
) -> None:
    reports = case_reports(len(split), f"lent {arch} {split}")
    assert check_reports(reports, len(split)) == len(split) * len(UNEVEN_STEPS)


@pytest.mark.parametrize("arch,split", LENT_HEADS)
def test_lent_heads_match_single_device(
    case_reports: Callable[[int, str], list[dict[str, Any]]], arch: str, split: list[int]
) -> None:
    reports = case_reports(len(split), f"lent heads {arch} {split}")
    assert check_reports(reports, len(split)) == len(split) * len(LENT_HEADS_STEPS)


@pytest.mark.parametrize("arch,split", LENT_HEADS_KV)
def test_lent_heads_with_quantized_or_bounded_caches_match_single_device(
    case_reports: Callable[[int, str], list[dict[str, Any]]], arch: str, split: list[int]
) -> None:
    reports = case_reports(len(split), f"lent heads kv {arch} {split}")
    assert check_reports(reports, len(split)) == len(split) * len(LENT_HEADS_KV_STEPS)


@pytest.mark.parametrize("arch,split", LENT_HEADS_AUTO)
def test_lend_auto_agrees_on_a_count_and_matches_single_device(
    case_reports: Callable[[int, str], list[dict[str, Any]]], arch: str, split: list[int]
) -> None:
    reports = case_reports(len(split), f"lent heads auto {arch} {split}")
    assert check_reports(reports, len(split)) == len(split) * len(UNEVEN_STEPS)
    counts = {step["lent_heads"] for report in reports for step in report["steps"]}
    assert len(counts) == 1, counts  # timed on each rank, agreed: the count depends on the machine's load


@pytest.mark.parametrize("name,costs,expected", LENT_HEADS_GIVEN_COSTS)
def test_lend_heads_auto_picks_the_count_the_layer_costs_call_for(
    case_reports: Callable[[int, str], list[dict[str, Any]]], name: str, costs: list[float], expected: int
) -> None:
    reports = case_reports(2, f"lent heads auto, {name}")
    assert check_reports(reports, 2) == 2 * len(UNEVEN_STEPS)
    assert [step["lent_heads"] for report in reports for step in report["steps"]] == [expected] * (
        2 * len(UNEVEN_STEPS)
    )
