"""Rank 0 as a worker of a separate front process: the serving loop's requests, over the link.

Rank 0 runs the same :class:`.loop.Leader` either way; here its
:class:`~.loop.Requests` are :class:`LinkRequests`: jobs from the front
process over the link (:mod:`.link`), and back what happens to them: each
generated token id, prefill progress, the end. It looks at no text: detokenizing, stop strings
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
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from typing import Any, NoReturn, cast

from .engines import Rank
from .front import RequestResult
from .link import BEAT_S, FRONT_SILENCE_S, Link, connect
from .loop import Request
from .penalties import Penalties

SLOTS_EVERY_S = 0.5  # seconds between the ranks' slots sent to the front (what /health shows of them)
JOIN_VARIABLE = "PIPEMLX_SERVE_JOIN"
"""Set for a ``--worker`` (hosts): its entry in the hostfile. It joins the front before the group forms, and the
front says which group to form (every host, or with ``--allow-shrink`` those still there)."""
CONNECT_EVERY_S = 1.0
"""Seconds between a worker's attempts to reach a front that is not answering."""


@dataclass(frozen=True)
class Assignment:
    """The group the front told a joined worker to form: the hostfile's entries of its hosts, in rank order,
    this worker's rank among them, and the split (``None``: the worker's own ``--split`` or the default)."""

    link: Link
    hosts: list[list[str]]
    rank: int
    split: list[int] | None


def join_front(address: str, key: str, entry: int, memory: int, attempt_s: float) -> Assignment:
    """Reach the front at ``address``, say which hostfile ``entry`` this worker is and the ``memory`` it can give,
    and wait for the group to form. Retries every :data:`CONNECT_EVERY_S` seconds while the front cannot be
    reached, closes the link and starts over when the front goes away or falls silent for
    :data:`FRONT_SILENCE_S` seconds: a worker waits for its front as long as it takes."""
    said = False
    while True:
        try:
            link = connect(address, key, timeout=attempt_s)
        except (OSError, EOFError, ValueError, AuthenticationError) as exc:  # AuthenticationError: a wrong key
            if not said:
                print(
                    f"pipemlx serve: worker {entry}: cannot reach the front at {address} ({type(exc).__name__}: "
                    f"{exc}); trying again every {CONNECT_EVERY_S:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            time.sleep(CONNECT_EVERY_S)
            continue
        link.send({"t": "join", "entry": entry, "memory": memory})
        heard = time.monotonic()
        while time.monotonic() - heard < FRONT_SILENCE_S:
            if not link.poll(BEAT_S):
                continue
            message = link.recv()
            if message is None:
                break
            heard = time.monotonic()
            if message.get("t") == "group":
                split = message.get("split")
                return Assignment(
                    link,
                    [[str(a) for a in host] for host in message["hosts"]],
                    int(message["rank"]),
                    None if split is None else [int(n) for n in split],
                )
        link.close()
        said = False
        print(f"pipemlx serve: worker {entry}: the front at {address} went away; joining again", file=sys.stderr)


class Inbox:
    """What the front sent, read by a thread of its own: jobs in order, cancelled ids, stop; and the heartbeat."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.jobs: queue.Queue[Request] = queue.Queue()  # handle: the front's job id
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
                    self.live.add(job.handle)
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


def _job(message: dict[str, Any]) -> Request:
    """A ``job`` message as rank 0's loop admits it: its handle is the front's job id; ``tokens`` is the prompt
    plus what it already generated (``drawn`` tokens: a resumed request's sampler skips as many keys)."""
    seed = message.get("seed")
    penalties = cast(dict[str, Any], message.get("penalties") or {})
    return Request(
        int(message["id"]),
        [int(t) for t in message["tokens"]],
        int(message["max_tokens"]),
        float(message["temperature"]),
        float(message["top_p"]),
        None if seed is None else int(seed),
        Penalties(**penalties),
        draft=bool(message.get("draft", True)),
        drawn=int(message.get("drawn") or 0),
    )


class LinkRequests:
    """:class:`~.loop.Requests` from a front process over the link: rank 0 reports each token id, the prefill's
    progress and each end, and looks at no text (the front tells it to cancel a request whose answer it has whole).

    Made once the group is up: it greets the front (``hello``: the split and every rank's slot) first.
    """

    def __init__(self, rank: Rank, link: Link) -> None:
        self.link = link
        # The front takes the first message for the greeting: send it before the heartbeat thread starts.
        link.send(
            {
                "t": "hello",
                "split": list(rank.stage.info.split),
                "slots": rank.slots,
                "prefix_budget": rank.prefix.budget_tokens,
            }
        )
        self.inbox = Inbox(link)
        self.ids: dict[int, int] = {}  # request number -> the front's job id
        self.slots_sent = 0.0

    def stopping(self) -> bool:
        return self.inbox.stop.is_set()

    def shutting_down(self) -> None:
        if self.inbox.why is not None:
            print(f"pipemlx serve: rank 0: {self.inbox.why}; stopping the group", file=sys.stderr)

    def next(self, wait: float) -> Request | None:
        """The next job sent, oldest first (one cancelled before it ran is answered and skipped)."""
        while True:
            try:
                job = self.inbox.jobs.get(timeout=wait) if wait > 0 else self.inbox.jobs.get_nowait()
            except queue.Empty:
                return None
            wait = 0.0
            job_id: int = job.handle
            if not self.inbox.is_cancelled(job_id):
                return job
            self.inbox.forget(job_id)
            self.link.send({"t": "ended", "id": job_id, "outcome": "cancelled", "generated": 0})

    def admitted(self, request: Request, seq: int, cached: int) -> None:
        job_id: int = request.handle
        self.ids[seq] = job_id
        self.link.send({"t": "admitted", "id": job_id, "seq": seq, "cached": cached})

    def slots(self, slots: Sequence[dict[str, int]]) -> None:
        now = time.monotonic()
        if now - self.slots_sent >= SLOTS_EVERY_S:
            self.slots_sent = now
            self.link.send({"t": "slots", "slots": list(slots)})

    def fail(self, exc: BaseException, where: str) -> NoReturn:
        """Tell the front (which restarts the group, or whose hosts' supervisors do) and exit."""
        self.link.send({"t": "fault", "message": f"{type(exc).__name__}{where}: {exc}"})
        print(f"pipemlx serve: rank 0: {type(exc).__name__}{where}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # after a lost or stalled peer, MLX's teardown can block

    def ended(self, seq: int, result: RequestResult) -> None:
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
                "proposed": result.proposed,
                "accepted": result.accepted,
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
