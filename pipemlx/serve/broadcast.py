"""The request broadcast: how rank 0 hands each request to the other ranks over ``mx.distributed`` itself.

Every message is one fixed-size ``int32`` all-sum (the *header*), followed for a
request by a second all-sum carrying its token ids. Rank 0 fills the header's
first :data:`BASE_FIELDS`; every rank fills its own *slot* of
:data:`SLOT_FIELDS` (pid, the last request it finished, how many positions its
cache held then, ...), so one collective both hands out the next request and
tells every rank where every other rank stands. All ranks contribute zeros
elsewhere, so the sum is exact (no floating point on the wire). Being plain
collectives, this runs on any backend the group runs on (ring, MPI, JACCL).

Kinds: ``HELLO`` (start-up: slots only), ``IDLE`` (rank 0 has no request; the
other ranks pause ``pause_ms`` and come back: the heartbeat), ``REQUEST`` (one
request, served alone), ``STEP`` (``--max-concurrency`` above 1: one batch step,
with the requests to insert and remove before it, see :mod:`.batching`) and
``SHUTDOWN``. Every wait is bounded (a helper thread evaluates the collective;
MLX cannot interrupt one), so a rank that dies or stalls becomes
:class:`PeerLostError` / :class:`PipelineTimeoutError`, never a hang.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from ..errors import PipelineMismatchError
from ..runtime.waits import wait_for

MAGIC = 0x7E4D
HELLO, IDLE, REQUEST, SHUTDOWN, STEP = 1, 2, 3, 4, 5
KIND_NAMES = {HELLO: "hello", IDLE: "idle", REQUEST: "request", SHUTDOWN: "shutdown", STEP: "step"}
PENALTY_FIELDS = (
    "repetition_penalty",  # float32 bits; 0: none
    "repetition_context_size",
    "presence_penalty",  # float32 bits; 0: none
    "presence_context_size",
    "frequency_penalty",  # float32 bits; 0: none
    "frequency_context_size",
)
"""A request's penalties (:class:`~pipemlx.serve.penalties.Penalties`), in its header and its batch insert."""
BASE_FIELDS = (
    "magic",
    "kind",
    "seq",  # the request's number (STEP: the step's number; 0 for the other kinds)
    "n_tokens",  # the prompt's length (STEP: the operations' length): the token all-sum that follows
    "max_tokens",
    "temperature",  # float32 bits
    "top_p",  # float32 bits
    "seed",  # -1: none
    "entry",  # the prefix-cache plan: entry id (-1: none), tokens reused, copy or take
    "reuse",
    "copy",
    "step",  # prefill step size, 0 for "auto"
    "pause_ms",  # IDLE: how long the other ranks wait before the next header
    "checksum",  # of the token ids
    *PENALTY_FIELDS,
)
SLOT_FIELDS = (
    "present",  # 1: the rank filled its slot
    "pid",
    "last_seq",  # the last request this rank finished
    "cache_tokens",  # positions its cache held when that request ended (-1: discarded)
    "outcome",  # OUTCOMES index of how it ended
    "bytes_per_token",  # HELLO: this rank's KV bytes per cached token
    "trimmable",  # HELLO: 1 when every cache of this rank can be cut back at any length
    "prefix_entries",
    "prefix_tokens",
)
OUTCOMES = ("none", "stop", "length", "cancelled", "failed")
CHECKSUM_MODULUS = 2_147_483_629  # a prime below 2**31


def float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def bits_float(value: int) -> float:
    return struct.unpack("<f", struct.pack("<i", value))[0]


def checksum(tokens: list[int]) -> int:
    value = len(tokens)
    for t in tokens:
        value = (value * 31 + t + 1) % CHECKSUM_MODULUS
    return value


@dataclass(frozen=True)
class Header:
    """A received header: rank 0's fields by name, and every rank's slot."""

    fields: dict[str, int]
    slots: list[dict[str, int]]

    @property
    def kind(self) -> int:
        return self.fields["kind"]

    def float(self, name: str) -> float:
        return bits_float(self.fields[name])


class Channel:
    """One rank's end of the broadcast; every rank calls :meth:`exchange` (and :meth:`tokens`) in the same order."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        # A stream that any thread may evaluate on: the collective runs in a helper thread (bounded waits).
        self.stream = mx.new_thread_unsafe_stream(mx.default_device())
        self.width = len(BASE_FIELDS) + len(SLOT_FIELDS) * self.size

    def exchange(self, fields: dict[str, int] | None, slot: dict[str, int], timeout: float | None, what: str) -> Header:
        """Send rank 0's ``fields`` (``None`` on the other ranks) and this rank's ``slot``; return the sum."""
        values = [0] * self.width
        if fields is not None:
            if self.rank != 0:
                raise ValueError("only rank 0 sends header fields")
            merged = {"magic": MAGIC, **fields}
            for i, name in enumerate(BASE_FIELDS):
                values[i] = int(merged.get(name, 0))
        start = len(BASE_FIELDS) + len(SLOT_FIELDS) * self.rank
        for i, name in enumerate(SLOT_FIELDS):
            values[start + i] = int(slot.get(name, 0))
        values[start] = 1
        summed = self._all_sum(values, timeout, what)
        header = Header(
            {name: summed[i] for i, name in enumerate(BASE_FIELDS)},
            [
                {name: summed[len(BASE_FIELDS) + len(SLOT_FIELDS) * r + i] for i, name in enumerate(SLOT_FIELDS)}
                for r in range(self.size)
            ],
        )
        if header.fields["magic"] != MAGIC or header.kind not in KIND_NAMES:
            raise PipelineMismatchError(
                f"rank {self.rank}: the request broadcast received garbage while {what} "
                f"(magic {header.fields['magic']:#x}, kind {header.kind}): the ranks are out of step"
            )
        return header

    def tokens(self, tokens: list[int] | None, count: int, timeout: float | None, what: str) -> list[int]:
        """Rank 0's ``tokens`` on every rank (the other ranks pass ``None`` and the count from the header)."""
        values = list(tokens) if tokens is not None else [0] * count
        if len(values) != count:
            raise ValueError(f"expected {count} tokens, got {len(values)}")
        return self._all_sum(values, timeout, what)

    def _all_sum(self, values: list[int], timeout: float | None, what: str) -> list[int]:
        if self.size == 1:
            return values
        with mx.stream(self.stream):
            summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        wait_for(summed, timeout, lambda: f"rank {self.rank}/{self.size} {what}")
        return cast(list[int], summed.tolist())
