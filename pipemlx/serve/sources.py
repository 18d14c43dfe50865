"""Where rank 0's serving loop (:class:`.loop.Leader`) takes its requests from and reports to: the book in its own
process (:class:`LocalRequests`), or a front process over the link (:class:`LinkRequests`).

Locally, the HTTP thread of rank 0's process fills a :class:`~.book.Book` and
rank 0 detokenizes and answers. Under a front, rank 0 gets each
:class:`~.requests.Request` as JSON over the link (:mod:`.link`) and sends
back what happens to it: admitted, prefill progress, each generated token id,
the end (a :class:`~.requests.RequestResult`). It looks at no text:
detokenizing, stop strings and the answers are the front's (its own
:class:`~.book.Book`), which tells rank 0 to ``cancel`` a request it has the
whole answer of. So the front holds every token a client was sent and can
resume the request on a new group after a fault. A fault (a lost or stalled
peer) is sent to the front as a ``fault`` message and rank 0 exits at once; when
the front goes away or falls silent, rank 0 stops the group.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

from .book import Book, log
from .link import BEAT_S, FRONT_SILENCE_S, Link
from .rank import Rank
from .requests import Request, RequestResult, from_json, to_json

SLOTS_EVERY_S = 0.5  # seconds between the ranks' slots sent to the front (what /health shows of them)


class LocalRequests:
    """Requests from the HTTP thread of rank 0's own process, through its :class:`~.book.Book`."""

    def __init__(self, book: Book, parent_pid: int | None = None) -> None:
        self.book = book
        self.parent_pid = parent_pid  # local ranks: the supervising process; when it is gone, stop
        book.status = "ready"

    def stopping(self) -> bool:
        book = self.book
        if self.parent_pid is not None and os.getppid() != self.parent_pid and not book.stopping.is_set():
            log("the launching process is gone; stopping")
            book.request_stop()
        if book.stopping.is_set():
            book.begin_stop()  # the waiting requests get 503 (they never reach the ranks)
            return True
        return False

    def next(self, wait: float) -> Request | None:
        ticket = self.book.next_waiting(wait)
        if ticket is None:
            return None
        self.book.start(ticket)
        return ticket.request

    def admitted(self, request_id: int, cached: int) -> None:
        self.book.admitted(request_id, cached)

    def ended(self, request_id: int, result: RequestResult) -> None:
        self.book.ended(request_id, result)

    def slots(self, slots: Sequence[dict[str, int]]) -> None:
        self.book.slots = list(slots)

    def shutting_down(self) -> None:
        self.book.shut_down()

    def fail(self, exc: BaseException, where: str) -> NoReturn:
        self.book.fail(exc, where)
        os._exit(1)  # not reached: fail exits

    # --- the scheduler's sink ----------------------------------------------------------------------------------------

    def progress(self, request_id: int, processed: int, total: int) -> None:
        self.book.progress(request_id, processed, total)

    def should_cancel(self, request_id: int) -> bool:
        return self.book.should_cancel(request_id)

    def token(self, request_id: int, token: int) -> bool:
        self.book.token(request_id, token)
        return self.book.cut_short(request_id)


class Inbox:
    """What the front sent, read by a thread of its own: requests in order, cancelled ids, stop; and the
    heartbeat."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.requests: queue.Queue[Request] = queue.Queue()
        self.live: set[int] = set()  # requests received and not yet ended: a cancel for another id is dropped
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
            try:
                if kind == "job":
                    request = from_json(Request, message.get("request"))
                    with self.lock:
                        self.live.add(request.id)
                    self.requests.put(request)
                elif kind == "cancel":
                    request_id = from_json(int, message.get("id"))
                    with self.lock:
                        if request_id in self.live:
                            self.cancelled.add(request_id)
                elif kind == "stop":
                    self.stop.set()
            except ValueError as exc:  # not what pipemlx's front sends: stop the group rather than guess
                self._stop(f"a malformed {kind!r} message from the front: {exc}")
                return

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

    def is_cancelled(self, request_id: int) -> bool:
        with self.lock:
            return request_id in self.cancelled

    def forget(self, request_id: int) -> None:
        """The request ended here: nothing more to hold about it."""
        with self.lock:
            self.live.discard(request_id)
            self.cancelled.discard(request_id)


class LinkRequests:
    """Requests from a front process over the link: rank 0 reports each token id, the prefill's progress and each
    end, and looks at no text (the front tells it to cancel a request whose answer it has whole).

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
        self.running: set[int] = set()
        self.slots_sent = 0.0

    def stopping(self) -> bool:
        return self.inbox.stop.is_set()

    def shutting_down(self) -> None:
        if self.inbox.why is not None:
            print(f"pipemlx serve: rank 0: {self.inbox.why}; stopping the group", file=sys.stderr)

    def next(self, wait: float) -> Request | None:
        """The next request sent, oldest first (one cancelled before it ran is answered and skipped)."""
        while True:
            try:
                request = self.inbox.requests.get(timeout=wait) if wait > 0 else self.inbox.requests.get_nowait()
            except queue.Empty:
                return None
            wait = 0.0
            if not self.inbox.is_cancelled(request.id):
                return request
            self.inbox.forget(request.id)
            self.link.send({"t": "ended", "id": request.id, "result": to_json(RequestResult("cancelled"))})

    def admitted(self, request_id: int, cached: int) -> None:
        self.running.add(request_id)
        self.link.send({"t": "admitted", "id": request_id, "cached": cached})

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

    def ended(self, request_id: int, result: RequestResult) -> None:
        if request_id not in self.running:
            return
        self.running.discard(request_id)
        self.inbox.forget(request_id)
        self.link.send({"t": "ended", "id": request_id, "result": to_json(result)})

    # --- the scheduler's sink ----------------------------------------------------------------------------------------

    def progress(self, request_id: int, processed: int, total: int) -> None:
        if request_id in self.running:
            self.link.send({"t": "progress", "id": request_id, "processed": processed, "total": total})

    def should_cancel(self, request_id: int) -> bool:
        return request_id not in self.running or self.inbox.is_cancelled(request_id) or self.inbox.stop.is_set()

    def token(self, request_id: int, token: int) -> bool:
        if request_id not in self.running:
            return False
        self.link.send({"t": "token", "id": request_id, "token": int(token)})
        return self.inbox.is_cancelled(request_id)  # the front has the whole answer: end it here too
