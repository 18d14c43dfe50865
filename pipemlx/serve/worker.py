"""Rank 0 as a worker of a separate front (``pipemlx serve --recover``): the serving loop, fed over the link.

Where :class:`.loop.Leader` takes requests from the HTTP thread in its own
process, :class:`WorkerLeader` takes them from the front process over the
link (:mod:`.link`) and sends back what happens to them: each generated token
id, prefill progress, the end. It looks at no text: detokenizing, stop strings
and the answers are the front's, which tells rank 0 to ``cancel`` a request it
has the whole answer of. So the front holds every token a client was sent and
can resume the request on a new group after a fault.

Every other rank runs :func:`.loop.follow` unchanged: the broadcast between
the ranks is the same. A fault (a lost or stalled peer) is sent to the front
as a ``fault`` message and rank 0 exits at once: the front restarts the group
(local ranks), or each host's supervisor restarts its worker (``--worker``).
When the front goes away or falls silent, rank 0 stops the group.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from .broadcast import IDLE, SHUTDOWN, Insert, Ops, checksum, decode_ops, encode_ops
from .engines import Rank, Scheduler
from .front import RequestResult
from .link import BEAT_S, FRONT_SILENCE_S, Link
from .loop import IDLE_POLL_S, share_entries
from .penalties import Penalties
from .prefix_cache import PrefixReuse

SLOTS_EVERY_S = 0.5  # seconds between the ranks' slots sent to the front (what /health shows of them)


@dataclass(frozen=True)
class RemoteJob:
    """A request as the front hands it to rank 0: ``tokens`` is its prompt plus what it already generated."""

    id: int
    tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    penalties: Penalties
    drawn: int = 0  # tokens it generated before (a resumed request): the sampler skips as many keys


class Inbox:
    """What the front sent, read by a thread of its own: jobs in order, cancelled ids, stop; and the heartbeat."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.jobs: queue.Queue[RemoteJob] = queue.Queue()
        self.live: set[int] = set()  # jobs received and not yet ended: a cancel for another id is dropped
        self.cancelled: set[int] = set()
        self.stop = threading.Event()
        self.why: str | None = None  # why the group stops when the front did not say so
        self.heard = time.monotonic()  # when the front last sent anything (it beats every BEAT_S)
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="pipemlx-serve-link", daemon=True).start()
        threading.Thread(target=self._beat, name="pipemlx-serve-beat", daemon=True).start()

    def _read(self) -> None:
        while True:
            message = self.link.recv()
            if message is None:  # the front is gone: stop the group
                self._stop("the link to the front closed")
                return
            self.heard = time.monotonic()
            kind = message.get("t")
            if kind == "job":
                job = _job(message)
                with self.lock:
                    self.live.add(job.id)
                self.jobs.put(job)
            elif kind == "cancel":
                with self.lock:
                    if int(message["id"]) in self.live:
                        self.cancelled.add(int(message["id"]))
            elif kind == "stop":
                self.stop.set()

    def _beat(self) -> None:
        while not self.stop.is_set():
            if not self.link.send({"t": "beat"}):
                self._stop("cannot send to the front")
                return
            if time.monotonic() - self.heard > FRONT_SILENCE_S:
                self._stop(f"the front sent nothing for {FRONT_SILENCE_S:g} s")
                return
            time.sleep(BEAT_S)

    def _stop(self, why: str) -> None:
        if not self.stop.is_set():
            self.why = why
            self.stop.set()

    def is_cancelled(self, job_id: int) -> bool:
        with self.lock:
            return job_id in self.cancelled

    def forget(self, job_id: int) -> None:
        """``job_id`` ended here: nothing more to hold about it."""
        with self.lock:
            self.live.discard(job_id)
            self.cancelled.discard(job_id)


def _job(message: dict[str, Any]) -> RemoteJob:
    seed = message.get("seed")
    penalties = cast(dict[str, Any], message.get("penalties") or {})
    return RemoteJob(
        int(message["id"]),
        [int(t) for t in message["tokens"]],
        int(message["max_tokens"]),
        float(message["temperature"]),
        float(message["top_p"]),
        None if seed is None else int(seed),
        Penalties(**penalties),
        int(message.get("drawn") or 0),
    )


class WorkerLeader:
    """Rank 0's serving loop under a front: admit the jobs sent, broadcast each step, report tokens and ends.

    Made once the group is up: it greets the front (``hello``: the split and every rank's slot) first.
    """

    def __init__(self, rank: Rank, scheduler: Scheduler, link: Link) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.link = link
        self.settings = rank.settings
        # The front takes the first message for the greeting: send it before the heartbeat thread starts.
        link.send({"t": "hello", "split": list(rank.stage.info.split), "slots": rank.slots})
        self.inbox = Inbox(link)
        self.ids: dict[int, int] = {}  # request number -> the front's job id
        self.seq = 0
        self.step = 0
        self.slots_sent = 0.0

    def serve(self) -> int:
        """Serve until the front says stop or goes away (0); a fault is reported and the process exits (1)."""
        scheduler = self.scheduler
        idle = False
        try:
            while True:
                stopping = self.inbox.stop.is_set()
                active = scheduler.active()
                if stopping and not active:
                    if self.inbox.why is not None:
                        print(f"pipemlx serve: rank 0: {self.inbox.why}; stopping the group", file=sys.stderr)
                    self._exchange({"op": SHUTDOWN}, "telling the ranks to stop")
                    return 0
                removes = [seq for seq in active if self.should_cancel(seq)]
                room = 0 if stopping else scheduler.capacity - len(active) + len(removes)
                inserts = self._admit(room, IDLE_POLL_S if idle else 0.0)
                if not active and not inserts:
                    self._exchange({"op": IDLE, "pause_ms": int(IDLE_POLL_S * 1000)}, "sending the idle heartbeat")
                    idle = True
                    continue
                idle = False
                self._step(Ops(removes, inserts))
        except Exception as exc:  # a lost or stalled peer, ranks out of step: the front restarts the group
            self.link.send({"t": "fault", "message": f"{type(exc).__name__}: {exc}"})
            print(f"pipemlx serve: rank 0: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(1)  # after a lost or stalled peer, MLX's teardown can block

    def _exchange(self, fields: dict[str, int], what: str) -> None:
        self.rank.exchange(fields, self.settings.timeout, what)
        now = time.monotonic()
        if now - self.slots_sent >= SLOTS_EVERY_S:
            self.slots_sent = now
            self.link.send({"t": "slots", "slots": self.rank.slots})

    def _admit(self, room: int, wait: float) -> list[Insert]:
        """Take the jobs sent, oldest first, while there is ``room`` (a job cancelled before it ran is dropped)."""
        prefix = self.rank.prefix
        inserts: list[Insert] = []
        while len(inserts) < room:
            try:
                job = self.inbox.jobs.get(timeout=wait) if wait > 0 else self.inbox.jobs.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if self.inbox.is_cancelled(job.id):
                self.inbox.forget(job.id)
                self.link.send({"t": "ended", "id": job.id, "outcome": "cancelled", "generated": 0})
                continue
            self.seq += 1
            seed = job.seed
            if seed is None:
                seed = random.randrange(1 << 31) if job.temperature > 0 else -1
            plan = prefix.plan(job.tokens) if prefix.budget_tokens > 0 else PrefixReuse()
            inserts.append(
                Insert(
                    self.seq,
                    job.tokens,
                    job.max_tokens,
                    job.temperature,
                    job.top_p,
                    seed,
                    plan,
                    job.penalties,
                    drawn=job.drawn,
                )
            )
            self.ids[self.seq] = job.id
            self.link.send({"t": "admitted", "id": job.id, "seq": self.seq, "cached": plan.reuse})
        return share_entries(inserts)

    def _step(self, ops: Ops) -> None:
        self.step += 1
        unit = f"{self.scheduler.unit} {self.step}"
        payload = encode_ops(ops)
        fields = {"op": self.scheduler.op, "seq": self.step, "n_tokens": len(payload), "checksum": checksum(payload)}
        self._exchange(fields, f"handing out {unit}")
        if payload:
            self.rank.channel.tokens(payload, len(payload), self.settings.timeout, f"sending {unit}")
        ended = self.scheduler.apply(decode_ops(payload), self)
        for seq, result in ended:
            self._ended(seq, result)

    def _ended(self, seq: int, result: RequestResult) -> None:
        job_id = self.ids.pop(seq, None)
        if job_id is None:
            return
        self.inbox.forget(job_id)
        self.link.send(
            {
                "t": "ended",
                "id": job_id,
                "outcome": result.outcome,
                "generated": len(result.generated),
                "cache_tokens": result.cache_tokens,
                "prefilled": result.prefilled,
                "error": None if result.error is None else f"{type(result.error).__name__}: {result.error}",
            }
        )

    # --- the scheduler's sink ----------------------------------------------------------------------------------------

    def progress(self, seq: int, processed: int, total: int) -> None:
        job_id = self.ids.get(seq)
        if job_id is not None:
            self.link.send({"t": "progress", "id": job_id, "processed": processed, "total": total})

    def should_cancel(self, seq: int) -> bool:
        job_id = self.ids.get(seq)
        return job_id is None or self.inbox.is_cancelled(job_id) or self.inbox.stop.is_set()

    def token(self, seq: int, token: int) -> bool:
        job_id = self.ids.get(seq)
        if job_id is None:
            return False
        self.link.send({"t": "token", "id": job_id, "token": int(token)})
        return self.inbox.is_cancelled(job_id)  # the front has the whole answer: end it here too
