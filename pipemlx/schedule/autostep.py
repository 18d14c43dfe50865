"""``step_size="auto"``: the chunk size the cost model expects to prefill fastest on this group.

The ranks first agree on a :class:`~pipemlx.schedule.costmodel.CostModel`
(measured on the group by :func:`pipemlx.runtime.calibrate.calibrate`). The
step is then the candidate whose simulated prefill
(:func:`pipemlx.schedule.costmodel.predict`: the real plans, per-chunk compute
growing with position, the S-1 bubble, per-message and per-agreement costs) is
shortest. Pure Python: no MLX; every rank derives the very same step from the
very same cost model.
"""

from __future__ import annotations

import math

from .costmodel import CostModel, predict

CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Powers of two: BLAS kernels run some odd chunk lengths markedly slower than the cost model's
linear per-token cost says (measured: 192 slower than 256 per token here)."""
MAX_CHUNKS = 512
"""Candidates that would cut the prompt into more chunks than this are not simulated."""


class AutoRequest:
    """What ranks compare in the handshake before an auto step is chosen: the prompt length, step 0."""

    step_size = 0

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def fingerprint(self) -> int:
        return 0


def candidate_steps(num_tokens: int) -> list[int]:
    """Steps worth simulating for a prompt of ``num_tokens``: the whole prefill in one chunk, and
    :data:`CANDIDATES` that give at most :data:`MAX_CHUNKS` chunks."""
    prefill = max(1, num_tokens - 1)
    steps = {prefill} | {c for c in CANDIDATES if c < prefill and math.ceil(prefill / c) <= MAX_CHUNKS}
    return sorted(steps)


def choose_step(num_tokens: int, costs: CostModel) -> int:
    """The candidate step with the shortest predicted prefill; the larger step on a tie."""
    timed = [(predict(num_tokens, step, costs).prefill_s, -step) for step in candidate_steps(num_tokens)]
    return -min(timed)[1]
