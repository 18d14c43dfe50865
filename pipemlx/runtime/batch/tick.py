"""One rank's part of one tick of :class:`pipemlx.BatchGenerator`: a decode step and a prefill chunk.

The tick's :class:`~pipemlx.schedule.batch_plan.Tick` says which chunk each
rank computes. Rank ``r`` does, in this order, all on its compute stream
(whose work MLX runs first in, first out, so every message leaves and is
taken in the order below on both ends of each link):

1. ``r > 0``: the chunk it received at the end of the last tick (its graph was
   built then; only the receive was evaluated), while rank 0 runs the decode;
2. the decode step of the batch: receive the rows' hidden states (``r > 0``),
   run the local layers, send them on (``r < S - 1``) or sample every row
   (last rank);
3. ``r = 0``: the tick's new chunk; ``r < S - 1``: send the chunk computed in
   this tick to rank ``r + 1`` (after the decode's send);
4. ``r > 0``: receive the chunk rank ``r - 1`` computed in this tick and build
   its graph for the next tick;
5. the tick's all-gather (:data:`~pipemlx.runtime.protocol.TICK`): a header
   the ranks compare, and the last rank's tokens (and, when some row has a
   sampler or logits processors, or the generator shares log-probabilities,
   the last rank's logits: every other rank then samples them as the last rank
   did, with the same requests' processors and samplers, after the all-gather;
   whether that raised goes in the next tick's header, ``failed_sample``).

The tick's all-gather is its only collective (``head="split"`` adds the
vocabulary shard's): a rank before the last whose processors or samplers raise
on the tick's logits reports it in the next tick's header, and every rank then
fails the rows that tick sampled (:attr:`TickOutcome.failed_sample`). Those
rows' tokens decided in the failing tick are returned only by the next tick
(a :class:`~pipemlx.runtime.batch.generator.Response` feeds its token), so
every rank still ends them at the same token, one message fewer per tick.

With decode groups in flight (``TickWork.groups``), step 2 is this rank's group's
step instead: rank 0 builds and computes the group it takes, a rank ``r > 0``
computes the step it received at the end of the last tick (its graph built
then, as a held chunk's) and sends it on or samples it (last rank); and at the
end of the tick, before the chunk's receive of step 4, a rank ``r > 0``
receives the step rank ``r - 1`` computed and builds its graph for the next
tick (:class:`HeldDecode`). The all-gather then carries the tokens of the group
the last rank finished.

Every send is taken by its receiver within the same tick, so nothing is on the
wire between ticks; sends are issued asynchronously and nothing blocks until
the all-gather, which is waited for with the stage's timeout.

A model error while building a rank's part (the model raised) does not skip
its messages: that rank *stands in* — it takes its input off the wire and
sends zeros of the right shape on — and reports the failure in the header;
every rank then fails the same requests (:class:`TickOutcome`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ...errors import PeerLostError, PipelineError, PipelineMismatchError, PipelineTimeoutError
from ...schedule.batch_plan import SERIAL, GroupTick, Tick, TickChunk
from ..caches import cache_state
from ..failure import stand_in
from ..protocol import TICK, Status, Table, gather
from ..sampling import SHARE_WIDTH, VocabShard, pick_tokens, shared_head, vocab_size_of
from ..send_mode import send_mode
from ..stage import PipelineStage
from ..waits import PEER_LOST_MARKERS, issue, wait_for
from .compiled import CompiledDecode


@dataclass
class Held:
    """A chunk received at the end of a tick, to compute in the next: its graph is built, its input is here."""

    chunk: TickChunk
    output: mx.array | None  # what goes on to the next rank (zeros when standing in; None on the last rank)
    cache: list[Any]


@dataclass
class HeldDecode:
    """A decode group's step received at the end of a tick (groups in flight), to compute in the next: its graph
    is built and its input is here. ``output``: what goes on to the next rank (zeros when standing in; ``None``
    on the last rank); ``final``: the last rank's logits (or final hidden states, where the head can be shared);
    ``failed``: the model raised while building it (reported in the tick that computes it)."""

    group: int
    output: mx.array | None
    final: mx.array | None
    cache: list[Any]
    failed: bool


@dataclass(frozen=True)
class DecodeJob:
    """A decode group's step on this rank: the token each row feeds and this rank's batch caches of the group."""

    group: int
    inputs: list[int]
    cache: list[Any]


@dataclass(frozen=True)
class TickOutcome:
    """What every rank learned from a tick's all-gather: the sampled tokens and what failed on some rank
    (``failed_groups``: the decode groups whose step failed, :data:`~pipemlx.schedule.batch_plan.SERIAL` for the
    serial batch; ``failed_sample``: a rank before the last raised sampling the logits of the last tick that ran,
    so every row that tick sampled fails now)."""

    tokens: list[int]
    failed_groups: frozenset[int]
    failed_uids: frozenset[int]
    failed_sample: bool = False
    ahead: list[int] = field(default_factory=list[int])  # a step with guesses: per row, its later positions' samples
    # The ranks' mean time of the tick before, in microseconds (GroupTimings, StepCosts). The mean, not the largest:
    # each rank's ticks add up to the wall time, but they end at different points around the shared all-gather, so
    # the largest overstates a tick (measured: groups' cost by about a tenth, enough to merge groups that win).
    last_tick_us: int = 0


@dataclass
class TickWork:
    """One rank's inputs for a tick (prepared by the generator from data every rank has)."""

    tick: Tick
    rows: int
    inputs: list[int]  # per row: the token the decode step feeds
    batch_cache: list[Any]
    uids_fingerprint: int
    prefixes_fingerprint: int  # of the rows' reused prefix lengths; UNCOUNTED where this rank cannot count
    chunk_tokens: Callable[[TickChunk], list[int]]  # a chunk's token ids
    chunk_cache: Callable[[TickChunk], list[Any]]  # the cache of a chunk's request on this rank
    sample: Callable[[mx.array], mx.array]  # logits [R, V] -> token ids [R]
    greedy: bool = False  # every live row samples greedily, with no logits processors, and the head can be shared
    processing: bool = False  # the last rank's logits go to every rank, which samples them too (see the module)
    logprobs: bool = True  # the responses carry log-probabilities (False: head="split" may share the head)
    groups: GroupTick | None = None  # groups in flight: who computes which group (None: the serial batch's step)
    jobs: dict[int, DecodeJob] = field(default_factory=dict[int, DecodeJob])  # the groups' steps in the tick
    plan: int | None = None  # the fingerprint of the tick's whole plan, chunks and groups (None: the chunks')
    width: int = 1  # positions per row in the decode step: 1, or 1 + the most guesses a row feeds (speculate.py)
    fed: list[list[int]] | None = None  # width > 1: per row, its next token, its guesses and padding
    sample_ahead: Callable[[mx.array], mx.array] | None = None  # width > 1: logits [R, width-1, V] -> ids [R, width-1]
    last_tick_us: int = 0  # this rank's time of its last tick, in microseconds: sent in the header

    def decode_inputs(self) -> mx.array:
        """The decode step's token ids, ``[rows, width]``."""
        if self.fed is not None:
            return mx.array(self.fed, dtype=mx.int32)
        return mx.array(self.inputs, dtype=mx.int32)[:, None]

    @property
    def finishing(self) -> int | None:
        """The group whose step ends in this tick (sampled by the last rank): the serial batch's, or none."""
        if self.groups is None:
            return SERIAL if self.rows else None
        return self.groups.finishing


@dataclass(eq=False)
class TickRunner:
    """Runs ticks on one rank, holding the chunk received for the next tick between calls."""

    model: nn.Module
    stage: PipelineStage
    timeout: float | None
    held: Held | None = None
    held_decode: HeldDecode | None = None  # groups in flight, ranks r > 0: the group received for the next tick
    error: BaseException | None = None  # the first model error this rank stood in for
    shares_head: bool = False  # every rank's rows were greedy in the last tick: this tick's decode shares the head
    shared_ticks: int = 0  # ticks whose decode shared the head (observability)
    shared_guess_ticks: int = 0  # of them, steps with guesses (a split head's best of every position)
    logits_dtype: mx.Dtype = mx.float32  # of the model's logits (they travel as float32)
    vocab_size: int = 0
    sample_failed: bool = False  # this rank's sampling of the last tick's logits raised: told in the next header
    compiled: CompiledDecode | None = None  # compiled_decode=True: the local layers' decode step, compiled

    def __post_init__(self) -> None:
        self.vocab_size = vocab_size_of(self.model)
        shard = self.stage.info.vocab_shard
        self._splits = shard is not None and shard.split  # head="split": each rank holds its rows of the vocabulary

    def _embed(self, work: TickWork) -> None:
        """``head="split"``, every rank at the start of a tick: the embeddings of the decode step's inputs and of
        rank 0's new chunk, summed from every rank's rows and left with rank 0's embedding (a collective)."""
        stage, tick = self.stage, work.tick
        new = tick.chunks[0]
        fed = work.inputs if work.fed is None else [t for row in work.fed for t in row]
        tokens = [*fed, *([] if new is None else work.chunk_tokens(new))]
        if tokens:
            shard = cast(VocabShard, stage.info.vocab_shard)
            describe = lambda: f"{stage.describe()} embedding batch tick {tick.index}'s tokens"  # noqa: E731
            shard.embed(mx.array(tokens, dtype=mx.int32), stage.group, self.timeout, describe)

    def _split_logits(self, work: TickWork, hidden: mx.array | None, failed: bool) -> mx.array:
        """``head="split"``, every rank once the tick's messages are out: the batch's whole logits ``[rows,
        vocabulary]`` from every rank's rows (:meth:`VocabShard.logits`, two all-gathers, the last rank's final
        hidden states ``hidden``; zeros where its decode failed). The last rank samples them; with a sampler or
        processors the others sample their own copy as the last rank did (nothing more travels)."""
        stage = self.stage
        shard = cast(VocabShard, stage.info.vocab_shard)
        if hidden is None or failed:
            hidden = mx.zeros((work.rows * work.width, shard.hidden_size), dtype=mx.float32)
        describe = lambda: f"{stage.describe()} gathering batch tick {work.tick.index}'s logits"  # noqa: E731
        logits = shard.logits(hidden, stage.group, self.timeout, describe)
        self.vocab_size, self.logits_dtype = logits.shape[-1], logits.dtype
        return logits

    def drop(self, uids: set[int]) -> None:
        """Forget a held chunk of a removed request (its input was already taken off the wire)."""
        if self.held is not None and self.held.chunk.uid in uids:
            self.held = None

    def run(self, work: TickWork) -> TickOutcome:
        """Carry out this rank's part of ``work.tick``; every rank returns the same outcome."""
        stage, tick = self.stage, work.tick
        failed_group = -1  # the decode group (SERIAL: the serial batch) whose step failed on this rank
        failed_uid = -1
        gathered_logits: mx.array | None = None  # head="split": the batch's whole logits, on every rank
        try:
            with send_mode(self.model, "queue"), stage.executing_plan(), mx.stream(stage.compute_stream):
                tokens = mx.zeros((work.rows * work.width,), dtype=mx.float32)  # the last rank's sampled tokens
                logits: mx.array | None = None  # the last rank's, for the others to sample (work.processing)
                mine = tick.chunks[stage.rank]
                if self._splits:  # head="split": rank 0's embeddings of the tick's decode inputs and new chunk
                    self._embed(work)
                held = self._take_held(mine)
                if held is not None:  # 1. the chunk received last tick
                    self._issue(self._chunk_results(held), tick.index, "computing the chunk it received")
                # Decided in the last tick, alike on every rank. head="split" shares only where no logprobs are
                # wanted (the whole logits are then never gathered: each rank's best decides each row's token).
                # A step with guesses shares only a split head (each rank's best of every position: no V-wide
                # gather, no extra collective); a whole head's last rank samples its guess positions itself.
                split_shares = not work.logprobs and not work.processing and work.greedy
                sharing = self.shares_head and work.rows > 0 and (not self._splits or split_shares)
                sharing = sharing and (work.width == 1 or self._splits)
                self.shared_ticks += sharing
                self.shared_guess_ticks += sharing and work.width > 1
                hidden: mx.array | None = None
                if work.groups is not None:  # 2. this rank's decode group's step
                    sent, hidden, logits, failed_group = self._group_step(work, sharing)
                    if stage.is_last:
                        tokens = sent
                elif work.rows:  # 2. the decode step
                    try:
                        with self._layers(work.batch_cache, work.width):
                            sent, hidden, logits = self._decode(work, sharing)
                    except Exception as exc:
                        if not _is_model_error(exc):
                            raise
                        self._note(exc)
                        failed_group = SERIAL
                        outgoing = stand_in(stage, work.rows, work.width, self._take_off_the_wire)
                        sent = mx.zeros((work.rows * work.width,)) if outgoing is None else self._send(outgoing)
                        hidden = logits = None
                    if stage.is_last:
                        tokens = sent
                    issued = [sent, cache_state(work.batch_cache), *([] if hidden is None else [hidden])]
                    self._issue(issued, tick.index, "running the decode step")
                if stage.is_first and mine is not None:  # 3. rank 0's new chunk
                    held, failed = self._build_chunk(mine, work)
                    if failed:
                        failed_uid = mine.uid
                    self._issue(self._chunk_results(held), tick.index, "computing its new chunk")
                if held is not None and held.output is not None:  # not on the last rank
                    self._issue(self._send(held.output), tick.index, "sending its chunk")
                if work.groups is not None and stage.rank > 0:  # 4. the group rank r-1 computed, before its chunk
                    group = work.groups.decode[stage.rank - 1]
                    if group is not None:
                        with self._layers(work.jobs[group].cache):
                            self._build_decode(work.jobs[group])
                coming = tick.receives(stage.rank)
                if coming is not None:  # 4. the chunk rank r-1 computed: taken off the wire now, computed next tick
                    self.held, failed = self._build_chunk(coming, work)
                    if failed:
                        failed_uid = coming.uid
                if self._splits and work.rows and not sharing:  # after every message of the tick, as below
                    gathered_logits = self._split_logits(work, hidden, failed_group >= 0)
                    if stage.is_last and failed_group < 0:
                        try:
                            tokens, logits = self._sample_steps(work, gathered_logits), gathered_logits
                        except Exception as exc:  # a processor or sampler raised: the decode failed here
                            if not _is_model_error(exc):
                                raise
                            self._note(exc)
                            failed_group = cast(int, work.finishing)
                status = Status.OK if failed_uid < 0 and failed_group < 0 else Status.CHUNK_FAILED
                values = {
                    "tick": tick.index,
                    "rows": work.rows,
                    "uids": work.uids_fingerprint,
                    "plan": tick.fingerprint() if work.plan is None else work.plan,
                    "lend_mlp": int(stage.info.lending.mlp),
                    "lend_heads": stage.info.lending.heads,
                    "prefixes": work.prefixes_fingerprint,
                    "failed_decode": failed_group + 1,
                    "failed_uid": failed_uid + 1,
                    "greedy": int(work.greedy),
                    "failed_sample": int(self.sample_failed),
                    "last_tick_us": work.last_tick_us,
                }
                self.sample_failed = False  # told in this header
                payload = [tokens]
                if sharing:  # after every message of the tick, as the all-gather below
                    shard = cast(VocabShard, stage.info.vocab_shard)
                    describe = lambda: f"{stage.describe()} sharing the output head in batch tick {tick.index}"  # noqa: E731
                    positions = work.rows * work.width
                    payload.append(shared_head(shard, hidden, positions, stage.group, self.timeout, describe))
                if work.processing and work.rows and not self._splits:  # last, after the tokens and the pairs
                    width = work.rows * work.width * self.vocab_size
                    payload.append(mx.zeros((width,)) if logits is None else mx.reshape(logits, (-1,)))
                gathered = gather(TICK.row(values, status, payload), stage.group)
            where = f"batch tick {tick.index}"
            wait_for(gathered, self.timeout, lambda: f"{stage.describe()} in {where} ({work.rows} rows)")
        except Exception as exc:  # a stalled or lost peer, or a failure mid-evaluation: peers may be blocked
            stage.mark_broken(exc)
            if _is_peer_lost(exc):
                raise PeerLostError(f"{stage.describe()} in batch tick {tick.index}: {exc}") from exc
            raise
        try:
            table = TICK.read(gathered, stage.world_size, where)
            outcome, greedy = outcome_of(table, work.rows, sharing, work.width)
        except PipelineMismatchError as exc:
            # Found only after the tick's messages went out, sized by each rank's own plan: bytes may be left
            # on a link, and every later message on it would be read shifted (wrong tokens, no error).
            stage.mark_broken(exc)
            raise PipelineMismatchError(
                f"{exc}; the ranks already exchanged this tick's messages, sized by plans that differ, so "
                "this rank's links cannot be trusted: exit and start every rank again (and make every rank "
                "call the BatchGenerator alike)"
            ) from exc
        self.shares_head = greedy and work.rows > 0
        if work.processing and work.rows and stage.world_size > 1:
            outcome = self._sample_here(work, table, outcome, gathered_logits)
        return outcome

    def _sample_here(
        self, work: TickWork, table: Table, outcome: TickOutcome, gathered: mx.array | None = None
    ) -> TickOutcome:
        """Every rank before the last samples the last rank's logits with the rows' own processors and samplers, as
        the last rank did (their log-probabilities are this rank's responses'; the tokens stay the last rank's).
        If that raised, this rank says so in the next tick's header (:attr:`sample_failed`) instead of in one more
        all-gather now, and every rank fails the rows sampled here then (:attr:`TickOutcome.failed_sample`): their
        tokens decided in this tick are returned only by the next, so every rank still ends them at the same token.
        ``gathered``: the logits every rank holds already (``head="split"``), else the last rank's in ``table``."""
        stage = self.stage
        finishing = cast(int, work.finishing)
        if not stage.is_last and finishing not in outcome.failed_groups:
            width = work.rows * work.width * self.vocab_size
            try:
                with mx.stream(stage.compute_stream):
                    if gathered is not None:
                        logits = gathered
                    else:
                        logits = mx.array(table.payloads[-1][-width:], dtype=mx.float32)
                        logits = logits.astype(self.logits_dtype)
                    sampled = self._sample_steps(work, logits)
                wait_for(sampled, self.timeout, lambda: f"{stage.describe()} sampling batch tick {work.tick.index}")
            except Exception as exc:  # a processor or sampler of this rank raised: the decode failed here
                if not _is_model_error(exc):
                    raise
                self._note(exc)
                self.sample_failed = True
        return outcome

    def _sample_steps(self, work: TickWork, logits: mx.array) -> mx.array:
        """The tokens of the decode step's ``logits`` (``[rows * width, vocabulary]`` or any shape of as many):
        each row's first position by ``work.sample``, then, in a step with guesses, the later positions by
        ``work.sample_ahead``, row by row (the payload's order: :func:`outcome_of`)."""
        logits = mx.reshape(logits, (work.rows, work.width, -1))
        first = work.sample(logits[:, 0, :]).astype(mx.float32)
        if work.width == 1 or work.sample_ahead is None:
            return first
        ahead = work.sample_ahead(logits[:, 1:, :]).astype(mx.float32)
        return mx.concatenate([first, mx.reshape(ahead, (-1,))])

    def _take_held(self, mine: TickChunk | None) -> Held | None:
        held, self.held = self.held, None
        if self.stage.is_first:
            return None
        if (held is None) != (mine is None) or (held is not None and held.chunk != mine):
            raise PipelineError(f"{self.stage.describe()}: the tick plans chunk {mine}, but this rank holds {held}")
        return held

    def _chunk_results(self, held: Held) -> list[Any]:
        return [cache_state(held.cache), *([] if held.output is None else [held.output])]

    def _decode(self, work: TickWork, sharing: bool) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """Build the decode step: what this rank sends on, or (last rank) the sampled tokens; (last rank,
        ``sharing``) the final hidden states, whose share of the head every rank applies; (last rank) the logits."""
        stage = self.stage
        inputs = work.decode_inputs()
        if work.width > 1 and self._splits and stage.is_last:  # every position's logits from every rank's rows
            shard = cast(VocabShard, stage.info.vocab_shard)
            self.stage.received.clear()
            hidden = shard.hidden(self.model, inputs, work.batch_cache)
            return (
                mx.zeros((work.rows * work.width,), dtype=mx.float32),
                mx.reshape(hidden, (-1, hidden.shape[-1])),
                None,
            )
        if work.width > 1:  # a step with guesses (never with a shared head: see run)
            logits = self._forward(inputs, work.batch_cache)
            self.vocab_size, self.logits_dtype = logits.shape[-1], logits.dtype
            if not stage.is_last:
                return self._send(self._queued_output()), None, None
            return self._sample_steps(work, logits), None, logits
        if self._splits and stage.is_last:  # the logits come from every rank's rows: _split_logits
            shard = cast(VocabShard, stage.info.vocab_shard)
            self.stage.received.clear()
            hidden = shard.hidden(self.model, inputs, work.batch_cache)[:, -1, :]
            return mx.zeros((work.rows,), dtype=mx.float32), hidden, None
        if sharing and stage.is_last:
            shard = cast(VocabShard, stage.info.vocab_shard)
            self.stage.received.clear()
            hidden = shard.hidden(self.model, inputs, work.batch_cache)[:, -1, :]
            full = cast(Callable[[mx.array], mx.array], shard.full)(hidden)
            self.vocab_size, self.logits_dtype = full.shape[-1], full.dtype
            sampled = work.sample(full)  # lazy: read only for a row that is not greedy (see run)
            if work.greedy:  # the tokens come from every rank's share of the head: nothing sampled here
                return mx.zeros((work.rows,), dtype=mx.float32), hidden, full
            return sampled.astype(mx.float32), hidden, full
        logits = self._forward(inputs, work.batch_cache)
        self.vocab_size, self.logits_dtype = logits.shape[-1], logits.dtype
        if stage.is_last:
            return work.sample(logits[:, -1, :]).astype(mx.float32), None, logits[:, -1, :]
        return self._send(self._queued_output()), None, None

    def _group_step(self, work: TickWork, sharing: bool) -> tuple[mx.array, mx.array | None, mx.array | None, int]:
        """Groups in flight: issue this rank's group's step in the tick. Rank 0 builds it and sends it on; a rank
        ``r > 0`` computes the step it received at the end of the last tick and sends it on, or (last rank)
        samples it. Returns what was sent (the last rank: the sampled tokens), the last rank's final hidden
        states and logits (as :meth:`_decode`), and the group whose step failed here (-1: none)."""
        stage, groups = self.stage, cast(GroupTick, work.groups)
        tokens = mx.zeros((work.rows,), dtype=mx.float32)
        mine = groups.decode[stage.rank]
        if mine is None:
            return tokens, None, None, -1
        failed = False
        if stage.is_first:
            job = work.jobs[mine]
            try:
                with self._layers(job.cache):
                    self._forward(mx.array(job.inputs, dtype=mx.int32)[:, None], job.cache)
                output = self._queued_output()
            except Exception as exc:
                if not _is_model_error(exc):
                    raise
                self._note(exc)
                failed, output = True, cast(mx.array, stand_in(stage, len(job.inputs), 1, self._take_off_the_wire))
            self._issue([self._send(output), cache_state(job.cache)], work.tick.index, "running its decode group")
            return tokens, None, None, mine if failed else -1
        held = self.held_decode
        self.held_decode = None
        if held is None or held.group != mine:
            raise PipelineError(f"{stage.describe()}: the tick plans decode group {mine}, but this rank holds {held}")
        if not stage.is_last:
            sent = self._send(cast(mx.array, held.output))
            self._issue([sent, cache_state(held.cache)], work.tick.index, "running its decode group")
            return tokens, None, None, mine if held.failed else -1
        if held.failed or held.final is None:
            return tokens, None, None, mine
        try:
            tokens, hidden, logits = self._head(work, held.final, sharing)
        except Exception as exc:  # a processor or sampler raised
            if not _is_model_error(exc):
                raise
            self._note(exc)
            return mx.zeros((work.rows,), dtype=mx.float32), None, None, mine
        issued = [tokens, cache_state(held.cache), *([] if hidden is None else [hidden])]
        self._issue(issued, work.tick.index, "running its decode group")
        return tokens, hidden, logits, -1

    def _head(
        self, work: TickWork, final: mx.array, sharing: bool
    ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """The last rank, groups in flight: the sampled tokens, final hidden states and logits of a step whose
        layers ran into ``final`` (:meth:`_build_decode`), as :meth:`_decode` gives them."""
        shard = self.stage.info.vocab_shard
        if shard is None:
            self.vocab_size, self.logits_dtype = final.shape[-1], final.dtype
            return work.sample(final).astype(mx.float32), None, final
        if self._splits:  # the logits come from every rank's rows: _split_logits
            return mx.zeros((work.rows,), dtype=mx.float32), final, None
        full = cast(Callable[[mx.array], mx.array], shard.full)(final)
        self.vocab_size, self.logits_dtype = full.shape[-1], full.dtype
        sampled = work.sample(full)  # lazy: read only for a row that is not greedy (see run)
        if sharing and work.greedy:  # the tokens come from every rank's share of the head
            return mx.zeros((work.rows,), dtype=mx.float32), final, full
        return sampled.astype(mx.float32), final if sharing else None, full

    def _build_decode(self, job: DecodeJob) -> None:
        """Groups in flight, a rank ``r > 0`` at the end of a tick: build the step of the group rank ``r - 1``
        computed in it (its receive is evaluated in this tick's order; the rest is computed in the next tick).
        The last rank stops at the final hidden states where the head can be shared (``final``), else the logits."""
        stage = self.stage
        try:
            inputs = mx.array(job.inputs, dtype=mx.int32)[:, None]
            output: mx.array | None = None
            if stage.is_last:
                shard = stage.info.vocab_shard
                stage.received.clear()
                if shard is not None:
                    final = shard.hidden(self.model, inputs, job.cache)[:, -1, :]
                else:
                    final = cast(mx.array, self.model(inputs, cache=job.cache))[:, -1, :]
            else:
                final = None
                self._forward(inputs, job.cache)
                output = self._queued_output()
            received = stage.take_received()
            if received:
                self._issue(received, None, f"receiving decode group {job.group}")
            self.held_decode = HeldDecode(job.group, output, final, job.cache, False)
        except Exception as exc:
            if not _is_model_error(exc):
                raise
            self._note(exc)
            outgoing = stand_in(stage, len(job.inputs), 1, self._take_off_the_wire)
            self.held_decode = HeldDecode(job.group, outgoing, None, [], True)

    def _build_chunk(self, chunk: TickChunk, work: TickWork) -> tuple[Held, bool]:
        """Build ``chunk``'s graph on this rank (its receive, if any, is evaluated in this tick's order)."""
        cache = work.chunk_cache(chunk)
        try:
            tokens = mx.array(work.chunk_tokens(chunk), dtype=mx.int32)[None]
            self._forward(tokens, cache)
            output = None if self.stage.is_last else self._queued_output()
            received = self.stage.take_received()
            if received:
                self._issue(received, None, f"receiving chunk {chunk.start}..{chunk.stop - 1} of request {chunk.uid}")
            return Held(chunk, output, cache), False
        except Exception as exc:
            if not _is_model_error(exc):
                raise
            self._note(exc)
            outgoing = stand_in(self.stage, 1, chunk.length, self._take_off_the_wire)
            return Held(chunk, outgoing, []), True

    def _layers(self, cache: list[Any], width: int = 1) -> AbstractContextManager[None]:
        """Where a decode step over ``cache`` runs its local layers compiled (:mod:`.compiled`): a context around
        building it; a null one otherwise, and for a step with guesses (``width`` positions a row: the compiled
        step reads one)."""
        return nullcontext() if self.compiled is None or width != 1 else self.compiled.layers(cache)

    def _forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        self.stage.received.clear()
        return cast(mx.array, self.model(tokens, cache=cache))

    def _queued_output(self) -> mx.array:
        queue = self.stage.send_queue
        if len(queue) != 1:
            raise PipelineError(f"{self.stage.describe()}: a forward pass queued {len(queue)} sends, expected 1")
        output = queue.pending[0].array
        queue.discard()
        return output

    def _take_off_the_wire(self, received: list[mx.array]) -> None:
        """Issue a failed pass's receives in the tick's order (:func:`~..failure.stand_in`)."""
        self._issue(received, None, "taking a failed pass's input off the wire")

    def _issue(self, arrays: Any, tick: int | None, what: str) -> None:
        """``mx.async_eval`` with the stage's deadline (it can block behind a receive: see :func:`issue`)."""
        where = f" in batch tick {tick}" if tick is not None else ""
        issue(arrays, self.timeout, lambda: f"{self.stage.describe()} {what}{where}")

    def _send(self, output: mx.array) -> mx.array:
        return mx.distributed.send(output, self.stage.rank + 1, group=self.stage.group)

    def _note(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc


def _is_peer_lost(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_LOST_MARKERS)


def _is_model_error(exc: BaseException) -> bool:
    """An error of the model's own (stood in for), not of the pipeline or the wire (which ends the tick)."""
    return not isinstance(exc, (PipelineError, PeerLostError, PipelineTimeoutError)) and not _is_peer_lost(exc)


def outcome_of(table: Table, rows: int, sharing: bool, width: int = 1) -> tuple[TickOutcome, bool]:
    """What every rank learns from a tick's gathered ``table``, and whether every rank's rows were greedy.

    The tokens are the last rank's, or, when the ranks shared the head (``sharing``) and the last rank's rows were
    all greedy, picked from every rank's best logits. A step with guesses (``width`` positions per row) carries
    after the rows' tokens their later positions' samples, row by row (:attr:`TickOutcome.ahead`); sharing a split
    head, every rank's best logits of every position, row by row, position by position.
    """
    positions = rows * width
    ahead: list[int] = []
    if sharing and table.last("greedy"):
        picked = pick_tokens([payload[positions : positions + SHARE_WIDTH * positions] for payload in table.payloads])
        tokens = picked[::width]  # picked row by row, position by position
        ahead = [t for row in range(rows) for t in picked[row * width + 1 : (row + 1) * width]]
    else:
        tokens = [int(t) for t in table.payloads[-1][:rows]]
        ahead = [int(t) for t in table.payloads[-1][rows:positions]]
    failed_uids = frozenset(u - 1 for u in table["failed_uid"] if u > 0)
    failed_groups = frozenset(g - 1 for g in table["failed_decode"] if g > 0)
    failed_sample = any(table["failed_sample"])
    outcome = TickOutcome(
        tokens=tokens,
        failed_groups=failed_groups,
        failed_uids=failed_uids,
        failed_sample=failed_sample,
        ahead=ahead,
        last_tick_us=sum(table["last_tick_us"]) // len(table["last_tick_us"]),  # the mean: see TickOutcome
    )
    return outcome, all(table["greedy"])
