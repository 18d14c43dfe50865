"""The one failure path: a rank whose compute raised stands in for its layers.

When the model raises on a rank in the middle of a pass (a prefill chunk, a
decode step, a batch tick), the other ranks are already exchanging that pass's
messages. The failing rank must still take its input off the wire and send a
message of the right shape on, or its neighbours would wait for ever and the
next pass would read stale bytes; it reports the failure in the pass's
agreement message (``Status.CHUNK_FAILED``).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .stage import PipelineStage


def stand_in(stage: PipelineStage, rows: int, length: int, take: Callable[[list[mx.array]], None]) -> mx.array | None:
    """This rank's messages for a failed pass of ``rows`` x ``length`` tokens, without its layers.

    Whatever the failed pass queued is discarded. Its input is taken off the wire (the receives the failed
    pass built, else a new one) through ``take``, the executor's own bounded wait or asynchronous issue.
    Returns zeros shaped as this rank's message to the next rank (``None`` on the last rank), for the caller to
    send as the pass would have sent its output.
    """
    stage.send_queue.discard()
    received = stage.take_received()
    with mx.stream(stage.compute_stream):  # evaluated by the bounded waits' helper threads
        if not stage.is_first and not received:
            incoming = stage.wire_zeros(rows, length, incoming=True)
            received = [mx.distributed.recv_like(incoming, stage.rank - 1, group=stage.group)]
        outgoing = None if stage.is_last else stage.wire_zeros(rows, length, incoming=False)
    if received:
        take(received)
    return outgoing
