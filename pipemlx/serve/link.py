"""The messages between the front process and rank 0 (``pipemlx serve --recover``): JSON over a local socket.

The front (:mod:`.recovery`) listens on a loopback port with
:class:`multiprocessing.connection.Listener` (the standard library's
length-prefixed, HMAC-authenticated connection) and rank 0 connects to it
(:mod:`.worker`); each message is one JSON object sent with ``send_bytes``
(nothing is unpickled). The ranks keep talking among themselves over
``mx.distributed``; this link only carries the requests and their tokens.

Front to rank 0: ``job`` (a request to run: its tokens, so far generated ones
included after a restart), ``cancel`` (stop a request: its client left, or the
front has its whole answer), ``stop`` (stop the group). Rank 0 to the front:
``hello`` (loaded and greeted: the split and the ranks' slots), ``admitted``,
``progress``, ``token``, ``ended``, ``slots``, ``beat`` (every
:data:`BEAT_S` seconds, from a thread of its own) and ``fault`` (the pipeline
failed; rank 0 exits right after).

No MLX here: the front imports it without joining any group.
"""

from __future__ import annotations

import json
import threading
from multiprocessing.connection import Connection
from typing import Any, cast

FRONT_ADDRESS_VARIABLE = "PIPEMLX_SERVE_FRONT"
"""``host:port`` of the front's listener, set for the ranks the front starts (rank 0 connects to it)."""
FRONT_KEY_VARIABLE = "PIPEMLX_SERVE_FRONT_KEY"
"""The link's authentication key (hex), random per front process."""
BEAT_S = 0.5
"""Seconds between rank 0's heartbeats; the front counts rank 0 as stalled after :data:`SILENCE_S` without a
message."""
SILENCE_S = 5.0


class Link:
    """One end of the link: JSON objects over a :class:`Connection`; :meth:`send` is safe from any thread."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        """Send ``message``; False when the other end is gone."""
        data = json.dumps(message, separators=(",", ":")).encode()
        try:
            with self.lock:
                self.connection.send_bytes(data)
        except (OSError, ValueError):
            return False
        return True

    def poll(self, timeout: float) -> bool:
        """A message (or the end of the link) is there to read within ``timeout`` seconds."""
        try:
            return self.connection.poll(timeout)
        except (OSError, ValueError):
            return True  # recv will say the link is gone

    def recv(self) -> dict[str, Any] | None:
        """The next message; ``None`` when the other end is gone."""
        try:
            data = self.connection.recv_bytes()
        except (EOFError, OSError, ValueError):
            return None
        value: Any = json.loads(data)
        return cast(dict[str, Any], value) if isinstance(value, dict) else None

    def close(self) -> None:
        try:
            self.connection.close()
        except OSError:
            pass
