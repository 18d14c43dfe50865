"""The requests' side of the server: settings, jobs and their answers, the queue and ``/health``.

The HTTP thread (:mod:`.app`) checks a request and queues it as a :class:`Job`
(:meth:`Front.submit`: 429 when the queue is full), and reads
:meth:`Front.health`. Rank 0's serving loop (:class:`.loop.Leader`, through
:class:`.loop.LocalRequests`) takes jobs
from the queue (:meth:`Front.next_job`), feeds each running job's
:class:`Reply` the tokens every rank agreed on, and hands the end to
:meth:`Front.answer`. A job talks to its HTTP handler only through
:class:`Event` objects, and nothing here uses MLX or the ranks, so this side
can live apart from the rank loop.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..observe.metrics import decode_tokens_per_s, prefill_tokens_per_s
from .openai_api import ApiError, Kind, StopText, unavailable, usage

if TYPE_CHECKING:
    from .metrics import ServeMetrics
    from .penalties import Penalties
    from .prefix_cache import PrefixCache

PROGRESS_LOG_S = 2.0  # a prefill longer than this logs its progress every this many seconds
RECENT = 16  # requests whose figures /health keeps

Outcome = Literal["stop", "length", "cancelled", "failed"]
OUTCOMES = ("none", "stop", "length", "cancelled", "failed")
"""How a rank's last request ended, as its ``outcome`` field numbers it."""


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} pipemlx serve: {message}", file=sys.stderr, flush=True)


@dataclass
class ServeSettings:
    """What ``pipemlx serve``'s options set (the same on every rank)."""

    model_id: str
    max_queue: int = 64
    prefix_cache_mb: float = 1024.0
    prefill_step_size: int | Literal["auto"] = "auto"
    timeout: float = 120.0
    default_max_tokens: int = 256
    default_temperature: float = 0.0
    context: int | None = None
    fault_grace: float = 5.0
    api_key: str | None = None
    parent_pid: int | None = None
    max_concurrency: int = 1  # requests decoded together; 1: one at a time (engines.py)
    prefill_chunking: Literal["fixed", "equal-cost"] = "equal-cost"  # with max_concurrency > 1: BatchGenerator's
    # Limits (docs/serve.md, "Limits and timeouts"): what one client may make the server hold or do.
    max_body_bytes: int = 4 << 20  # a larger request body gets 413
    max_tokens_limit: int = 8192  # a request asking for more gets 400
    max_streams: int = 64  # streamed answers open at once; more get 429
    header_timeout: float = 10.0  # seconds a new connection may take to send its first request's headers
    idle_timeout: int = 5  # seconds a kept-alive connection may stay idle between requests
    grace: float = 30.0  # on SIGTERM: seconds the running requests get to finish
    metrics_public: bool = False  # /metrics without the API key
    # Speculative decoding (docs/speculative.md), with max_concurrency 1 only: the CLI refuses it with batching.
    draft_model: str | None = None  # a folder or repo id, loaded whole on every rank
    num_draft_tokens: int | Literal["auto"] = 3
    prompt_lookup: int | None = None  # guess from the longest earlier n-gram match, up to this n

    @property
    def speculation(self) -> str | None:
        """How requests guess tokens, in words (``None``: they do not)."""
        if self.draft_model is not None:
            return f"draft model {self.draft_model}, {self.num_draft_tokens} tokens a pass"
        if self.prompt_lookup is not None:
            return f"prompt lookup of up to {self.prompt_lookup} tokens, {self.num_draft_tokens} tokens a pass"
        return None


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
    draft: bool = True  # the request's ``draft``: False opts it out of the server's speculative decoding
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
    """How a request ended on the ranks."""

    outcome: Outcome
    generated: list[int]
    cached: int  # prompt positions reused from the prefix cache
    cache_tokens: int  # positions its cache held at the end
    prefilled: int  # prompt positions computed by this request (processed of a prefill cut short)
    error: BaseException | None = None
    proposed: int = 0  # speculative decoding: tokens guessed
    accepted: int = 0  # of which the pipeline confirmed


class Reply:
    """Rank 0's view of a running request: progress, text, stop strings, figures."""

    def __init__(self, job: Job, tokenizer: Any, metrics: ServeMetrics | None = None) -> None:
        self.job = job
        self.metrics = metrics
        self.detokenizer: Any = tokenizer.detokenizer
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.stop_text = StopText(job.stop)
        self.start = time.perf_counter()
        self.prefill_end: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.next_log = self.start + PROGRESS_LOG_S

    def progress(self, processed: int, total: int) -> None:
        """``processed`` of the ``total`` prompt positions to compute are in every rank's cache."""
        job = self.job
        if processed < total:
            job.phase, job.prefilled = "prefill", processed
        now = time.perf_counter()
        if processed >= total - 1 and self.prefill_end is None:
            self.prefill_end = now
        if now >= self.next_log and 0 < processed < total - 1:
            rate = processed / max(now - self.start, 1e-9)
            log(f"request {job.seq}: prefill {processed}/{total} tokens ({rate:,.0f} tokens/s)")
            self.next_log = now + PROGRESS_LOG_S

    def token(self, token: int) -> bool:
        """Take one generated token; True when the answer is complete (end of sequence or a stop string)."""
        job = self.job
        now = time.perf_counter()
        self._observe(now)
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

    def _observe(self, now: float) -> None:
        """Time to first token, or the time since the last token, into the histograms."""
        if self.metrics is None:
            return
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.inter_token.observe(now - self.last_token)

    def finish(self) -> str:
        """The text still held back (a partial stop string, an unfinished character), sent at the end."""
        self.detokenizer.finalize()
        return self.stop_text.finish(self.detokenizer.text)


class Front:
    """The request queue, the answers, and the state that ``/health`` shows."""

    def __init__(
        self,
        settings: ServeSettings,
        split: Sequence[int] = (),
        prefix: PrefixCache | None = None,
        slots: Sequence[dict[str, int]] = (),
    ) -> None:
        self.settings = settings
        self.split = list(split)
        self.prefix = prefix
        # A front process holds no prefix cache: rank 0 says its budget, the front counts the admissions.
        self.remote_prefix: dict[str, int] | None = None  # budget_tokens, hits, misses
        self.slots = list(slots)  # every rank's own fields, as of the last broadcast (replaced whole by the loop)
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=settings.max_queue)
        self.status: Literal["loading", "ready", "failed", "stopping", "recovering"] = "loading"
        self.recover_expired = False  # recovering for longer than --recover-timeout: new requests get 503 at once
        self.recovery: dict[str, Any] | None = None  # with --recover: restarts and recovery times (/health)
        self.fault: str | None = None
        self.stopping = threading.Event()
        self.running: tuple[Job, ...] = ()  # oldest first (replaced whole by the leader loop, read by the HTTP thread)
        self.peak_running = 0
        self.counts = {"served": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.guesses = (0, 0)  # speculative decoding over every request: (proposed, accepted) tokens
        self.recent: list[dict[str, Any]] = []
        self.started = time.time()
        self.lock = threading.Lock()
        self.streams = 0  # streamed answers open (changed by the HTTP thread only)
        self.stop_deadline: float | None = None  # when a graceful stop cuts the running requests short
        self.metrics: ServeMetrics | None = None  # set by the app (/metrics)

    # --- what /metrics reads (metrics.FrontView) ---------------------------------------------------------------------

    def waiting(self) -> int:
        return self.queue.qsize()

    def running_count(self) -> int:
        return len(self.running)

    def open_streams(self) -> int:
        return self.streams

    def rank_slots(self) -> Sequence[dict[str, int]]:
        return self.slots

    def prefix_budget_tokens(self) -> int:
        counts = self.prefix_counts()
        return 0 if counts is None else counts["budget_tokens"]

    def prefix_counts(self) -> dict[str, int] | None:
        """The prefix cache's budget in tokens, hits and misses (``None``: no rank said yet)."""
        if self.prefix is not None:
            return {"budget_tokens": self.prefix.budget_tokens, "hits": self.prefix.hits, "misses": self.prefix.misses}
        return None if self.remote_prefix is None else dict(self.remote_prefix)

    def admitted_remotely(self, cached: int) -> None:
        """A front process: rank 0 admitted a request for the first time, ``cached`` prompt positions reused."""
        counts = self.remote_prefix
        if counts is not None and counts["budget_tokens"] > 0:
            counts["hits" if cached > 0 else "misses"] += 1

    # --- the HTTP side -----------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job`` or raise :class:`ApiError` (429 when the queue is full, 503 when the pipeline cannot serve)."""
        if self.status == "failed":
            raise unavailable(f"the pipeline failed and the server is exiting: {self.fault}")
        if self.status == "stopping" or self.stopping.is_set():
            raise unavailable("the server is shutting down", code="shutting_down")
        if self.status == "loading":
            raise unavailable("the model is still loading", code="loading")
        if self.status == "recovering" and self.recover_expired:
            raise ApiError(
                503,
                f"the pipeline is recovering from a fault and is not back yet: {self.fault}",
                type="server_error",
                code="pipeline_recovering",
                headers={"Retry-After": "2"},
            )
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self._count("rejected")
            raise ApiError(
                429,
                f"the request queue is full ({self.settings.max_queue} waiting); retry later",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None

    def open_stream(self) -> None:
        """Count one more open stream, or raise 429 at ``--max-streams`` (HTTP thread only)."""
        cap = self.settings.max_streams
        if self.streams >= cap:
            self._count("rejected")
            raise ApiError(
                429,
                f"{cap} streamed answers are open, this server's cap (--max-streams); retry later",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.streams += 1

    def close_stream(self) -> None:
        self.streams -= 1

    def health(self) -> dict[str, Any]:
        running = self.running
        slots = self.slots
        ranks: list[dict[str, Any]] = []
        start = 0
        for r, count in enumerate(self.split):
            slot = slots[r] if r < len(slots) else {}
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
        prefix = self.prefix_counts()
        return {
            "status": self.status,
            "model": self.settings.model_id,
            "ranks": len(self.split),
            "split": self.split,
            "rank_status": ranks,
            "queue": {"waiting": self.queue.qsize(), "max": self.settings.max_queue},
            "open_streams": self.streams,
            "active": None if not running else _job_status(running[0]),
            "running": [_job_status(job) for job in running],
            "max_concurrency": self.settings.max_concurrency,
            "peak_running": self.peak_running,
            "requests": dict(self.counts),
            "speculation": self._speculation(),
            "recent": list(self.recent),
            "prefix_cache": None
            if prefix is None
            else {
                # As of the last broadcast (the main thread changes the entries while this thread reads).
                "entries": slots[0]["prefix_entries"] if slots else 0,
                "tokens": slots[0]["prefix_tokens"] if slots else 0,
                "budget_tokens": prefix["budget_tokens"],
                "budget_mb": self.settings.prefix_cache_mb,
                "hits": prefix["hits"],
                "misses": prefix["misses"],
            },
            "last_fault": self.fault,
            **({} if self.recovery is None else {"recovery": dict(self.recovery)}),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def _speculation(self) -> dict[str, Any] | None:
        """``/health``'s ``speculation``: the server's setting and its guesses so far (``None``: it does not guess)."""
        settings = self.settings
        if settings.speculation is None:
            return None
        with self.lock:
            proposed, accepted = self.guesses
        return {
            "draft_model": settings.draft_model,
            "prompt_lookup": settings.prompt_lookup,
            "num_draft_tokens": settings.num_draft_tokens,
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        }

    # --- the loop's side (rank 0's main thread) ----------------------------------------------------------------------

    def next_job(self, wait: float) -> Job | None:
        """The oldest waiting job whose client is still there, waiting up to ``wait`` seconds for one."""
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            try:
                job = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                return None
            if not job.cancelled.is_set():
                return job
            self._count("cancelled")  # the client left while its request waited: nothing reaches the other ranks
            job.emit(Event("done", finish_reason="cancelled"))

    def request_stop(self) -> None:
        """Ask for a graceful stop (safe in a signal handler: assignments only): new requests get 503 from now
        on, and the running ones have ``--grace`` seconds from now to finish."""
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.settings.grace
        self.status = "stopping"
        self.stopping.set()

    def begin_stop(self) -> None:
        """The loop's side of a stop: the waiting requests get 503 (they never reach the ranks)."""
        self.request_stop()
        self.reject_waiting(unavailable("the server is shutting down", code="shutting_down"))

    def stop_due(self) -> bool:
        """The grace is over (or no stop began and the server is stopping anyway): cut what still runs."""
        if not self.stopping.is_set():
            return False
        return self.stop_deadline is None or time.monotonic() >= self.stop_deadline

    def reject_waiting(self, error: ApiError) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            job.emit(Event("error", error=error))

    def answer(self, job: Job, reply: Reply, result: RequestResult) -> None:
        """Send the end of ``job``'s answer (or its error), count it, and record it."""
        counts = usage(len(job.tokens), len(result.generated), result.cached)
        finish = result.outcome
        if finish != "failed" and job.cancelled.is_set():
            finish = "cancelled"
        if finish == "failed":
            self._count("failed")
            message = f"the request failed on a rank: {type(result.error).__name__}: {result.error}"
            job.emit(Event("error", error=ApiError(500, message, type="server_error", code="generation_failed")))
        elif finish == "cancelled":
            self._count("cancelled")
            if self.stopping.is_set() and not job.cancelled.is_set():
                job.emit(Event("error", error=unavailable("the server is shutting down", code="shutting_down")))
            else:
                job.emit(Event("done", finish_reason="cancelled", usage=counts))
        else:
            rest = reply.finish()
            if rest:
                job.emit(Event("text", rest))
            self._count("served")
            job.emit(Event("done", finish_reason=finish, usage=counts))
        if self.metrics is not None:
            self.metrics.request_done(finish, len(job.tokens), len(result.generated), result.cached)
        self.guessed(result.proposed, result.accepted)
        self._record(job, reply, result, finish)

    def guessed(self, proposed: int, accepted: int) -> None:
        """Count speculative decoding's guesses of one request: ``proposed`` tokens, ``accepted`` of them."""
        if self.metrics is not None:
            self.metrics.guessed(proposed, accepted)
        with self.lock:
            self.guesses = (self.guesses[0] + proposed, self.guesses[1] + accepted)

    def _count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def count(self, what: str) -> None:
        """Count one request as ``what`` (``served``, ``cancelled``, ``failed``, ``rejected``)."""
        self._count(what)

    def _record(self, job: Job, reply: Reply, result: RequestResult, finish: str) -> None:
        """The request's one log line, and its entry in /health's ``recent``."""
        end = time.perf_counter()
        prefilled = result.prefilled
        generated = len(result.generated)
        prefill_s = (reply.prefill_end or end) - reply.start
        decode_s = (reply.last_token or end) - (reply.first_token or end)
        prefill_tps = prefill_tokens_per_s(prefilled, prefill_s)
        decode_tps = decode_tokens_per_s(generated, decode_s)
        phase = "prefill" if reply.first_token is None else "decode"
        record = {
            "seq": job.seq,
            "id": job.request_id,
            "kind": job.kind,
            "prompt_tokens": len(job.tokens),
            "cached_tokens": result.cached,
            "prefilled_tokens": prefilled,
            "completion_tokens": generated,
            "finish_reason": finish,
            "ended_in": phase,
            "cache_tokens": result.cache_tokens,
            "ttft_s": round((reply.first_token or end) - reply.start, 4),
            "prefill_tokens_per_s": round(prefill_tps, 1),
            "decode_tokens_per_s": round(decode_tps, 1),
            "seconds": round(end - reply.start, 4),
            "draft_proposed_tokens": result.proposed,
            "draft_accepted_tokens": result.accepted,
        }
        with self.lock:
            self.recent = (self.recent + [record])[-RECENT:]
        log(
            f"request {job.seq} ({job.kind}): prompt {len(job.tokens)} tokens, cached {result.cached}, "
            f"prefill {_tokens(prefilled)}"
            + (f" at {prefill_tps:,.0f} tokens/s" if prefilled > 1 else "")
            + f", decode {_tokens(generated)}"
            + (f" at {decode_tps:,.1f} tokens/s" if generated > 1 else "")
            + (f", {_guesses(result.proposed, result.accepted)}" if result.proposed else "")
            + f", finish {finish}"
            + (f" in the {phase}" if finish == "cancelled" else "")
            + f", {end - reply.start:.2f} s"
        )

    def shut_down(self) -> None:
        """Stopping: the running and the waiting requests get 503 ``shutting_down``."""
        self.status = "stopping"
        error = unavailable("the server is shutting down", code="shutting_down")
        for job in self.running:
            job.emit(Event("error", error=error))
        self.running = ()
        self.reject_waiting(error)

    def fail(self, exc: BaseException, jobs: Sequence[Job], where: str) -> None:
        """The pipeline is gone: answer 503 to ``jobs`` (those in flight) and to everyone for ``fault_grace``
        seconds, then exit with status 1."""
        self.status = "failed"
        self.fault = f"{type(exc).__name__}{where}: {exc}"
        error = unavailable(f"the pipeline failed: {self.fault}")
        for job in jobs:
            job.emit(Event("error", error=error))
            self._count("failed")
        self.reject_waiting(error)
        log(f"the pipeline failed ({self.fault}); answering 503 for {self.settings.fault_grace:g} s, then exiting")
        self.stopping.wait(self.settings.fault_grace)
        self.reject_waiting(error)
        time.sleep(0.2)  # let the HTTP thread deliver the last 503s
        print(f"pipemlx serve: exiting after a pipeline fault: {self.fault}", file=sys.stderr, flush=True)
        os._exit(1)  # after a lost or stalled peer, MLX's teardown can block


def _guesses(proposed: int, accepted: int) -> str:
    """Speculative decoding's figures for the log line: ``draft accepted 12 of 20 guessed tokens (60%)``."""
    return f"draft accepted {accepted} of {proposed} guessed tokens ({accepted / proposed:.0%})"


def _tokens(tokens: int) -> str:
    return f"{tokens} token{'' if tokens == 1 else 's'}"


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
