"""Weights from a peer: a rank that has the model serves its files to the ranks of its group that do not.

At the start of :func:`pipemlx.models.loading.load_sharded`, every rank says in one all-gather over the group
(:func:`share_model`) whether this machine has the model (a folder, or a Hub snapshot with every weight file:
:func:`pipemlx.models.hub.cached_snapshot`); a rank that has it listens on its own address in the group (its
hostfile entry's IP, loopback without a hostfile) and adds its port, a fingerprint of the model and a random
32-byte token to its row. A rank without the model then reads it from one that has it
(:class:`PeerSource`): the headers, the config and tokenizer files, and the byte ranges of its own tensors,
into its weight folder (:func:`pipemlx.models.weights.fetch_rank_folder`).

The server (:class:`PeerServer`) is read-only and answers only three requests: the model's headers and
file list, one of its config or tokenizer files, and a byte range (at most
:data:`~pipemlx.models.weights.CHUNK_BYTES`) inside one of its weight files. A connection first proves it holds
the token (an HMAC of a fresh challenge); every answer ends with a keyed BLAKE3 hash, under a key derived from
the token and that challenge, of the answer's position on the connection, its request, its head and its bytes.
The fetching rank hashes the bytes as they arrive and checks the length and the hash at the end of the answer:
a byte changed in transit, a short or cut answer fails the fetch with a :class:`TransferError` (the weight
folder being written is removed). For speed, a rank keeps :data:`IN_FLIGHT` range requests sent ahead; the
holder sends ranges with ``sendfile`` and hashes them from a mapping of the file; the rank receives into one
reused buffer. The server stops once every rank has loaded (the exchange of :mod:`.load_wait` ended), or with
the run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import secrets
import shutil
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
from blake3 import blake3

from ..runtime.waits import wait_for
from . import weights
from .hub import cached_snapshot
from .load_wait import FIRST_MEETING_TIMEOUTS, LOGGER
from .weights import (
    CHUNK_BYTES,
    DONE_FILE,
    FetchCount,
    FolderSource,
    TensorInfo,
    TransferError,
    weights_root,
)

TOKEN_BYTES = 32
HOST_BYTES = 64
"""The most bytes of a holder's address in the all-gathered row."""
PEER_TIMEOUT_S = 60.0
"""Seconds a fetching rank waits for any one read or write on its connection to the holder."""
MAX_CONNECTIONS = 64
"""Connections a server handles at once; more are closed at once."""
MAX_REQUEST_BYTES = 4096
MAX_FILE_BYTES = 256 << 20
"""The largest config or tokenizer file served."""
IN_FLIGHT = 3
"""Range requests a fetching rank keeps sent ahead of the answer it reads."""
SLICE_BYTES = 1 << 20
"""A range is hashed and sent by slices of this many bytes (each hashed while in the CPU's cache)."""
RECEIVE_BYTES = 1 << 20
"""The most bytes one receive takes (then hashed, while in the CPU's cache)."""
RESUME_TRIES = 3
"""Reconnections in a row a fetching rank tries after a cut transfer before it fails."""
RESUME_WAIT_S = 0.2
"""Seconds before the first reconnection; doubled before each next one."""
HELLO, SESSION = b"pipemlx-peer-hello", b"pipemlx-peer-session"
HOSTFILE_VARIABLE = "MLX_HOSTFILE"
PEER_HOST_VARIABLE = "PIPEMLX_PEER_HOST"
"""This host's address for the ranks that fetch the model from it (the default: its ring hostfile entry)."""


def own_host(rank: int) -> str:
    """The address a rank that has the model serves it on: ``$PIPEMLX_PEER_HOST`` where set (the MPI backend has
    no hostfile to read it from), else this rank's entry of the ring hostfile MLX was given, else loopback."""
    given = os.environ.get(PEER_HOST_VARIABLE, "").strip()
    if given:
        return given
    path = os.environ.get(HOSTFILE_VARIABLE)
    if path:
        try:
            hosts: Any = json.loads(Path(path).read_text())
            entry = str(hosts[rank][0] if isinstance(hosts[rank], list) else hosts[rank])
            host = entry.rpartition(":")[0].strip("[]")
            if host:
                return host
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            pass
    return "127.0.0.1"


def fingerprint(source: FolderSource) -> bytes:
    """32 bytes naming the held model's bytes (its folder, files, sizes and modification times)."""
    return hashlib.sha256(source.identity().encode()).digest()


class PeerServer:
    """Serves one model folder, read-only, to connections that hold ``token`` (see the module)."""

    def __init__(self, source: FolderSource, host: str, token: bytes) -> None:
        self.source = source
        self.token = token
        self.served = 0
        """Bytes of weight ranges sent so far (tests count them)."""
        self._lock = threading.Lock()
        self._open = 0
        self._files = set(source.weight_files())
        self._metadata = set(source.metadata_files())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self._socket.listen(16)
        self.address: tuple[str, int] = (host, int(self._socket.getsockname()[1]))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="pipemlx-peer-server", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.served and not self._stopped.is_set():
            LOGGER.warning("pipemlx: served %d bytes of %s's tensors to the group", self.served, self.source.name)
        self._stopped.set()
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return
            with self._lock:
                full = self._open >= MAX_CONNECTIONS
                self._open += 0 if full else 1
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        files: dict[str, tuple[BinaryIO, mmap.mmap]] = {}
        try:
            conn.settimeout(PEER_TIMEOUT_S)
            nonce = secrets.token_bytes(16)
            conn.sendall(nonce)
            proof = _read_exact(conn, 32)
            if not hmac.compare_digest(proof, hmac.new(self.token, HELLO + nonce, "sha256").digest()):
                return
            key = hmac.new(self.token, SESSION + nonce, "sha256").digest()
            index = 0
            while not self._stopped.is_set():
                try:
                    (length,) = struct.unpack(">I", _read_exact(conn, 4))
                except EOFError:
                    return
                if length > MAX_REQUEST_BYTES:
                    return
                request = _read_exact(conn, length)
                mac = _answer_mac(key, index, request)
                index += 1
                try:
                    answer, ok = self._answer(json.loads(request), files), True
                except (ValueError, KeyError, TypeError, OSError) as exc:
                    answer, ok = str(exc).encode(), False
                size = len(answer) if isinstance(answer, bytes) else answer[2] - answer[1]
                head = bytes([0 if ok else 1]) + struct.pack(">Q", size)
                mac.update(head)
                conn.sendall(head)
                if isinstance(answer, bytes):
                    mac.update(answer)
                    conn.sendall(answer)
                else:
                    self._send_range(conn, mac, files[answer[0]], answer[1], answer[2])
                conn.sendall(mac.digest())
        except (OSError, EOFError):
            return
        finally:
            for handle, mapped in files.values():
                mapped.close()
                handle.close()
            conn.close()
            with self._lock:
                self._open -= 1

    def _send_range(
        self, conn: socket.socket, mac: blake3, file: tuple[BinaryIO, mmap.mmap], start: int, stop: int
    ) -> None:
        """Bytes ``start:stop`` of an open weight file: by slices, each sent by the kernel from the page cache
        (``sendfile``: no copy here), then hashed from the file's mapping while it is still in the CPU's cache
        and the receiver takes it."""
        handle, mapped = file
        with memoryview(mapped) as view:
            for begin in range(start, stop, SLICE_BYTES):
                end = min(stop, begin + SLICE_BYTES)
                conn.sendfile(handle, begin, end - begin)
                mac.update(view[begin:end])  # while the receiver takes the slice
        with self._lock:
            self.served += stop - start

    def _answer(
        self, request: dict[str, Any], files: dict[str, tuple[BinaryIO, mmap.mmap]]
    ) -> bytes | tuple[str, int, int]:
        """The answer's bytes, or for a byte range ``(file, start, stop)`` with the file opened into ``files``."""
        op = request["op"]
        if op == "meta":
            headers = {k: v.to_json() for k, v in self.source.headers().items()}
            meta = {"headers": headers, "files": sorted(self._metadata)}
            return json.dumps(meta).encode()
        if op == "file":
            name = str(request["name"])
            if name not in self._metadata:
                raise ValueError(f"{name!r} is not a config or tokenizer file of the model served")
            path = self.source.root / name
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"{name} is larger than {MAX_FILE_BYTES} bytes")
            return path.read_bytes()
        if op == "range":
            file, start, stop = str(request["file"]), int(request["start"]), int(request["stop"])
            if file not in self._files:
                raise ValueError(f"{file!r} is not a weight file of the model served")
            if file not in files:
                handle = open(self.source.root / file, "rb")  # noqa: SIM115 (closed with the connection)
                try:
                    files[file] = (handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
                except (OSError, ValueError):
                    handle.close()
                    raise
            size = len(files[file][1])
            if not 0 <= start < stop <= size or stop - start > CHUNK_BYTES:
                raise ValueError(f"bytes {start}:{stop} are not a range of at most {CHUNK_BYTES} bytes in {file}")
            return file, start, stop
        raise ValueError(f"unknown request {op!r}")


@dataclass
class PeerSource:
    """The model as a rank of the group that has it serves it (a :class:`~pipemlx.models.weights.WeightSource`)."""

    label: str
    address: tuple[str, int]
    token: bytes
    print_: bytes
    """The holder's :func:`fingerprint` of the model: the cache key of what is fetched from it."""
    holder: int
    count: FetchCount = field(default_factory=FetchCount)
    """Requests answered so far (the ranks' progress exchange counts them)."""
    _conn: socket.socket | None = field(default=None, repr=False)
    _key: bytes = field(default=b"", repr=False)
    _index: int = field(default=0, repr=False)
    _buffer: bytearray = field(default_factory=bytearray, repr=False)

    @property
    def name(self) -> str:
        return self.label

    @property
    def local(self) -> bool:
        return False

    def identity(self) -> str:
        return "peer:" + self.print_.hex()

    def describe(self) -> str:
        return f"rank {self.holder} ({self.address[0]}:{self.address[1]})"

    def metadata_root(self) -> Path:
        """The holder's config, tokenizer files and headers, fetched once into the cache (``meta-*``)."""
        final = weights_root() / f"meta-{self.print_.hex()[:32]}"
        if (final / DONE_FILE).is_file():
            return final
        temporary = final.with_name(f"{final.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
        temporary.mkdir(parents=True)
        try:
            meta = json.loads(self._request({"op": "meta"}))
            for name in meta["files"]:
                if "/" in name or name.startswith("."):
                    raise TransferError(f"{self.describe()} named a file {name!r} outside the model folder")
                (temporary / name).write_bytes(self._request({"op": "file", "name": name}))
            (temporary / "pipemlx-headers.json").write_text(json.dumps(meta["headers"]))
            (temporary / DONE_FILE).write_text(json.dumps({"source": self.identity()}))
            try:
                os.rename(temporary, final)
            except OSError:
                if not (final / DONE_FILE).is_file():
                    raise
        finally:
            if temporary.exists():
                shutil.rmtree(temporary, ignore_errors=True)
        return final

    def headers(self) -> dict[str, TensorInfo]:
        rows = json.loads((self.metadata_root() / "pipemlx-headers.json").read_text())
        return {k: TensorInfo.from_json(v) for k, v in rows.items()}

    def read(self, file: str, start: int, stop: int) -> Iterator[tuple[int, bytes | memoryview]]:
        """The range in requests of at most :data:`~pipemlx.models.weights.CHUNK_BYTES`, up to :data:`IN_FLIGHT`
        of them sent ahead (the holder reads and sends the next while this rank takes this one), each answer's
        bytes in pieces of one reused buffer (valid until the next piece), its keyed hash checked after its last
        piece. A cut connection is opened again, up to :data:`RESUME_TRIES` times in a row, and the transfer goes
        on from the start of the answer that was cut (its bytes are sent again)."""
        chunk = weights.CHUNK_BYTES
        spans = [(begin, min(stop, begin + chunk)) for begin in range(start, stop, chunk)]
        checked = cuts = 0  # answers checked; cuts since the last answer checked
        while checked < len(spans):
            pending: deque[bytes] = deque()
            sent, cut = checked, None
            try:
                for begin, end in spans[checked:]:
                    while sent < len(spans) and len(pending) < IN_FLIGHT:
                        request = {"op": "range", "file": file, "start": spans[sent][0], "stop": spans[sent][1]}
                        pending.append(self._send(request))
                        sent += 1
                    offset = begin
                    for piece in self._receive(pending.popleft(), file, end - begin):
                        yield offset, piece
                        offset += len(piece)
                    if offset != end:
                        raise TransferError(
                            f"{self.describe()} sent {offset - begin} bytes of {file} for {end - begin}"
                        )
                    checked, cuts = checked + 1, 0
            except _Cut as exc:
                cut = exc
            finally:
                if checked < len(spans):  # answers, or parts of one, still on their way (an error, a cut, or the
                    self.close()  # caller stopped)
            if cut is not None:
                cuts += 1
                _before_reconnecting(cut, cuts)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connect(self) -> socket.socket:
        if self._conn is not None:
            return self._conn
        try:
            conn = socket.create_connection(self.address, timeout=PEER_TIMEOUT_S)
            nonce = _read_exact(conn, 16)
            conn.sendall(hmac.new(self.token, HELLO + nonce, "sha256").digest())
        except (OSError, EOFError) as exc:
            raise _Cut(f"cannot reach {self.describe()}, which has {self.label}: {exc}") from None
        self._conn, self._key, self._index = conn, hmac.new(self.token, SESSION + nonce, "sha256").digest(), 0
        return conn

    def _request(self, request: dict[str, Any]) -> bytes:
        """One request and its checked answer (nothing else in flight); asked again on a new connection after a
        cut, up to :data:`RESUME_TRIES` times."""
        what = f"{request.get('file') or request.get('name') or 'the headers'}"
        cuts = 0
        while True:
            try:
                return b"".join(bytes(piece) for piece in self._receive(self._send(request), what, None))
            except _Cut as cut:
                self.close()
                cuts += 1
                _before_reconnecting(cut, cuts)

    def _send(self, request: dict[str, Any]) -> bytes:
        raw = json.dumps(request, separators=(",", ":")).encode()
        conn = self._connect()
        try:
            conn.sendall(struct.pack(">I", len(raw)) + raw)
        except OSError as exc:
            self.close()
            raise _Cut(f"the request to {self.describe()} failed ({exc})") from None
        return raw

    def _receive(self, raw: bytes, what: str, expected: int | None) -> Iterator[memoryview]:
        """The answer to request ``raw`` (the next on the connection): its body in pieces of this source's one
        buffer, each hashed as it arrives; its keyed hash checked after the last piece (a refusal is read whole
        and raised once checked). ``expected``: the body's length, where known."""
        conn = self._connect()
        mac = _answer_mac(self._key, self._index, raw)
        self._index += 1
        if len(self._buffer) != RECEIVE_BYTES:
            self._buffer = bytearray(RECEIVE_BYTES)
        view = memoryview(self._buffer)
        got = 0
        refusal = bytearray()
        try:
            head = _read_exact(conn, 1 + 8)
            status, (length,) = head[0], struct.unpack(">Q", head[1:9])
            if length > CHUNK_BYTES + MAX_FILE_BYTES or (status == 0 and expected not in (None, length)):
                self.close()
                raise TransferError(f"{self.describe()} announced {length} bytes for {what}")
            mac.update(head)
            while got < length:
                filled, want = 0, min(length - got, RECEIVE_BYTES)
                while filled < want:  # a whole buffer at a time: one hash update and one write per buffer
                    n = conn.recv_into(view[filled:want])
                    if n == 0:
                        raise EOFError
                    filled += n
                got += filled
                mac.update(view[:filled])  # while the bytes are still in the CPU's cache
                if status == 0:
                    yield view[:filled]
                else:
                    refusal += view[:filled]
            tag = _read_exact(conn, 32)
        except (OSError, EOFError) as exc:
            if isinstance(exc, TransferError):
                raise
            self.close()
            cause = "the connection closed" if isinstance(exc, EOFError) else str(exc) or type(exc).__name__
            raise _Cut(f"the transfer of {what} from {self.describe()} was cut after {got} bytes ({cause})") from None
        if not hmac.compare_digest(tag, mac.digest()):
            self.close()
            raise TransferError(
                f"{length} bytes of {what} from {self.describe()} fail their check (changed in transit); "
                "no weight folder was kept"
            )
        self.count.requests += 1
        if status != 0:
            raise TransferError(f"{self.describe()} refused {what}: {bytes(refusal).decode(errors='replace')}")


def _before_reconnecting(cut: _Cut, cuts: int) -> None:
    """After the ``cuts``-th cut in a row: the error on this rank once :data:`RESUME_TRIES` reconnections have
    failed, else a warning and a wait that doubles with each cut."""
    if cuts > RESUME_TRIES:
        raise TransferError(f"{cut} ({RESUME_TRIES} reconnections failed); no weight folder was kept") from None
    LOGGER.warning("pipemlx: %s; reconnecting (%d of %d)", cut, cuts, RESUME_TRIES)
    time.sleep(RESUME_WAIT_S * 2 ** (cuts - 1))


class _Cut(TransferError):
    """A connection to the holder that failed or closed before an answer was complete (a reconnection may help;
    a failed check or a refusal is not a cut)."""


def _answer_mac(key: bytes, index: int, request: bytes) -> blake3:
    """The keyed hash (BLAKE3 keyed with the session key) of answer number ``index`` on a connection: it covers the
    answer's position, its request, its head and its body, so that no answer can stand for another."""
    mac = blake3(struct.pack(">QI", index, len(request)), key=key)
    mac.update(request)
    return mac


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = conn.recv(n - len(data))
        if not piece:
            raise EOFError
        data += piece
    return bytes(data)


@dataclass(frozen=True)
class Sharing:
    """What :func:`share_model` agreed for this rank: the peer to fetch the model from (``None``: not from a peer)
    and whether this rank has the model itself (and serves it)."""

    peer: PeerSource | None
    holds: bool


@contextmanager
def share_model(
    group: Any, path: str | os.PathLike[str], revision: str | None, timeout: float | None
) -> Generator[Sharing]:
    """Agree who has the model ``path`` (one all-gather over ``group``); serve it while the body runs where this
    rank has it; give the body a :class:`Sharing` whose ``peer`` is the :class:`PeerSource` to fetch from where
    this rank lacks the model and another has it (``None``: this rank has it, or no rank does)."""
    if group.size() == 1:
        yield Sharing(None, False)
        return
    rank: int = group.rank()
    size: int = group.size()
    held = cached_snapshot(path, revision)
    token = secrets.token_bytes(TOKEN_BYTES)
    server = PeerServer(held, own_host(rank), token).start() if held is not None else None
    try:
        host = (server.address[0] if server else "").encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        row = [1 if server else 0, server.address[1] if server else 0, *token]
        row += [*(fingerprint(held) if held is not None else bytes(32)), *host]
        stream = mx.new_thread_unsafe_stream(mx.default_device())
        with mx.stream(stream):
            gathered = mx.distributed.all_gather(mx.array(row, dtype=mx.int32), group=group)
        wait = None if timeout is None else timeout * FIRST_MEETING_TIMEOUTS
        wait_for(gathered, wait, lambda: f"rank {rank}/{size} telling the others whether it has {os.fspath(path)}")
        flat: list[int] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
        rows: list[list[int]] = [flat[r * len(row) : (r + 1) * len(row)] for r in range(size)]
        holders = [r for r in range(size) if rows[r][0] == 1]
        if held is not None or not holders:
            yield Sharing(None, held is not None)
            return
        chosen = holders[rank % len(holders)]
        line = rows[chosen]
        start = 2
        peer_token = bytes(line[start : start + TOKEN_BYTES])
        print_ = bytes(line[start + TOKEN_BYTES : start + 2 * TOKEN_BYTES])
        peer_host = bytes(line[start + 2 * TOKEN_BYTES :]).rstrip(b"\0").decode()
        source = PeerSource(os.fspath(path), (peer_host, line[1]), peer_token, print_, chosen)
        try:
            yield Sharing(source, False)
        finally:
            source.close()
    finally:
        if server is not None:
            server.stop()
