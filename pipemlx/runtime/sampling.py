"""Choosing tokens: greedy picking, samplers, logits processors, and the output head shared for greedy decodes.

Used alike by :func:`pipemlx.generate_step` (one row) and the ticks of
:class:`pipemlx.BatchGenerator` (a row per request).

The shared head. Decoding a token is bound by reading weights, and the output
head can be the largest matrix of all; applied by the last rank alone, it
makes the other ranks wait. With the head on every rank
(``shard_model``'s default ``head="all"``) and greedy decoding, every rank
can take a share: the last rank's final (normed) hidden state goes to all
ranks in a small all-gather, each rank multiplies it by its own rows of the
head, and each rank's largest logit and its vocabulary id travel in the
step's all-gather of statuses. The token is the id of the largest of those,
the lowest id on ties: what ``argmax`` over the whole vocabulary gives, since
each logit is computed from the same row of the head and the same hidden state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .waits import wait_for

Sampler = Callable[[mx.array], mx.array]
"""mlx-lm's sampler: log-probabilities ``[rows, vocabulary]`` to token ids."""
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's logits processor: ``(tokens so far, logits) -> logits``."""

EMBED_BLOCK = 1024  # head="split": prompt tokens whose embeddings one all-sum carries
SHARE_WIDTH = 2  # what a rank adds to a decode step's share per row: its largest logit and that logit's vocabulary id


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
    full: Callable[[mx.array], mx.array] | None
    sum_rows: Callable[[mx.array, mx.distributed.Group], mx.array] | None = None
    """``head="split"`` (each rank holds only these rows of the head and of the embedding): the embeddings of
    the tokens given, summed from every rank's rows (a collective; ``None``: the head is whole)."""
    keep: Callable[[mx.array, mx.array], None] | None = None
    """``head="split"``: hands tokens and their embeddings to rank 0's embedding for its next forward passes."""
    vocab: int = 0  # the whole vocabulary (head="split"), which the ranks' rows cover

    @property
    def split(self) -> bool:
        """Whether each rank holds only its rows (``head="split"``): no rank can apply the whole head."""
        return self.sum_rows is not None

    def pairs(
        self, hidden: mx.array, group: mx.distributed.Group, timeout: float | None, describe: Callable[[], str]
    ) -> mx.array:
        """``[rows, 2]``, lazily: this rank's largest logit and its id per row, for the last rank's ``hidden``.

        The all-gather that brings the last rank's rows to every rank is
        evaluated here on its own (a bounded wait, ``describe()`` naming it),
        before any later collective is built on it: on MLX's ring backend a
        graph holding two collectives hangs when a peer dies during the first,
        while a graph holding one fails with the lost connection.
        """
        gathered = mx.distributed.all_gather(hidden.astype(mx.float32), group=group)
        last = gathered[-hidden.shape[0] :]
        wait_for(last, timeout, describe)
        return self.best(last)

    def embed(
        self, tokens: mx.array, group: mx.distributed.Group, timeout: float | None, describe: Callable[[], str]
    ) -> None:
        """``head="split"``: every rank's rows of ``tokens``' embeddings summed, left with rank 0's embedding for its
        next forward passes over them; a collective, waited for here (bounded), in blocks of
        :data:`EMBED_BLOCK` tokens so that the other ranks never hold a long prompt's embeddings whole."""
        assert self.sum_rows is not None and self.keep is not None
        tokens = mx.reshape(tokens, (-1,))
        blocks: list[mx.array] = []  # rank 0's: the others drop each block once summed
        for start in range(0, tokens.size, EMBED_BLOCK):
            summed = self.sum_rows(tokens[start : start + EMBED_BLOCK], group)
            wait_for(summed, timeout, describe)
            if group.rank() == 0:
                blocks.append(summed)
        if blocks:
            self.keep(tokens, blocks[0] if len(blocks) == 1 else mx.concatenate(blocks))

    def logits(
        self,
        hidden: mx.array,
        group: mx.distributed.Group,
        timeout: float | None,
        describe: Callable[[], str],
    ) -> mx.array:
        """``[rows, vocabulary]``: the whole head's logits for the last rank's final hidden states ``hidden``.

        ``head="split"``: the hidden states reach every rank (an all-gather), each projects its rows, and a second
        all-gather of the slices (padded to one width) gives every rank the whole logits, in the head's dtype:
        each logit is computed from the same row and hidden state as one process computes it.
        """
        world = group.size()
        gathered = mx.distributed.all_gather(hidden.astype(mx.float32), group=group)
        last = gathered[-hidden.shape[0] :]
        wait_for(last, timeout, describe)
        local = self.project(last.astype(self.dtype))
        dtype = local.dtype
        width = -(-self.vocab // world)
        padded = mx.pad(local.astype(mx.float32), [(0, 0), (0, width - local.shape[-1])])
        everyone = mx.distributed.all_gather(padded, group=group)
        wait_for(everyone, timeout, describe)
        rows = hidden.shape[0]
        pieces = [
            everyone[r * rows : (r + 1) * rows, : self.vocab * (r + 1) // world - self.vocab * r // world]
            for r in range(world)
        ]
        return mx.concatenate(pieces, axis=-1).astype(dtype)

    def best(self, last: mx.array) -> mx.array:
        """``[rows, 2]``: per row, this rank's largest logit and its vocabulary id, for the final hidden states ``last``."""
        logits = self.project(last.astype(self.dtype)).astype(mx.float32)
        top = mx.max(logits, axis=-1)
        index = mx.argmax(logits, axis=-1).astype(mx.float32) + self.rows.start
        return mx.stack([top, index], axis=-1)


def vocab_size_of(model: nn.Module) -> int:
    """The model's vocabulary size from its arguments (0: not found; the first step's logits tell it then)."""
    for owner in (model, getattr(model, "language_model", None)):
        size = getattr(getattr(owner, "args", None), "vocab_size", None)
        if isinstance(size, int):
            return size
    return 0


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


def greedy(logits: mx.array) -> mx.array:
    """The largest entry's id per row: the token greedy decoding picks from logits or log-probabilities alike."""
    return mx.argmax(logits, axis=-1)


def log_probabilities(logits: mx.array) -> mx.array:
    """``logits`` normalised per row (what mlx-lm's samplers and ``logprobs`` are)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def processed(logits: mx.array, context: mx.array, processors: Sequence[LogitsProcessor]) -> mx.array:
    """``logits`` (one row) after each of ``processors``, which see ``context``: the tokens so far."""
    for processor in processors:
        logits = processor(context, logits)
    return logits


def choose(logits: mx.array, sampler: Sampler | None) -> tuple[mx.array, mx.array]:
    """The token ids and the log-probabilities of ``logits`` (lazy): greedy when ``sampler`` is ``None``.

    Greedy takes the argmax of the logits themselves, so the vocabulary-wide
    ``logsumexp`` is computed only if the log-probabilities are read.
    """
    logprobs = log_probabilities(logits)
    return (greedy(logits) if sampler is None else sampler(logprobs)), logprobs


def sample_rows(logprobs: mx.array, samplers: Sequence[Sampler | None]) -> mx.array:
    """Row ``i`` of ``logprobs`` sampled with ``samplers[i]`` (``None``: greedy); one call when all are one."""
    first = samplers[0]
    if all(s is first for s in samplers):
        sampled = greedy(logprobs) if first is None else first(logprobs)
        return mx.reshape(sampled, (-1,))
    rows = [
        mx.reshape(greedy(logprobs[i : i + 1]) if s is None else s(logprobs[i : i + 1]), (-1,))
        for i, s in enumerate(samplers)
    ]
    return mx.concatenate(rows)


def shared_head(
    shard: VocabShard,
    hidden: mx.array | None,
    rows: int,
    group: mx.distributed.Group,
    timeout: float | None,
    describe: Callable[[], str],
) -> mx.array:
    """This rank's part of a shared head's step, flattened: per row, its largest logit and that logit's id.

    ``hidden`` is the last rank's final hidden states (``None`` on the other ranks and on a rank standing in:
    zeros are sent). A collective: every rank calls it once its own part of the step is evaluated.
    """
    if hidden is None:
        hidden = mx.zeros((rows, shard.hidden_size), dtype=mx.float32)
    return mx.reshape(shard.pairs(hidden, group, timeout, describe), (-1,))
