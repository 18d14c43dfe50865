"""send_mode: the queue-versus-immediate send policy, scoped to a ``with`` block."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import mlx.nn as nn

from ..errors import PeerLostError, PipelineTimeoutError
from .send_queue import SendQueue
from .stage import SEND_MODES, SendMode, stage_of
from .waits import wait_for


@contextmanager
def send_mode(model: nn.Module, mode: SendMode) -> Generator[SendQueue, None, None]:
    """Within the block, the last local layer of ``model`` sends in ``mode``; yields the send queue.

    ``"immediate"`` is the mode outside any block. On leaving the block the
    previous mode comes back, whatever happened inside. A normal exit issues
    every send still queued and waits for the sends to complete (bounded by
    the model's timeout), so a queued send cannot outlive the block that
    queued it; an exit by exception discards the queued sends instead.
    Switching from ``"queue"`` to ``"immediate"`` first issues what is queued,
    so sends leave in the order they were made. Blocks nest.

    Raises ``ValueError`` for an unknown mode and :class:`NotShardedError` for
    a model :func:`pipemlx.shard_model` did not shard.
    """
    if mode not in SEND_MODES:
        raise ValueError(f"unknown send mode {mode!r}; expected one of {SEND_MODES}")
    stage = stage_of(model)
    queue = stage.send_queue
    previous = stage.mode
    if previous == "queue" and mode == "immediate":
        queue.flush()
    if previous == "immediate":
        stage.received.clear()  # an immediate pass's receive: evaluated with that pass, not the block's to wait for
    stage.set_mode(mode)
    try:
        yield queue
    except BaseException:
        queue.discard()
        stage.received.clear()
        raise
    else:
        queue.flush()
        stage.received.clear()
        try:
            wait_for(queue.in_flight(), stage.info.timeout, lambda: f"{stage.describe()} completing its sends")
        except (PipelineTimeoutError, PeerLostError) as exc:
            stage.mark_broken(exc)
            raise
        queue.mark_complete()
    finally:
        stage.set_mode(previous)
