"""Lean decoding: the last rank applies the head and samples; tokens equal single device on every rank."""

from __future__ import annotations

import pytest
from conftest import run_ranks

MAX_TOKENS = 8


@pytest.mark.parametrize(
    "arch,world_size", [("llama", 2), pytest.param("qwen3", 3, marks=pytest.mark.slow)]
)  # the suite's time budget: run with -m slow
def test_lean_decode_matches_single_device(arch: str, world_size: int) -> None:
    spec = {"arch": arch, "lengths": [1, 9, 40], "max_tokens": MAX_TOKENS}
    reports = run_ranks(world_size, "lean_decode.py", spec, timeout=180)
    for i, length in enumerate(spec["lengths"]):
        rows = [r["results"][i] for r in reports]
        for row in rows:
            assert row["lean"] == row["reference"], row
            assert len(row["lean"]) == MAX_TOKENS
            # Like mlx-lm: the prompt and every yielded token are in the cache, nothing is left in flight.
            assert row["offset"] == length + MAX_TOKENS, row
            assert row["early"] == row["reference"][:3], row  # rank 0 stopped after 3: so did every rank
        sampled = {tuple(row["sampled"]) for row in rows}
        assert len(sampled) == 1, f"ranks disagree on sampled tokens for M={length}: {sampled}"
