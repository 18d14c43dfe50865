"""The prefill plan: what every rank does, in order, as plain data.

A plan is built by a pure function of ``(num_tokens, step_size, world_size, rank)``
and nothing else, so every rank derives the same schedule and can check that
with the others (:meth:`PrefillPlan.fingerprint`). The executor in
:mod:`pipemlx.runtime.prefill` only carries a plan out; the simulator in
:mod:`pipemlx.schedule.simulate` runs the very same objects.

The schedule is a wavefront. The prompt minus its last token is cut into ``n``
chunks of ``step_size`` tokens (the last may be shorter), exactly as mlx-lm's
``generate_step`` cuts it. There are ``n + S - 1`` steps; in step ``t`` rank ``r``
works on chunk ``t - r`` when that chunk exists. One step of one rank is::

    Send(t-1-r -> r+1)   issue the send queued by the previous step's compute
    Recv(t-r <- r-1)     the first local layer receives its input
    Compute(t-r)         run the local layers; the last one queues its output
    Agree(t)             collective: every rank has finished step t
    Progress(...)        from step S-1 on: chunk t-S+1 has left the last rank

A closing ``Agree(n + S - 1)`` follows the last progress report, so that a
failure anywhere, the progress callback included, reaches every rank before
any of them returns. Agreement points are where ranks stop together: a
cancellation or an error raised between two of them is acted on at the next.

A send is issued one step after its compute, and after an agreement point, so
a receive never waits on a peer that is itself waiting in a collective: the
plan cannot deadlock even if every send blocks until it is received.
Progress is reported when a chunk has passed through *all* ranks, so every rank
reports the same sequence: ``(0, M)``, then ``(stop, M)`` for each chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from typing_extensions import TypeAlias


@dataclass(frozen=True)
class Chunk:
    """Prompt positions ``[start, stop)``, the ``index``-th chunk of the prefill."""

    index: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Handshake:
    """Collective at the start: ranks compare what they are about to do."""


@dataclass(frozen=True)
class Send:
    """Issue the queued output of ``chunk``'s compute to rank ``peer``."""

    chunk: Chunk
    peer: int


@dataclass(frozen=True)
class Recv:
    """The first local layer receives ``chunk``'s hidden state from rank ``peer``."""

    chunk: Chunk
    peer: int


@dataclass(frozen=True)
class Compute:
    """Run this rank's layers on ``chunk``, filling their caches."""

    chunk: Chunk


@dataclass(frozen=True)
class Agree:
    """Collective agreement point closing step ``step``; entered by every rank."""

    step: int


@dataclass(frozen=True)
class Progress:
    """Call the progress callback with ``(processed, total)``."""

    processed: int
    total: int


Action: TypeAlias = Union[Handshake, Send, Recv, Compute, Agree, Progress]


@dataclass(frozen=True)
class PrefillPlan:
    """One rank's ordered actions for prefilling ``num_tokens - 1`` prompt tokens."""

    num_tokens: int
    step_size: int
    world_size: int
    rank: int
    chunks: tuple[Chunk, ...]
    actions: tuple[Action, ...]
    agree_every: int = 1

    @property
    def num_steps(self) -> int:
        """Steps of the wavefront: ``n + S - 1`` with ``n`` chunks, 0 when there is nothing to do."""
        return len(self.chunks) + self.world_size - 1 if self.chunks else 0

    def completed_after(self, step: int) -> int:
        """Prompt positions that every rank has processed once step ``step`` is agreed."""
        finished = min(step - (self.world_size - 1), len(self.chunks) - 1)
        return self.chunks[finished].stop if finished >= 0 else 0

    def fingerprint(self) -> int:
        """A 31-bit digest of the schedule shared by all ranks (not of this rank's actions).

        Two ranks whose fingerprints differ would not exchange the same messages.
        """
        spacing = f"a{self.agree_every}/" if self.agree_every != 1 else ""
        text = f"{self.num_tokens}/{self.step_size}/{self.world_size}/{spacing}" + ",".join(
            f"{c.start}:{c.stop}" for c in self.chunks
        )
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1

    def progress_sequence(self) -> list[tuple[int, int]]:
        """The ``(processed, total)`` pairs this plan reports, in order."""
        return [(a.processed, a.total) for a in self.actions if isinstance(a, Progress)]


def check_prefill_args(num_tokens: int, step_size: int, world_size: int) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad number, or return quietly."""
    for name, value in (("prefill_step_size", step_size), ("num_tokens", num_tokens), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"{name} must be an int or 'auto', got {type(value).__name__} {value!r}")
    if step_size < 1:
        raise ValueError(f"prefill_step_size must be at least 1 or 'auto', got {step_size}")
    if num_tokens < 1:
        raise ValueError("the prompt is empty (0 tokens); pipeline_prefill needs at least 1 token")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def chunk_prompt(num_tokens: int, step_size: int) -> tuple[Chunk, ...]:
    """Cut positions ``0 .. num_tokens-2`` into chunks as mlx-lm's ``generate_step`` does.

    The last prompt token is left for decoding, so a 1-token prompt has no chunk.
    """
    check_prefill_args(num_tokens, step_size, 1)
    prefill = num_tokens - 1
    return tuple(
        Chunk(index=i, start=start, stop=min(start + step_size, prefill))
        for i, start in enumerate(range(0, prefill, step_size))
    )


def chunks_of_lengths(num_tokens: int, lengths: Sequence[int]) -> tuple[Chunk, ...]:
    """Cut positions ``0 .. num_tokens-2`` into consecutive chunks of the given ``lengths``.

    Raises ``ValueError`` unless the lengths are positive and add up to ``num_tokens - 1``.
    """
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"chunk lengths must be positive ints, got {list(lengths)}")
    if sum(lengths) != num_tokens - 1:
        raise ValueError(
            f"chunk lengths add up to {sum(lengths)}, but a {num_tokens}-token prompt prefills {num_tokens - 1}"
        )
    chunks: list[Chunk] = []
    start = 0
    for index, length in enumerate(lengths):
        chunks.append(Chunk(index, start, start + length))
        start += length
    return tuple(chunks)


MAX_STEP_SIZE = 512
CHUNKS_PER_RANK = 4


def default_step_size(num_tokens: int, world_size: int) -> int:
    """512 tokens, or less so that a short prompt still gives every rank ``CHUNKS_PER_RANK`` chunks."""
    return max(1, min(MAX_STEP_SIZE, -(-(num_tokens - 1) // (CHUNKS_PER_RANK * world_size))))


AGREEMENTS_PER_PREFILL = 8
"""With the default spacing a prefill has at most about this many agreement points (plus the closing one)."""


def default_agreement_spacing(
    num_tokens: int, step_size: int, world_size: int, chunk_lengths: Sequence[int] | None = None
) -> int:
    """Steps between agreement points for the chunks :func:`build_plan` cuts from these arguments: about
    :data:`AGREEMENTS_PER_PREFILL` of them.

    Fewer agreement points let the ranks run free between them; each one still
    bounds how late a cancellation or an error is acted on.
    """
    num_chunks = len(chunk_lengths) if chunk_lengths is not None else -(-(num_tokens - 1) // step_size)
    steps = num_chunks + world_size - 1
    return max(1, -(-steps // AGREEMENTS_PER_PREFILL))


def build_plan(
    num_tokens: int,
    step_size: int,
    world_size: int,
    rank: int,
    agree_every: int = 1,
    chunk_lengths: Sequence[int] | None = None,
) -> PrefillPlan:
    """Rank ``rank``'s plan for prefilling a ``num_tokens`` prompt across ``world_size`` ranks.

    The prompt is cut as mlx-lm cuts it with ``step_size``, or, when
    ``chunk_lengths`` is given, into chunks of those lengths (``step_size``
    must then be the largest of them).

    ``agree_every`` spaces the agreement points: step ``t`` closes with an
    :class:`Agree` when ``t + 1`` is a multiple of it, and the last step always
    does. The progress of the chunks that left the last rank since the previous
    agreement point is reported, in order, after the next one.
    """
    check_prefill_args(num_tokens, step_size, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if isinstance(agree_every, bool) or not isinstance(agree_every, int) or agree_every < 1:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"agree_every must be a positive int, got {agree_every!r}")
    if chunk_lengths is None:
        chunks = chunk_prompt(num_tokens, step_size)
    else:
        chunks = chunks_of_lengths(num_tokens, chunk_lengths)
        if chunks and step_size != max(c.length for c in chunks):
            raise ValueError(f"step_size {step_size} is not the largest of the chunk lengths {list(chunk_lengths)}")
    last = world_size - 1
    actions: list[Action] = [Handshake(), Progress(0, num_tokens)]
    num_steps = len(chunks) + last if chunks else 0
    reported = 0  # chunks whose progress is already in the plan
    for step in range(num_steps):
        sent = step - 1 - rank
        if rank < last and 0 <= sent < len(chunks):
            actions.append(Send(chunks[sent], rank + 1))
        current = step - rank
        if 0 <= current < len(chunks):
            if rank > 0:
                actions.append(Recv(chunks[current], rank - 1))
            actions.append(Compute(chunks[current]))
        if (step + 1) % agree_every and step != num_steps - 1:
            continue
        actions.append(Agree(step))
        finished = step - last
        while reported <= finished:
            actions.append(Progress(chunks[reported].stop, num_tokens))
            reported += 1
    actions.append(Agree(num_steps))
    return PrefillPlan(
        num_tokens=num_tokens,
        step_size=step_size,
        world_size=world_size,
        rank=rank,
        chunks=chunks,
        actions=tuple(actions),
        agree_every=agree_every,
    )


def build_plans(
    num_tokens: int,
    step_size: int,
    world_size: int,
    agree_every: int = 1,
    chunk_lengths: Sequence[int] | None = None,
) -> tuple[PrefillPlan, ...]:
    """Every rank's plan, indexed by rank."""
    return tuple(
        build_plan(num_tokens, step_size, world_size, r, agree_every, chunk_lengths) for r in range(world_size)
    )
