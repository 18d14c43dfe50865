"""The serving loops: rank 0 leads (:class:`Leader`), every other rank follows (:func:`follow`), at any concurrency.

At each step rank 0 decides the operations: the requests to remove (their
client left, or their answer is complete: a stop string) and the waiting
requests to insert (first come, first served, while the scheduler has room),
each with its prefix-cache plan and seed. It broadcasts them (:mod:`.broadcast`),
and every rank, rank 0 included, applies them as received to its scheduler
(:mod:`.engines`) and runs the step, so a removal takes effect everywhere at
the same step.

Where the requests come from and where their tokens go is :class:`Requests`,
the one thing that differs between the two ways rank 0 serves: the HTTP thread
of its own process (:class:`LocalRequests`, over a :class:`~.front.Front`), or
a front process over a link (:class:`.worker.LinkRequests`, ``pipemlx serve``
with local ranks and ``--worker``). The loop itself is the same.

With nothing to run, rank 0 sends an ``IDLE`` message every :data:`IDLE_POLL_S`
seconds: the other ranks sleep for the tick, then meet rank 0 in the next
message, so an idle server neither busy-waits in a collective for long nor lets
a dead or stalled rank go unnoticed (every wait is bounded by the timeout). A
lost or stalled peer, or ranks out of step, end the loop through
:meth:`Requests.fail`, which does not return.

Everything MLX does on rank 0 happens on its main thread; the HTTP server (or
the link's reader) runs in another thread.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol

from ..errors import PipelineMismatchError
from .broadcast import IDLE, OPS, SHUTDOWN, Insert, Ops, checksum, decode_ops, encode_ops
from .engines import Rank, Scheduler, Sink
from .front import Front, Job, Reply, RequestResult, log
from .penalties import Penalties
from .prefix_cache import PrefixReuse

IDLE_POLL_S = 0.05  # seconds between idle messages: the extra wait of a request that arrives while the server is idle


@dataclass(frozen=True)
class Request:
    """A request as rank 0's loop admits it: ``tokens`` is its prompt (plus, when it is resumed after a restart,
    the ``drawn`` tokens it generated before); ``handle`` is what its :class:`Requests` knows it by."""

    handle: Any
    tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    penalties: Penalties
    draft: bool = True
    drawn: int = 0


class Requests(Sink, Protocol):
    """Where rank 0's loop takes requests from and reports what becomes of them (the scheduler's :class:`Sink`)."""

    def stopping(self) -> bool:
        """No more requests are admitted; the group stops once none runs."""
        ...

    def next(self, wait: float) -> Request | None:
        """The oldest request waiting, waiting up to ``wait`` seconds for one."""
        ...

    def admitted(self, request: Request, seq: int, cached: int) -> None:
        """``request`` runs as number ``seq`` from the next step, ``cached`` prompt positions from the prefix cache."""
        ...

    def ended(self, seq: int, result: RequestResult) -> None:
        """Request ``seq`` left the scheduler (answered, cancelled or failed)."""
        ...

    def slots(self, slots: Sequence[dict[str, int]]) -> None:
        """Every rank's own fields, as the last broadcast carried them."""
        ...

    def shutting_down(self) -> None:
        """The group is about to stop (nothing runs any more)."""
        ...

    def fail(self, exc: BaseException, where: str) -> NoReturn:
        """The pipeline cannot go on (a lost or stalled peer, ranks out of step): answer for it and exit."""
        ...


class Leader:
    """Rank 0: admit the waiting requests, broadcast each step, run it, report the tokens and the ends."""

    def __init__(self, rank: Rank, scheduler: Scheduler, requests: Requests) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.requests = requests
        self.settings = rank.settings
        self.seq = 0  # requests handed out
        self.step = 0
        self.where = ""  # the step under way, for the fault's message

    def serve(self) -> int:
        """Serve until asked to stop and nothing runs (0); a pipeline fault goes to :meth:`Requests.fail`."""
        try:
            return self._serve()
        except Exception as exc:  # a lost or stalled peer, ranks out of step: the pipeline cannot go on
            self.requests.fail(exc, self.where)

    def _serve(self) -> int:
        requests, scheduler = self.requests, self.scheduler
        idle = False
        while True:
            stopping = requests.stopping()
            active = scheduler.active()
            if stopping and not active:
                requests.shutting_down()
                self._exchange({"op": SHUTDOWN}, "telling the ranks to stop")
                return 0
            removes = [seq for seq in active if requests.should_cancel(seq)]
            room = 0 if stopping else scheduler.capacity - len(active) + len(removes)
            inserts = self._admit(room, IDLE_POLL_S if idle else 0.0)
            if not active and not inserts:
                self._exchange({"op": IDLE, "pause_ms": int(IDLE_POLL_S * 1000)}, "sending the idle heartbeat")
                idle = True
                continue
            idle = False
            self._step(Ops(removes, inserts))

    def _exchange(self, fields: dict[str, int], what: str) -> None:
        self.requests.slots(self.rank.exchange(fields, self.settings.timeout, what).slots)

    def _admit(self, room: int, wait: float) -> list[Insert]:
        """Take waiting requests, oldest first, while there is ``room``; plan each one's prefix and seed."""
        prefix = self.rank.prefix
        inserts: list[Insert] = []
        while len(inserts) < room:
            request = self.requests.next(wait)
            wait = 0.0
            if request is None:
                break
            self.seq += 1
            seed = request.seed
            if seed is None:
                seed = random.randrange(1 << 31) if request.temperature > 0 else -1
            plan = prefix.plan(request.tokens) if prefix.budget_tokens > 0 else PrefixReuse()
            inserts.append(
                Insert(
                    self.seq,
                    request.tokens,
                    request.max_tokens,
                    request.temperature,
                    request.top_p,
                    seed,
                    plan,
                    request.penalties,
                    draft=request.draft,
                    drawn=request.drawn,
                )
            )
            self.requests.admitted(request, self.seq, plan.reuse)
        return share_entries(inserts)

    def _step(self, ops: Ops) -> None:
        """Broadcast ``ops``, run the step on this rank like every other, and report the requests that ended."""
        self.step += 1
        unit = f"{self.scheduler.unit} {self.step}"
        self.where = f" in {unit}"
        payload = encode_ops(ops)
        fields = {"op": self.scheduler.op, "seq": self.step, "n_tokens": len(payload), "checksum": checksum(payload)}
        self._exchange(fields, f"handing out {unit}")
        if payload:
            self.rank.channel.tokens(payload, len(payload), self.settings.timeout, f"sending {unit}")
        ended = self.scheduler.apply(decode_ops(payload), self.requests)  # what every other rank applies
        self.where = ""
        for seq, result in ended:
            self.requests.ended(seq, result)


@dataclass
class Running:
    """A request handed out and not yet answered, as :class:`LocalRequests` holds it."""

    job: Job
    reply: Reply


class LocalRequests:
    """:class:`Requests` from the HTTP thread of rank 0's own process: the :class:`~.front.Front`'s queue; rank 0
    detokenizes and answers."""

    def __init__(self, front: Front, tokenizer: Any, parent_pid: int | None = None) -> None:
        self.front = front
        self.tokenizer = tokenizer
        self.parent_pid = parent_pid  # local ranks: the supervising process; when it is gone, stop
        self.running: dict[int, Running] = {}
        front.status = "ready"

    def stopping(self) -> bool:
        front = self.front
        if self.parent_pid is not None and os.getppid() != self.parent_pid and not front.stopping.is_set():
            log("the launching process is gone; stopping")
            front.request_stop()
        if front.stopping.is_set():
            front.begin_stop()  # the waiting requests get 503 (they never reach the ranks)
            return True
        return False

    def next(self, wait: float) -> Request | None:
        job = self.front.next_job(wait)
        if job is None:
            return None
        return Request(
            job, job.tokens, job.max_tokens, job.temperature, job.top_p, job.seed, job.penalties, draft=job.draft
        )

    def admitted(self, request: Request, seq: int, cached: int) -> None:
        job: Job = request.handle
        job.seq, job.phase, job.cached = seq, "prefill", cached
        self.running[seq] = Running(job, Reply(job, self.tokenizer, self.front.metrics))
        self._publish()

    def ended(self, seq: int, result: RequestResult) -> None:
        answered = self.running.pop(seq, None)
        if answered is not None:
            self.front.answer(answered.job, answered.reply, result)
        self._publish()

    def slots(self, slots: Sequence[dict[str, int]]) -> None:
        self.front.slots = list(slots)

    def shutting_down(self) -> None:
        self.front.shut_down()
        self.running.clear()

    def fail(self, exc: BaseException, where: str) -> NoReturn:
        self.front.fail(exc, [r.job for r in self.running.values()], where)
        os._exit(1)  # not reached: fail exits

    def _publish(self) -> None:
        """Show the running requests to the HTTP thread."""
        self.front.running = tuple(r.job for r in self.running.values())
        self.front.peak_running = max(self.front.peak_running, len(self.running))

    # --- the scheduler's sink ----------------------------------------------------------------------------------------

    def progress(self, seq: int, processed: int, total: int) -> None:
        running = self.running.get(seq)
        if running is not None:
            running.reply.progress(processed, total)

    def should_cancel(self, seq: int) -> bool:
        running = self.running.get(seq)
        return running is None or running.job.cancelled.is_set() or self.front.stop_due()

    def token(self, seq: int, token: int) -> bool:
        running = self.running.get(seq)
        if running is None or running.job.cancelled.is_set():  # removed at the next step
            return False
        return running.reply.token(token)


def share_entries(inserts: list[Insert]) -> list[Insert]:
    """Inserts of one step that start from the same prefix-cache entry copy it (none may take it from another)."""
    uses: dict[int, int] = {}
    for i in inserts:
        uses[i.plan.entry] = uses.get(i.plan.entry, 0) + 1
    return [
        replace(i, plan=replace(i.plan, copy=True)) if i.plan.entry >= 0 and uses[i.plan.entry] > 1 else i
        for i in inserts
    ]


def follow(rank: Rank, scheduler: Scheduler) -> int:
    """Every rank but 0: meet rank 0 in the next broadcast and do what it says, until ``SHUTDOWN`` (returns 0)."""
    timeout = rank.settings.timeout
    pause = 0.0
    while True:
        if pause > 0:
            time.sleep(pause)
        header = rank.exchange(None, timeout + IDLE_POLL_S, "waiting for the next request")
        op, step = header.op, header.fields["seq"]
        pause = 0.0
        if op == IDLE:
            pause = header.fields["pause_ms"] / 1000.0
        elif op == SHUTDOWN:
            return 0
        elif op == scheduler.op:
            unit = f"{scheduler.unit} {step}"
            count = header.fields["n_tokens"]
            payload = rank.channel.tokens(None, count, timeout, f"receiving {unit}") if count else []
            if checksum(payload) != header.fields["checksum"]:
                raise PipelineMismatchError(f"rank {rank.rank}: {unit} arrived damaged (its checksum differs)")
            scheduler.apply(decode_ops(payload), None)
        else:
            raise PipelineMismatchError(
                f"rank {rank.rank}: rank 0 sent a {OPS[op]} where this rank runs a {scheduler.unit}: "
                "the ranks were started with different --max-concurrency"
            )
