"""The serving loop on each rank: rank 0 takes requests from the HTTP side, every rank runs them together.

Rank 0 (:class:`Leader`) runs the requests one at a time in arrival order from
a bounded queue that the HTTP thread fills (:meth:`Leader.submit`). For each
one it plans the prefix-cache reuse, broadcasts the request
(:mod:`.broadcast`) and runs :func:`pipemlx.generate_step` on it like every
other rank (:class:`Follower`), with the same arguments. Only rank 0 looks at
the text: it detokenizes, applies stop strings and end-of-sequence tokens and
stops its generator, and the library stops every rank after the same token.
A client that goes away makes rank 0's ``should_cancel`` say yes: every rank
stops at the same prefill agreement point or decode step.

Between requests rank 0 sends an ``IDLE`` header every :data:`TICK` seconds:
the other ranks sleep for the tick, then meet rank 0 in the next header, so an
idle server neither busy-waits in a collective for long nor lets a dead or
stalled rank go unnoticed (each header wait is bounded by the timeout).

Everything MLX does on rank 0 happens on its main thread; the HTTP server runs
in another thread and talks to this loop only through :class:`Job` objects.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.sample_utils import make_sampler  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineError, PipelineMismatchError, PrefillCancelled
from ..runtime.caches import UNCOUNTED, always_trimmable, cache_offset, cache_parts, counted_offset
from ..runtime.generate import generate_step
from ..runtime.stage import stage_of
from .broadcast import (
    HELLO,
    IDLE,
    OUTCOMES,
    PENALTY_FIELDS,
    REQUEST,
    SHUTDOWN,
    STEP,
    Channel,
    Header,
    bits_float,
    checksum,
    float_bits,
)
from .penalties import LogitsProcessor, Penalties
from .prefix_cache import Plan, PrefixCache
from .protocol import ApiError, Kind, StopText, unavailable

TICK = 0.05
"""Seconds between idle headers: the extra wait of a request that arrives while the server is idle."""
PROGRESS_LOG_S = 2.0
"""A prefill longer than this logs its progress every this many seconds."""
WARM_UP_TOKENS = 4
MB = float(1 << 20)

Outcome = Literal["stop", "length", "cancelled", "failed"]


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} pipemlx serve: {message}", file=sys.stderr, flush=True)


@dataclass
class ServeSettings:
    """What ``pipemlx serve``'s options set (the same on every rank)."""

    model_id: str
    max_queue: int = 64
    prefix_cache_mb: float = 1024.0
    step_size: int | Literal["auto"] | None = None
    timeout: float = 60.0
    default_max_tokens: int = 512
    default_temperature: float = 0.0
    context: int | None = None
    fault_grace: float = 5.0
    api_key: str | None = None
    parent_pid: int | None = None
    max_concurrency: int = 1
    """Requests decoded together (:mod:`.batching`); 1: one at a time, here."""
    prefill_chunking: Literal["fixed", "equal-cost"] = "equal-cost"
    """With ``max_concurrency`` above 1: :class:`pipemlx.BatchGenerator`'s ``prefill_chunking``."""


@dataclass
class Event:
    """What rank 0's loop tells a request's HTTP handler: text, the end, or an error."""

    kind: Literal["text", "done", "error"]
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: ApiError | None = None


@dataclass
class Job:
    """One request on its way from the HTTP thread to the pipeline and back."""

    kind: Kind
    request_id: str
    created: int
    tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    penalties: Penalties
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    # What /health shows while it runs:
    seq: int = 0
    phase: str = "queued"
    prefilled: int = 0
    generated: int = 0
    cached: int = 0

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the HTTP side (thread-safe); a closed event loop means nobody listens any more."""
        if event.kind != "text":
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class RequestResult:
    outcome: Outcome
    generated: list[int]
    cached: int
    cache_tokens: int
    prefilled: int
    """Prompt positions computed by this request (``processed`` of a cancelled prefill)."""
    error: BaseException | None = None


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


class Engine:
    """What every rank does: warm up, greet the others, and run a broadcast request on the pipeline."""

    def __init__(self, model: nn.Module, tokenizer: Any, group: mx.distributed.Group, settings: ServeSettings) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.group = group
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
        self.slots: list[dict[str, int]] = []

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

    def start(self) -> None:
        """Run one small request through the pipeline (every rank), measure the KV footprint, then greet."""
        cache = make_prompt_cache(self.model)
        prompt = mx.arange(1, WARM_UP_TOKENS + 1, dtype=mx.int32)
        for _ in generate_step(prompt, self.model, prompt_cache=cache, max_tokens=1, timeout=self.settings.timeout):
            pass
        self.bytes_per_token = _bytes_per_token(cache)
        self.trimmable = int(always_trimmable(make_prompt_cache(self.model)))
        header = self.channel.exchange(
            {"kind": HELLO} if self.rank == 0 else None, self.slot(), self.settings.timeout, "greeting the other ranks"
        )
        self.slots = header.slots
        largest = max(s["bytes_per_token"] for s in header.slots)
        # Entries are cut back only when every rank can cut its caches back.
        self.prefix = PrefixCache(
            int(self.settings.prefix_cache_mb * MB) // largest, cut_back=all(s["trimmable"] for s in header.slots)
        )

    def run(self, header: Header, tokens: list[int], consumer: LeaderConsumer | None) -> RequestResult:
        """Run the request ``header`` announced, on this rank; every rank calls it with the same header and tokens."""
        f = header.fields
        plan = Plan(f["entry"], f["reuse"], bool(f["copy"]))
        cache = self.prefix.checkout(plan, lambda: make_prompt_cache(self.model))
        if f["seed"] >= 0:
            mx.random.seed(f["seed"])
        temperature = bits_float(f["temperature"])
        # Greedy as no sampler: generate_step then takes the argmax of the logits (no log-softmax to wait for).
        sampler = None if temperature <= 0 else make_sampler(temperature, top_p=bits_float(f["top_p"]))
        step: int | Literal["auto"] = f["step"] if f["step"] > 0 else "auto"
        generated: list[int] = []
        outcome: Outcome = "length"
        error: BaseException | None = None
        kept = tokens
        prefilled = len(tokens) - plan.reuse
        generator = generate_step(
            mx.array(tokens[plan.reuse :], dtype=mx.int32),
            self.model,
            prompt_cache=cache,
            max_tokens=f["max_tokens"],
            sampler=sampler,
            logits_processors=_seeing(tokens[: plan.reuse], Penalties.from_ints([f[n] for n in PENALTY_FIELDS])),
            prefill_step_size=step,
            prompt_progress_callback=consumer.progress if consumer is not None else None,
            should_cancel=consumer.should_cancel if consumer is not None else None,
            timeout=self.settings.timeout,
        )
        try:
            try:
                for token, _ in generator:
                    generated.append(token)
                    if consumer is not None and consumer.token(token):
                        outcome = "stop"
                        break
            finally:
                generator.close()
            kept = tokens + generated
            if outcome != "stop":
                last = self.stage.last_stop
                reason = getattr(last, "reason", "length")
                outcome = "failed" if reason == "failed" else "cancelled" if reason == "cancelled" else "length"
        except PrefillCancelled as exc:
            outcome = "cancelled" if not exc.failed_ranks else "failed"
            # A rank that cannot cut its caches back keeps nothing: every rank must keep the same entries.
            kept = tokens[: plan.reuse + exc.processed] if exc.cache_trimmed and self.prefix.cut_back else []
            prefilled = exc.processed
            error = exc if exc.failed_ranks else None
        except PipelineMismatchError as exc:  # every rank raised it (the group is fine): drop the prefix caches
            self.prefix.clear()
            outcome, kept, error = "failed", [], exc
        except PipelineError:  # a lost or stalled peer, or a pipeline this rank cannot use any more
            raise
        except Exception as exc:  # this rank's own error (a callback, the model): the stop was agreed
            outcome, kept, error = "failed", [], exc
        offset = counted_offset(cache)
        if offset == UNCOUNTED:  # recurrent layers only: the agreed stop left the same positions as on the others
            offset = len(kept)
        if outcome != "failed" and kept and offset == len(kept):
            self.prefix.store(kept, cache)
        self.last_seq = f["seq"]
        self.last_cache_tokens = offset
        self.last_outcome = OUTCOMES.index(outcome)
        return RequestResult(outcome, generated, plan.reuse, offset, prefilled, error)


class LeaderConsumer:
    """Rank 0's view of a running request: progress, cancellation, text, stop strings, figures."""

    def __init__(self, job: Job, tokenizer: Any, leader: Leader) -> None:
        self.job = job
        self.leader = leader
        self.detokenizer: Any = tokenizer.detokenizer
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.stop_text = StopText(job.stop)
        self.start = time.perf_counter()
        self.prefill_end: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.next_log = self.start + PROGRESS_LOG_S
        self.total = 0

    def progress(self, processed: int, total: int) -> None:
        job = self.job
        self.total = total
        if processed < total:
            job.phase, job.prefilled = "prefill", processed
        if processed >= total - 1 and self.prefill_end is None:
            self.prefill_end = time.perf_counter()
        now = time.perf_counter()
        if now >= self.next_log and 0 < processed < total - 1:
            rate = processed / max(now - self.start, 1e-9)
            log(f"request {job.seq}: prefill {processed}/{total} tokens ({rate:,.0f} tokens/s)")
            self.next_log = now + PROGRESS_LOG_S

    def should_cancel(self) -> bool:
        return self.job.cancelled.is_set() or self.leader.stopping.is_set()

    def token(self, token: int) -> bool:
        """Take one generated token; True when the request is complete (end of sequence or a stop string)."""
        job = self.job
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            if self.prefill_end is None:
                self.prefill_end = now
        self.last_token = now
        job.phase = "decode"
        job.generated += 1
        if token in self.eos:
            return True
        self.detokenizer.add_token(token)
        piece = self.stop_text.update(self.detokenizer.text)
        if piece:
            job.emit(Event("text", piece))
        return self.stop_text.stopped

    def finish(self) -> str:
        """The text still held back (a partial stop string, an unfinished character), sent at the end."""
        self.detokenizer.finalize()
        return self.stop_text.finish(self.detokenizer.text)


class Leader:
    """Rank 0: the request queue, the serving loop, the state that ``/health`` shows."""

    def __init__(self, engine: Engine | None, settings: ServeSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=settings.max_queue)
        self.status: Literal["loading", "ready", "failed", "stopping"] = "loading"
        self.fault: str | None = None
        self.stopping = threading.Event()
        self.active: Job | None = None
        self.peak_running = 0  # the most requests that ran at once
        self.seq = 0
        self.counts = {"served": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.recent: list[dict[str, Any]] = []
        self.started = time.time()
        self.lock = threading.Lock()

    # --- the HTTP side ---------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job`` or raise :class:`ApiError` (429 when the queue is full, 503 when the pipeline cannot serve)."""
        if self.status == "failed":
            raise unavailable(f"the pipeline failed and the server is exiting: {self.fault}")
        if self.status == "stopping" or self.stopping.is_set():
            raise unavailable("the server is shutting down", code="shutting_down")
        if self.status == "loading":
            raise unavailable("the model is still loading", code="loading")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            with self.lock:
                self.counts["rejected"] += 1
            raise ApiError(
                429,
                f"the request queue is full ({self.settings.max_queue} waiting); retry later",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None

    def health(self) -> dict[str, Any]:
        engine = self.engine
        active = self.active_jobs()
        ranks: list[dict[str, Any]] = []
        split: list[int] = []
        if engine is not None:
            split = list(engine.stage.split)
            start = 0
            for r, count in enumerate(split):
                slot = engine.slots[r] if r < len(engine.slots) else {}
                ranks.append(
                    {
                        "rank": r,
                        "layers": [start, start + count - 1],
                        "pid": slot.get("pid"),
                        "last_request": slot.get("last_seq"),
                        "cache_tokens": slot.get("cache_tokens"),
                        "outcome": OUTCOMES[slot.get("outcome", 0)],
                        "prefix_entries": slot.get("prefix_entries"),
                    }
                )
                start += count
        prefix = engine.prefix if engine is not None else None
        return {
            "status": self.status,
            "model": self.settings.model_id,
            "ranks": len(split),
            "split": split,
            "rank_status": ranks,
            "queue": {"waiting": self.queue.qsize(), "max": self.settings.max_queue},
            "active": None if not active else _job_status(active[0]),
            "running": [_job_status(job) for job in active],
            "max_concurrency": self.settings.max_concurrency,
            "peak_running": self.peak_running,
            "requests": dict(self.counts),
            "recent": list(self.recent),
            "prefix_cache": None
            if prefix is None
            else {
                # As of the last header (the main thread changes the entries while this thread reads).
                "entries": engine.slots[0]["prefix_entries"] if engine and engine.slots else 0,
                "tokens": engine.slots[0]["prefix_tokens"] if engine and engine.slots else 0,
                "budget_tokens": prefix.budget_tokens,
                "budget_mb": self.settings.prefix_cache_mb,
                "hits": prefix.hits,
                "misses": prefix.misses,
            },
            "last_fault": self.fault,
            "uptime_s": round(time.time() - self.started, 1),
        }

    def active_jobs(self) -> list[Job]:
        """The requests running now, oldest first (read by the HTTP thread for ``/health``)."""
        active = self.active
        return [] if active is None else [active]

    # --- the serving loop (rank 0's main thread) ----------------------------------------------------------------------

    def serve(self) -> int:
        """Serve until asked to stop (0) or until the pipeline fails (the caller exits with 1)."""
        engine = self.engine
        assert engine is not None
        self.status = "ready"
        idle = False
        while True:
            if self._parent_gone():
                log("the launching process is gone; stopping")
                self.stopping.set()
            if self.stopping.is_set():
                self.status = "stopping"
                self._reject_waiting(unavailable("the server is shutting down", code="shutting_down"))
                self._exchange({"kind": SHUTDOWN}, "telling the ranks to stop")
                return 0
            job = self._next_job(TICK if idle else 0.0)
            if job is None:
                self._exchange({"kind": IDLE, "pause_ms": int(TICK * 1000)}, "sending the idle heartbeat")
                idle = True
                continue
            idle = False
            self._run(job)

    def _exchange(self, fields: dict[str, int], what: str) -> Header:
        engine = self.engine
        assert engine is not None
        header = engine.channel.exchange(fields, engine.slot(), self.settings.timeout, what)
        engine.slots = header.slots
        return header

    def _next_job(self, wait: float) -> Job | None:
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            try:
                job = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                return None
            if not job.cancelled.is_set():
                return job
            with self.lock:  # the client left while its request waited: nothing reaches the other ranks
                self.counts["cancelled"] += 1
            job.emit(Event("done", finish_reason="cancelled"))

    def _parent_gone(self) -> bool:
        parent = self.settings.parent_pid
        return parent is not None and os.getppid() != parent

    def _run(self, job: Job) -> None:
        engine = self.engine
        assert engine is not None
        self.seq += 1
        job.seq = self.seq
        self.active = job
        self.peak_running = max(self.peak_running, 1)
        plan = engine.prefix.plan(job.tokens) if engine.prefix.budget_tokens > 0 else Plan()
        job.cached = plan.reuse
        new_tokens = len(job.tokens) - plan.reuse
        step = self.settings.step_size
        step_field = 0 if step == "auto" else step if step is not None else _default_step(new_tokens, engine.size)
        seed = job.seed
        if seed is None:
            seed = random.randrange(1 << 31) if job.temperature > 0 else -1
        fields = {
            "kind": REQUEST,
            "seq": job.seq,
            "n_tokens": len(job.tokens),
            "max_tokens": job.max_tokens,
            "temperature": float_bits(job.temperature),
            "top_p": float_bits(job.top_p),
            "seed": seed,
            "entry": plan.entry,
            "reuse": plan.reuse,
            "copy": int(plan.copy),
            "step": step_field,
            "checksum": checksum(job.tokens),
            **dict(zip(PENALTY_FIELDS, job.penalties.to_ints())),
        }
        consumer = LeaderConsumer(job, engine.tokenizer, self)
        job.phase = "prefill"
        try:
            header = self._exchange(fields, f"handing out request {job.seq}")
            engine.channel.tokens(job.tokens, len(job.tokens), self.settings.timeout, f"sending request {job.seq}")
            result = engine.run(header, job.tokens, consumer)
        except Exception as exc:  # a lost or stalled peer, or ranks out of step: the group cannot go on
            self._fail(exc, [job], f" while serving request {job.seq}")
            return  # not reached: _fail exits
        finally:
            self.active = None
        self._answer(job, consumer, result)

    def _answer(self, job: Job, consumer: LeaderConsumer, result: RequestResult) -> None:
        usage = {
            "prompt_tokens": len(job.tokens),
            "completion_tokens": len(result.generated),
            "total_tokens": len(job.tokens) + len(result.generated),
            "prompt_tokens_details": {"cached_tokens": result.cached},
        }
        finish = result.outcome
        if finish == "failed":
            with self.lock:
                self.counts["failed"] += 1
            message = f"the request failed on a rank: {type(result.error).__name__}: {result.error}"
            job.emit(Event("error", error=ApiError(500, message, type="server_error", code="generation_failed")))
        elif finish == "cancelled":
            with self.lock:
                self.counts["cancelled"] += 1
            if self.stopping.is_set() and not job.cancelled.is_set():
                job.emit(Event("error", error=unavailable("the server is shutting down", code="shutting_down")))
            else:
                job.emit(Event("done", finish_reason="cancelled", usage=usage))
        else:
            rest = consumer.finish()
            if rest:
                job.emit(Event("text", rest))
            with self.lock:
                self.counts["served"] += 1
            job.emit(Event("done", finish_reason=finish, usage=usage))
        self._record(job, consumer, result)

    def _record(self, job: Job, consumer: LeaderConsumer, result: RequestResult) -> None:
        """The request's one log line, and its entry in /health's ``recent``."""
        end = time.perf_counter()
        prefilled = result.prefilled
        prefill_s = (consumer.prefill_end or end) - consumer.start
        decode_s = (consumer.last_token or end) - (consumer.first_token or end)
        prefill_tps = max(prefilled - 1, 0) / prefill_s if prefill_s > 0 else 0.0
        decode_tps = (len(result.generated) - 1) / decode_s if decode_s > 0 and len(result.generated) > 1 else 0.0
        phase = "prefill" if consumer.first_token is None else "decode"
        record = {
            "seq": job.seq,
            "id": job.request_id,
            "kind": job.kind,
            "prompt_tokens": len(job.tokens),
            "cached_tokens": result.cached,
            "prefilled_tokens": prefilled,
            "completion_tokens": len(result.generated),
            "finish_reason": result.outcome,
            "ended_in": phase,
            "cache_tokens": result.cache_tokens,
            "ttft_s": round((consumer.first_token or end) - consumer.start, 4),
            "prefill_tokens_per_s": round(prefill_tps, 1),
            "decode_tokens_per_s": round(decode_tps, 1),
            "seconds": round(end - consumer.start, 4),
        }
        with self.lock:
            self.recent = (self.recent + [record])[-16:]
        log(
            f"request {job.seq} ({job.kind}): prompt {len(job.tokens)} tokens, cached {result.cached}, "
            f"prefill {_count(prefilled)}"
            + (f" at {prefill_tps:,.0f} tokens/s" if prefilled > 1 else "")
            + f", decode {_count(len(result.generated))}"
            + (f" at {decode_tps:,.1f} tokens/s" if len(result.generated) > 1 else "")
            + f", finish {result.outcome}"
            + (f" in the {phase}" if result.outcome == "cancelled" else "")
            + f", {end - consumer.start:.2f} s"
        )

    def _reject_waiting(self, error: ApiError) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            job.emit(Event("error", error=error))

    def _fail(self, exc: BaseException, jobs: Sequence[Job], where: str) -> None:
        """The pipeline is gone: answer 503 to ``jobs`` (those in flight) and to everyone for ``fault_grace``
        seconds, then exit with status 1."""
        self.status = "failed"
        self.fault = f"{type(exc).__name__}{where}: {exc}"
        error = unavailable(f"the pipeline failed: {self.fault}")
        for job in jobs:
            job.emit(Event("error", error=error))
            with self.lock:
                self.counts["failed"] += 1
        self._reject_waiting(error)
        log(f"the pipeline failed ({self.fault}); answering 503 for {self.settings.fault_grace:g} s, then exiting")
        self.stopping.wait(self.settings.fault_grace)
        self._reject_waiting(error)
        time.sleep(0.2)  # let the HTTP thread deliver the last 503s
        print(f"pipemlx serve: exiting after a pipeline fault: {self.fault}", file=sys.stderr, flush=True)
        os._exit(1)  # after a lost or stalled peer, MLX's teardown can block

    def fail_idle(self, exc: BaseException) -> None:
        """A fault outside any request (an idle heartbeat found a rank gone)."""
        self._fail(exc, [], "")


def _count(tokens: int) -> str:
    return f"{tokens} token{'' if tokens == 1 else 's'}"


def _default_step(new_tokens: int, ranks: int) -> int:
    """512 tokens, less for short prompts so that every rank gets about 4 chunks (``pipemlx generate``'s rule)."""
    return max(1, min(512, -(-(new_tokens - 1) // (4 * ranks))))


class Follower:
    """Every rank but 0: wait for the next header, run what it says, until ``SHUTDOWN``."""

    def __init__(
        self, engine: Engine, settings: ServeSettings, batch: Callable[[list[int]], object] | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.batch = batch
        """With ``--max-concurrency`` above 1: runs one ``STEP`` from its encoded operations (:mod:`.batching`)."""

    def serve(self) -> int:
        engine = self.engine
        pause = 0.0
        while True:
            if pause > 0:
                time.sleep(pause)
            header = engine.channel.exchange(
                None, engine.slot(), self.settings.timeout + TICK, "waiting for the next request"
            )
            engine.slots = header.slots
            pause = 0.0
            if header.kind == IDLE:
                pause = header.fields["pause_ms"] / 1000.0
            elif header.kind == SHUTDOWN:
                return 0
            elif header.kind == REQUEST:
                count = header.fields["n_tokens"]
                tokens = engine.channel.tokens(
                    None, count, self.settings.timeout, f"receiving request {header.fields['seq']}"
                )
                if checksum(tokens) != header.fields["checksum"]:
                    raise PipelineMismatchError(
                        f"rank {engine.rank}: request {header.fields['seq']} arrived damaged (token checksum differs)"
                    )
                engine.run(header, tokens, None)
            elif header.kind == STEP:
                self._step(header)

    def _step(self, header: Header) -> None:
        engine = self.engine
        count = header.fields["n_tokens"]
        what = f"receiving batch step {header.fields['seq']}"
        payload = engine.channel.tokens(None, count, self.settings.timeout, what) if count else []
        if checksum(payload) != header.fields["checksum"]:
            raise PipelineMismatchError(f"rank {engine.rank}: batch step {header.fields['seq']} arrived damaged")
        if self.batch is None:
            raise PipelineMismatchError(f"rank {engine.rank}: rank 0 batches requests but this rank was not told to")
        self.batch(payload)


def _job_status(job: Job) -> dict[str, Any]:
    return {
        "id": job.request_id,
        "seq": job.seq,
        "phase": job.phase,
        "prompt_tokens": len(job.tokens),
        "cached_tokens": job.cached,
        "prefilled_tokens": job.prefilled,
        "generated_tokens": job.generated,
    }


def describe_ranks(split: Sequence[int]) -> str:
    return ", ".join(f"rank {r} layers {sum(split[:r])}-{sum(split[: r + 1]) - 1}" for r in range(len(split)))


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
