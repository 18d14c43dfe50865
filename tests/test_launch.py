"""The local launcher pins each rank to its own share of the CPUs (pipemlx.launch)."""

from __future__ import annotations

import os
import sys

import pytest

from pipemlx.launch import cpu_shares, launch

AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"
pinnable = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")


@pinnable
def test_shares_are_disjoint_contiguous_and_cover_every_cpu() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    for ranks in range(2, len(cpus) + 1):
        shares = cpu_shares(ranks)
        assert shares is not None and len(shares) == ranks
        assert all(shares), shares
        assert sorted(c for s in shares for c in s) == cpus
    assert cpu_shares(len(cpus) + 1) is None  # more ranks than CPUs: not pinned
    assert cpu_shares(1) is None


@pinnable
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_each_rank_runs_on_its_own_share() -> None:
    results = launch(2, [sys.executable, "-c", AFFINITY], timeout=60)
    seen = [eval(r.stdout.strip()) for r in results]
    assert [set(s) for s in seen] == cpu_shares(2)
    unpinned = launch(2, [sys.executable, "-c", AFFINITY], timeout=60, pin_cpus=False)
    assert all(eval(r.stdout.strip()) == sorted(os.sched_getaffinity(0)) for r in unpinned)
