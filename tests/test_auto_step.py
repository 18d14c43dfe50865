"""prefill_step_size="auto": every rank picks the same step, and the result equals single device at that step."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_ranks

from pipemlx.schedule.autostep import candidate_steps, choose_step
from pipemlx.schedule.costmodel import CostModel, LayerCosts


@pytest.mark.parametrize(
    "world_size", [2, pytest.param(3, marks=pytest.mark.slow)]
)  # the suite's time budget: run with -m slow
def test_auto_step_is_agreed_and_exact(world_size: int, tmp_path: Path) -> None:
    """From an empty calibration cache and with timing forbidden: the first requests plan with the prior, the
    chunks of the first long enough one refine it, and every rank ends holding the same measured cost model."""
    spec = {"lengths": [1, 50, 700], "mismatch_rank": world_size - 1, "cache_dir": str(tmp_path)}
    reports = run_ranks(world_size, "auto_step.py", spec, timeout=240)
    for i, length in enumerate(spec["lengths"]):
        steps = {r["results"][i]["step"] for r in reports}
        assert len(steps) == 1, f"ranks chose different steps for M={length}: {steps}"
        for r in reports:
            result = r["results"][i]
            assert result["tokens"] == result["reference"], result
            # auto's documented sequence: (0, M), the end of each chunk, strictly increasing, to (M-1, M)
            progress = result["progress"]
            assert progress[0] == [0, length] and progress[-1] == [max(length - 1, 0), length], result
            assert all(a[0] < b[0] for a, b in zip(progress, progress[1:])), result
            assert progress == reports[0]["results"][i]["progress"], "ranks reported different progress"
    for r in reports:
        assert not r["held_before"] and r["held"] and r["held"] == reports[0]["held"], "ranks hold different models"
        assert {"stage", "shape", "layer"} <= set(r["stored"]), r["stored"]
        assert (
            r["mismatch"] is not None
            and "ranks disagree on prefill_step_size" in r["mismatch"]
            and "auto" in r["mismatch"]
        )
        assert "ranks disagree on decode_settings" in (r["logprobs_mismatch"] or ""), r["logprobs_mismatch"]
        assert "share_logprobs=True" in r["logprobs_mismatch"] and "share_logprobs=False" in r["logprobs_mismatch"]
        assert r["after"][0] == r["after"][1] and r["after"][0], r["after"]  # the group goes on


def costs(chunk_s: float, token_s: float, collective_s: float = 2e-4) -> CostModel:
    return CostModel(LayerCosts(chunk_s, token_s, 0.0), layers=(4, 4), hidden_size=512, collective_s=collective_s)


def test_choice_follows_the_costs() -> None:
    """Dear chunks (high fixed cost) favour big steps; cheap chunks favour small steps and a small bubble."""
    big = choose_step(4096, costs(chunk_s=0.05, token_s=1e-5))
    small = choose_step(4096, costs(chunk_s=1e-6, token_s=1e-3))
    assert small < big
    assert small in candidate_steps(4096) and big in candidate_steps(4096)


def test_candidates_cover_the_single_chunk_and_bound_the_chunk_count() -> None:
    assert candidate_steps(1) == [1]
    assert candidate_steps(10) == [9]
    steps = candidate_steps(100_000)
    assert max(steps) == 99_999 and all((99_999 + s - 1) // s <= 512 for s in steps)
