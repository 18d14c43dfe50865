"""The messages of a run of batch ticks, executed without MLX: is it deadlock-free and consistent on the wire?

:func:`tick_ops` lists what one rank does in one tick, in the order
:mod:`pipemlx.runtime.batch.tick` issues it on the rank's compute stream (one
first-in first-out queue per rank). :func:`run_ticks` runs every rank's
operations together with rendezvous sends (``capacity`` messages may wait on
a link unreceived; 0: a send completes only when its receive does) and
collectives that need every rank, and reports a deadlock or a receive that
would take another message (a different shape on the wire) as readable
problems. Pure Python: the tests drive it with random schedules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .batch_plan import GroupTick, Tick

OpKind = Literal["compute", "send", "recv", "gather"]


@dataclass(frozen=True)
class Op:
    """One operation of one rank: ``what`` names the message or work (``("decode", tick)``, a chunk, a gather)."""

    kind: OpKind
    what: tuple[object, ...]
    peer: int = -1


def tick_ops(tick: Tick, rows: int, rank: int, world_size: int, groups: GroupTick | None = None) -> list[Op]:
    """What ``rank`` does in ``tick`` with ``rows`` decoding rows, in order; with ``groups`` (decode groups in
    flight, not serial), the step of group ``groups.decode[rank]`` instead (received at the end of the last tick
    on a rank ``r > 0``), and at the end of the tick the receive of the group rank ``r - 1`` computed, before its
    chunk."""
    ops: list[Op] = []
    mine = tick.chunks[rank]
    chunk = None if mine is None else ("chunk", mine.uid, mine.start, mine.stop)
    decode = ("decode", tick.index)
    if rank > 0 and chunk is not None:
        ops.append(Op("compute", chunk))
    decoding = None if groups is None or groups.serial else groups.decode  # per rank: the group it computes
    if decoding is not None:
        group = decoding[rank]
        if group is not None:
            ops.append(Op("compute", ("decode", group)))
            if rank < world_size - 1:
                ops.append(Op("send", ("decode", group, tick.index), rank + 1))
    elif rows:
        if rank > 0:
            ops.append(Op("recv", decode, rank - 1))
        ops.append(Op("compute", decode))
        if rank < world_size - 1:
            ops.append(Op("send", decode, rank + 1))
    if rank == 0 and chunk is not None:
        ops.append(Op("compute", chunk))
    if chunk is not None and rank < world_size - 1:
        ops.append(Op("send", chunk, rank + 1))
    if decoding is not None and rank > 0 and decoding[rank - 1] is not None:
        ops.append(Op("recv", ("decode", decoding[rank - 1], tick.index), rank - 1))
    coming = tick.receives(rank)
    if coming is not None:
        ops.append(Op("recv", ("chunk", coming.uid, coming.start, coming.stop), rank - 1))
    ops.append(Op("gather", ("tick", tick.index, tick.fingerprint())))
    return ops


def run_ticks(programs: Sequence[Sequence[Op]], capacity: int = 0) -> list[str]:
    """Run every rank's operations together; return the problems found (empty: it ran through cleanly)."""
    size = len(programs)
    position = [0] * size
    links: dict[tuple[int, int], deque[tuple[object, ...]]] = {}
    problems: list[str] = []
    progressed = True
    while progressed and not problems:
        progressed = False
        for rank in range(size):
            while position[rank] < len(programs[rank]):
                op = programs[rank][position[rank]]
                if op.kind == "compute":
                    position[rank] += 1
                elif op.kind == "send":
                    link = links.setdefault((rank, op.peer), deque())
                    if len(link) > capacity:
                        break
                    if not link or link[-1] is not op.what:
                        link.append(op.what)
                    if len(link) > capacity:
                        break  # waits until its message is received
                    position[rank] += 1
                elif op.kind == "recv":
                    link = links.setdefault((op.peer, rank), deque())
                    if not link:
                        break
                    message = link.popleft()
                    if message != op.what:
                        problems.append(f"rank {rank} receives {op.what} but rank {op.peer} sent {message}")
                        break
                    position[rank] += 1
                    _release(programs, position, op.peer, rank, links, capacity)
                else:
                    waiting = [
                        programs[r][position[r]] if position[r] < len(programs[r]) else None for r in range(size)
                    ]
                    if any(w is None or w.kind != "gather" for w in waiting):
                        break
                    if len({w.what for w in waiting if w is not None}) > 1:
                        problems.append(f"ranks enter different gathers: {[w.what for w in waiting if w]}")
                        break
                    for r in range(size):
                        position[r] += 1
                progressed = True
    if not problems:
        stuck = [r for r in range(size) if position[r] < len(programs[r])]
        if stuck:
            problems.append("deadlock: " + "; ".join(f"rank {r} at {programs[r][position[r]]}" for r in stuck))
        left = {k: list(v) for k, v in links.items() if v}
        if left:
            problems.append(f"messages never received: {left}")
    return problems


def _release(
    programs: Sequence[Sequence[Op]],
    position: list[int],
    sender: int,
    receiver: int,
    links: dict[tuple[int, int], deque[tuple[object, ...]]],
    capacity: int,
) -> None:
    """A blocked sender whose message was just taken moves past its send."""
    index = position[sender]
    if index < len(programs[sender]):
        op = programs[sender][index]
        if op.kind == "send" and op.peer == receiver and len(links[(sender, receiver)]) <= capacity:
            position[sender] += 1
