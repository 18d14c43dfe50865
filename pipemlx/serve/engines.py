"""What every rank runs: its share of the model (:class:`Rank`), and one of two schedulers behind one interface.

A :class:`Scheduler` applies a step's operations (:class:`~.broadcast.Ops`), the
same on every rank, runs the step, hands rank 0 each token through a
:class:`Sink` and returns the requests that ended. :class:`OneAtATime`
(``--max-concurrency 1``) runs a whole request per step; its cache ends holding
every token the request generated, so the next turn of a conversation reuses all
of it. :class:`Batched` (above 1) runs a tick of the batch per step; a finished
request hands back its cache holding all but its last token (never fed back).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.sample_utils import apply_top_p, make_sampler  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineError, PipelineMismatchError, PrefillCancelled
from ..runtime.batch import BatchGenerator, LogitsProcessor, Response, Sampler
from ..runtime.caches import UNCOUNTED, always_trimmable, cache_offset, cache_parts, counted_offset, trim_to
from ..runtime.generate import generate_step
from ..runtime.stage import stage_of
from .broadcast import HELLO, REQUEST, STEP, Channel, Header, Insert, Ops
from .front import OUTCOMES, Outcome, RequestResult, ServeSettings
from .penalties import Penalties
from .prefix_cache import PrefixCache, PrefixReuse

WARM_UP_TOKENS = 4
MB = float(1 << 20)
DEFAULT_STEP = 128
"""The batch's prefill chunk when ``--step-size`` is not a number: while others decode, each tick adds one chunk
of this many tokens per rank."""


class Rank:
    """What every rank holds: the model, its end of the broadcast, its prefix cache, where it stands."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        group: mx.distributed.Group,
        settings: ServeSettings,
        draft: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.draft = draft  # --draft-model, whole on every rank (speculative decoding, one request at a time)
        self.tokenizer = tokenizer
        self.rank = group.rank()
        self.size = group.size()
        self.settings = settings
        self.stage = stage_of(model)
        self.channel = Channel(group)
        self.prefix = PrefixCache(0)
        self.last_seq = 0
        self.last_cache_tokens = 0
        self.last_outcome = 0
        self.bytes_per_token = 0
        self.trimmable = 0
        self.slots: list[dict[str, int]] = []  # every rank's slot, as of the last broadcast

    def slot(self) -> dict[str, int]:
        return {
            "pid": os.getpid(),
            "last_seq": self.last_seq,
            "cache_tokens": self.last_cache_tokens,
            "outcome": self.last_outcome,
            "bytes_per_token": self.bytes_per_token,
            "trimmable": self.trimmable,
            "prefix_entries": len(self.prefix.entries),
            "prefix_tokens": self.prefix.tokens,
        }

    def exchange(self, fields: Mapping[str, int] | None, timeout: float, what: str) -> Header:
        """One broadcast: rank 0's ``fields`` (``None`` elsewhere) and this rank's slot."""
        header = self.channel.exchange(fields, self.slot(), timeout, what)
        self.slots = header.slots
        return header

    def start(self) -> None:
        """Run one small request through the pipeline (every rank), measure the KV footprint, then greet."""
        cache = make_prompt_cache(self.model)
        prompt = mx.arange(1, WARM_UP_TOKENS + 1, dtype=mx.int32)
        for _ in generate_step(prompt, self.model, prompt_cache=cache, max_tokens=1, timeout=self.settings.timeout):
            pass
        self.bytes_per_token = _bytes_per_token(cache)
        self.trimmable = int(always_trimmable(make_prompt_cache(self.model)))
        hello = {"op": HELLO} if self.rank == 0 else None
        slots = self.exchange(hello, self.settings.timeout, "greeting the other ranks").slots
        largest = max(s["bytes_per_token"] for s in slots)
        # Entries are cut back only when every rank can cut its caches back.
        budget = int(self.settings.prefix_cache_mb * MB) // largest
        self.prefix = PrefixCache(budget, cut_back=all(s["trimmable"] for s in slots))

    def checkout(self, plan: PrefixReuse) -> list[Any]:
        """The cache a request starts from: its planned prefix-cache entry, or a new one."""
        return self.prefix.checkout(plan, lambda: make_prompt_cache(self.model))

    def ended(self, seq: int, cache_tokens: int, outcome: Outcome) -> None:
        """Request ``seq`` left this rank's scheduler, its cache holding ``cache_tokens`` positions."""
        self.last_seq, self.last_cache_tokens, self.last_outcome = seq, cache_tokens, OUTCOMES.index(outcome)


class Sink(Protocol):
    """Rank 0's side of the running requests, which a scheduler reports to (the other ranks have none)."""

    def progress(self, seq: int, processed: int, total: int) -> None:
        """``processed`` of the ``total`` prompt positions request ``seq`` computes are in every rank's cache."""
        ...

    def should_cancel(self, seq: int) -> bool:
        """Whether request ``seq`` is to stop now (its client left, the server is stopping)."""
        ...

    def token(self, seq: int, token: int) -> bool:
        """Request ``seq`` generated ``token``; True when its answer is complete on rank 0 (a stop string)."""
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
    """The scheduler of ``--max-concurrency``; ``TypeError`` (on every rank alike) when the model cannot batch."""
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
        return [(i.seq, self.run(i, sink)) for i in ops.inserts]

    def run(self, insert: Insert, sink: Sink | None) -> RequestResult:
        """Run ``insert`` on this rank, as every rank does; ``sink`` sees its progress and tokens (rank 0)."""
        rank, settings = self.rank, self.rank.settings
        seq, tokens, plan = insert.seq, insert.tokens, insert.plan
        cache = rank.checkout(plan)
        if insert.seed >= 0:
            mx.random.seed(insert.seed)
            if insert.drawn and insert.temperature > 0:  # a resumed request: skip the keys its tokens used
                for _ in range(insert.drawn):
                    mx.random.uniform(shape=())
                # Evaluated here: left lazy, the key would be computed on a helper thread that lacks this stream.
                mx.eval(mx.random.state)  # pyright: ignore[reportUnknownMemberType]
        # Greedy as no sampler: generate_step then takes the argmax of the logits (no log-softmax to wait for).
        sampler = None if insert.temperature <= 0 else make_sampler(insert.temperature, top_p=insert.top_p)
        new = len(tokens) - plan.reuse
        step: int | Literal["auto"] = settings.prefill_step_size
        generated: list[int] = []
        outcome: Outcome = "length"
        error: BaseException | None = None
        kept = tokens
        prefilled = new
        # Speculative decoding (--draft-model, --prompt-lookup) unless the request said "draft": false.
        guess = insert.draft and (rank.draft is not None or settings.prompt_lookup is not None)
        generator = generate_step(
            mx.array(tokens[plan.reuse :], dtype=mx.int32),
            rank.model,
            prompt_cache=cache,
            max_tokens=insert.max_tokens,
            sampler=sampler,
            logits_processors=_seeing(tokens[: plan.reuse], insert.penalties),
            prefill_step_size=step,
            prompt_progress_callback=None if sink is None else lambda done, total: sink.progress(seq, done, total),
            should_cancel=None if sink is None else lambda: sink.should_cancel(seq),
            timeout=settings.timeout,
            draft_model=rank.draft if guess else None,
            num_draft_tokens=settings.num_draft_tokens,
            prompt_lookup=settings.prompt_lookup if guess else None,
            history=tokens[: plan.reuse],  # the proposer reads the reused prefix too
        )
        try:
            try:
                for token, _ in generator:
                    generated.append(token)
                    if sink is not None and sink.token(seq, token):
                        outcome = "stop"
                        break
            finally:
                generator.close()
            # What every rank decided: with guesses, rank 0's stop string may have come before the end of a pass
            # whose tokens are in every cache (streamed: ``generated``, up to the stop).
            kept = tokens + generator.decided
            if outcome != "stop":
                reason = generator.stop.reason if generator.stop is not None else "length"
                outcome = "failed" if reason == "failed" else "cancelled" if reason == "cancelled" else "length"
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
            rank.prefix.store(kept, cache)
        rank.ended(seq, offset, outcome)
        proposed, accepted = generator.guesses
        return RequestResult(outcome, generated, plan.reuse, offset, prefilled, error, proposed, accepted)


@dataclass
class _Request:
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
            stop_tokens=[int(t) for t in getattr(rank.tokenizer, "eos_token_ids", ())],
            prefill_step_size=step,
            prefill_chunk_tokens=step if isinstance(step, int) else DEFAULT_STEP,
            prefill_chunking=settings.prefill_chunking,
            timeout=settings.timeout,
        )
        self.requests: dict[int, _Request] = {}  # by request number
        self.seqs: dict[int, int] = {}  # the generator's uid -> request number

    def active(self) -> Collection[int]:
        return self.requests.keys()

    def apply(self, ops: Ops, sink: Sink | None) -> list[tuple[int, RequestResult]]:
        caches = [self.rank.checkout(i.plan) for i in ops.inserts]
        ended: list[tuple[int, RequestResult]] = []
        gone = [self.requests[seq] for seq in ops.removes if seq in self.requests]
        agreed = [self._agreed_prompt(r) for r in gone]  # asked before the generator forgets them
        self.generator.remove([r.uid for r in gone])
        for request, length in zip(gone, agreed):
            self._keep_prompt(request, length)
            ended.append(self._end(request, "cancelled", None if request.generated else length))
        if ops.inserts:
            uids = self.generator.insert(
                [i.tokens[i.plan.reuse :] for i in ops.inserts],
                max_tokens=[i.max_tokens for i in ops.inserts],
                samplers=[request_sampler(i.temperature, i.top_p, i.seed, i.drawn) for i in ops.inserts],
                caches=caches,
                logits_processors=[i.penalties.processors() for i in ops.inserts],
                all_tokens=[i.tokens[: i.plan.reuse] for i in ops.inserts],
            )
            for insert, uid, cache in zip(ops.inserts, uids, caches):
                self.requests[insert.seq] = _Request(insert, uid, cache)
                self.seqs[uid] = insert.seq
        for response in self.generator.next():
            seq = self.seqs[response.uid]
            request = self.requests[seq]
            if response.finish_reason == "error":  # its cache may hold a stand-in's zeros: never reused
                request.prompt_cache = None
                ended.append(self._end(request, "failed", error=self.generator.last_error))
                continue
            request.generated.append(response.token)
            self._keep_prompt(request, None)
            complete = sink is not None and sink.token(seq, response.token)
            if response.finish_reason is not None:
                self._keep_answer(request, response)
                ended.append(self._end(request, "stop" if complete else response.finish_reason))
            elif complete:  # rank 0 answers it now; every rank removes it at the next step
                ended.append((seq, self._result(request, "stop")))
        if sink is not None:
            for seq, request in self.requests.items():
                if not request.generated:
                    new = len(request.insert.tokens) - request.insert.plan.reuse
                    sink.progress(seq, self.generator.prefilled(request.uid), new)
        return ended

    def _agreed_prompt(self, request: _Request) -> int:
        """Positions of ``request``'s prompt that every rank holds (a rank ahead in the prefill holds more): its
        reused prefix and what all prefilled."""
        return request.insert.plan.reuse + self.generator.prefilled(request.uid)

    def _keep_prompt(self, request: _Request, length: int | None) -> None:
        """Keep the first ``length`` positions of ``request``'s prompt in the prefix cache (once, the first time).

        ``length`` is the same on every rank (``None``: the prompt but its last token, which a decoding request's
        cache holds); a cache holding more is cut back to it, so that every rank keeps the same entry.
        """
        cache, request.prompt_cache = request.prompt_cache, None
        prefix = self.rank.prefix
        tokens = request.insert.tokens
        if cache is None or prefix.budget_tokens <= 0:
            return
        if length is None:  # the request decodes: its own cache holds exactly this on every rank, nothing to cut
            if len(tokens) > 1:
                prefix.store(tokens[:-1], cache)
        elif 0 < length < len(tokens) and prefix.cut_back and trim_to(cache, length):
            # (``cut_back``: every rank can cut back, so every rank keeps it or none does.)
            prefix.store(tokens[:length], cache)

    def _keep_answer(self, request: _Request, response: Response) -> None:
        """Keep a finished request's conversation: its prompt and every token but the last (never fed back)."""
        tokens = request.insert.tokens + request.generated
        if response.prompt_cache is None or self.rank.prefix.budget_tokens <= 0 or len(tokens) < 2:
            return
        self.rank.prefix.store(tokens[:-1], response.prompt_cache)

    def _result(
        self, request: _Request, outcome: Outcome, agreed: int | None = None, error: BaseException | None = None
    ) -> RequestResult:
        """``agreed``: a request removed in its prefill, the prompt positions every rank holds."""
        insert = request.insert
        reuse = insert.plan.reuse
        cache_tokens = len(insert.tokens) + len(request.generated) - 1 if agreed is None else agreed
        prefilled = len(insert.tokens) - reuse if agreed is None else agreed - reuse
        if outcome == "failed" and error is None:
            error = RuntimeError("the model raised on another rank")
        return RequestResult(outcome, list(request.generated), reuse, max(cache_tokens, 0), prefilled, error)

    def _end(
        self, request: _Request, outcome: Outcome, agreed: int | None = None, error: BaseException | None = None
    ) -> tuple[int, RequestResult]:
        """``request`` leaves the batch."""
        seq = request.insert.seq
        del self.requests[seq]
        del self.seqs[request.uid]
        result = self._result(request, outcome, agreed, error)
        self.rank.ended(seq, result.cache_tokens, outcome)
        return seq, result


def request_sampler(temperature: float, top_p: float, seed: int, drawn: int = 0) -> Sampler | None:
    """The sampler of one batched request: ``None`` (greedy) at temperature 0, else categorical with its own key.

    Each call splits the request's key as MLX's global generator splits its
    own, so the draws equal a solo run after ``mx.random.seed(seed)``: what
    else is in the batch does not change a seeded request's text. ``drawn``
    keys are skipped first (a request resumed after ``drawn`` tokens draws
    what the undisturbed run draws next).
    """
    if temperature <= 0:
        return None
    state = [mx.random.key(seed)]
    for _ in range(drawn):
        state[0] = mx.random.split(state[0])[0]
    # Evaluated here: left lazy, the key would be computed on a helper thread that lacks this thread's stream.
    mx.eval(state[0])  # pyright: ignore[reportUnknownMemberType]

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        pair = mx.random.split(state[0])
        state[0] = pair[0]
        return mx.random.categorical(logprobs * (1.0 / temperature), key=pair[1])

    return sample


def _seeing(reused: list[int], penalties: Penalties) -> list[LogitsProcessor] | None:
    """``penalties``' processors, shown the ``reused`` prompt tokens (in the cache, not passed) before the rest.

    ``generate_step`` hands its processors the prompt it was given and the
    tokens generated since; a request continuing a cached prefix was given
    only the rest of its prompt. Its answer equals a single process's on the
    whole prompt only if the processors see all of it.
    """
    processors = penalties.processors()
    if processors is None or not reused:
        return processors
    before = mx.array(reused, dtype=mx.int32)

    def seeing(processor: LogitsProcessor) -> LogitsProcessor:
        return lambda tokens, logits: processor(mx.concatenate([before, tokens.astype(mx.int32)]), logits)

    return [seeing(p) for p in processors]


def _bytes_per_token(cache: list[Any]) -> int:
    """The KV bytes one cached position takes in ``cache`` (this rank's layers), from the arrays it holds."""
    offset = max(1, cache_offset(cache))
    total = 0.0
    for c in cache_parts(cache):
        leaves = cast(list[tuple[str, Any]], tree_flatten(c.state))
        size = sum(a.nbytes for _, a in leaves if isinstance(a, mx.array))
        keys = getattr(c, "keys", None)  # a KVCache allocates positions ahead: divide by what it holds room for
        positions = keys.shape[-2] if isinstance(keys, mx.array) and keys.ndim >= 2 else offset
        total += size / max(1, positions)
    return max(1, round(total))
