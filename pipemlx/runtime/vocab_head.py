"""The output head cut by vocabulary among the ranks, for greedy decoding.

Decoding a token is bound by reading weights, and the output head is often
the largest matrix of all (32000 x 512 on the benchmark model: as many bytes
as five of its decoder layers), which the last rank alone applied after its
layers, while the others waited. With the head on every rank
(``shard_model``'s default ``head="all"``) and greedy decoding, every rank
can take a share: the last rank's final (normed) hidden state goes to all
ranks in a small all-gather, each rank multiplies it by its own rows of the
head, and each rank's largest logit and its vocabulary id travel in the
step's all-gather of statuses. The token is the id of the largest of those,
the lowest id on ties: what ``argmax`` over the whole vocabulary gives, since
each logit is computed from the same row of the head and the same hidden state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .waits import wait_for

SHARE_WIDTH = 2
"""What a rank adds to a decode step's share per row: its largest logit and that logit's vocabulary id."""


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the output head, and how to reach the final hidden state on the last rank.

    ``hidden(model, inputs, cache)`` runs the sharded model up to the final
    norm (the last rank's part of a forward pass, without the head); ``full``
    applies the whole head (the last rank's log-probabilities, computed only
    when read); ``project`` applies this rank's rows ``rows``. ``dtype`` is
    the dtype of the final hidden state, which travels as float32.
    """

    rows: range
    hidden_size: int
    dtype: mx.Dtype
    hidden: Callable[[nn.Module, mx.array, list[Any]], mx.array]
    project: Callable[[mx.array], mx.array]
    full: Callable[[mx.array], mx.array]

    def pairs(
        self, hidden: mx.array, group: mx.distributed.Group, timeout: float | None, describe: Callable[[], str]
    ) -> mx.array:
        """``[rows, 2]``, lazily: this rank's largest logit and its id per row, for the last rank's ``hidden``.

        ``hidden`` is ``[rows, hidden_size]``: the final hidden states on the
        last rank, zeros on the others; every rank calls this once per step,
        after its own part of the step is evaluated. The all-gather that brings
        the last rank's rows to every rank is evaluated here on its own (a
        bounded wait, ``describe()`` naming it), before any later collective is
        built on it: measured on MLX's ring backend, a graph holding two
        collectives hangs when a peer dies during the first, while a graph
        holding one fails with the lost connection.
        """
        gathered = mx.distributed.all_gather(hidden.astype(mx.float32), group=group)
        last = gathered[-hidden.shape[0] :]
        wait_for(last, timeout, describe)
        return self.best(last)

    def best(self, last: mx.array) -> mx.array:
        """``[rows, 2]``: per row, this rank's largest logit and its vocabulary id, for the final hidden states ``last``."""
        logits = self.project(last.astype(self.dtype)).astype(mx.float32)
        top = mx.max(logits, axis=-1)
        index = mx.argmax(logits, axis=-1).astype(mx.float32) + self.rows.start
        return mx.stack([top, index], axis=-1)


def pick_tokens(best: list[list[float]]) -> list[int]:
    """Each row's token from every rank's ``[largest logit, its id]`` pairs (one list per rank, rows flattened).

    The largest logit wins; on ties the lowest id, as ``argmax`` over the whole vocabulary picks.
    """
    rows = len(best[0]) // SHARE_WIDTH
    tokens: list[int] = []
    for row in range(rows):
        pairs = [(ranked[SHARE_WIDTH * row], ranked[SHARE_WIDTH * row + 1]) for ranked in best]
        top = max(value for value, _ in pairs)
        tied = [index for value, index in pairs if value == top] or [pairs[0][1]]  # none: a NaN logit
        tokens.append(int(min(tied)))
    return tokens
