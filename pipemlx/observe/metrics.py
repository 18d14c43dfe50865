"""The figures pipemlx reports, each defined once.

``pipemlx generate``, ``pipemlx bench``, ``benchmarks/ranks/bench_rank.py`` and the
docs all use these definitions. For a prompt of ``M`` tokens:

- **prefill time** (``prefill_s``): seconds from the start of the request (the
  call of :func:`pipemlx.pipeline_prefill`, or of mlx-lm's ``generate_step`` in
  one process) until the cache holds the prompt's first ``M - 1`` positions: the
  moment ``pipeline_prefill`` returns, and the moment mlx-lm's progress callback
  reports ``(M - 1, M)`` (:class:`PrefillClock` notes it). The last prompt token
  is not part of the prefill: it goes through the model in the first decode
  step, the one that produces the first token.
- **prefill tokens/s** (:func:`prefill_tokens_per_s`) and **decode tokens/s**
  (:func:`decode_tokens_per_s`): the first decode step, from the end of the
  prefill to the first token, counts in neither figure.

Pure Python: no MLX.
"""

from __future__ import annotations

import time


def prefill_positions(prompt_tokens: int) -> int:
    """Prompt positions a prefill puts in the cache: all but the last token (which decoding starts from)."""
    return max(prompt_tokens - 1, 0)


def prefill_tokens_per_s(prompt_tokens: int, prefill_s: float) -> float:
    """Prefill tokens/s: :func:`prefill_positions` over the prefill time (0 when no time passed)."""
    return prefill_positions(prompt_tokens) / prefill_s if prefill_s > 0 else 0.0


def decode_tokens_per_s(generated: int, first_to_last_s: float) -> float:
    """Decode tokens/s: the ``generated - 1`` tokens after the first, over the seconds from the first to the last."""
    return (generated - 1) / first_to_last_s if generated > 1 and first_to_last_s > 0 else 0.0


class PrefillClock:
    """A progress callback (``callback(processed, total)``) that notes when the prefill ends.

    For mlx-lm's ``generate_step`` in one process, whose prefill ends when it
    reports ``(M - 1, M)``; :attr:`seconds` is the prefill time counted from
    ``start`` (a :func:`time.perf_counter` reading).
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.end: float | None = None

    def __call__(self, processed: int, total: int) -> None:
        if self.end is None and processed >= total - 1:
            self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        """The prefill time; raises ``RuntimeError`` before the prefill has ended."""
        if self.end is None:
            raise RuntimeError("the prefill has not ended: no (M - 1, M) progress report yet")
        return self.end - self.start
