"""Continuous batching for ``pipemlx serve --max-concurrency N`` (N > 1): requests decode together.

At every step boundary rank 0 (:class:`BatchLeader`) decides the operations:
the requests to remove (their client left, a stop string ended them on rank 0,
the server is stopping) and the waiting requests to insert (first come, first
served, while fewer than N run), each with its token ids, ``max_tokens`` and
sampling parameters. It broadcasts them as one ``STEP`` header
(:mod:`.broadcast`), followed, when there are any, by one all-sum of the
encoded operations (:func:`encode_ops`). Every rank then applies them to its own
:class:`pipemlx.BatchGenerator` in the same order and runs one
:meth:`~pipemlx.BatchGenerator.next` (:class:`BatchRunner`): every rank makes
the same calls with the same arguments, as the generator requires, and a
removal takes effect on every rank at the same step. The tokens are the same on
every rank; only rank 0 turns them into text and answers the clients.

A sampled request samples with its own random key, seeded from its ``seed``
(rank 0 draws one when the request has none), and draws exactly the numbers a
solo run seeded with ``mx.random.seed(seed)`` draws, so what else is in the
batch does not change its text.

A lost or stalled peer (or any error inside a step, which leaves the pipeline
unusable) fails every request in flight with a 503 and the server exits, as
with one request at a time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.sample_utils import apply_top_p  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineMismatchError
from ..runtime.batch import BatchGenerator, Response, Sampler
from ..runtime.caches import trim_to
from .broadcast import IDLE, OUTCOMES, PENALTY_FIELDS, SHUTDOWN, STEP, bits_float, checksum, float_bits
from .engine import (
    TICK,
    Engine,
    Event,
    Job,
    Leader,
    LeaderConsumer,
    RequestResult,
    ServeSettings,
    log,
)
from .penalties import Penalties
from .prefix_cache import Plan
from .protocol import unavailable

DEFAULT_STEP = 128
"""Prefill chunk of a new prompt when ``--step-size`` is not a number: while others decode, each batch step
(one tick of :class:`pipemlx.BatchGenerator`) adds one chunk of this many tokens per rank."""
INSERT_FIELDS = 9 + len(PENALTY_FIELDS)
"""seq, prompt length, max_tokens, temperature bits, top_p bits, seed, prefix entry, reuse, copy."""


@dataclass(frozen=True)
class Insert:
    """A request joining the batch, as every rank receives it."""

    seq: int
    tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    plan: Plan = field(default_factory=Plan)
    penalties: Penalties = field(default_factory=Penalties)


@dataclass(frozen=True)
class Ops:
    """One step boundary's operations: remove ``removes`` (request numbers), then insert ``inserts``, then step."""

    removes: list[int] = field(default_factory=list[int])
    inserts: list[Insert] = field(default_factory=list[Insert])


def encode_ops(ops: Ops) -> list[int]:
    """``ops`` as int32 values for the broadcast; :func:`decode_ops` reverses it exactly."""
    values = [len(ops.removes), len(ops.inserts), *ops.removes]
    for i in ops.inserts:
        values += [i.seq, len(i.tokens), i.max_tokens, float_bits(i.temperature), float_bits(i.top_p), i.seed]
        values += [i.plan.entry, i.plan.reuse, int(i.plan.copy), *i.penalties.to_ints(), *i.tokens]
    return values


def decode_ops(values: Sequence[int]) -> Ops:
    """The :class:`Ops` that :func:`encode_ops` made; :class:`PipelineMismatchError` when ``values`` are not such."""
    if not values:
        return Ops()
    try:
        removes_count, inserts_count = values[0], values[1]
        at = 2 + removes_count
        removes = list(values[2:at])
        inserts: list[Insert] = []
        for _ in range(inserts_count):
            seq, length, max_tokens, temp, top_p, seed, entry, reuse, copy = values[at : at + 9]
            penalties = Penalties.from_ints(list(values[at + 9 : at + INSERT_FIELDS]))
            at += INSERT_FIELDS
            tokens = list(values[at : at + length])
            at += length
            if len(tokens) != length or length < 1:
                raise ValueError("a prompt is cut short")
            plan = Plan(entry, reuse, bool(copy))
            inserts.append(Insert(seq, tokens, max_tokens, bits_float(temp), bits_float(top_p), seed, plan, penalties))
    except ValueError as exc:
        raise PipelineMismatchError(f"a batch step's operations arrived damaged: {exc}") from exc
    if at != len(values) or len(removes) != removes_count:
        raise PipelineMismatchError("a batch step's operations arrived damaged (wrong length)")
    return Ops(removes, inserts)


def request_sampler(temperature: float, top_p: float, seed: int) -> Sampler | None:
    """The sampler of one request: ``None`` (greedy) at temperature 0, else categorical with its own key.

    Each call splits the request's key as MLX's global generator splits its
    own, so the draws equal a solo run after ``mx.random.seed(seed)``.
    """
    if temperature <= 0:
        return None
    state = [mx.random.key(seed)]

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        pair = mx.random.split(state[0])
        state[0] = pair[0]
        return mx.random.categorical(logprobs * (1.0 / temperature), key=pair[1])

    return sample


def share_entries(inserts: list[Insert]) -> list[Insert]:
    """Inserts of one step that start from the same prefix-cache entry copy it (none may take it from another)."""
    uses: dict[int, int] = {}
    for i in inserts:
        uses[i.plan.entry] = uses.get(i.plan.entry, 0) + 1
    return [
        replace(i, plan=replace(i.plan, copy=True)) if i.plan.entry >= 0 and uses[i.plan.entry] > 1 else i
        for i in inserts
    ]


class BatchRunner:
    """Every rank's :class:`pipemlx.BatchGenerator`, driven by the broadcast operations.

    :meth:`apply` makes the same generator calls on every rank for the same
    ``ops``, and keeps the rank's slot (the last request it finished, how many
    positions its cache held for it) up to date for ``/health``.
    """

    def __init__(self, engine: Engine) -> None:
        """Raises ``TypeError`` (on every rank alike) when mlx-lm cannot batch this model's layer caches."""
        self.engine = engine
        settings = engine.settings
        step = settings.step_size if isinstance(settings.step_size, int) else DEFAULT_STEP
        eos = [int(t) for t in getattr(engine.tokenizer, "eos_token_ids", ())]
        self.generator = BatchGenerator(
            engine.model,
            stop_tokens=eos,
            prefill_step_size=step,
            prefill_chunk_tokens=step,
            prefill_chunking=settings.prefill_chunking,
            timeout=settings.timeout,
        )
        self.uids: dict[int, int] = {}  # request number -> the generator's uid
        self.seqs: dict[int, int] = {}
        self.prompts: dict[int, tuple[list[int], list[Any]]] = {}  # prompts not yet stored in the prefix cache
        self.reused: dict[int, int] = {}  # request number -> prompt positions its cache held at insert
        self.answers: dict[int, list[int]] = {}  # request number -> its prompt and the tokens generated so far

    def apply(self, ops: Ops) -> list[tuple[int, Response]]:
        """Remove, insert, then one :meth:`~pipemlx.BatchGenerator.next`; every response with its request number.

        Each insert starts from its planned prefix-cache entry (checked out
        before anything is stored in this step, so the plans rank 0 made still
        hold) and is prefilled from the first token the entry lacks. Once a
        request's prompt is in its cache (its first token arrives), or when it
        is removed while its prompt is still being prefilled, the cache it was
        prefilled in is stored in the prefix cache, on every rank alike.
        """
        engine = self.engine
        caches = [engine.prefix.checkout(i.plan, lambda: make_prompt_cache(engine.model)) for i in ops.inserts]
        gone = [seq for seq in ops.removes if seq in self.uids]
        agreed = {seq: self._agreed_prompt(seq) for seq in gone}  # asked before the generator forgets them
        self.generator.remove([self.uids[seq] for seq in gone])
        for seq in gone:
            self._keep_prompt(seq, agreed[seq])
            self._forget(seq, "cancelled")
        if ops.inserts:
            uids = self.generator.insert(
                [i.tokens[i.plan.reuse :] for i in ops.inserts],
                max_tokens=[i.max_tokens for i in ops.inserts],
                samplers=[request_sampler(i.temperature, i.top_p, i.seed) for i in ops.inserts],
                caches=caches,
                logits_processors=[i.penalties.processors() for i in ops.inserts],
                all_tokens=[i.tokens[: i.plan.reuse] for i in ops.inserts],
            )
            for insert, uid, cache in zip(ops.inserts, uids, caches):
                self.uids[insert.seq] = uid
                self.seqs[uid] = insert.seq
                self.prompts[insert.seq] = (insert.tokens, cache)
                self.answers[insert.seq] = list(insert.tokens)
                self.reused[insert.seq] = insert.plan.reuse
        responses = [(self.seqs[r.uid], r) for r in self.generator.next()]
        for seq, response in responses:
            self.answers[seq].append(response.token)
            if response.finish_reason == "error":  # its cache may hold a stand-in's zeros: never reused
                self.prompts.pop(seq, None)
            self._keep_prompt(seq, None)
            if response.finish_reason is not None:
                self._keep_answer(seq, response)
                self._forget(seq, "failed" if response.finish_reason == "error" else response.finish_reason)
        return responses

    def _agreed_prompt(self, seq: int) -> int:
        """Positions of request ``seq``'s prompt that every rank holds: its reused prefix and what all prefilled.

        A rank ahead in the prefill pipeline holds more in its own cache (rank 0
        computes chunk k while the last rank computes an earlier one): only this
        count is the same on every rank.
        """
        return self.reused.get(seq, 0) + self.generator.prefilled(self.uids[seq])

    def _keep_prompt(self, seq: int, length: int | None) -> None:
        """Store the first ``length`` positions of request ``seq``'s prompt (once, the first time).

        ``length`` is the same on every rank (``None``: the prompt but its last
        token, which a decoding request's cache holds on every rank); a cache
        holding more (a rank ahead in the prefill) is cut back to it, so that
        every rank stores the same entry.
        """
        kept = self.prompts.pop(seq, None)
        self.reused.pop(seq, None)
        prefix = self.engine.prefix
        if kept is None or prefix.budget_tokens <= 0:
            return
        tokens, cache = kept
        if length is None:  # the request decodes: its own cache holds exactly this on every rank, nothing to cut
            if len(tokens) > 1:
                prefix.store(tokens[:-1], cache)
        elif 0 < length < len(tokens) and prefix.cut_back and trim_to(cache, length):
            # (``cut_back``: every rank can cut back, so every rank stores it or none does.)
            prefix.store(tokens[:length], cache)

    def _keep_answer(self, seq: int, response: Response) -> None:
        """Store a finished request's whole conversation: its prompt and every token but the last (never fed).

        The cache is the one the generator hands back (evaluated) with the final
        response, the same positions on every rank; the next turn of the conversation then
        prefills only what it adds.
        """
        tokens = self.answers.get(seq, [])
        if response.prompt_cache is None or self.engine.prefix.budget_tokens <= 0 or len(tokens) < 2:
            return
        self.engine.prefix.store(tokens[:-1], response.prompt_cache)

    def apply_payload(self, payload: list[int]) -> list[tuple[int, Response]]:
        """:meth:`apply` on operations as they arrive from the broadcast (:func:`decode_ops`)."""
        return self.apply(decode_ops(payload))

    def prefilled(self, seq: int) -> int:
        """Prompt positions of a request still being prefilled (0 otherwise)."""
        uid = self.uids.get(seq)
        return 0 if uid is None else self.generator.prefilled(uid)

    def _forget(self, seq: int, outcome: str) -> None:
        uid = self.uids.pop(seq)
        del self.seqs[uid]
        length = len(self.answers.pop(seq))
        engine = self.engine
        engine.last_seq = seq
        engine.last_cache_tokens = length - 1  # the last token is never fed back
        engine.last_outcome = OUTCOMES.index(outcome)


@dataclass
class Running:
    """Rank 0's view of one request in the batch."""

    job: Job
    consumer: LeaderConsumer
    insert: Insert
    generated: list[int] = field(default_factory=list[int])
    done: bool = False  # answered on rank 0 (a stop string): removed at the next step boundary


class BatchLeader(Leader):
    """Rank 0 with ``--max-concurrency`` above 1: up to N requests in one batch, the rest wait in the queue."""

    def __init__(self, engine: Engine, settings: ServeSettings, runner: BatchRunner) -> None:
        super().__init__(engine, settings)
        self.runner = runner
        self.running: dict[int, Running] = {}
        self.snapshot: tuple[Job, ...] = ()  # the running requests as of the last step, for the HTTP thread
        self.step = 0

    def active_jobs(self) -> list[Job]:
        return list(self.snapshot)

    def serve(self) -> int:
        """Serve until asked to stop (0); a pipeline fault answers 503 to everyone in flight and exits (1)."""
        self.status = "ready"
        idle = False
        while True:
            if self._parent_gone():
                log("the launching process is gone; stopping")
                self.stopping.set()
            if self.stopping.is_set():
                return self._shut_down()
            removes = [seq for seq, r in self.running.items() if r.done or r.job.cancelled.is_set()]
            inserts = self._admit(len(self.running) - len(removes), TICK if idle and not self.running else 0.0)
            if not self.running and not inserts:
                self._exchange({"kind": IDLE, "pause_ms": int(TICK * 1000)}, "sending the idle heartbeat")
                idle = True
                continue
            idle = False
            self._step(Ops(removes, inserts))

    def _admit(self, running: int, wait: float) -> list[Insert]:
        """Take waiting requests, oldest first, while fewer than ``--max-concurrency`` run."""
        engine = self.engine
        assert engine is not None
        inserts: list[Insert] = []
        jobs: dict[int, Job] = {}
        while running + len(inserts) < self.settings.max_concurrency:
            job = self._next_job(wait)
            wait = 0.0
            if job is None:
                break
            self.seq += 1
            job.seq = self.seq
            jobs[job.seq] = job
            job.phase = "prefill"
            seed = job.seed
            if seed is None:
                seed = random.randrange(1 << 31) if job.temperature > 0 else -1
            plan = engine.prefix.plan(job.tokens) if engine.prefix.budget_tokens > 0 else Plan()
            job.cached = plan.reuse
            inserts.append(
                Insert(job.seq, job.tokens, job.max_tokens, job.temperature, job.top_p, seed, plan, job.penalties)
            )
        inserts = share_entries(inserts)
        for insert in inserts:
            job = jobs[insert.seq]
            self.running[insert.seq] = Running(job, LeaderConsumer(job, engine.tokenizer, self), insert)
        self.peak_running = max(self.peak_running, running + len(inserts))
        return inserts

    def _step(self, ops: Ops) -> None:
        """Broadcast ``ops``, run the step on this rank like every other, and hand out the tokens."""
        engine = self.engine
        assert engine is not None
        self.step += 1
        payload = encode_ops(ops) if ops.removes or ops.inserts else []
        fields = {"kind": STEP, "seq": self.step, "n_tokens": len(payload), "checksum": checksum(payload)}
        try:
            self._exchange(fields, f"handing out batch step {self.step}")
            if payload:
                engine.channel.tokens(payload, len(payload), self.settings.timeout, f"sending batch step {self.step}")
            responses = self.runner.apply(ops)
        except Exception as exc:  # a lost or stalled peer, a failed step: the pipeline cannot go on
            jobs = [r.job for r in self.running.values() if not r.done]
            self._fail(exc, jobs, f" in batch step {self.step}")
            return  # not reached: _fail exits
        for seq in ops.removes:
            removed = self.running.pop(seq)
            if not removed.done:
                self._finish(removed, "cancelled")
        for seq, response in responses:
            self._deliver(seq, response)
        for r in self.running.values():
            if not r.generated:
                r.job.prefilled = self.runner.prefilled(r.job.seq)
        self.snapshot = tuple(r.job for r in self.running.values() if not r.done)

    def _deliver(self, seq: int, response: Response) -> None:
        r = self.running[seq]
        finished = response.finish_reason is not None
        if finished:
            del self.running[seq]
        if r.done:
            return
        if r.job.cancelled.is_set():
            if finished:
                self._finish(r, "cancelled")
            return
        if response.finish_reason == "error":  # a rank's model raised on this request; the others go on
            r.done = True
            self._finish(r, "failed")
            return
        r.generated.append(response.token)
        complete = r.consumer.token(response.token)
        if complete or response.finish_reason == "stop":
            r.done = True
            self._finish(r, "stop")
        elif finished:
            self._finish(r, "length")

    def _finish(self, r: Running, outcome: str) -> None:
        job = r.job
        length = len(job.tokens) + len(r.generated)
        error = self.runner.generator.last_error if outcome == "failed" else None
        result = RequestResult(
            "stop"
            if outcome == "stop"
            else "length"
            if outcome == "length"
            else "failed"
            if outcome == "failed"
            else "cancelled",
            r.generated,
            cached=r.insert.plan.reuse,
            cache_tokens=max(length - 1, 0),
            prefilled=len(job.tokens) - r.insert.plan.reuse,
            error=error or (RuntimeError("the model raised on another rank") if outcome == "failed" else None),
        )
        self._answer(job, r.consumer, result)

    def _shut_down(self) -> int:
        """Stop: the running requests get 503 ``shutting_down``, the waiting ones too; then tell the ranks."""
        self.status = "stopping"
        error = unavailable("the server is shutting down", code="shutting_down")
        for r in self.running.values():
            if not r.done:
                r.job.emit(Event("error", error=error))
        self.running.clear()
        self.snapshot = ()
        self._reject_waiting(error)
        self._exchange({"kind": SHUTDOWN}, "telling the ranks to stop")
        return 0
