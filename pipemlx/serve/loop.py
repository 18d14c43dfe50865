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
of its own process (:class:`.sources.LocalRequests`, over a :class:`~.book.Book`), or
a front process over a link (:class:`.sources.LinkRequests`, ``pipemlx serve``
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

import random
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn, Protocol

from ..errors import PipelineMismatchError
from .broadcast import IDLE, OPS, SHUTDOWN, Insert, Ops, checksum, decode_ops, encode_ops
from .prefix_cache import PrefixReuse
from .rank import Rank
from .requests import Request, RequestResult
from .schedulers import Scheduler, Sink

IDLE_POLL_S = 0.05  # seconds between idle messages: the extra wait of a request that arrives while the server is idle


class Requests(Sink, Protocol):
    """Where rank 0's loop takes requests from and reports what becomes of them (the scheduler's :class:`Sink`)."""

    def stopping(self) -> bool:
        """No more requests are admitted; the group stops once none runs."""
        ...

    def next(self, wait: float) -> Request | None:
        """The oldest request waiting, waiting up to ``wait`` seconds for one."""
        ...

    def admitted(self, request_id: int, cached: int) -> None:
        """The request runs from the next step, ``cached`` prompt positions from the prefix cache."""
        ...

    def ended(self, request_id: int, result: RequestResult) -> None:
        """The request left the scheduler (answered, cancelled or failed)."""
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
            removes = [i for i in active if requests.should_cancel(i)]
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
            if request.sampling.seed is None and request.sampling.temperature > 0:
                request = request.with_seed(random.randrange(1 << 31))  # every rank samples alike
            plan = prefix.plan(request.tokens, request.partition) if prefix.budget_tokens > 0 else PrefixReuse()
            inserts.append(Insert(request, plan))
            self.requests.admitted(request.id, plan.reuse)
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
        for request_id, result in ended:
            self.requests.ended(request_id, result)


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
                "the ranks were started with different --decode-concurrency"
            )
