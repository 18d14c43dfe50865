"""No wasted work in prefill: no logits are computed, on any rank of a real 2-rank group.

One chunk's logits (256 tokens x 32000 vocab x 4 bytes = 32.8 MB) dwarf everything
else this tiny model allocates during a prefill, so a peak (above the memory the
weights already hold) below that proves they were never materialised; the
control run (the sharded model called as mlx-lm calls it, its output evaluated)
shows the measurement can see them, on the same rank.
"""

from __future__ import annotations

from conftest import run_ranks

VOCAB, STEP, CHUNKS = 32000, 256, 4
LOGITS_BYTES = STEP * VOCAB * 4


def test_pipelined_prefill_computes_no_logits_on_any_rank() -> None:
    reports = run_ranks(2, "no_waste.py", {"vocab": VOCAB, "step": STEP, "chunks": CHUNKS}, timeout=240)
    for report in reports:
        assert report["control"] >= LOGITS_BYTES, f"the control should materialise one chunk's logits: {report}"
        assert report["prefill"] < LOGITS_BYTES / 2, f"prefill peaked at {report['prefill'] / 2**20:.1f} MB: {report}"
        assert report["offsets"] == [CHUNKS * STEP], report
