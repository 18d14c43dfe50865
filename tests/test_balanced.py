"""split="balanced": layers in proportion to each rank's speed, measured on the group or given."""

from __future__ import annotations

import pytest
from conftest import run_ranks


def test_balanced_split_on_a_real_group() -> None:
    reports = run_ranks(2, "balanced.py", {"layers": 8, "speeds": [1, 3], "slow": 1}, timeout=120)
    speeds = reports[0]["speeds"]
    assert all(r["speeds"] == speeds for r in reports), "the ranks must agree on the speeds"
    # rank 1's measured time is multiplied by 4 (a slower machine, simulated); other jobs on a shared 2-core machine
    # take the ranks' CPU at random moments (ratios of 1.8 measured under load), so only the order is asserted
    assert speeds[0] > speeds[1], speeds
    assert all(r["measured_split"] == reports[0]["measured_split"] for r in reports)
    measured = reports[0]["measured_split"]
    assert measured[0] > measured[1] and sum(measured) == 8, measured
    assert [r["given_split"] for r in reports] == [[2, 6], [2, 6]]
    # Both splits decode as single-process mlx-lm on the whole model: tokens on every rank, logprobs on the last.
    reference = reports[0]["reference"]
    assert len(set(reference["tokens"])) > 1, reference
    for report in reports:
        assert report["reference"] == reference
        for split in ("tokens_measured", "tokens_given"):
            assert report[split]["tokens"] == reference["tokens"], (report["rank"], split)
    for split in ("tokens_measured", "tokens_given"):
        for got, expected in zip(reports[-1][split]["logprobs"], reference["logprobs"]):
            assert got == pytest.approx(expected, abs=2e-4), split
