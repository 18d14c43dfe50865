"""Checking a group before trusting it: every rank's facts, and each neighbour link's latency and bandwidth.

Used by ``pipemlx doctor``. Every wait is bounded (:func:`pipemlx.runtime.waits.wait_for`), so a link
that is cut or a rank that stalls becomes an error naming the link, not a hang.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .waits import wait_for

FACTS_BYTES = 2048
SMALL_ELEMENTS = 4
LARGE_BYTES = 4 * 2**20
SMALL_REPEATS = 5
LARGE_REPEATS = 2


@dataclass(frozen=True)
class LinkResult:
    """One neighbour link, measured from its lower end: round trips of a tiny and of a 4 MB message."""

    source: int
    target: int
    latency_s: float
    bandwidth_bytes_s: float


def _stream() -> Any:
    return mx.stream(mx.new_thread_unsafe_stream(mx.default_device()))  # a stream wait_for's thread may run


def gather_facts(group: mx.distributed.Group, facts: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Every rank's ``facts`` (a small JSON-able dict), the same list on every rank (a collective)."""
    raw = json.dumps(facts, sort_keys=True).encode()
    if len(raw) > FACTS_BYTES:
        raise ValueError(f"facts too large to share ({len(raw)} bytes > {FACTS_BYTES})")
    padded = list(raw) + [0] * (FACTS_BYTES - len(raw))
    with _stream():
        gathered = mx.distributed.all_gather(mx.array(padded, dtype=mx.int32)[None], group=group)
    wait_for(gathered, timeout, lambda: f"rank {group.rank()}/{group.size()} sharing its versions and memory")
    rows: list[list[int]] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
    return [json.loads(bytes(v for v in row if v).decode()) for row in rows]


def neighbour_pairs(world_size: int) -> list[tuple[int, int]]:
    """The links a ring uses: (r, r+1), and (S-1, 0) closing the ring when S > 2."""
    if world_size < 2:
        return []
    pairs = [(r, r + 1) for r in range(world_size - 1)]
    return pairs + ([(world_size - 1, 0)] if world_size > 2 else [])


def _round_trip(group: mx.distributed.Group, peer: int, payload: mx.array, timeout: float, what: str) -> float:
    start = time.perf_counter()
    with _stream():
        sent = mx.distributed.send(payload, peer, group=group)
    wait_for(sent, timeout, lambda: f"{what}: sending")
    with _stream():
        back = mx.distributed.recv_like(payload, peer, group=group)
    wait_for(back, timeout, lambda: f"{what}: waiting for the echo")
    return time.perf_counter() - start


def _echo(group: mx.distributed.Group, peer: int, like: mx.array, timeout: float, what: str) -> None:
    with _stream():
        received = mx.distributed.recv_like(like, peer, group=group)
    wait_for(received, timeout, lambda: f"{what}: receiving")
    with _stream():
        sent = mx.distributed.send(received, peer, group=group)
    wait_for(sent, timeout, lambda: f"{what}: echoing")


def measure_links(group: mx.distributed.Group, timeout: float) -> list[LinkResult]:
    """Latency and bandwidth of every neighbour link (a collective: all ranks call it; bounded by ``timeout``).

    For each link the lower rank sends a tiny message :data:`SMALL_REPEATS`
    times and a 4 MB one :data:`LARGE_REPEATS` times, and the other end echoes
    them; half the fastest round trip is the latency, twice the bytes over the
    fastest large round trip the bandwidth. Every rank gets every link's
    figures. Raises :class:`~pipemlx.errors.PipelineTimeoutError` /
    :class:`~pipemlx.errors.PeerLostError` naming the link when one fails.
    """
    rank, size = group.rank(), group.size()
    small = mx.zeros((SMALL_ELEMENTS,), dtype=mx.float32)
    large = mx.zeros((LARGE_BYTES // 4,), dtype=mx.float32)
    mx.eval(small, large)  # pyright: ignore[reportUnknownMemberType]
    pairs = neighbour_pairs(size)
    mine = [0.0] * (2 * len(pairs))
    for index, (a, b) in enumerate(pairs):
        what = f"link rank {a} <-> rank {b}"
        if rank == a:
            latency = min(_round_trip(group, b, small, timeout, what) for _ in range(SMALL_REPEATS)) / 2
            trip = min(_round_trip(group, b, large, timeout, what) for _ in range(LARGE_REPEATS))
            mine[2 * index : 2 * index + 2] = [latency, 2 * LARGE_BYTES / max(trip - 2 * latency, 1e-9)]
        elif rank == b:
            for payload, repeats in ((small, SMALL_REPEATS), (large, LARGE_REPEATS)):
                for _ in range(repeats):
                    _echo(group, a, payload, timeout, what)
    if not pairs:
        return []
    with _stream():
        total = mx.distributed.all_sum(mx.array(mine, dtype=mx.float32), group=group)
    wait_for(total, timeout, lambda: f"rank {rank}/{size} sharing the link figures")
    values: list[float] = total.tolist()  # pyright: ignore[reportAssignmentType]
    return [LinkResult(a, b, values[2 * i], values[2 * i + 1]) for i, (a, b) in enumerate(pairs)]
