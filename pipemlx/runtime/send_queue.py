"""The send queue: sends a rank's last layer produced but has not issued yet."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class PendingSend:
    """A hidden state waiting to be sent to rank ``peer``."""

    array: mx.array
    peer: int


class SendQueue:
    """Pending sends of one sharded model, issued only when flushed.

    In ``"queue"`` mode (see :func:`pipemlx.send_mode`) the last local layer puts
    its output here instead of sending it. :meth:`flush` issues every pending
    send asynchronously, in order, on the queue's own stream so that sending
    does not hold up the next computation; :meth:`in_flight` lists the sends
    issued and not yet waited for; :meth:`discard` drops what was not issued.
    """

    def __init__(self, group: mx.distributed.Group, stream: mx.Stream) -> None:
        self._group = group
        self._stream = stream
        self._pending: list[PendingSend] = []
        self._in_flight: list[mx.array] = []

    def __len__(self) -> int:
        """Number of sends queued and not yet issued."""
        return len(self._pending)

    def put(self, array: mx.array, peer: int) -> None:
        """Queue ``array`` for rank ``peer``."""
        self._pending.append(PendingSend(array, peer))

    @property
    def pending(self) -> tuple[PendingSend, ...]:
        return tuple(self._pending)

    def flush(self) -> int:
        """Issue every pending send, oldest first, without waiting; return how many."""
        issued = [mx.distributed.send(p.array, p.peer, group=self._group, stream=self._stream) for p in self._pending]
        self._pending.clear()
        if issued:
            mx.async_eval(issued)  # pyright: ignore[reportUnknownMemberType]
            self._in_flight.extend(issued)
        return len(issued)

    def in_flight(self) -> list[mx.array]:
        """Sends issued and not yet known to be complete."""
        return list(self._in_flight)

    def mark_complete(self) -> None:
        """Forget the in-flight sends once the caller has waited for them."""
        self._in_flight.clear()

    def discard(self) -> int:
        """Drop every pending send without issuing it; return how many were dropped."""
        dropped = len(self._pending)
        self._pending.clear()
        return dropped
