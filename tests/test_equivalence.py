"""Pipelined prefill + decode equal to single-device mlx-lm, on every rank.

Each rank runs the reference itself (the whole model, mlx-lm's generate_step
with the same prefill_step_size) and the pipeline, and reports both; here we
compare tokens, progress-callback sequences and cache lengths rank by rank.
"""

from __future__ import annotations

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
            assert step["progress"] == step["ref_progress"], where
            if step["kind"] == "pipeline":
                assert step["cache_offsets"] == [step["M"] - 1], where
            compared += 1
    first = reports[0]["steps"]
    for report in reports[1:]:
        assert [s.get("tokens") for s in report["steps"]] == [s.get("tokens") for s in first]
    return compared


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pipeline_matches_single_device(arch: str, num_ranks: int) -> None:
    spec = {"arch": arch, "seed": 3, "max_tokens": 6, "steps": scenario(num_ranks)}
    reports = run_ranks(num_ranks, "equivalence.py", spec, timeout=240)
    assert check_reports(reports, num_ranks) == num_ranks * (len(scenario(num_ranks)) - 1)


@pytest.mark.parametrize("split", [[1, 5], [5, 1], [4, 1, 1], [1, 1, 4]])
def test_uneven_splits_match_single_device(split: list[int]) -> None:
    steps = [{"kind": "pipeline", "M": m, "step": 4} for m in (1, 5, 23)] + [{"kind": "plain", "M": 9, "step": 4}]
    spec = {"arch": "llama", "seed": 5, "max_tokens": 5, "split": split, "steps": steps}
    reports = run_ranks(len(split), "equivalence.py", spec)
    assert check_reports(reports, len(split)) == len(split) * len(steps)
