"""The one failure path: a rank whose compute raised stands in for its layers.

When the model raises on a rank in the middle of a pass (a prefill chunk, a
decode step, a batch tick), the other ranks are already exchanging that pass's
messages. The failing rank must still take its input off the wire and send a
message of the right shape on, or its neighbours would wait for ever and the
next pass would read stale bytes; it reports the failure in the pass's
agreement message (``Status.CHUNK_FAILED``).
"""

from __future__ import annotations

import mlx.core as mx

from .stage import PipelineStage


def stand_in(stage: PipelineStage, rows: int, length: int) -> tuple[list[mx.array], mx.array | None]:
    """This rank's messages for a failed pass of ``rows`` x ``length`` tokens, without its layers (lazy).

    Returns the receives of the pass's input (the ones the failed pass built, else a new one) and zeros shaped as
    this rank's message to the next rank (``None`` on the last rank), which the caller sends on; whatever the failed
    pass queued is discarded.
    """
    stage.send_queue.discard()
    received = stage.take_received()
    with mx.stream(stage.compute_stream):  # evaluated by the bounded waits' helper threads
        if not stage.is_first and not received:
            incoming = stage.wire_zeros(rows, length, incoming=True)
            received = [mx.distributed.recv_like(incoming, stage.rank - 1, group=stage.group)]
        outgoing = None if stage.is_last else stage.wire_zeros(rows, length, incoming=False)
    return received, outgoing
