"""Shared helpers: run a rank program on N local ranks and collect each rank's JSON report."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipemlx.launch import LaunchError, launch
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE

RANKS_DIR = Path(__file__).parent / "ranks"


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One calibration cache for the whole session (the rank programs inherit it): "auto" (the default step and
    lending) calibrates once per configuration, not once per test, and nothing is written to the user's cache."""
    folder = tmp_path_factory.mktemp("calibration-cache")
    previous = os.environ.get(CACHE_DIR_VARIABLE)
    os.environ[CACHE_DIR_VARIABLE] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(CACHE_DIR_VARIABLE, None)
    else:
        os.environ[CACHE_DIR_VARIABLE] = previous


def run_ranks(
    num_ranks: int,
    program: str,
    spec: dict[str, Any],
    timeout: float = 120.0,
    expect_exit: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Run ``tests/ranks/<program>`` on ``num_ranks`` ranks; return each rank's last stdout line as JSON.

    Every rank is killed when one fails or ``timeout`` passes, and the test
    fails with every rank's stderr. ``expect_exit`` maps ranks that are meant
    to die (fault injection) to their exit status: then no rank is killed
    early, those ranks' statuses are checked and they owe no report (``{}``).
    """
    command = [sys.executable, str(RANKS_DIR / program), json.dumps(spec)]
    expected = expect_exit or {}
    try:
        results = launch(num_ranks, command, timeout=timeout, fail_fast=not expected)
    except LaunchError as exc:
        pytest.fail(f"{program} on {num_ranks} ranks failed: {exc}", pytrace=False)
    reports: list[dict[str, Any]] = []
    for r in results:
        if r.rank in expected:
            assert r.returncode == expected[r.rank], f"rank {r.rank} exited {r.returncode}; stderr:\n{r.stderr}"
            reports.append({})
            continue
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}; stderr:\n{r.stderr[-4000:]}"
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank {r.rank} printed no report; stderr:\n{r.stderr}"
        reports.append(json.loads(lines[-1]))
    return reports
