"""split="balanced": layers in proportion to each rank's speed, measured on the group or given."""

from __future__ import annotations

from conftest import run_ranks


def test_balanced_split_on_a_real_group() -> None:
    reports = run_ranks(2, "balanced.py", {"layers": 8, "speeds": [1, 3], "slow": 1}, timeout=120)
    speeds = reports[0]["speeds"]
    assert all(r["speeds"] == speeds for r in reports), "the ranks must agree on the speeds"
    assert speeds[0] > 2 * speeds[1], speeds  # rank 1 measured 4x slower (simulated)
    assert all(r["measured_split"] == reports[0]["measured_split"] for r in reports)
    measured = reports[0]["measured_split"]
    assert measured[0] > measured[1] and sum(measured) == 8, measured
    assert [r["given_split"] for r in reports] == [[2, 6], [2, 6]]
    assert reports[0]["tokens_given"] == reports[1]["tokens_given"]
    assert reports[0]["tokens_measured"] == reports[1]["tokens_measured"] == reports[0]["tokens_given"]
