"""The front process's relay: the requests of its :class:`~.book.Book` to rank 0 over the link, and back what
rank 0 reports, for as long as one group serves (:meth:`Relay.serve`).

The front holds every running request's tokens and text in its book, so a
lost group costs no request: when a new group greets the front, every
unfinished request is sent again (:meth:`~.requests.Request.resumed`: its
prompt plus the tokens already generated, ``max_tokens`` reduced by them), and
the client's stream pauses and continues. A request whose answer is whole
here (a stop string) is cancelled on the ranks. Anything that ends the group
(a rank exits, rank 0 reports a fault or falls silent, a malformed message) is
a :class:`Fault` for the supervisor (:mod:`.supervisor`) to recover from.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from .book import Book, Running
from .link import BEAT_S, SILENCE_S, Link
from .openai_api import shutting_down
from .requests import RequestResult, from_json, to_json


class Fault(Exception):
    """The group cannot go on (a rank exited, rank 0 reported a pipeline error or went silent)."""


class Regroup(Fault):
    """Across hosts, after a shrink: a missing host is back; the group stops and forms again with it."""


class Group(Protocol):
    """What the relay asks of the supervisor about the group it relays to."""

    def check(self) -> None:
        """Raise :class:`Fault` (or :class:`Regroup`) when the group cannot go on as it is."""
        ...

    def gone(self, link_closed: bool) -> bool:
        """Every rank left (after a stop)."""
        ...

    def kill(self) -> None:
        """End what is left of the group."""
        ...


class Relay:
    """The requests of ``book`` to the group behind one link after another."""

    def __init__(self, book: Book, stop_grace: float) -> None:
        self.book = book
        self.stop_grace = stop_grace
        self.cancel_sent: set[int] = set()

    def serve(self, link: Link, group: Group) -> int:
        """Relay to the group behind ``link`` until stopped (0); :class:`Fault` when the group fails."""
        book = self.book
        book.status = "stopping" if book.stopping.is_set() else "ready"
        book.recover_expired = False
        book.end_known()  # whole when the old group failed
        book.forget_finished()  # answered; the old group's end of them is gone
        self.cancel_sent.clear()
        for running in list(book.running.values()):  # resume, in order
            self._send(link, running)
        last_heard = beat_sent = time.monotonic()
        stop_sent, stop_sent_at, closed = False, 0.0, False
        while True:
            if not closed and link.poll(0.02):
                while True:
                    message = link.recv()
                    if message is None:
                        if stop_sent:
                            closed = True
                            break
                        group.check()
                        if link.malformed is not None:
                            raise Fault(f"rank 0 sent {link.malformed}")
                        raise Fault("rank 0 closed the link")
                    last_heard = time.monotonic()
                    self._handle(message)
                    if not link.poll(0):
                        break
            elif closed:
                time.sleep(0.02)
            now = time.monotonic()
            if now - beat_sent >= BEAT_S:  # rank 0 stops the group when the front falls silent
                beat_sent = now
                link.send({"t": "beat"})
            if link.broken and not stop_sent:
                raise Fault("a message to rank 0 could not be sent (the link broke)")
            if stop_sent:
                if group.gone(closed) or time.monotonic() - stop_sent_at > self.stop_grace:
                    group.kill()
                    book.fail_running(shutting_down())
                    return 0
                continue
            group.check()
            if time.monotonic() - last_heard > SILENCE_S:
                raise Fault(f"rank 0 sent nothing for {SILENCE_S:g} s (stalled)")
            for running in book.running.values():
                ticket = running.ticket
                over = ticket.cancelled.is_set() or ticket.finished or running.cut_short
                if over and ticket.id not in self.cancel_sent:
                    self.cancel_sent.add(ticket.id)
                    link.send({"t": "cancel", "id": ticket.id})
            if book.stopping.is_set():
                book.begin_stop()
                if not book.unfinished() or book.stop_due():
                    link.send({"t": "stop"})
                    stop_sent, stop_sent_at = True, time.monotonic()
                continue
            while len(book.unfinished()) < book.settings.engine.max_concurrency:
                ticket = book.next_waiting(0.0)
                if ticket is None:
                    break
                self._send(link, book.start(ticket))

    def _send(self, link: Link, running: Running) -> None:
        """Hand the request to rank 0: its prompt and what it generated so far, for the tokens it still may."""
        link.send({"t": "job", "request": to_json(running.ticket.request.resumed(running.generated))})

    def _handle(self, message: dict[str, Any]) -> None:
        """One message from rank 0; a malformed one is a :class:`Fault` (the group is not what it should be)."""
        book = self.book
        kind = message.get("t")
        try:
            if kind == "fault":
                raise Fault(str(message.get("message")))
            if kind == "slots":
                book.slots = from_json(list[dict[str, int]], message.get("slots"))
            elif kind == "admitted":
                book.admitted(from_json(int, message.get("id")), from_json(int, message.get("cached")))
            elif kind == "progress":
                request_id = from_json(int, message.get("id"))
                book.progress(
                    request_id, from_json(int, message.get("processed")), from_json(int, message.get("total"))
                )
            elif kind == "token":
                book.token(from_json(int, message.get("id")), from_json(int, message.get("token")))
            elif kind == "ended":
                book.ended(from_json(int, message.get("id")), from_json(RequestResult, message.get("result")))
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            raise Fault(f"a malformed {kind!r} message from rank 0: {type(exc).__name__}: {exc}") from None
