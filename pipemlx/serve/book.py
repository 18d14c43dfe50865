"""The book of requests: the queue, the running requests and their answers, and what ``/health`` shows.

One :class:`Book` serves wherever HTTP is served: in rank 0's process (its
serving loop reports to the book through :class:`.sources.LocalRequests`) or in
the front process (:class:`.relay.Relay` reports what rank 0 sends over the
link). The HTTP thread (:mod:`.app`) numbers a request (:meth:`Book.number`),
queues its :class:`Ticket` (:meth:`Book.submit`: 429 when the queue is full)
and reads :meth:`Book.health`. The serving side takes tickets from the queue
(:meth:`Book.next_waiting`), starts them (:meth:`Book.start`), feeds each
running request the tokens every rank agreed on (:meth:`Book.token`: its
:class:`Reply` detokenizes and finds the stop strings) and ends it
(:meth:`Book.ended`): one owner of a running request's text, tokens and answer.
A ticket talks to its HTTP handler only through :class:`Event` objects, and
nothing here uses MLX or the ranks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

from ..observe.metrics import decode_tokens_per_s, prefill_tokens_per_s
from .openai_api import ApiError, Kind, StopText, shutting_down, unavailable, usage
from .requests import OUTCOMES, Outcome, Request, RequestResult, response_id
from .settings import ServeSettings

if TYPE_CHECKING:
    from .metrics import ServeMetrics
    from .prefix_cache import PrefixCache

PROGRESS_LOG_S = 2.0  # a prefill longer than this logs its progress every this many seconds
RECENT = 16  # requests whose figures /health keeps


LOGGER = logging.getLogger("pipemlx.serve")


def log(message: str) -> None:
    """One line of the server's log (``--log-level INFO``: requests, start-up, stops)."""
    LOGGER.info(message)


def warn(message: str) -> None:
    """A fault or a failure: shown at every ``--log-level`` but ERROR and CRITICAL."""
    LOGGER.warning(message)


def configure_logging(level: str) -> None:
    """The server's lines on stderr, ``HH:MM:SS pipemlx serve: ...``, from ``level`` up (``--log-level``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s pipemlx serve: %(message)s", "%H:%M:%S"))
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(level)
    LOGGER.propagate = False


@dataclass
class Event:
    """What the serving side tells a request's HTTP handler: text, the end, or an error."""

    kind: Literal["text", "done", "error"]
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: ApiError | None = None


@dataclass
class Ticket:
    """A request as its HTTP handler holds it: the :class:`Request`, how to answer (``kind``, ``stream``), and
    the events the serving side sends it."""

    request: Request
    kind: Kind
    created: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]
    stream: bool = False
    include_usage: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    # What /health shows while it runs:
    phase: str = "queued"
    prefilled: int = 0
    generated: int = 0
    cached: int = 0

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def response_id(self) -> str:
        """The OpenAI ``id`` of the answer."""
        return response_id(self.kind, self.request.id)

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


class Reply:
    """A running request's answer as it grows: progress, text, stop strings, figures."""

    def __init__(self, ticket: Ticket, tokenizer: Any, metrics: ServeMetrics | None = None) -> None:
        self.ticket = ticket
        self.metrics = metrics
        self.detokenizer: Any = tokenizer.detokenizer
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.stop_text = StopText(ticket.request.stop)
        self.start = time.perf_counter()
        self.prefill_end: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.next_log = self.start + PROGRESS_LOG_S

    def progress(self, processed: int, total: int) -> None:
        """``processed`` of the ``total`` prompt positions to compute are in every rank's cache."""
        ticket = self.ticket
        if processed < total:
            ticket.phase, ticket.prefilled = "prefill", processed
        now = time.perf_counter()
        if processed >= total - 1 and self.prefill_end is None:
            self.prefill_end = now
        if now >= self.next_log and 0 < processed < total - 1:
            rate = processed / max(now - self.start, 1e-9)
            log(f"request {ticket.id}: prefill {processed}/{total} tokens ({rate:,.0f} tokens/s)")
            self.next_log = now + PROGRESS_LOG_S

    def token(self, token: int) -> bool:
        """Take one generated token; True when the answer is complete (end of sequence or a stop string)."""
        ticket = self.ticket
        now = time.perf_counter()
        self._observe(now)
        if self.first_token is None:
            self.first_token = now
            if self.prefill_end is None:
                self.prefill_end = now
        self.last_token = now
        ticket.phase = "decode"
        ticket.generated += 1
        if token in self.eos:
            return True
        self.detokenizer.add_token(token)
        piece = self.stop_text.update(self.detokenizer.text)
        if piece:
            self.ticket.emit(Event("text", piece))
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


@dataclass
class Running:
    """A request the serving side started and has not answered."""

    ticket: Ticket
    reply: Reply
    generated: list[int] = field(default_factory=list[int])
    """Every token it generated, over every group that ran it (the front resumes it from them)."""
    cached: int | None = None
    """Prompt positions reused at its first admission (what ``usage`` reports)."""
    complete: Outcome | None = None
    """The answer is whole here (end of sequence, a stop string, ``max_tokens``): it ends as this when the ranks
    report its end (the same step, or the next after a cancel), or at once when the group fails first."""

    @property
    def cut_short(self) -> bool:
        """The answer ended at a stop string, which only the book sees: the ranks must be told to end it (they end
        it themselves at an end of sequence or ``max_tokens``, in the step that yields it)."""
        return self.reply.stop_text.stopped


class Book:
    """The request queue, the running requests, their answers, and the state that ``/health`` shows."""

    def __init__(
        self,
        settings: ServeSettings,
        tokenizer: Any,
        split: Sequence[int] = (),
        prefix: PrefixCache | None = None,
        slots: Sequence[dict[str, int]] = (),
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.split = list(split)
        self.prefix = prefix
        # A front process holds no prefix cache: rank 0 says its budget, the book counts the admissions.
        self.remote_prefix: dict[str, int] | None = None  # budget_tokens, hits, misses
        self.slots = list(slots)  # every rank's own fields, as of the last broadcast (replaced whole)
        self.queue: queue.Queue[Ticket] = queue.Queue(maxsize=settings.http.max_queue)
        self.status: Literal["loading", "ready", "failed", "stopping", "recovering"] = "loading"
        self.recover_expired = False  # recovering for longer than --recover-timeout: new requests get 503 at once
        self.recovery: dict[str, Any] | None = None  # with the front: restarts and recovery times (/health)
        self.fault: str | None = None
        self.stopping = threading.Event()
        self.running: dict[int, Running] = {}  # by request id, oldest first (the serving side's thread only)
        self.shown: tuple[Ticket, ...] = ()  # the running tickets as the HTTP thread reads them (replaced whole)
        self.peak_running = 0
        self.counts = {"served": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.guesses = (0, 0)  # speculative decoding over every request: (proposed, accepted) tokens
        self.recent: list[dict[str, Any]] = []
        self.started = time.time()
        self.lock = threading.Lock()
        self.last_id = 0
        self.streams = 0  # streamed answers open (changed by the HTTP thread only)
        self.stop_deadline: float | None = None  # when a graceful stop cuts the running requests short
        self.metrics: ServeMetrics | None = None  # set by the app (/metrics)

    # --- what /metrics reads (metrics.py) ------------------------------------------------------------------------------

    def waiting(self) -> int:
        return self.queue.qsize()

    def running_count(self) -> int:
        return len(self.shown)

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

    # --- the HTTP side -----------------------------------------------------------------------------------------------

    def number(self) -> int:
        """A new request's id (1, 2, ... in this process)."""
        with self.lock:
            self.last_id += 1
            return self.last_id

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket`` or raise :class:`ApiError` (429 when the queue is full, 503 when the pipeline cannot
        serve)."""
        if self.status == "failed":
            raise unavailable(f"the pipeline failed and the server is exiting: {self.fault}")
        if self.status == "stopping" or self.stopping.is_set():
            raise shutting_down()
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
            self.queue.put_nowait(ticket)
        except queue.Full:
            raise self._rejected(f"the request queue is full ({self.settings.http.max_queue} waiting)") from None

    def open_stream(self) -> None:
        """Count one more open stream, or raise 429 at ``--max-streams`` (HTTP thread only)."""
        cap = self.settings.http.max_streams
        if self.streams >= cap:
            raise self._rejected(f"{cap} streamed answers are open, this server's cap (--max-streams)")
        self.streams += 1

    def _rejected(self, why: str) -> ApiError:
        """429 saying ``why``, counted."""
        self.count("rejected")
        message = f"{why}; retry later"
        return ApiError(429, message, type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})

    def close_stream(self) -> None:
        self.streams -= 1

    def health(self) -> dict[str, Any]:
        running = self.shown
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
            "queue": {"waiting": self.queue.qsize(), "max": self.settings.http.max_queue},
            "open_streams": self.streams,
            "active": None if not running else _ticket_status(running[0]),
            "running": [_ticket_status(ticket) for ticket in running],
            "max_concurrency": self.settings.engine.max_concurrency,
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
                "budget_mb": self.settings.engine.prefix_cache_mb,
                "hits": prefix["hits"],
                "misses": prefix["misses"],
            },
            "last_fault": self.fault,
            **({} if self.recovery is None else {"recovery": dict(self.recovery)}),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def _speculation(self) -> dict[str, Any] | None:
        """``/health``'s ``speculation``: the server's setting and its guesses so far (``None``: it does not guess)."""
        engine = self.settings.engine
        if engine.speculation is None:
            return None
        with self.lock:
            proposed, accepted = self.guesses
        return {
            "draft_model": engine.draft_model,
            "prompt_lookup": engine.prompt_lookup,
            "num_draft_tokens": engine.num_draft_tokens,
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        }

    # --- the serving side (one thread) -------------------------------------------------------------------------------

    def next_waiting(self, wait: float) -> Ticket | None:
        """The oldest waiting ticket whose client is still there, waiting up to ``wait`` seconds for one."""
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            try:
                ticket = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                return None
            if not ticket.cancelled.is_set():
                return ticket
            self.count("cancelled")  # the client left while its request waited: nothing reaches the ranks
            ticket.emit(Event("done", finish_reason="cancelled"))

    def start(self, ticket: Ticket) -> Running:
        """``ticket`` runs from now on: its answer begins."""
        running = Running(ticket, Reply(ticket, self.tokenizer, self.metrics))
        self.running[ticket.id] = running
        self._publish()
        return running

    def admitted(self, request_id: int, cached: int) -> None:
        """The ranks admitted the request (again, after a restart), ``cached`` prompt positions reused."""
        running = self.running.get(request_id)
        if running is None:
            return
        if running.cached is None:
            running.cached = running.ticket.cached = cached
            counts = self.remote_prefix
            if counts is not None and counts["budget_tokens"] > 0:
                counts["hits" if cached > 0 else "misses"] += 1
        if not running.generated:
            running.ticket.phase = "prefill"

    def progress(self, request_id: int, processed: int, total: int) -> None:
        running = self.running.get(request_id)
        if running is not None and not running.generated:
            running.reply.progress(processed, total)

    def token(self, request_id: int, token: int) -> Outcome | None:
        """The ranks generated ``token`` for the request; how its answer is complete, if it now is."""
        running = self.running.get(request_id)
        if running is None or running.ticket.finished or running.complete is not None:
            return None if running is None else running.complete
        running.generated.append(token)
        if running.reply.token(token):
            running.complete = "stop"
        elif len(running.generated) >= running.ticket.request.max_tokens:
            running.complete = "length"
        return running.complete

    def cut_short(self, request_id: int) -> bool:
        running = self.running.get(request_id)
        return running is not None and running.cut_short

    def should_cancel(self, request_id: int) -> bool:
        """The request is to stop now: its client left, or the server's stop is due."""
        running = self.running.get(request_id)
        return running is None or running.ticket.cancelled.is_set() or self.stop_due()

    def ended(self, request_id: int, result: RequestResult) -> None:
        """The ranks ended the request: answer it (when it is not answered yet) and forget it."""
        running = self.running.pop(request_id, None)
        if running is None:
            return
        if not running.ticket.finished:
            if running.complete is not None and result.outcome != "failed":
                result = replace(result, outcome=running.complete)
            self._answer(running, result)
        self._publish()

    def end_known(self) -> None:
        """The group failed: every running request whose answer is whole here ends so, with what the book knows."""
        for running in list(self.running.values()):
            if running.complete is not None and not running.ticket.finished:
                request = running.ticket.request
                cached = running.cached or 0
                known = RequestResult(
                    running.complete, cached, len(request.tokens) + len(running.generated), len(request.tokens) - cached
                )
                self._answer(running, known)

    def fail_running(self, error: ApiError) -> None:
        """Every running request gets ``error`` (but those whose answer is whole here: they end so) and is
        forgotten; so do the waiting ones."""
        self.end_known()
        for running in self.running.values():
            if not running.ticket.finished:
                running.ticket.emit(Event("error", error=error))
                self.count("failed")
        self.running.clear()
        self._publish()
        self.reject_waiting(error)

    def forget_finished(self) -> None:
        """Drop the running requests already answered (after a restart: the old group's end of them is gone)."""
        for request_id in [i for i, r in self.running.items() if r.ticket.finished]:
            del self.running[request_id]
        self._publish()

    def unfinished(self) -> list[Running]:
        return [r for r in self.running.values() if not r.ticket.finished]

    def _publish(self) -> None:
        """Show the running requests to the HTTP thread."""
        self.shown = tuple(r.ticket for r in self.running.values() if not r.ticket.finished)
        self.peak_running = max(self.peak_running, len(self.shown))

    def request_stop(self) -> None:
        """Ask for a graceful stop (safe in a signal handler: assignments only): new requests get 503 from now
        on, and the running ones have ``--grace`` seconds from now to finish."""
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.settings.process.grace
        self.status = "stopping"
        self.stopping.set()

    def begin_stop(self) -> None:
        """The serving side's part of a stop: the waiting requests get 503 (they never reach the ranks)."""
        self.request_stop()
        self.reject_waiting(shutting_down())

    def stop_due(self) -> bool:
        """The grace is over (or no stop began and the server is stopping anyway): cut what still runs."""
        if not self.stopping.is_set():
            return False
        return self.stop_deadline is None or time.monotonic() >= self.stop_deadline

    def reject_waiting(self, error: ApiError) -> None:
        while True:
            try:
                ticket = self.queue.get_nowait()
            except queue.Empty:
                return
            ticket.emit(Event("error", error=error))

    def _answer(self, running: Running, result: RequestResult) -> None:
        """Send the end of the request's answer (or its error), count it, and record it."""
        ticket, reply = running.ticket, running.reply
        prompt = len(ticket.request.tokens)
        generated = len(running.generated)
        cached = running.cached if running.cached is not None else result.cached
        # --no-cached-tokens: the count a client could watch grow to read another's prompt is not told.
        counts = usage(prompt, generated, cached if self.settings.http.report_cached_tokens else 0)
        finish = result.outcome
        if finish != "failed" and ticket.cancelled.is_set():
            finish = "cancelled"
        if finish == "failed":
            self.count("failed")
            message = f"the request failed on a rank: {result.error}"
            ticket.emit(Event("error", error=ApiError(500, message, type="server_error", code="generation_failed")))
        elif finish == "cancelled":
            self.count("cancelled")
            if self.stopping.is_set() and not ticket.cancelled.is_set():
                ticket.emit(Event("error", error=shutting_down()))
            else:
                ticket.emit(Event("done", finish_reason="cancelled", usage=counts))
        else:
            rest = reply.finish()
            if rest:
                ticket.emit(Event("text", rest))
            self.count("served")
            ticket.emit(Event("done", finish_reason=finish, usage=counts))
        if self.metrics is not None:
            self.metrics.request_done(finish, prompt, generated, cached)
        self.guessed(result.proposed, result.accepted)
        self._record(running, result, finish)

    def guessed(self, proposed: int, accepted: int) -> None:
        """Count speculative decoding's guesses of one request: ``proposed`` tokens, ``accepted`` of them."""
        if self.metrics is not None:
            self.metrics.guessed(proposed, accepted)
        with self.lock:
            self.guesses = (self.guesses[0] + proposed, self.guesses[1] + accepted)

    def count(self, what: str) -> None:
        """Count one request as ``what`` (``served``, ``cancelled``, ``failed``, ``rejected``)."""
        with self.lock:
            self.counts[what] += 1

    def _record(self, running: Running, result: RequestResult, finish: str) -> None:
        """The request's one log line, and its entry in /health's ``recent``."""
        ticket, reply = running.ticket, running.reply
        end = time.perf_counter()
        prefilled = result.prefilled
        generated = len(running.generated)
        cached = ticket.cached
        prompt = len(ticket.request.tokens)
        prefill_s = (reply.prefill_end or end) - reply.start
        decode_s = (reply.last_token or end) - (reply.first_token or end)
        prefill_tps = prefill_tokens_per_s(prefilled, prefill_s)
        decode_tps = decode_tokens_per_s(generated, decode_s)
        phase = "prefill" if reply.first_token is None else "decode"
        record = {
            "seq": ticket.id,
            "id": ticket.response_id,
            "kind": ticket.kind,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefilled_tokens": prefilled,
            "completion_tokens": generated,
            "decoded_tokens": result.generated,
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
            f"request {ticket.id} ({ticket.kind}): prompt {prompt} tokens, cached {cached}, "
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
        self.fail_running(shutting_down())

    def fail(self, exc: BaseException, where: str) -> None:
        """The pipeline is gone and this process exits: answer 503 to the running requests and to everyone for
        ``--fault-grace`` seconds, then exit with status 1."""
        self.status = "failed"
        self.fault = f"{type(exc).__name__}{where}: {exc}"
        error = unavailable(f"the pipeline failed: {self.fault}")
        self.fail_running(error)
        grace = self.settings.process.fault_grace
        warn(f"the pipeline failed ({self.fault}); answering 503 for {grace:g} s, then exiting")
        self.stopping.wait(grace)
        self.reject_waiting(error)
        time.sleep(0.2)  # let the HTTP thread deliver the last 503s
        print(f"pipemlx serve: exiting after a pipeline fault: {self.fault}", file=sys.stderr, flush=True)
        os._exit(1)  # after a lost or stalled peer, MLX's teardown can block

    def stop_on_signals(self, exit_now: Callable[[], None] = lambda: None) -> None:
        """SIGINT/SIGTERM: a graceful stop; a second one calls ``exit_now`` and exits (130)."""

        def stop(signum: int, frame: FrameType | None) -> None:
            if self.stopping.is_set():
                log(f"{signal.Signals(signum).name} again: exiting now")
                exit_now()
                os._exit(130)
            log(
                f"{signal.Signals(signum).name}: new requests get 503; the running ones get "
                f"{self.settings.process.grace:g} s (--grace) to finish, then every rank stops"
            )
            self.request_stop()

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)

    def log_start(self, took: float | None = None, ranks_word: str = "ranks") -> None:
        """The start-up line: where the layers are, the prefix cache, the queue, batching and speculation."""
        settings, split = self.settings, self.split
        layers = ", ".join(f"rank {r} layers {sum(split[:r])}-{sum(split[: r + 1]) - 1}" for r in range(len(split)))
        engine = settings.engine
        log(
            (f"the {ranks_word} are up after {took:.2f} s" if took is not None else settings.model_id)
            + f" ({layers}); prefix cache {engine.prefix_cache_mb:g} MB ({self.prefix_budget_tokens()} tokens); "
            f"queue {settings.http.max_queue}"
            + (f"; up to {engine.max_concurrency} requests batched" if engine.max_concurrency > 1 else "")
            + (f"; speculative decoding: {engine.speculation}" if engine.speculation else "")
        )


def _guesses(proposed: int, accepted: int) -> str:
    """Speculative decoding's figures for the log line: ``draft accepted 12 of 20 guessed tokens (60%)``."""
    return f"draft accepted {accepted} of {proposed} guessed tokens ({accepted / proposed:.0%})"


def _tokens(tokens: int) -> str:
    return f"{tokens} token{'' if tokens == 1 else 's'}"


def _ticket_status(ticket: Ticket) -> dict[str, Any]:
    return {
        "id": ticket.response_id,
        "seq": ticket.id,
        "phase": ticket.phase,
        "prompt_tokens": len(ticket.request.tokens),
        "cached_tokens": ticket.cached,
        "prefilled_tokens": ticket.prefilled,
        "generated_tokens": ticket.generated,
    }
