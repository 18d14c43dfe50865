"""Shared helpers: run a rank program on N local ranks and collect each rank's JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pipemlx.launch import LaunchError, launch

RANKS_DIR = Path(__file__).parent / "ranks"


def run_ranks(num_ranks: int, program: str, spec: dict[str, Any], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run ``tests/ranks/<program>`` on ``num_ranks`` ranks; return each rank's last stdout line as JSON.

    Every rank is killed when one fails or ``timeout`` passes, and the test
    fails with every rank's stderr.
    """
    command = [sys.executable, str(RANKS_DIR / program), json.dumps(spec)]
    try:
        results = launch(num_ranks, command, timeout=timeout)
    except LaunchError as exc:
        pytest.fail(f"{program} on {num_ranks} ranks failed: {exc}", pytrace=False)
    reports: list[dict[str, Any]] = []
    for r in results:
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank {r.rank} printed no report; stderr:\n{r.stderr}"
        reports.append(json.loads(lines[-1]))
    return reports
