"""The work of a generator's ticks, counted as mlx-lm's ``BatchGenerator`` counts its own."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import asdict

from mlx_lm.generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats


class Counters(BatchCounters):
    """mlx-lm's counters, added to once per tick."""

    def count(self, prefilled: int, generated: int, seconds: float) -> None:
        """Add a tick that prefilled ``prefilled`` prompt positions and returned ``generated`` tokens: its time is
        decode time when it returned any (a tick computes a decode step and prefill chunks at once)."""
        self.prompt_tokens += prefilled
        if generated:
            self.generation_tokens += generated
            self.generation_steps += 1
            self.decode_time += seconds
        else:
            self.prompt_time += seconds

    @contextlib.contextmanager
    def stats(self) -> Generator[BatchStats]:
        """mlx-lm's ``BatchStats`` of the work counted while the block runs, filled in on leaving it."""
        stats = BatchStats()
        start = BatchCountersSnapshot(**asdict(self))
        try:
            yield stats
        finally:
            stats += BatchCountersSnapshot.between(start, BatchCountersSnapshot(**asdict(self)))
