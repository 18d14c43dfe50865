"""The serving loops: rank 0 leads (:class:`Leader`), every other rank follows (:func:`follow`), at any concurrency.

At each step rank 0 decides the operations: the requests to remove (their
client left, or rank 0 has answered them: a stop string) and the waiting
requests to insert (first come, first served, while the scheduler has room),
each with its prefix-cache plan and seed. It broadcasts them (:mod:`.broadcast`),
and every rank, rank 0 included, applies them as received to its scheduler
(:mod:`.engines`) and runs the step, so a removal takes effect everywhere at
the same step. Only rank 0 looks at the text: :class:`Leader` is the
scheduler's :class:`~.engines.Sink`.

With nothing to run, rank 0 sends an ``IDLE`` message every :data:`IDLE_POLL_S`
seconds: the other ranks sleep for the tick, then meet rank 0 in the next
message, so an idle server neither busy-waits in a collective for long nor lets
a dead or stalled rank go unnoticed (every wait is bounded by the timeout). A
lost or stalled peer, or ranks out of step, fail every request in flight with
a 503, and the server exits.

Everything MLX does on rank 0 happens on its main thread; the HTTP server runs
in another thread and talks to this loop only through the :class:`~.front.Front`.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, replace

from ..errors import PipelineMismatchError
from .broadcast import IDLE, OPS, SHUTDOWN, Insert, Ops, checksum, decode_ops, encode_ops
from .engines import Rank, Scheduler
from .front import Front, Job, Reply, log
from .prefix_cache import PrefixReuse

IDLE_POLL_S = 0.05  # seconds between idle messages: the extra wait of a request that arrives while the server is idle


@dataclass
class Running:
    """Rank 0's view of a request it has handed out and not yet answered."""

    job: Job
    reply: Reply


class Leader:
    """Rank 0: admit the waiting requests, broadcast each step, run it, deliver the tokens and the ends."""

    def __init__(self, rank: Rank, scheduler: Scheduler, front: Front) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.front = front
        self.settings = rank.settings
        self.running: dict[int, Running] = {}
        self.seq = 0  # requests handed out
        self.step = 0

    def serve(self) -> int:
        """Serve until asked to stop (0); a pipeline fault answers 503 to everyone and exits the process (1)."""
        front, scheduler = self.front, self.scheduler
        front.status = "ready"
        idle = False
        while True:
            parent = self.settings.parent_pid
            if parent is not None and os.getppid() != parent:
                log("the launching process is gone; stopping")
                front.request_stop()
            if front.stopping.is_set():
                front.begin_stop()
                if not scheduler.active():
                    front.shut_down()
                    self.running.clear()
                    self._exchange({"op": SHUTDOWN}, "telling the ranks to stop")
                    return 0
            active = scheduler.active()
            removes = [seq for seq in active if self.should_cancel(seq)]
            room = 0 if front.stopping.is_set() else scheduler.capacity - len(active) + len(removes)
            inserts = self._admit(room, IDLE_POLL_S if idle else 0.0)
            if not active and not inserts:
                self._exchange({"op": IDLE, "pause_ms": int(IDLE_POLL_S * 1000)}, "sending the idle heartbeat")
                idle = True
                continue
            idle = False
            self._step(Ops(removes, inserts))

    def _exchange(self, fields: dict[str, int], what: str) -> None:
        self.front.slots = self.rank.exchange(fields, self.settings.timeout, what).slots

    def _admit(self, room: int, wait: float) -> list[Insert]:
        """Take waiting requests, oldest first, while there is ``room``; plan each one's prefix and seed."""
        prefix = self.rank.prefix
        inserts: list[Insert] = []
        while len(inserts) < room:
            job = self.front.next_job(wait)
            wait = 0.0
            if job is None:
                break
            self.seq += 1
            job.seq, job.phase = self.seq, "prefill"
            seed = job.seed
            if seed is None:
                seed = random.randrange(1 << 31) if job.temperature > 0 else -1
            plan = prefix.plan(job.tokens) if prefix.budget_tokens > 0 else PrefixReuse()
            job.cached = plan.reuse
            inserts.append(
                Insert(
                    job.seq,
                    job.tokens,
                    job.max_tokens,
                    job.temperature,
                    job.top_p,
                    seed,
                    plan,
                    job.penalties,
                    draft=job.draft,
                )
            )
            self.running[job.seq] = Running(job, Reply(job, self.rank.tokenizer, self.front.metrics))
        self._publish()
        return share_entries(inserts)

    def _step(self, ops: Ops) -> None:
        """Broadcast ``ops``, run the step on this rank like every other, and answer the requests that ended."""
        self.step += 1
        unit = f"{self.scheduler.unit} {self.step}"
        payload = encode_ops(ops)
        fields = {"op": self.scheduler.op, "seq": self.step, "n_tokens": len(payload), "checksum": checksum(payload)}
        try:
            self._exchange(fields, f"handing out {unit}")
            if payload:
                self.rank.channel.tokens(payload, len(payload), self.settings.timeout, f"sending {unit}")
            ended = self.scheduler.apply(decode_ops(payload), self)  # what every other rank applies
        except Exception as exc:  # a lost or stalled peer, ranks out of step: the pipeline cannot go on
            self.front.fail(exc, [r.job for r in self.running.values()], f" in {unit}")
            return  # not reached: fail exits
        for seq, result in ended:
            answered = self.running.pop(seq, None)
            if answered is not None:
                self.front.answer(answered.job, answered.reply, result)
        self._publish()

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
