"""The server's messages between ranks, over pipemlx's wire protocol (:mod:`pipemlx.runtime.protocol`).

Rank 0 hands out each step as one ``SERVE`` message: an all-gather in which
rank 0 fills the operation's fields (``op``, ``seq``, ...) and every rank fills
its own (pid, the last request it finished, how many positions its cache held
then, ...), so one collective both says what comes next and tells every rank
where every other rank stands. A step with operations follows it with one
``TOKENS`` message: rank 0's :class:`Ops` in their JSON form (the requests'
one wire form, :mod:`.requests`) as an ``int32`` payload (the other ranks send
zeros of the same count), read from rank 0's row. Being plain
collectives with bounded waits, both run on any backend the group runs on, and
a rank that dies or stalls becomes :class:`PeerLostError` /
:class:`PipelineTimeoutError`, never a hang.

Operations (``op``): ``HELLO`` (start-up: every rank's own fields only),
``IDLE`` (rank 0 has nothing to run; the other ranks pause ``pause_ms`` and
come back: the heartbeat), ``REQUEST`` (one request, run whole), ``STEP`` (one
tick of the batch) and ``SHUTDOWN``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import PipelineMismatchError
from ..runtime.protocol import SERVE, TOKENS, gather
from ..runtime.waits import wait_for
from .prefix_cache import PrefixReuse
from .requests import Request, from_json, to_json

HELLO, IDLE, REQUEST, SHUTDOWN, STEP = 1, 2, 3, 4, 5
OPS = {HELLO: "hello", IDLE: "idle", REQUEST: "request", SHUTDOWN: "shutdown", STEP: "step"}
RANK_FIELDS = (
    "pid",
    "last_seq",
    "cache_tokens",
    "outcome",
    "bytes_per_token",
    "trimmable",
    "prefix_entries",
    "prefix_tokens",
)
"""The fields of ``SERVE`` that every rank fills for itself; the others are rank 0's."""
LEADER_FIELDS = tuple(f.name for f in SERVE.fields if f.name not in RANK_FIELDS)
CHECKSUM_MODULUS = 2_147_483_629  # a prime below 2**31


def checksum(tokens: Sequence[int]) -> int:
    value = len(tokens)
    for t in tokens:
        value = (value * 31 + t + 1) % CHECKSUM_MODULUS
    return value


@dataclass(frozen=True)
class Insert:
    """A request joining the scheduler, as every rank receives it: the request (its seed agreed) and how it
    starts from the prefix cache."""

    request: Request
    plan: PrefixReuse = field(default_factory=PrefixReuse)


@dataclass(frozen=True)
class Ops:
    """One step's operations: remove ``removes`` (request ids), then insert ``inserts``, then run."""

    removes: list[int] = field(default_factory=list[int])
    inserts: list[Insert] = field(default_factory=list[Insert])


def encode_ops(ops: Ops) -> list[int]:
    """``ops`` as int32 values for the broadcast (none for no operation): the bytes of their JSON form, four to a
    value; :func:`decode_ops` reverses it exactly."""
    if not ops.removes and not ops.inserts:
        return []
    data = json.dumps(to_json(ops), separators=(",", ":")).encode()
    data += b" " * (-len(data) % 4)
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def decode_ops(values: Sequence[int]) -> Ops:
    """The :class:`Ops` that :func:`encode_ops` made; :class:`PipelineMismatchError` when ``values`` are not such."""
    if not values:
        return Ops()
    try:
        ops = from_json(Ops, json.loads(struct.pack(f"<{len(values)}i", *values)))
        if any(not i.request.tokens for i in ops.inserts):
            raise ValueError("an empty prompt")
    except (ValueError, struct.error) as exc:  # JSON's and UTF-8's errors are ValueErrors too
        raise PipelineMismatchError(f"a step's operations arrived damaged: {exc}") from exc
    return ops


@dataclass(frozen=True)
class Header:
    """A received ``SERVE`` message: rank 0's fields by name, and every rank's own fields (its *slot*)."""

    fields: dict[str, int]
    slots: list[dict[str, int]]

    @property
    def op(self) -> int:
        return self.fields["op"]


def read_header(gathered: mx.array, size: int) -> Header:
    """The :class:`Header` of an evaluated ``SERVE`` all-gather; :class:`PipelineMismatchError` (the same on every
    rank) when garbled."""
    where = SERVE.name
    table = SERVE.read(gathered, size, where)
    header = Header(
        {name: table[name][0] for name in LEADER_FIELDS},
        [{name: table[name][r] for name in RANK_FIELDS} for r in range(size)],
    )
    if header.op not in OPS:
        raise PipelineMismatchError(f"{where}: rank 0 sent an unknown operation {header.op}: the ranks are out of step")
    return header


class Channel:
    """One rank's end of the broadcast; every rank calls :meth:`exchange` (and :meth:`tokens`) in the same order."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        # A stream that any thread may evaluate on: the collective runs in a helper thread (bounded waits).
        self.stream = mx.new_thread_unsafe_stream(mx.default_device())

    def exchange(
        self, fields: Mapping[str, int] | None, slot: Mapping[str, int], timeout: float | None, what: str
    ) -> Header:
        """Send rank 0's ``fields`` (``None`` on the other ranks) and this rank's ``slot``; return what all sent."""
        if fields is not None and self.rank != 0:
            raise ValueError("only rank 0 sends the operation's fields")
        wrong = sorted({*(fields or {})} - {*LEADER_FIELDS} | {*slot} - {*RANK_FIELDS})
        if wrong:
            raise ValueError(f"not fields of the request broadcast: {wrong}")
        with mx.stream(self.stream):
            gathered = gather(SERVE.header({**(fields or {}), **slot}), self.group)
        wait_for(gathered, timeout, lambda: f"rank {self.rank}/{self.size} {what}")
        return read_header(gathered, self.size)

    def tokens(self, tokens: Sequence[int] | None, count: int, timeout: float | None, what: str) -> list[int]:
        """Rank 0's ``tokens`` on every rank (the other ranks pass ``None`` and the count from the header)."""
        values = list(tokens) if tokens is not None else [0] * count
        if len(values) != count:
            raise ValueError(f"expected {count} tokens, got {len(values)}")
        with mx.stream(self.stream):
            row = TOKENS.row({"count": count}, payload=[mx.array(values, dtype=mx.int32)])
            gathered = gather(row, self.group)
        wait_for(gathered, timeout, lambda: f"rank {self.rank}/{self.size} {what}")
        return [int(v) for v in TOKENS.read(gathered, self.size, TOKENS.name).payloads[0]]
