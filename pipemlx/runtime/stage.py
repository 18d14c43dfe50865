"""A sharded model's pipeline state: who it talks to, and how its sends go out."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from ..errors import NotShardedError, PipelineError
from .caches import attach_dependency
from .send_queue import SendQueue

SendMode = Literal["immediate", "queue"]
SEND_MODES: tuple[SendMode, ...] = ("immediate", "queue")
STAGE_ATTRIBUTE = "_pipemlx_stage"


class PipelineStage:
    """What :func:`pipemlx.shard_model` attaches to a model: one rank's part of the pipeline.

    It owns the model's :class:`SendQueue` and the current send mode. The mode
    is read by the last local layer on every call and changed only by
    :func:`pipemlx.send_mode`, which scopes it to a ``with`` block:

    - ``"immediate"`` (outside any block): the last local layer sends its output
      to the next rank inside the model's graph, then every rank receives the
      final hidden state (an all-gather), so each rank computes the same logits.
      The send is tied to the layer's cache, so evaluating the caches alone
      (as mlx-lm's ``generate_step`` does while prefilling) still sends.
    - ``"queue"``: the last local layer puts its output on the send queue and
      returns; nothing is broadcast. The first local layer's receives are
      recorded in :attr:`received` for the prefill executor to wait on.
    """

    def __init__(
        self,
        group: mx.distributed.Group,
        split: tuple[int, ...],
        layers: range,
        total_layers: int,
        timeout: float | None,
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.split = split
        self.layers = layers
        self.total_layers = total_layers
        self.timeout = timeout
        self.compute_stream = mx.new_thread_unsafe_stream(mx.default_device())
        self.send_queue = SendQueue(group, mx.new_thread_unsafe_stream(mx.default_device()))
        self.received: list[mx.array] = []
        self.broken: str | None = None
        self.hidden_size = 0
        self.dtype: mx.Dtype | None = None
        self._mode: SendMode = "immediate"
        self._detached = False
        self._broadcast = True
        self.cost_model: Any = None  # set by pipemlx.autostep once the group has calibrated

    @property
    def mode(self) -> SendMode:
        return self._mode

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def set_mode(self, mode: SendMode) -> None:
        """Switch the send mode; only :func:`pipemlx.send_mode` should call this."""
        if mode not in SEND_MODES:
            raise ValueError(f"unknown send mode {mode!r}; expected one of {SEND_MODES}")
        self._mode = mode

    @contextmanager
    def detached(self) -> Generator[None, None, None]:
        """Within the block the edges neither receive nor send: the local layers run on their own.

        For timing the local layers (:mod:`pipemlx.autostep`); nothing crosses the wire.
        """
        self._detached = True
        try:
            yield
        finally:
            self._detached = False
            self._broadcast = True

    @contextmanager
    def without_broadcast(self) -> Generator[None, None, None]:
        """Within the block an immediate send is not followed by the final hidden state's all-gather.

        For :func:`pipemlx.lean_generate_step`, where only the last rank applies the head.
        """
        self._broadcast = False
        try:
            yield
        finally:
            self._broadcast = True

    def mark_broken(self, reason: BaseException) -> None:
        """Record that a wait failed: a communication may still be blocked in MLX."""
        self.broken = f"{type(reason).__name__}: {reason}"

    def check_usable(self) -> None:
        """Raise if an earlier timeout or lost peer left this rank's communication unusable."""
        if self.broken is not None:
            raise PipelineError(
                f"{self.describe()} cannot communicate any more after an earlier failure ({self.broken}); "
                "exit the process and start every rank again"
            )

    def receive(self, like: mx.array) -> mx.array:
        """The hidden state from the previous rank, shaped and typed like ``like``."""
        self.check_usable()
        if self._detached:
            return like
        received = mx.distributed.recv_like(like, self.rank - 1, group=self.group)
        if self._mode == "queue":
            self.received.append(received)
        return received

    def emit(self, output: mx.array, cache: Any) -> mx.array:
        """Route the last local layer's ``output`` according to the send mode."""
        self.check_usable()
        if self._detached:
            return output
        if self._mode == "queue":
            if not self.is_last:
                self.send_queue.put(output, self.rank + 1)
            return output
        if not self.is_last:
            output = mx.distributed.send(output, self.rank + 1, group=self.group)
        if self.world_size > 1 and self._broadcast:
            output = mx.distributed.all_gather(output, group=self.group)[-output.shape[0] :]
        if cache is not None:
            attach_dependency(cache, output)
        return output

    def describe(self) -> str:
        """``rank 1/3 (layers 4..7 of 12)`` for messages."""
        return (
            f"rank {self.rank}/{self.world_size} "
            f"(layers {self.layers.start}..{self.layers.stop - 1} of {self.total_layers})"
        )


def stage_of(model: nn.Module) -> PipelineStage:
    """The stage :func:`pipemlx.shard_model` attached to ``model``; raises :class:`NotShardedError`."""
    stage = getattr(model, STAGE_ATTRIBUTE, None)
    if not isinstance(stage, PipelineStage):
        raise NotShardedError(
            f"{type(model).__module__}.{type(model).__name__} is not sharded: "
            "call pipemlx.shard_model(model, group) on every rank first"
        )
    return stage


def is_sharded(model: nn.Module) -> bool:
    return isinstance(getattr(model, STAGE_ATTRIBUTE, None), PipelineStage)


def ensure_unsharded(model: nn.Module) -> None:
    if is_sharded(model):
        raise PipelineError(f"{type(model).__name__} is already sharded; shard a fresh model")
