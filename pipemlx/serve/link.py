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
failed; rank 0 exits right after). The front sends ``beat`` too while it
serves: rank 0 stops the group when the front is silent for
:data:`FRONT_SILENCE_S` (the front gone, or the network between them cut).

Across hosts (``--hostfile``) the front listens on ``--front-listen`` and rank 0
of the workers connects to it from another machine; the key is then a secret
the user gives every host. :func:`connect` and :class:`Acceptor` bound every
wait of the connection and its handshake, so a peer that connects and says
nothing (or a cut network) cannot hold either end.

Every message is encrypted and authenticated (ChaCha20-Poly1305 from ``cryptography``) with keys of that
connection: after the HMAC challenge each end sends 16 random bytes, and HKDF-SHA256 derives one key per
direction from the shared key and both ends' bytes. Each message's nonce is its number in its direction, so a
host in the path can neither read the requests nor change, drop, replay or reorder a message undetected:
the receiving end finds the link broken (:attr:`Link.malformed`), which the front counts as a fault.

No MLX here: the front imports it without joining any group.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

FRONT_ADDRESS_VARIABLE = "PIPEMLX_SERVE_FRONT"
"""``host:port`` of the front's listener, set for the ranks the front starts (rank 0 connects to it)."""
FRONT_KEY_VARIABLE = "PIPEMLX_SERVE_FRONT_KEY"
"""The link's authentication key: random per front process for local ranks; across hosts a secret the user
sets on the front and on every worker (any string; its UTF-8 bytes are the HMAC key)."""
BEAT_S = 0.5
"""Seconds between heartbeats (rank 0's and the front's); the front counts rank 0 as stalled after
:data:`SILENCE_S` without a message."""
SILENCE_S = 5.0
FRONT_SILENCE_S = 10.0
"""Seconds without a word from the front after which rank 0 stops the group (longer than :data:`SILENCE_S`:
the front, which sees a fault first, restarts nothing when the ranks are only slow to hear it)."""
HANDSHAKE_S = 10.0
"""Seconds the connection and its whole HMAC handshake may take, at either end (not per read: a peer trickling a
byte now and then is cut off at the deadline all the same)."""
MAX_HANDSHAKES = 64
"""Connections the front's listener handshakes at once; more are closed at once (each holds a thread and a
descriptor until its deadline, so a flood of silent peers cannot exhaust either)."""
MIN_KEY_BYTES = 16
"""The shortest shared key accepted (128 bits): a short one could be guessed against the challenge."""
JOIN_VARIABLE = "PIPEMLX_SERVE_JOIN"
"""Set for a ``--worker`` (hosts): its entry in the hostfile. It joins the front before the group forms, and the
front says which group to form (every host, or with ``--allow-shrink`` those still there)."""
MAX_MESSAGE_BYTES = 64 << 20
"""The longest message read; a longer one breaks the link (a peer cannot make the front allocate without bound)."""
CONNECT_EVERY_S = 1.0
"""Seconds between attempts to reach a front that is not answering (a worker joining, rank 0 connecting)."""


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, like 10.0.0.1:8090, got {text!r}")
    return host, int(port)


def key_from_environment() -> str | None:
    """The shared key in :data:`FRONT_KEY_VARIABLE`, or None when it is unset or empty."""
    return os.environ.get(FRONT_KEY_VARIABLE) or None


def check_key(key: str) -> None:
    """ValueError unless ``key`` has at least :data:`MIN_KEY_BYTES` bytes (UTF-8)."""
    if len(key.encode()) < MIN_KEY_BYTES:
        raise ValueError(
            f"the shared key in ${FRONT_KEY_VARIABLE} has {len(key.encode())} bytes; it needs {MIN_KEY_BYTES} at "
            "least (128 bits; e.g. from: openssl rand -hex 32)"
        )


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def set_timeouts(fd: int, receive: float, send: float) -> None:
    """Bound the blocking reads and writes of socket ``fd`` (0: unbounded). A :class:`Connection` reads and writes
    its descriptor directly, which a socket object's timeout (a non-blocking descriptor) would break; a bounded
    call fails with an OSError instead of hanging on a silent peer or a cut network."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(receive))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send))
    finally:
        sock.close()


SESSION_NONCE_BYTES = 16


def _session(connection: Connection[Any, Any], key: bytes, front: bool) -> tuple[bytes, bytes]:
    """The connection's keys, (to send, to receive), from ``key`` and a random nonce from each end (exchanged
    here, after the HMAC challenge): new keys for every connection, so no message of one fits another."""
    ours = os.urandom(SESSION_NONCE_BYTES)
    connection.send_bytes(ours)
    theirs = connection.recv_bytes(64)
    if len(theirs) != SESSION_NONCE_BYTES:
        raise AuthenticationError("the peer's session nonce is malformed")
    nonces = ours + theirs if front else theirs + ours  # the front's first

    def derive(direction: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, salt=nonces, info=b"pipemlx serve link " + direction).derive(key)

    to_rank, to_front = derive(b"front to rank 0"), derive(b"rank 0 to front")
    return (to_rank, to_front) if front else (to_front, to_rank)


def connect(address: str, key: str, timeout: float = HANDSHAKE_S, send_timeout: float = FRONT_SILENCE_S) -> Link:
    """Rank 0's end of the link to the front at ``address`` (``host:port``): connected and authenticated within
    ``timeout`` seconds, else OSError or EOFError (:class:`AuthenticationError` for a wrong key). A send that
    cannot go out for ``send_timeout`` seconds marks the link gone."""
    host, port = parse_address(address)
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    set_timeouts(sock.fileno(), timeout, timeout)
    connection: Connection[Any, Any] = Connection(sock.detach())
    try:
        answer_challenge(connection, key.encode())
        deliver_challenge(connection, key.encode())
        keys = _session(connection, key.encode(), front=False)
        set_timeouts(connection.fileno(), 0, send_timeout)
    except BaseException:
        connection.close()
        raise
    return Link(connection, *keys)


class Acceptor:
    """The front's listener: every connection that passes the HMAC handshake becomes a :class:`Link` in
    :attr:`accepted`.

    Each handshake runs in a thread of its own, so a silent peer holds nothing up; the whole handshake has
    ``handshake_s`` seconds (the accept thread shuts down the sockets past their deadline), at most
    ``max_handshakes`` run at once (more connections are closed as they come), and the accept thread outlives
    any error (too many open files: it says so once per burst, waits, and accepts again)."""

    def __init__(
        self,
        host: str,
        port: int,
        key: str,
        send_timeout: float = SILENCE_S,
        handshake_s: float = HANDSHAKE_S,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.sock.settimeout(0.1)  # the accept thread wakes up to enforce the handshakes' deadlines
        self.address: tuple[str, int] = cast(tuple[str, int], self.sock.getsockname()[:2])
        self.key = key.encode()
        self.send_timeout = send_timeout
        self.handshake_s = handshake_s
        self.max_handshakes = max_handshakes
        self.accepted: queue.Queue[Link] = queue.Queue()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.pending: dict[socket.socket, float] = {}  # handshaking sockets and their deadlines
        self.refused = 0  # connections closed unheard: over the cap (reported with the next burst's line)
        threading.Thread(target=self._accept, name="pipemlx-serve-accept", daemon=True).start()

    def _accept(self) -> None:
        said_at = -BURST_S
        while not self.closed.is_set():
            self._expire()
            try:
                sock, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.closed.is_set():
                    return
                now = time.monotonic()
                if now - said_at >= BURST_S:  # once per burst, not per accept
                    said_at = now
                    print(
                        f"pipemlx serve: the link's listener cannot accept ({exc}); trying again",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(0.1)
                continue
            with self.lock:
                full = len(self.pending) >= self.max_handshakes
                if not full:
                    self.pending[sock] = time.monotonic() + self.handshake_s
            if full:
                self.refused += 1
                sock.close()
                continue
            try:
                threading.Thread(
                    target=self._handshake, args=(sock,), name="pipemlx-serve-handshake", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had
                self._done(sock)
                sock.close()

    def _expire(self) -> None:
        """Cut the handshakes past their deadline (their threads then fail and end)."""
        now = time.monotonic()
        with self.lock:
            late = [sock for sock, due in self.pending.items() if due <= now]
        for sock in late:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _done(self, sock: socket.socket) -> None:
        with self.lock:
            self.pending.pop(sock, None)

    def _handshake(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(None)
            set_timeouts(sock.fileno(), self.handshake_s, self.handshake_s)
            connection: Connection[Any, Any] = Connection(os.dup(sock.fileno()))
        except OSError:
            self._done(sock)
            sock.close()
            return
        try:
            deliver_challenge(connection, self.key)
            answer_challenge(connection, self.key)
            keys = _session(connection, self.key, front=True)
            set_timeouts(connection.fileno(), 0, self.send_timeout)
            ok = not self.closed.is_set()
        except (OSError, EOFError, ValueError, AuthenticationError):  # not our rank 0, a wrong key, a silent peer
            ok, keys = False, (b"", b"")
        finally:
            self._done(sock)  # no deadline from here on: the accept thread no longer touches it
            sock.close()  # the connection keeps its own descriptor
        if not ok:
            connection.close()
            return
        self.accepted.put(Link(connection, *keys))

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.close()
        except OSError:
            pass


BURST_S = 10.0
"""Seconds during which repeated accept failures are reported once."""


class Link:
    """One end of the link: JSON objects over a :class:`Connection`, each sealed with ``send_key`` and opened with
    ``recv_key`` (ChaCha20-Poly1305, the message's number in its direction as nonce); :meth:`send` is safe from
    any thread, :meth:`recv` is for one thread."""

    def __init__(self, connection: Connection[Any, Any], send_key: bytes, recv_key: bytes) -> None:
        self.connection = connection
        self.sealer = ChaCha20Poly1305(send_key)
        self.opener = ChaCha20Poly1305(recv_key)
        self.sent = 0  # messages sent (the next one's nonce)
        self.received = 0  # messages received (the next one's expected nonce)
        self.lock = threading.Lock()
        self.broken = False  # a send failed, perhaps halfway through a message: nothing more goes out
        self.malformed: str | None = None  # what was wrong with the message that broke the link

    def send(self, message: dict[str, Any]) -> bool:
        """Send ``message``; False when the other end is gone (or a send timed out: the link is then broken)."""
        return self.send_bytes(json.dumps(message, separators=(",", ":")).encode())

    def send_bytes(self, data: bytes) -> bool:
        """Seal and send ``data`` (one message); False when the link is gone."""
        with self.lock:
            if self.broken:
                return False
            sealed = self.sealer.encrypt(_nonce(self.sent), data, None)
            self.sent += 1
            try:
                self.connection.send_bytes(sealed)
            except (OSError, ValueError):
                self.broken = True
                return False
        return True

    def poll(self, timeout: float) -> bool:
        """A message (or the end of the link) is there to read within ``timeout`` seconds."""
        try:
            return self.connection.poll(timeout)
        except (OSError, ValueError):
            return True  # recv will say the link is gone

    def recv(self) -> dict[str, Any] | None:
        """The next message; ``None`` when the other end is gone, or sent something that is not a JSON object (then
        :attr:`malformed` says what, and the link is broken: the front counts it as a fault of that link)."""
        try:
            sealed = self.connection.recv_bytes(MAX_MESSAGE_BYTES)
        except (EOFError, OSError, ValueError):
            return None
        try:
            data = self.opener.decrypt(_nonce(self.received), sealed, None)
        except InvalidTag:
            self.malformed = "a message that fails authentication (changed, forged, replayed or out of order)"
            self.broken = True
            return None
        self.received += 1
        try:
            value: Any = json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            value = exc
        if not isinstance(value, dict):
            what = f"{type(value).__name__}: {value}" if isinstance(value, Exception) else type(value).__name__
            self.malformed = f"a message that is not a JSON object ({what[:200]})"
            self.broken = True
            return None
        return cast(dict[str, Any], value)

    def close(self) -> None:
        try:
            self.connection.close()
        except OSError:
            pass


def _nonce(number: int) -> bytes:
    """The 12-byte nonce of a direction's message ``number``."""
    return struct.pack("<4xQ", number)


@dataclass(frozen=True)
class Assignment:
    """The group the front told a joined worker to form: the hostfile's entries of its hosts, in rank order,
    this worker's rank among them, and the split (``None``: the worker's own ``--split`` or the default)."""

    link: Link
    hosts: list[list[str]]
    rank: int
    split: list[int] | None


def connect_retrying(address: str, key: str, attempt_s: float, who: str, meanwhile: Callable[[], None]) -> Link:
    """Connect to the front at ``address`` (each attempt bounded by ``attempt_s``), trying again every
    :data:`CONNECT_EVERY_S` seconds while it cannot be reached (down, restarting, a cut network) and calling
    ``meanwhile`` between attempts; ``who`` says once that it cannot reach it, and when it did."""
    said = False
    while True:
        started = time.monotonic()
        try:
            link = connect(address, key, timeout=attempt_s)
        except (OSError, EOFError, ValueError, AuthenticationError) as exc:  # AuthenticationError: a wrong key
            if not said:
                print(
                    f"pipemlx serve: {who}: cannot reach the front at {address} ({type(exc).__name__}: {exc}); "
                    f"trying again every {CONNECT_EVERY_S:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            meanwhile()
            time.sleep(max(0.0, CONNECT_EVERY_S - (time.monotonic() - started)))
            continue
        if said:
            print(f"pipemlx serve: {who}: connected to the front at {address}", file=sys.stderr, flush=True)
        return link


def join_front(address: str, key: str, entry: int, memory: int, attempt_s: float) -> Assignment:
    """Reach the front at ``address``, say which hostfile ``entry`` this worker is and the ``memory`` it can give,
    and wait for the group to form. Retries while the front cannot be reached, closes the link and starts over
    when the front goes away or falls silent for :data:`FRONT_SILENCE_S` seconds: a worker waits for its front as
    long as it takes."""
    while True:
        link = connect_retrying(address, key, attempt_s, f"worker {entry}", lambda: None)
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
        print(f"pipemlx serve: worker {entry}: the front at {address} went away; joining again", file=sys.stderr)
