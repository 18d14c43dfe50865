"""How the ranks run the requests: two schedulers behind one interface, the same calls on every rank.

A :class:`Scheduler` applies a step's operations (:class:`~.broadcast.Ops`), the
same on every rank, runs the step, hands rank 0 each token through a
:class:`Sink` and returns the requests that ended. :class:`OneAtATime`
(``--decode-concurrency 1``) runs a whole request per step; its cache ends holding
every token the request generated, so the next turn of a conversation reuses all
of it. :class:`Batched` (above 1) runs a tick of the batch per step; a finished
request hands back its cache holding every token too (its closing tick fed the last).
Both end a request at an end-of-sequence token in the step that yields it, on
every rank alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import mlx.core as mx

from ..errors import PipelineError, PipelineMismatchError, PrefillCancelled
from ..runtime.batch import BatchGenerator, LogitsProcessor, Response, Sampler
from ..runtime.caches import UNCOUNTED, counted_offset, trim_to
from ..runtime.generate import generate_step
from .broadcast import REQUEST, STEP, Insert, Ops
from .rank import Rank
from .requests import Outcome, Request, RequestResult, SamplingParams, describe

DEFAULT_STEP = 128
"""The batch's prefill chunk when ``--step-size`` is not a number: while others decode, each tick adds one chunk
of this many tokens per rank."""


class Sink(Protocol):
    """Rank 0's side of the running requests, which a scheduler reports to (the other ranks have none)."""

    def progress(self, request_id: int, processed: int, total: int) -> None:
        """``processed`` of the ``total`` prompt positions the request computes are in every rank's cache."""
        ...

    def should_cancel(self, request_id: int) -> bool:
        """Whether the request is to stop now (its client left, the server is stopping)."""
        ...

    def token(self, request_id: int, token: int) -> bool:
        """The request generated ``token``; True when its answer is complete on rank 0 (a stop string)."""
        ...


class Scheduler(Protocol):
    """How the ranks run the requests; every rank makes the same calls with the same operations."""

    op: int  # the broadcast operation of a step (REQUEST, STEP); a rank told another one is out of step
    unit: str  # what a step is called in messages
    capacity: int  # the most requests it runs at once

    def active(self) -> Collection[int]:
        """The requests it holds between steps (rank 0 removes those answered or cancelled)."""
        ...

    def apply(self, ops: Ops, sink: Sink | None) -> list[tuple[int, RequestResult]]:
        """Remove, insert, run one step; the requests that ended in it (rank 0 also: those its sink completed)."""
        ...


def make_scheduler(rank: Rank) -> Scheduler:
    """The scheduler of ``--decode-concurrency``; ``TypeError`` (on every rank alike) when the model cannot batch."""
    return Batched(rank) if rank.settings.max_concurrency > 1 else OneAtATime(rank)


class OneAtATime:
    """One request per step, run whole by :func:`pipemlx.generate_step` on every rank."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.op = REQUEST
        self.unit = "request"
        self.capacity = 1

    def active(self) -> Collection[int]:
        return ()

    def apply(self, ops: Ops, sink: Sink | None) -> list[tuple[int, RequestResult]]:
        if ops.removes or len(ops.inserts) > 1:
            raise PipelineMismatchError(f"{self.rank.stage.describe()}: a step of one request holds other operations")
        return [(i.request.id, self.run(i, sink)) for i in ops.inserts]

    def run(self, insert: Insert, sink: Sink | None) -> RequestResult:
        """Run ``insert`` on this rank, as every rank does; ``sink`` sees its progress and tokens (rank 0)."""
        rank, settings = self.rank, self.rank.settings
        request, plan = insert.request, insert.plan
        request_id, tokens, sampling = request.id, request.tokens, request.sampling
        cache = rank.checkout(plan)
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
            if request.drawn and sampling.temperature > 0:  # a resumed request: skip the keys its tokens used
                for _ in range(request.drawn):
                    mx.random.uniform(shape=())
                # Evaluated here: left lazy, the key would be computed on a helper thread that lacks this stream.
                mx.eval(mx.random.state)  # pyright: ignore[reportUnknownMemberType]
        new = len(tokens) - plan.reuse
        step: int | Literal["auto"] = settings.prefill_step_size
        generated: list[int] = []
        outcome: Outcome = "length"
        error: BaseException | None = None
        kept = tokens
        prefilled = new
        # Speculative decoding (--draft-model, --prompt-lookup) unless the request said "draft": false.
        guess = sampling.draft and (rank.draft is not None or settings.prompt_lookup is not None)
        generator = generate_step(
            mx.array(tokens[plan.reuse :], dtype=mx.int32),
            rank.model,
            prompt_cache=cache,
            max_tokens=request.max_tokens,
            sampler=sampling.sampler(),  # greedy as None: the argmax of the logits (no log-softmax to wait for)
            logits_processors=_seeing(tokens[: plan.reuse], sampling),
            prefill_step_size=step,
            prompt_progress_callback=None
            if sink is None
            else lambda done, total: sink.progress(request_id, done, total),
            should_cancel=None if sink is None else lambda: sink.should_cancel(request_id),
            timeout=settings.timeout,
            stop_tokens=rank.eos,  # the end of sequence ends the request in the step that yields it, on every rank
            draft_model=rank.draft if guess else None,
            num_draft_tokens=settings.num_draft_tokens,
            prompt_lookup=settings.prompt_lookup if guess else None,
            history=tokens[: plan.reuse],  # the proposer reads the reused prefix too
            logprobs=False,  # never read here (serve refuses requests for them): head="split" gathers no logits
        )
        try:
            try:
                for token, _ in generator:
                    generated.append(token)
                    if sink is not None and sink.token(request_id, token):
                        outcome = "stop"
                        break
            finally:
                generator.close()
            # What every rank decided: with guesses, rank 0's stop string may have come before the end of a pass
            # whose tokens are in every cache (streamed: ``generated``, up to the stop).
            kept = tokens + generator.decided
            if outcome != "stop":
                reason = generator.stop.reason if generator.stop is not None else "length"
                outcome = reason if reason in ("failed", "cancelled", "stop") else "length"
        except PrefillCancelled as exc:
            outcome = "cancelled" if not exc.failed_ranks else "failed"
            # A rank that cannot cut its caches back keeps nothing: every rank must keep the same entries.
            kept = tokens[: plan.reuse + exc.processed] if exc.cache_trimmed and rank.prefix.cut_back else []
            prefilled = exc.processed
            error = exc if exc.failed_ranks else None
        except PipelineMismatchError as exc:  # every rank raised it (the group is fine): drop the prefix caches
            rank.prefix.clear()
            outcome, kept, error = "failed", [], exc
        except PipelineError:  # a lost or stalled peer, or a pipeline this rank cannot use any more
            raise
        except Exception as exc:  # this rank's own error (a callback, the model): the stop was agreed
            outcome, kept, error = "failed", [], exc
        offset = counted_offset(cache)
        if offset == UNCOUNTED:  # recurrent layers only: the agreed stop left the same positions as on the others
            offset = len(kept)
        if outcome != "failed" and kept and offset == len(kept):
            rank.prefix.store(kept, cache, request.partition)
        rank.ended(request_id, offset, outcome)
        proposed, accepted = generator.guesses
        return RequestResult(
            outcome, plan.reuse, offset, prefilled, describe(error), proposed, accepted, len(generated)
        )


@dataclass
class InBatch:
    """A request in the batch, on every rank."""

    insert: Insert
    uid: int
    prompt_cache: list[Any] | None  # the cache its prompt is prefilled in, until kept in the prefix cache
    generated: list[int] = field(default_factory=list[int])


class Batched:
    """Every rank's :class:`pipemlx.BatchGenerator`, one tick per step.

    Each insert starts from its planned prefix-cache entry (checked out before
    anything is stored in the step, so the plans rank 0 made still hold). Once a
    request's prompt is in its cache, or when it is removed during its prefill,
    that cache is kept in the prefix cache; when it finishes, the cache the
    generator hands back (its prompt and answer) replaces it, on every rank alike.
    """

    def __init__(self, rank: Rank) -> None:
        """Raises ``TypeError`` (on every rank alike) when mlx-lm cannot batch this model's layer caches."""
        self.rank = rank
        settings = rank.settings
        self.op = STEP
        self.unit = "batch step"
        self.capacity = settings.max_concurrency
        step = settings.prefill_step_size
        self.generator = BatchGenerator(
            rank.model,
            stop_tokens=rank.eos,
            prefill_step_size=step,
            prefill_chunk_tokens=step if isinstance(step, int) else DEFAULT_STEP,
            prefill_chunking=settings.prefill_chunking,
            decode_groups=settings.decode_groups,
            timeout=settings.timeout,
            logprobs=False,  # never read here (serve refuses requests for them): head="split" gathers no logits
            prompt_lookup=settings.prompt_lookup,  # speculation in the batch (--prompt-lookup or --draft-model)
            draft_model=rank.draft,
            num_draft_tokens=settings.num_draft_tokens,
        )
        self.requests: dict[int, InBatch] = {}  # by request id
        self.ids: dict[int, int] = {}  # the generator's uid -> request id

    def active(self) -> Collection[int]:
        return self.requests.keys()

    def apply(self, ops: Ops, sink: Sink | None) -> list[tuple[int, RequestResult]]:
        caches = [self.rank.checkout(i.plan) for i in ops.inserts]
        ended: list[tuple[int, RequestResult]] = []
        gone = [self.requests[i] for i in ops.removes if i in self.requests]
        agreed = [self._agreed_prompt(r) for r in gone]  # asked before the generator forgets them
        decoding = {r.uid for r in gone if r.generated}
        handed = self.generator.remove(decoding, return_prompt_caches=True) if decoding else {}
        self.generator.remove([r.uid for r in gone if r.uid not in decoding])
        for request, length in zip(gone, agreed):
            self._keep_prompt(request, length)
            if request.uid in handed:
                self._keep_decided(request, *handed[request.uid])
            ended.append(self._end(request, "cancelled", None if request.generated else length))
        if ops.inserts:
            requests = [i.request for i in ops.inserts]
            uids = self.generator.insert(
                [i.request.tokens[i.plan.reuse :] for i in ops.inserts],
                max_tokens=[r.max_tokens for r in requests],
                samplers=[_keyed_sampler(r) for r in requests],
                caches=caches,
                logits_processors=[r.sampling.processors() for r in requests],
                all_tokens=[i.request.tokens[: i.plan.reuse] for i in ops.inserts],
                draft=[r.sampling.draft for r in requests],
            )
            for insert, uid, cache in zip(ops.inserts, uids, caches):
                self.requests[insert.request.id] = InBatch(insert, uid, cache)
                self.ids[uid] = insert.request.id
        answered: set[int] = set()  # rank 0 answered it in this step (a stop string): its later tokens are not sent
        for response in self.generator.next():  # with guesses, a request may have several tokens in a step
            request_id = self.ids.get(response.uid)
            if request_id is None:
                continue
            request = self.requests[request_id]
            # Rank 0 answered it earlier in this step (a stop string inside a pass): the pass's later tokens are
            # counted and cached as every other rank does (their figures and prefix caches agree), never sent, and
            # its result is not given twice.
            quiet = request_id in answered
            if response.finish_reason == "error":  # its cache may hold a stand-in's zeros: never reused
                request.prompt_cache = None
                end = self._end(request, "failed", error=self.generator.last_error)
                ended.extend([] if quiet else [end])
                continue
            request.generated.append(response.token)
            self._keep_prompt(request, None)
            complete = not quiet and sink is not None and sink.token(request_id, response.token)
            if response.finish_reason is not None:
                self._keep_answer(request, response)
                end = self._end(request, "stop" if complete else response.finish_reason)
                ended.extend([] if quiet else [end])
            elif complete:  # rank 0 answers it now; every rank removes it at the next step
                answered.add(request_id)
                ended.append((request_id, self._result(request, "stop")))
        if sink is not None:
            for request_id, request in self.requests.items():
                if not request.generated:
                    new = len(request.insert.request.tokens) - request.insert.plan.reuse
                    sink.progress(request_id, self.generator.prefilled(request.uid), new)
        return ended

    def _agreed_prompt(self, request: InBatch) -> int:
        """Positions of ``request``'s prompt that every rank holds (a rank ahead in the prefill holds more): its
        reused prefix and what all prefilled."""
        return request.insert.plan.reuse + self.generator.prefilled(request.uid)

    def _keep_prompt(self, request: InBatch, length: int | None) -> None:
        """Keep the first ``length`` positions of ``request``'s prompt in the prefix cache (once, the first time).

        ``length`` is the same on every rank (``None``: the prompt but its last token, which a decoding request's
        cache holds); a cache holding more is cut back to it, so that every rank keeps the same entry.
        """
        cache, request.prompt_cache = request.prompt_cache, None
        prefix = self.rank.prefix
        tokens = request.insert.request.tokens
        partition = request.insert.request.partition
        if cache is None or prefix.budget_tokens <= 0:
            return
        if length is None:  # the request decodes: its own cache holds exactly this on every rank, nothing to cut
            if len(tokens) > 1:
                prefix.store(tokens[:-1], cache, partition)
        elif 0 < length < len(tokens) and prefix.cut_back and trim_to(cache, length):
            # (``cut_back``: every rank can cut back, so every rank keeps it or none does.)
            prefix.store(tokens[:length], cache, partition)

    def _keep_decided(self, request: InBatch, cache: list[Any] | None, held: list[int]) -> None:
        """Keep a request removed while it decodes (a stop string rank 0 answered, a client that left) with every
        token its caches hold, which every rank decided alike (with guesses, the confirmed ones fed in the last
        step too, not yet returned): the next turn reuses its answer as well, as after a request decoded one at a
        time."""
        tokens = request.insert.request.tokens
        if cache is None or self.rank.prefix.budget_tokens <= 0 or len(held) <= len(tokens):
            return
        answer = held[len(tokens) :]
        if held[: len(tokens)] != tokens or answer[: len(request.generated)] != request.generated[: len(answer)]:
            return  # (never: the caches hold the prompt and the tokens decided since)
        self.rank.prefix.store(held, cache, request.insert.request.partition)

    def _keep_answer(self, request: InBatch, response: Response) -> None:
        """Keep a finished request's conversation: its prompt and every token (its closing tick fed the last)."""
        tokens = request.insert.request.tokens + request.generated
        if response.prompt_cache is None or self.rank.prefix.budget_tokens <= 0:
            return
        self.rank.prefix.store(tokens, response.prompt_cache, request.insert.request.partition)

    def _result(
        self, request: InBatch, outcome: Outcome, agreed: int | None = None, error: BaseException | None = None
    ) -> RequestResult:
        """``agreed``: a request removed in its prefill, the prompt positions every rank holds."""
        tokens, reuse = request.insert.request.tokens, request.insert.plan.reuse
        cache_tokens = len(tokens) + len(request.generated) if agreed is None else agreed  # every returned token fed
        prefilled = len(tokens) - reuse if agreed is None else agreed - reuse
        if outcome == "failed" and error is None:
            error = RuntimeError("the model raised on another rank")
        proposed, accepted = self.generator.guesses_of(request.uid)
        return RequestResult(
            outcome,
            reuse,
            max(cache_tokens, 0),
            prefilled,
            describe(error),
            proposed,
            accepted,
            generated=len(request.generated),
        )

    def _end(
        self, request: InBatch, outcome: Outcome, agreed: int | None = None, error: BaseException | None = None
    ) -> tuple[int, RequestResult]:
        """``request`` leaves the batch."""
        request_id = request.insert.request.id
        del self.requests[request_id]
        del self.ids[request.uid]
        result = self._result(request, outcome, agreed, error)
        self.rank.ended(request_id, result.cache_tokens, outcome)
        return request_id, result


def _keyed_sampler(request: Request) -> Sampler | None:
    """A batched request's sampler: its own key, so what else is in the batch does not change a seeded request's
    text (the seed is agreed at admission whenever the request samples)."""
    seed = request.sampling.seed
    return request.sampling.keyed_sampler(0 if seed is None else seed, request.drawn)


def _seeing(reused: list[int], sampling: SamplingParams) -> list[LogitsProcessor] | None:
    """The penalties' processors, shown the ``reused`` prompt tokens (in the cache, not passed) before the rest.

    ``generate_step`` hands its processors the prompt it was given and the
    tokens generated since; a request continuing a cached prefix was given
    only the rest of its prompt. Its answer equals a single process's on the
    whole prompt only if the processors see all of it.
    """
    processors = sampling.processors()
    if processors is None or not reused:
        return processors
    before = mx.array(reused, dtype=mx.int32)

    def seeing(processor: LogitsProcessor) -> LogitsProcessor:
        return lambda tokens, logits: processor(mx.concatenate([before, tokens.astype(mx.int32)]), logits)

    return [seeing(p) for p in processors]
