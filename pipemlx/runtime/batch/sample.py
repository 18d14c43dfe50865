"""Each row's token on the last rank: its request's logits processors and sampler, dead rows left out."""

from __future__ import annotations

import mlx.core as mx

from ..sampling import Sampler, greedy, log_probabilities, processed, sample_rows
from .requests import BatchRequest


def sample(
    logits: mx.array, rows: list[BatchRequest], default: Sampler | None, skip: frozenset[int] = frozenset()
) -> tuple[mx.array, mx.array]:
    """Every row's token (``[rows]``) and the log-probabilities it was sampled from (lazy, for the responses).

    Samplers get log-probabilities, as mlx-lm's do; one batched call when every live row has the same
    (``default`` when its request has none). An all-greedy batch takes the argmax of the logits instead: the
    same tokens, and the vocabulary-wide ``logsumexp`` is computed only if a response's ``logprobs`` is read.
    Dead rows (their tokens are ignored, 0) are left out of every sampler call: a sampler may keep state (a
    seeded request's random key), so it sees exactly the rows it would see without them. So are the requests of
    ``skip`` (uids), rows that fail in the next tick (a rank before the last whose sampling of them raised).
    """
    logits = _processed(logits, rows, skip)
    logprobs = log_probabilities(logits)
    live = [i for i, r in enumerate(rows) if not r.done and r.uid not in skip]
    samplers = [rows[i].sampler or default for i in live]
    if all(s is None for s in samplers):
        return greedy(logits), logprobs
    if len(live) == len(rows):
        return sample_rows(logprobs, samplers), logprobs
    index = mx.array(live)
    sampled = sample_rows(logprobs[index], samplers)
    tokens = mx.zeros((len(rows),), dtype=sampled.dtype)
    tokens[index] = sampled
    return tokens, logprobs


def all_greedy(rows: list[BatchRequest], default: Sampler | None) -> bool:
    """Whether there are rows and every live one samples greedily, with no logits processors (the output head may
    then be shared)."""
    return bool(rows) and all((r.sampler or default) is None and not r.processors for r in rows if not r.done)


def _processed(logits: mx.array, rows: list[BatchRequest], skip: frozenset[int]) -> mx.array:
    """``logits`` with each live row's processors applied to its row, one row at a time as mlx-lm's
    ``BatchGenerator`` does (the rows without any, or skipped: as they are)."""
    if not any(r.processors and not r.done and r.uid not in skip for r in rows):
        return logits
    return mx.concatenate(
        [
            processed(logits[i : i + 1], mx.array(r.context), r.processors)
            if r.processors and not r.done and r.uid not in skip
            else logits[i : i + 1]
            for i, r in enumerate(rows)
        ],
        axis=0,
    )
