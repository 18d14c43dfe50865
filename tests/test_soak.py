"""Soak: 100 consecutive requests of random length with random cancellations on one group (run by hand).

python -m pytest -m slow tests/test_soak.py -s
"""

from __future__ import annotations

import pytest
from conftest import run_ranks

REQUESTS = 100


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_soak_many_requests_with_cancellations(world_size: int) -> None:
    spec = {"requests": REQUESTS, "seed": 11, "max_tokens_in_prompt": 300, "cancel_probability": 0.3}
    reports = run_ranks(world_size, "soak.py", spec, timeout=900)
    outcomes = [[e["outcome"] for e in r["results"]] for r in reports]
    assert all(o == outcomes[0] for o in outcomes), "ranks disagree on which requests were cancelled"
    assert "WRONG" not in outcomes[0]
    for r in reports:
        assert all(e["expected"] for e in r["results"] if e["outcome"] == "cancelled"), "an unrequested cancellation"
    cancelled = outcomes[0].count("cancelled")
    assert 0 < cancelled < REQUESTS
    for r in reports:
        rss = [e["rss_mb"] for e in r["results"]]
        growth = max(rss[REQUESTS // 5 :]) - rss[REQUESTS // 5]
        print(
            f"S={world_size} rank {r['rank']}: {REQUESTS} requests in {r['seconds']:.1f} s, "
            f"{cancelled} cancelled, RSS {rss[REQUESTS // 5]:.0f} -> {rss[-1]:.0f} MB (max growth {growth:.1f} MB)"
        )
        assert growth < 50, f"RSS grew by {growth:.1f} MB after warm-up on rank {r['rank']}"
