"""The decode of one request on one rank, the state machine behind :func:`pipemlx.generate_step`.

Per decoded token each rank runs its layers and sends on; only the last rank
applies the head and samples, and one small all-gather per token hands every
rank the token id together with every rank's word on whether to go on (see
``docs/design.md``, "The request lifecycle"). Nothing is evaluated ahead: a
token is computed only after every consumer asked for it, so when a generator
ends nothing is left in flight. A consumer that stops (``break``, ``close()``,
an exception) still runs the step the others are running, saying "stop" in its
all-gather. Like mlx-lm, the forward pass of the last yielded token always runs
before the generator ends, so the cache holds the prompt and every yielded token.

:class:`DecodeRun` is the steps, the agreement in each and the closing step; speculative decoding is its own part,
:class:`Speculation` (the proposer, the guesses each message carries, the tally), which a decode without guesses
holds too, idle. :mod:`pipemlx.runtime.generate` turns a :class:`DecodeStream` into mlx-lm's API.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]

from ..errors import PeerLostError, PipelineError, PipelineTimeoutError
from ..schedule.batch_plan import fingerprint
from .caches import always_trimmable, cache_offset, cache_state, trim_to
from .failure import stand_in
from .prefill import CancelCheck, PrefillOptions, prefill_before_decode
from .protocol import DECODE, GUESSES, MAX_GUESSES, PASS, Status, Table, gather
from .sampling import (
    LogitsProcessor,
    Sampler,
    VocabShard,
    choose,
    log_probabilities,
    pick_tokens,
    processed,
    shared_head,
    vocab_size_of,
)
from .speculative import AUTO_PIPELINES, SPECULATION_MODES, DraftLength, Proposer, SpeculationMode, accepted
from .stage import PipelineStage
from .stops import StopMatcher, StopSet
from .waits import wait_for


@dataclass(frozen=True)
class DecodeStop:
    """Why a decode ended, the same on every rank (:attr:`DecodeStream.stop`).

    ``length``: ``max_tokens`` reached; ``stop``: one of ``stop_tokens`` was yielded; ``cancelled``: a
    rank's consumer stopped or its ``should_cancel`` said yes; ``failed``: a callback or the model raised.
    """

    reason: Literal["length", "cancelled", "failed", "stop"]
    tokens: int  # yielded before the end
    ranks: tuple[int, ...] = ()  # that asked to stop (cancelled) or failed (failed)


@dataclass
class _Part:
    """This rank's part of a decode step, lazily: what it moves on the wire and what it computed."""

    moved: list[mx.array]  # its receive and send (evaluating these runs the rank's own part)
    token: mx.array | None = None  # the last rank's sampled token (after the accepted guesses)
    accepted: mx.array | None = None  # how many guesses the last rank's samples confirmed
    logprobs: mx.array | None = None  # the last rank's log-probabilities, one row per position
    hidden: mx.array | None = None  # the last rank's final hidden state, when the ranks share the head
    logits: mx.array | None = None  # the last rank's logits before its processors, when every rank runs them


@dataclass(frozen=True)
class _Pass:
    """A pass of pipelined speculation: the tick rank 0 started it in, the tokens it reads, where they go in the
    caches (the first one's position)."""

    start: int
    inputs: list[int]
    offset: int


class DecodeStream(Generator[tuple[int, "mx.array | None"], None, "DecodeStop | None"]):
    """What :func:`generate_step` returns: mlx-lm's generator of ``(token, logprobs)`` pairs.

    Once it has ended, :attr:`stop` says why (the same on every rank; also the generator's return value);
    :attr:`shared_head` says whether its steps after the first shared the output head among the ranks.
    """

    def __init__(self, run: DecodeRun, inner: Generator[tuple[int, mx.array | None], None, DecodeStop | None]):
        self._run = run
        self._inner = inner

    @property
    def stop(self) -> DecodeStop | None:
        """Why the decode ended; ``None`` while it runs, or when it ended in an error."""
        return self._run.stop

    @property
    def shared_head(self) -> bool:
        return self._run.shares_head

    @property
    def speculating(self) -> bool:
        """Whether the steps guessed tokens (every rank could cut its caches back)."""
        return self._run.speculation.active

    @property
    def pipelined(self) -> bool:
        """Whether the decode runs (or ended in) pipelined speculation's ticks: ``speculation="pipelined"`` or
        ``"auto"`` where it pipelines, until ``num_draft_tokens="auto"`` leaves them for the serial steps."""
        return self._run.ticking

    @property
    def from_draft(self) -> bool:
        """Whether the last token yielded was a guess the pipeline confirmed."""
        return self._run.from_draft

    @property
    def decided(self) -> list[int]:
        """Every token the request decided, the same on every rank: what the caches hold after the prompt once
        the generator ended. A consumer that stopped in the middle of a pass (with guesses) saw fewer."""
        return list(self._run.decided)

    @property
    def guesses(self) -> tuple[int, int]:
        """Speculative decoding's tally so far: ``(proposed, accepted)`` guesses."""
        return self._run.speculation.proposed, self._run.speculation.accepted

    def send(self, value: None) -> tuple[int, mx.array | None]:
        return self._inner.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> tuple[int, mx.array | None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self._inner.throw(typ, val, tb)

    def close(self) -> None:
        self._inner.close()


@dataclass(eq=False)
class DecodeRun:
    """One request's decode on one rank: the steps, the agreement in each, and the trailing step.

    :meth:`run` is the generator behind :func:`generate_step`; :meth:`finish` closes it when it was left suspended
    (the stage's open request). Its guesses, when it speculates, are :attr:`speculation`'s.
    """

    stage: PipelineStage
    model: nn.Module
    max_tokens: int
    sampler: Sampler | None
    logits_processors: list[LogitsProcessor]
    quantize: Callable[[list[Any]], None]
    timeout: float | None
    share_logprobs: bool
    stop_tokens: StopSet
    speculation: Speculation
    logprobs: bool = True  # yield the log-probabilities (False: None on every rank)
    generator: weakref.ref[Generator[Any, None, Any]] | None = None
    cache: list[Any] = field(default_factory=list[Any])
    history: mx.array | None = None
    deferred: BaseException | None = None
    vocab_size: int = 0
    stop: DecodeStop | None = None
    shares_head: bool = False  # every rank said it may, in the first step: the later steps share the head
    decided: list[int] = field(default_factory=list[int])  # every decided token
    from_draft: bool = False
    offset: int = 0  # the caches' positions before the step running now
    history_length: int = 0  # the logits processors' history's length before it
    logits_dtype: mx.Dtype = mx.float32  # of the model's logits (they travel as float32)
    replay_error: BaseException | None = None  # this rank's own processors or sampler raised in the last step
    ticking: bool = False  # pipelined speculation's ticks run (or ran last) this decode

    def __post_init__(self) -> None:
        self.stop_fingerprint = self.stop_tokens.fingerprint()
        self.stops: StopMatcher = self.stop_tokens.matcher()  # where the tokens yielded stand in the stop sequences
        # Greedy, no processors, logprobs kept on the last rank, no guesses: this rank may share the head.
        shard = self.stage.info.vocab_shard
        # head="split": no rank holds the whole head; every step gathers the logits (see _split_head), unless the
        # log-probabilities are not wanted: then greedy steps after the first share the head as with head="all".
        self.splits_head = shard is not None and shard.split
        self.may_share_head = shard is not None and (not self.splits_head or not self.logprobs)
        self.may_share_head = self.may_share_head and self.sampler is None and not self.logits_processors
        self.may_share_head = self.may_share_head and not self.share_logprobs and self.speculation.proposer is None
        # A sampler or processors: every rank runs them on the last rank's logits, as one process would call them.
        self.processing = self.stage.world_size > 1 and (self.sampler is not None or bool(self.logits_processors))
        self.vocab_size = vocab_size_of(self.model)
        # Pipelined speculation (see _pipelined): several ranks, guesses, no processors (they would need every
        # rank's history of each pass in flight), a head each pass's last rank holds whole.
        mode = self.speculation.mode
        self.pipelines = self.speculation.proposer is not None and self.stage.world_size > 1
        self.pipelines = self.pipelines and (mode == "pipelined" or (mode == "auto" and AUTO_PIPELINES))
        self.pipelines = self.pipelines and not self.logits_processors and not self.splits_head

    def finish(self) -> None:
        """Close the suspended generator: it runs the step the peers are in, saying stop (never raises)."""
        live = self.generator() if self.generator is not None else None
        if live is None:
            return
        try:
            live.close()
        except Exception as exc:  # the stage is marked broken; settle() reports it
            if self.stage.broken is None:
                self.stage.mark_broken(exc)

    def run(
        self, prompt: mx.array, cache: list[Any], prefill: PrefillOptions
    ) -> Generator[tuple[int, mx.array | None], None, DecodeStop | None]:
        """The generator behind :func:`generate_step` (``prefill`` holds its callbacks); returns why it stopped."""
        stage, speculation = self.stage, self.speculation
        stage.settle(self.timeout)
        self.cache = cache
        # mlx-lm's history: the prefilled tokens, then each step's input (the prompt's last token first).
        self.history = prompt[:-1] if self.logits_processors else None
        if self.history is not None:
            mx.eval(self.history)  # pyright: ignore[reportUnknownMemberType]  # a local slice: the helper thread cannot run it
        if speculation.proposer is not None:  # after ``history``, what the cache held before
            speculation.tokens += [int(t) for t in cast(list[int], prompt.tolist())]
        num_tokens = prompt.size
        prefill_before_decode(self.model, prompt, self.cache, prefill)
        if speculation.proposer is not None:  # every rank alike: the handshake compared the proposers
            failed = speculation.open(stage, self.cache, self.timeout, propose=not self.pipelines)
            if failed is not None:  # acted on in the first step's agreement, by every rank
                self.deferred = failed
        progress, should_cancel = prefill.prompt_progress_callback, prefill.should_cancel
        last = cast(int, prompt[-1].item())
        n = 0
        ended = False  # max_tokens reached, or a stop token yielded
        if self.pipelines and speculation.active and self.max_tokens != 0:
            handed = yield from self._pipelined(last, should_cancel, progress, num_tokens)
            if handed is None:  # the request ended
                return self.stop
            n, last = handed  # num_draft_tokens="auto" left pipelining: the serial steps go on from there
            progress = None
        while True:
            done = ended or n == self.max_tokens
            status = Status.END if done else self._poll(should_cancel)
            started = time.perf_counter()
            guesses = [] if done else speculation.guess(n)  # alike on every rank, whatever each one's status
            speculation.proposing = 0.0
            decided, logprobs, table = self._step(last, guesses, n, status)
            seconds = time.perf_counter() - started - speculation.proposing  # the guesses proposed again: apart
            speculation.draft_length.record(len(guesses), len(decided) - 1, seconds)
            if n == 0 and progress is not None:
                try:
                    progress(num_tokens, num_tokens)
                except Exception as exc:  # acted on in the next step's agreement, by every rank
                    self.deferred = exc
            if not table.all_ok:
                self._drop_guesses(table, guesses)
                self.stop = _decode_stop(table, n, stopped_at_token=self.stops.stopped)
                failed = self.deferred or self.replay_error
                if failed is not None:
                    raise failed
                return self.stop
            kept = self._keep(decided, guesses)
            speculation.accepted += min(len(decided) - 1, kept)
            speculation.proposed += len(guesses)
            # This rank's own processors or sampler raised: it yields none of the step's tokens and stops the
            # others after them (they yielded them), as a consumer that raised would.
            stopped: BaseException | None = self.replay_error
            failing, self.replay_error = stopped is not None, None
            if stopped is None:
                try:
                    yield from self._hand_out(decided, kept, logprobs)
                except BaseException as exc:  # the others yield this pass's tokens: stop after them too
                    stopped = exc
            n += kept
            last = decided[kept - 1]
            ended = self.stops.stopped
            if stopped is not None:
                done = ended or n == self.max_tokens
                closing_guesses = [] if done else speculation.guess(n)
                final = self._step(last, closing_guesses, n, Status.FAILED if failing else Status.CANCEL)[2]
                self.replay_error = None  # the closing step's own replay: the request ends with the first error
                self._drop_guesses(final, closing_guesses)
                self.stop = _decode_stop(final, n, stopped_at_token=False)
                raise stopped

    def _hand_out(
        self, decided: list[int], kept: int, logprobs: mx.array | None
    ) -> Generator[tuple[int, mx.array | None], None, None]:
        """Yield a pass's first ``kept`` decided tokens (with their log-probabilities, where any), the request open
        on the stage while the consumer holds each. It catches nothing: what the consumer throws in, and the
        ``GeneratorExit`` of a consumer's ``break`` (PEP 380 closes this generator, then raises it in the
        caller's ``yield from``), reaches the caller, which still has to run the step that stops every rank."""
        for i in range(kept):
            self.from_draft = i < len(decided) - 1
            self.stage.open_request = self
            try:
                yield decided[i], None if logprobs is None else logprobs[i]
            finally:
                self.stage.open_request = None

    def _keep(self, decided: list[int], guesses: list[int], kept: int | None = None) -> int:
        """How many of a step's ``decided`` tokens are yielded (up to the first stop token), and the caches and
        histories cut to match: they hold the step's input and the guesses before the last yielded token."""
        if kept is None:
            kept = self.stops.first_stop(decided)
            if self.max_tokens != -1:  # a step may decide one token more than max_tokens leaves room for
                kept = min(kept, self.max_tokens - len(self.decided))
        if guesses:
            trim_to(self.cache, self.offset + kept)
            if self.history is not None:
                with mx.stream(self.stage.compute_stream):  # the next step's wait evaluates it in a helper thread
                    self.history = self.history[: self.history_length + kept]
        if self.speculation.proposer is not None:
            self.speculation.tokens.extend(decided[:kept])
        self.decided.extend(decided[:kept])
        for token in decided[:kept]:
            self.stops.advance(token)
        return kept

    def _drop_guesses(self, table: Table, guesses: list[int]) -> None:
        """After a step that ends the request: the caches keep its input only, as a step without guesses would."""
        if guesses and not table.ranks_with(Status.CHUNK_FAILED):  # (a failed step is undone whole)
            self._keep([], guesses, kept=1)

    def _poll(self, should_cancel: CancelCheck | None) -> Status:
        if self.deferred is not None:
            return Status.FAILED
        if should_cancel is None:
            return Status.OK
        try:
            return Status.CANCEL if should_cancel() else Status.OK
        except Exception as exc:  # acted on by every rank in this step's agreement
            self.deferred = exc
            return Status.FAILED

    def _step(
        self, last: int, guesses: list[int], index: int, status: Status
    ) -> tuple[list[int], mx.array | None, Table]:
        """One forward pass of every rank over ``last`` and ``guesses``, and the step's message: the decided tokens
        (the confirmed guesses, then the last rank's own), their log-probabilities, and every rank's status.

        Each communication is evaluated on its own (this rank's part, the shared head's all-gather, then the step's
        message), so that a lost rank fails at once (:class:`PeerLostError`) rather than after the timeout.
        """
        stage, speculation = self.stage, self.speculation
        inputs = mx.array([last, *guesses], dtype=mx.int32)
        mx.eval(inputs)  # pyright: ignore[reportUnknownMemberType]  # a local array: the helper thread cannot run it
        self.offset = offset = cache_offset(self.cache)
        self.history_length = 0 if self.history is None else self.history.size
        where = f"decode step {index}"
        try:
            with mx.stream(stage.compute_stream), stage.without_broadcast():
                stage.received.clear()
                if self.splits_head:  # rank 0's embedding of the step's inputs, from every rank's rows
                    shard = cast(VocabShard, stage.info.vocab_shard)
                    shard.embed(
                        inputs, stage.group, self.timeout, lambda: f"{stage.describe()} embedding token {index}"
                    )
                try:
                    part = self._build(inputs, len(guesses))
                except Exception as exc:  # the model failed here: stand in for this rank's part, report it
                    self.deferred = self.deferred or exc
                    status = Status.CHUNK_FAILED
                    draining = f"{stage.describe()} draining token {index}'s input after an error"
                    outgoing = stand_in(stage, 1, inputs.size, lambda r: wait_for(r, self.timeout, lambda: draining))
                    sent = (
                        [] if outgoing is None else [mx.distributed.send(outgoing, stage.rank + 1, group=stage.group)]
                    )
                    part = _Part(moved=sent)
                if self.splits_head and not self.shares_head:
                    part, failed = self._split_head(part, inputs, index)
                    if failed is not None:
                        self.deferred, status = self.deferred or failed, Status.FAILED
                if self.processing:
                    payload = [self._shared_logits(part, inputs.size)]
                else:
                    payload = [self._shared_logprobs(part, inputs.size)] if self.share_logprobs else []
                own = [*part.moved, *(a for a in (part.token, part.hidden) if a is not None), *payload]
                # The last rank proposes the next step's guesses: the likeliest ones while the ranks before it
                # compute this step (it would wait for them), the right ones after it, unless those were the same.
                proposes = stage.is_last and speculation.active and not speculation.off
                proposes = proposes and part.token is not None and status == Status.OK
                wanted = speculation.draft_length.next() if proposes else 0
                ahead: list[int] = []
                following: list[int] = []
                # The samples of this step are drawn: the next step's guesses draw after them, as in mlx-lm.
                drawn = _RandomKey() if proposes and self.sampler is not None else None
                try:
                    ahead = speculation.ahead(guesses, index, wanted) if proposes else []
                except Exception as exc:  # the proposer failed here: this step says so, every rank stops
                    self.deferred, status, proposes = self.deferred or exc, Status.FAILED, False
                if stage.world_size > 1 or proposes:
                    wait_for(own, self.timeout, lambda: f"{stage.describe()} computing token {index}")
                try:
                    following = speculation.following(guesses, index, wanted, part, ahead, drawn) if proposes else []
                except Exception as exc:
                    self.deferred, status = self.deferred or exc, Status.FAILED
                if self.shares_head:
                    shard = cast(VocabShard, stage.info.vocab_shard)
                    describe = lambda: f"{stage.describe()} sharing token {index}'s output head"  # noqa: E731
                    payload.append(shared_head(shard, part.hidden, 1, stage.group, self.timeout, describe))
                values: dict[str, int | mx.array] = {
                    "index": index,
                    "max_tokens": self.max_tokens,
                    "stop_tokens": self.stop_fingerprint,
                    "guesses": len(guesses),
                    "guessed": fingerprint(g + 1 for g in guesses),
                    "token": part.token if part.token is not None else 0,
                    "accepted": part.accepted if part.accepted is not None else 0,
                    "shares_head": int(self.may_share_head),
                    "next_guesses": len(following),
                    **_numbered(following),
                }
                gathered = gather(DECODE.row(values, status, payload), stage.group)
            # Greedy logprobs are left lazy (their logits are evaluated): computed when the caller reads them.
            waited = [gathered] if part.logprobs is None or self.sampler is None else [gathered, part.logprobs]
            wait_for(waited, self.timeout, lambda: f"{stage.describe()} in {where}")
            stage.outstanding.clear()  # this pass is complete: nothing for the next one to wait for
        except Exception as exc:  # failed mid-evaluation: a peer may be inside this step's collectives
            stage.mark_broken(exc)
            raise
        table = DECODE.read(gathered, stage.world_size, where)
        if table.ranks_with(Status.CHUNK_FAILED):
            trim_to(self.cache, offset)  # the failed step is in no cache: undo it on every rank
        logprobs = part.logprobs
        if not self.logprobs:
            logprobs = None
        elif self.processing and not stage.is_last and table.statuses[-1] != Status.CHUNK_FAILED:
            logprobs = self._replay(table.payloads[-1], inputs, index)
        elif self.share_logprobs and not stage.is_last:
            logprobs = mx.reshape(mx.array(table.payloads[-1]), (inputs.size, -1))
        if self.shares_head:
            (token,) = pick_tokens(table.payloads)
        else:
            token = table.last("token")
        if index == 0:  # every rank holds the same rows: the later steps share the head on every rank, or on none
            self.shares_head = all(table["shares_head"])
        speculation.pending = _guesses_of(table)
        confirmed = guesses[: table.last("accepted")] if guesses else []
        return [*confirmed, token], logprobs, table

    def _pipelined(
        self, last: int, should_cancel: CancelCheck | None, progress: Callable[[int, int], Any] | None, num_tokens: int
    ) -> Generator[tuple[int, mx.array | None], None, tuple[int, int] | None]:
        """Pipelined speculation: the decode as ticks, in each of which every rank computes a different pass.

        Rank 0 starts a pass every tick (proposing its tokens: the token the passes in flight end on, guessed, then
        its guesses) on the assumption that every pass in flight confirms all its guesses and samples the token
        guessed after them; rank ``r`` computes, in tick ``t``, the pass rank 0 started in tick ``t - r``; the tick's
        message (:data:`~.protocol.PASS`) says which pass rank 0 started and what the last rank decided of the
        oldest one. When that pass rejected a guess (or sampled another token than the next pass starts with), the
        passes after it are dropped on every rank alike: the sends queued for them are discarded and every cache
        cut back to what the pass confirmed. Nothing but the send queue outlives a tick, so the request can end
        after any tick: every rank then cuts its caches back to the prompt and the decided tokens but the last, and
        the closing step of the plain decode (:meth:`_step`, no guesses) reads that last token and agrees why the
        request ended, as after a plain decode. Returns ``None`` then; or, when rank 0 said in a tick's message
        that pipelining loses (``num_draft_tokens="auto"``, :meth:`DraftLength.next_pipelined`), the decided
        count and the last token, with the caches left as for a closing step: the serial steps go on from there.
        """
        stage, speculation = self.stage, self.speculation
        flight: list[_Pass] = []  # the passes started and not yet verified, oldest first, alike on every rank
        base = cache_offset(self.cache)  # the position of the prompt's last token
        following = base  # where the next pass starts when none is in flight
        self.ticking = True
        n = tick = verified = 0
        reported = progress is None
        leaving = False
        closing = Status.END
        stopped: BaseException | None = None
        while True:
            status = self._poll(should_cancel) if stopped is None else Status.CANCEL
            started = time.perf_counter()
            speculation.proposing = 0.0
            table, logprobs, status = self._tick(tick, flight, last, n, status, verified)
            tick += 1
            new = [table.columns[f"in_{i}"][0] for i in range(table.columns["inputs"][0])]
            if new:  # where the passes in flight end, if they all hold
                offset = flight[-1].offset + len(flight[-1].inputs) if flight else following
                flight.append(_Pass(tick - 1, new, offset))
            done = flight[0] if flight and flight[0].start == tick - stage.world_size else None
            if not reported and (done is not None or not table.all_ok):
                reported = True
                try:
                    cast(Callable[[int, int], Any], progress)(num_tokens, num_tokens)
                except Exception as exc:  # acted on in the next tick's agreement, by every rank
                    self.deferred = exc
            if new and stage.is_first:
                seconds = time.perf_counter() - started
                speculation.draft_length.record_tick(len(new) - 1, seconds, speculation.proposing)
            if not table.all_ok:
                closing = status if status != Status.OK else Status.END
                break
            leaving = table.columns["serial"][0] == 1
            if done is None:
                if leaving:
                    break
                continue
            flight.pop(0)
            verified += 1
            guesses = done.inputs[1:]
            count, token = min(table.last("accepted"), len(guesses)), table.last("token")
            decided = [*guesses[:count], token]
            chained = count == len(guesses) and bool(flight)  # the next pass's first token was a guess of `token`
            held = chained and flight[0].inputs[0] == token
            speculation.draft_length.record_guesses(len(guesses) + chained, count + held)
            if not held:
                flight.clear()  # built on a guess that failed: dropped on every rank
                stage.send_queue.discard()
                following = done.offset + 1 + count
                trim_to(self.cache, following)
            kept = self.stops.first_stop(decided)
            if self.max_tokens != -1:
                kept = min(kept, self.max_tokens - n)
            speculation.tokens.extend(decided[:kept])
            self.decided.extend(decided[:kept])
            for token in decided[:kept]:
                self.stops.advance(token)
            speculation.accepted += min(count, kept)
            speculation.proposed += len(guesses)
            if stopped is None:
                try:
                    yield from self._hand_out(decided, kept, logprobs)
                except BaseException as exc:  # the others yield this pass's tokens: stop in the next tick
                    stopped = exc
            n += kept
            last = decided[kept - 1]
            if self.stops.stopped or n == self.max_tokens or stopped is not None:
                leaving = False
            if self.stops.stopped or n == self.max_tokens or leaving:
                break
        # Every rank's caches: the prompt and the decided tokens but the last, which the closing step reads.
        stage.send_queue.discard()
        trim_to(self.cache, base + n)
        if leaving:  # guessing loses here: the rest of the request is plain decoding (a sampler's draws too)
            self.ticking, speculation.off = False, True
            return n, last
        if self.deferred is not None:
            closing = Status.FAILED
        elif stopped is not None:
            closing = Status.CANCEL
        final = self._step(last, [], n, closing)[2]
        self.stop = _decode_stop(final, n, stopped_at_token=self.stops.stopped and stopped is None)
        failed = stopped or self.deferred or self.replay_error
        if failed is not None:
            raise failed
        return None

    def _tick(
        self, tick: int, flight: list[_Pass], last: int, n: int, status: Status, passes: int
    ) -> tuple[Table, mx.array | None, Status]:
        """One tick of :meth:`_pipelined` on this rank: its queued send goes out, rank 0 proposes and starts a
        pass, each rank computes the pass it holds, and the tick's message is gathered. Returns the message, the
        log-probabilities of the pass the last rank verified (one row per position; ``None`` where this rank has
        none) and this rank's status (``FAILED`` when its proposer or its layers raised). ``passes``: how many
        passes were verified before it (rank 0's ``num_draft_tokens="auto"`` leaves pipelining only after some)."""
        stage, queue = self.stage, self.stage.send_queue
        where = f"pipelined tick {tick}"
        verified = flight[0] if flight and flight[0].start == tick - (stage.world_size - 1) else None
        try:
            with mx.stream(stage.compute_stream):
                queue.flush()  # this rank's output of the last tick: the next rank computes it in this one
                inputs: list[int] = []
                leave = False
                if stage.is_first and status == Status.OK:
                    try:
                        wanted = self.speculation.draft_length.next_pipelined(stage.world_size, passes)
                        leave = wanted is None
                        began = time.perf_counter()
                        inputs = [] if wanted is None else self._propose_pass(flight, last, n, wanted)
                        self.speculation.proposing = time.perf_counter() - began
                    except Exception as exc:  # the proposer failed: this tick says so, every rank stops
                        self.deferred, status = self.deferred or exc, Status.FAILED
                held = [p.inputs for p in flight if p.start == tick - stage.rank]
                mine = inputs if stage.is_first else (held[0] if held else [])
                token: mx.array | None = None
                count: mx.array | None = None
                logprobs: mx.array | None = None
                if mine:
                    try:
                        token, count, logprobs = self._compute_pass(mine, tick)
                    except (PipelineTimeoutError, PeerLostError, PipelineError):
                        raise
                    except Exception as exc:  # the model failed here: stand in for this rank's part, report it
                        self.deferred, status = self.deferred or exc, Status.FAILED
                        draining = f"{stage.describe()} draining {where}'s input after an error"
                        outgoing = stand_in(stage, 1, len(mine), lambda r: wait_for(r, self.timeout, lambda: draining))
                        if outgoing is not None:
                            queue.put(outgoing, stage.rank + 1)
                        token = count = logprobs = None
                shared = self.logprobs and (self.sampler is not None or self.share_logprobs)
                payload: list[mx.array] = []
                if shared and verified is not None:
                    rows = len(verified.inputs)
                    own = logprobs if stage.is_last and logprobs is not None else None
                    width = self.vocab_size if own is None else own.shape[-1]
                    payload = [mx.reshape(own, (-1,)) if own is not None else mx.zeros((rows * width,), mx.float32)]
                values: dict[str, int | mx.array] = {
                    "tick": tick,
                    "in_flight": len(flight),
                    "max_tokens": self.max_tokens,
                    "stop_tokens": self.stop_fingerprint,
                    "inputs": len(inputs),
                    **{f"in_{i}": t for i, t in enumerate(inputs)},
                    "token": token if token is not None else 0,
                    "accepted": count if count is not None else 0,
                    "serial": int(leave),
                }
                in_flight = queue.in_flight()
                if in_flight:
                    wait_for(in_flight, self.timeout, lambda: f"{stage.describe()} sending on in {where}")
                    queue.mark_complete()
                gathered = gather(PASS.row(values, status, payload), stage.group)
            wait_for([gathered], self.timeout, lambda: f"{stage.describe()} in {where}")
        except Exception as exc:  # failed mid-evaluation: a peer may be inside this tick's collectives
            stage.mark_broken(exc)
            raise
        table = PASS.read(gathered, stage.world_size, where)
        if verified is None or not self.logprobs:
            return table, None, status
        if stage.is_last:
            return table, logprobs, status
        if shared:
            return table, mx.reshape(mx.array(table.payloads[-1]), (len(verified.inputs), -1)), status
        return table, None, status

    def _propose_pass(self, flight: list[_Pass], last: int, n: int, wanted: int) -> list[int]:
        """Rank 0: the tokens of the pass it starts now, ``wanted`` guesses (none: it starts none). With no pass
        in flight, ``last`` and the guesses after it; else the token the passes in flight end on (guessed), then the guesses after
        it. Never more tokens than ``max_tokens`` leaves room for (as :meth:`Speculation.room`), never more passes
        in flight than ranks."""
        speculation = self.speculation
        proposer = cast(Proposer, speculation.proposer)
        if len(flight) >= self.stage.world_size:
            return []
        optimistic = n + sum(len(p.inputs) for p in flight)  # decided if every pass in flight holds
        wanted = min(wanted, MAX_GUESSES)
        room = wanted if self.max_tokens == -1 else min(wanted, self.max_tokens - optimistic)
        if not flight:
            return [last, *(proposer.propose(speculation.tokens, room, self.sampler) if room > 0 else [])]
        if room <= 0:
            return []
        # The oldest pass in flight starts with the last decided token (in the history already), the others with
        # the token guessed after the pass before them.
        chain = [*speculation.tokens, *flight[0].inputs[1:], *(t for p in flight[1:] for t in p.inputs)]
        return proposer.propose(chain, room + 1, self.sampler, greedy=1)[: room + 1]

    def _compute_pass(self, inputs: list[int], tick: int) -> tuple[mx.array | None, mx.array | None, mx.array | None]:
        """This rank's layers over one pass, in queue mode: its input received, its output queued for the next
        rank (sent at the start of the next tick). The last rank samples every row as plain decoding would, each
        with the random generator's state plain decoding gives that position (the rows after the first rejected
        guess are drawn again from there in the next pass); returns its token, the confirmed guesses' count and
        the log-probabilities (``None`` on the other ranks)."""
        stage = self.stage
        ids = mx.array(inputs, dtype=mx.int32)
        mx.eval(ids)  # pyright: ignore[reportUnknownMemberType]  # a local array: the helper thread cannot run it
        stage.set_mode("queue")
        try:
            with stage.executing_plan():
                output = cast(mx.array, self.model(ids[None], cache=self.cache))
            self.quantize(self.cache)
        finally:
            stage.set_mode("immediate")
        received = stage.take_received()
        if received:
            wait_for(received, self.timeout, lambda: f"{stage.describe()} receiving pipelined tick {tick}'s pass")
        if not stage.is_last:
            queued = [p.array for p in stage.send_queue.pending]
            wait_for(
                [cache_state(self.cache), queued], self.timeout, lambda: f"{stage.describe()} computing tick {tick}"
            )
            return None, None, None
        logits = output[0]
        keys: list[_RandomKey] = []
        if self.sampler is None:
            tokens, logprobs = choose(logits, None)
        else:  # one draw per row, as plain decoding draws one per token
            drawn: list[tuple[mx.array, mx.array]] = []
            for i in range(len(inputs)):
                drawn.append(choose(logits[i : i + 1], self.sampler))
                keys.append(_RandomKey())
            tokens = mx.concatenate([mx.reshape(t, (1,)) for t, _ in drawn])
            logprobs = mx.concatenate([lp for _, lp in drawn])
        count = accepted(ids[1:], tokens)
        waited = [count, tokens, cache_state(self.cache)] + ([logprobs] if self.sampler is not None else [])
        wait_for(waited, self.timeout, lambda: f"{stage.describe()} computing tick {tick}")
        confirmed = cast(int, count.item())
        if keys:
            keys[confirmed].restore()
        return mx.reshape(tokens[confirmed], (1,)), mx.reshape(count, (1,)), logprobs

    def _shared_logits(self, part: _Part, positions: int) -> mx.array:
        """A sampler or processors: the last rank's logits before its processors; zeros of the same size elsewhere."""
        if part.logits is not None:
            return mx.reshape(part.logits, (-1,))
        return mx.zeros((positions * self.vocab_size,), dtype=mx.float32)

    def _replay(self, payload: list[float], inputs: mx.array, index: int) -> mx.array | None:
        """A rank before the last: its own processors and sampler over the last rank's logits (``payload``), called
        with what the last rank's were called with; returns the log-probabilities (``None`` if they raised).

        The token is the last rank's whatever this rank's sampler draws: a sampler seeded alike on every rank draws
        alike, one that is not may draw another token here, which is dropped. An error is kept in
        :attr:`replay_error`: this rank then yields none of the step's tokens and stops the request.
        """
        stage = self.stage
        try:
            with mx.stream(stage.compute_stream):
                logits = mx.reshape(mx.array(payload, dtype=mx.float32), (inputs.size, -1)).astype(self.logits_dtype)
                tokens, logprobs = self._choose(logits, inputs)
            wait_for([tokens, logprobs], self.timeout, lambda: f"{stage.describe()} sampling token {index}")
        except Exception as exc:
            self.replay_error = exc
            return None
        return logprobs

    def _choose(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, mx.array]:
        """The step's logits (one row per position of ``inputs``) through the processors, each row seeing the
        history up to its own input as mlx-lm's do, then sampled: the tokens and log-probabilities, lazily."""
        if self.logits_processors:
            rows: list[mx.array] = []
            for i in range(inputs.size):
                self.history = inputs[:1] if self.history is None else mx.concatenate([self.history, inputs[i : i + 1]])
                rows.append(processed(logits[i : i + 1], self.history, self.logits_processors))
            logits = mx.concatenate(rows)
        return choose(logits, self.sampler)

    def _shared_logprobs(self, part: _Part, positions: int) -> mx.array:
        """``share_logprobs``: the last rank's log-probabilities; zeros of the same size on the others."""
        if part.logprobs is not None:
            return mx.reshape(part.logprobs, (-1,))
        return mx.zeros((positions * self.vocab_size,), dtype=mx.float32)

    def _split_head(self, part: _Part, inputs: mx.array, index: int) -> tuple[_Part, Exception | None]:
        """``head="split"``: once this rank's part is computed, the whole logits from every rank's rows (two
        all-gathers, every rank), and the last rank's tokens chosen from them as :meth:`_build` chooses them.

        Returns the part and the error the logits processors or the sampler raised (``None``: none)."""
        stage = self.stage
        shard = cast(VocabShard, stage.info.vocab_shard)
        wait_for(
            [*part.moved, *(a for a in (part.hidden,) if a is not None)],
            self.timeout,
            lambda: f"{stage.describe()} computing token {index}",
        )
        hidden = part.hidden if part.hidden is not None else mx.zeros((inputs.size, shard.hidden_size), mx.float32)
        describe = lambda: f"{stage.describe()} gathering token {index}'s logits"  # noqa: E731
        logits = shard.logits(hidden, stage.group, self.timeout, describe)
        self.vocab_size = logits.shape[-1]
        if not stage.is_last or part.hidden is None:
            return part, None
        try:
            return replace(self._decide(inputs, logits), moved=part.moved), None
        except Exception as exc:
            return part, exc

    def _build(self, inputs: mx.array, guesses: int) -> _Part:
        """This rank's part of a step, lazily (see :class:`_Part`)."""
        stage = self.stage
        if self.splits_head and stage.is_last:  # the logits are gathered from every rank's rows (_split_head), or
            shard = cast(VocabShard, stage.info.vocab_shard)  # each rank's best decides the token (shares_head)
            hidden = shard.hidden(self.model, inputs[None], self.cache)[0]
            self.quantize(self.cache)
            return _Part(moved=[], hidden=hidden)
        if self.shares_head and stage.is_last:
            shard = cast(VocabShard, stage.info.vocab_shard)
            hidden = shard.hidden(self.model, inputs[None], self.cache)[:, -1, :]
            self.quantize(self.cache)
            logits = cast(Callable[[mx.array], mx.array], shard.full)(hidden)  # read only with the logprobs
            return _Part(moved=[], logprobs=log_probabilities(logits), hidden=hidden)
        output = cast(mx.array, self.model(inputs[None], cache=self.cache))
        self.quantize(self.cache)
        self.vocab_size, self.logits_dtype = output.shape[-1], output.dtype
        if not stage.is_last:
            # This rank's send is tied to its cache: evaluating the cache sends.
            leaves = cast(list[tuple[str, Any]], tree_flatten(cache_state(self.cache)))
            return _Part(moved=[a for _, a in leaves if isinstance(a, mx.array)])
        return self._decide(inputs, output[0])  # one row per position: the input's, then each guess's

    def _decide(self, inputs: mx.array, logits: mx.array) -> _Part:
        """The last rank: the step's tokens and log-probabilities from its ``logits`` (one row per position)."""
        tokens, logprobs = self._choose(logits, inputs)
        count = accepted(inputs[1:], tokens)
        return _Part(
            moved=[],
            token=mx.reshape(tokens[count], (1,)),
            accepted=mx.reshape(count, (1,)),
            logprobs=logprobs,
            logits=logits if self.processing else None,
        )


@dataclass(eq=False)
class Speculation:
    """Speculative decoding's part of one decode on one rank: the proposer (``None``: the decode guesses nothing),
    the guesses the last message carried, and the tally.

    Only the last rank proposes: the first guesses before the first step (:meth:`open`, where every rank also says
    whether its caches can be cut back), then each step's next ones while the ranks before it compute
    (:meth:`ahead`) and, when those do not stand, once the step's tokens are known (:meth:`following`). The guesses
    reach every rank in the step's message (:attr:`pending`), and every rank takes the same ones (:meth:`guess`).
    """

    proposer: Proposer | None
    draft_length: DraftLength
    max_tokens: int
    sampler: Sampler | None
    mode: SpeculationMode = "auto"  # "serial": one pass at a time; "pipelined": passes in flight (see DecodeRun)
    tokens: list[int] = field(default_factory=list[int])  # generate_step's history, the prompt, every decided token
    pending: list[int] = field(default_factory=list[int])  # the last step's message: the next step's guesses
    active: bool = False  # every rank could cut its caches back, in the first step: the later steps guess
    off: bool = False  # num_draft_tokens="auto" left pipelined speculation: the rest of the request guesses nothing
    proposed: int = 0
    accepted: int = 0
    proposing: float = 0.0  # the last rank, the step running now: seconds proposing its guesses again after it

    def __post_init__(self) -> None:
        fixed = self.draft_length.fixed or 0  # "auto": 0
        # The handshake compares it: 0 without a proposer, else the proposer's fingerprint (+ 1) and k above it.
        mode = SPECULATION_MODES.index(self.mode)
        self.handshake = (
            0 if self.proposer is None else (self.proposer.fingerprint() + 1) | (fixed << 24) | (mode << 29)
        )

    def guess(self, n: int) -> list[int]:
        """The guesses for the step after ``n`` tokens, as the last message carried them: none unless every rank
        said it can speculate, and never more than ``max_tokens`` leaves room for."""
        if self.proposer is None or not self.active or self.off:
            return []
        return self.pending[: self.room(n, len(self.pending))]

    def room(self, n: int, wanted: int) -> int:
        """How many of ``wanted`` guesses the step after ``n`` tokens may carry: as many as tokens are left, as in
        mlx-lm's ``speculative_generate_step`` (the step's own token may then be one too many: it is not yielded)."""
        return wanted if self.max_tokens == -1 else max(0, min(wanted, self.max_tokens - n))

    def open(
        self, stage: PipelineStage, cache: list[Any], timeout: float | None, *, propose: bool = True
    ) -> Exception | None:
        """Before the first step of a speculative decode: every rank says whether its caches can be cut back at any
        length, and the last rank proposes the first step's guesses (the draft reads the prompt, as mlx-lm's does;
        ``propose=False``, pipelined speculation: none, rank 0 proposes in its first tick).

        Returns the proposer's error, if it raised: that fails the first step on every rank (it is acted on there).
        """
        assert self.proposer is not None
        failed: Exception | None = None
        can = always_trimmable(cache)
        guesses: list[int] = []
        saved = _RandomKey() if stage.is_last and self.sampler is not None else None
        if stage.is_last and can and propose:
            try:
                guesses = self.proposer.propose(self.tokens, self.room(0, self.draft_length.next()), self.sampler)
            except Exception as exc:  # acted on in the first step's agreement, by every rank
                failed = exc
                guesses = []
        values = {"can_speculate": int(can), "next_guesses": len(guesses), **_numbered(guesses)}
        try:
            table = GUESSES.exchange(
                stage.group,
                stage.compute_stream,
                values,
                timeout=timeout,
                where="the first guesses",
                who=stage.describe(),
            )
        except Exception as exc:
            stage.mark_broken(exc)
            raise
        self.active = all(table["can_speculate"])
        self.pending = _guesses_of(table) if self.active else []
        if not self.active and saved is not None:
            saved.restore()  # no guesses after all: the samples are plain decoding's
        return failed

    def ahead(self, guesses: list[int], n: int, wanted: int) -> list[int]:
        """The last rank, while the ranks before it compute this step: the proposer's guesses for the next step if
        this one confirms all of ``guesses`` (``n`` tokens before it), led by its guess of this step's own token."""
        assert self.proposer is not None
        room = self.room(n + len(guesses) + 1, wanted)
        if room <= 0:
            return []
        return self.proposer.propose([*self.tokens, *guesses], room + 1, self.sampler, greedy=1)

    def following(
        self, guesses: list[int], n: int, wanted: int, part: _Part, ahead: list[int], drawn: _RandomKey | None
    ) -> list[int]:
        """The last rank, once this step's tokens are sampled: the guesses for the next step. ``ahead`` holds them
        when this step confirmed every guess and sampled the token the proposer expected; else it proposes again,
        drawing from where the random generator stood after this step's samples (``drawn``)."""
        assert self.proposer is not None and part.accepted is not None and part.token is not None
        count, token = cast(int, part.accepted.item()), cast(int, part.token.item())
        decided = [*guesses[:count], token]
        room = self.room(n + len(decided), wanted)
        if count == len(guesses) and ahead[:1] == [token]:
            return ahead[1 : 1 + room]
        if drawn is not None:
            drawn.restore()
        if room <= 0:
            return []
        started = time.perf_counter()
        following = self.proposer.propose([*self.tokens, *decided], room, self.sampler)
        self.proposing = time.perf_counter() - started
        self.draft_length.record_proposal(len(following), self.proposing)
        return following


def _decode_stop(table: Table, n: int, *, stopped_at_token: bool) -> DecodeStop:
    """Why a decode ended after ``n`` tokens, from the last step's table (which every rank holds alike)."""
    failed = table.ranks_with(Status.FAILED, Status.CHUNK_FAILED)
    asked = table.ranks_with(Status.CANCEL)
    if failed:
        return DecodeStop("failed", n, failed)
    if asked:
        return DecodeStop("cancelled", n, asked)
    return DecodeStop("stop" if stopped_at_token else "length", n)


def _numbered(guesses: list[int]) -> dict[str, int]:
    """The ``next_i`` fields of a message that carries ``guesses``."""
    return {f"next_{i}": g for i, g in enumerate(guesses)}


def _guesses_of(table: Table) -> list[int]:
    """The guesses the last rank's ``next_i`` fields carry."""
    return [table.last(f"next_{i}") for i in range(table.last("next_guesses"))]


class _RandomKey:
    """Where MLX's global random generator stands now, to come back to: guesses drawn ahead that do not stand are
    drawn again from there, so the keys drawn are the ones one process drawing after the facts draws."""

    def __init__(self) -> None:
        self.key = cast(mx.array, cast(Any, mx.random.state)[0])  # (the stubs type the state as an object)

    def restore(self) -> None:
        high, low = cast(list[int], self.key.tolist())
        mx.random.seed((high << 32) | low)  # a key is two 32-bit words: the seed that makes it
