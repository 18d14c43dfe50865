"""A sharded model's pipeline state: who it talks to, and how its sends go out."""

from __future__ import annotations

import atexit
import weakref
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..errors import NotShardedError, PipelineError
from .caches import attach_dependency
from .sampling import VocabShard
from .send_queue import SendQueue
from .waits import wait_for_scheduled


class OpenRequest(Protocol):
    """A request still holding the pipeline (an unfinished decode): the stage finishes it before the next one."""

    def finish(self) -> None:
        """Stop the request the way every rank agrees on, leaving nothing in flight; never raises."""
        ...


SendMode = Literal["immediate", "queue"]
SEND_MODES: tuple[SendMode, ...] = ("immediate", "queue")
STAGE_ATTRIBUTE = "_pipemlx_stage"
OUTSTANDING_OUTPUTS = 4  # immediate-mode outputs remembered for PipelineStage.settle (mlx-lm leaves one step in flight)
EXIT_TIMEOUT = 10.0  # seconds the end of the program may wait for what a stage left in flight


@dataclass(frozen=True)
class Lending:
    """Where the cuts fall inside layers (``shard_model``'s ``lend``); none by default."""

    mlp: bool = False  # each rank's last layer's feed-forward half runs on the next rank
    share: float = 0.0  # the share of a layer's per-token work that the cut moves to the next rank
    heads: int = 0  # key-value heads of that layer's attention moved too
    pair_share: float = 0.0  # the share of a layer's attention to earlier positions that the lent heads move
    incoming_width: int = 0  # of the messages from the previous rank (0: hidden_size); lent heads widen them
    outgoing_width: int = 0  # of the messages to the next rank (0: hidden_size)


@dataclass(frozen=True)
class StageInfo:
    """What one rank is in the pipeline, fixed by :func:`pipemlx.shard_model` in one place and never changed."""

    rank: int
    world_size: int
    split: tuple[int, ...]  # layers per rank
    layers: range  # this rank's layers, as indices into the whole model's
    total_layers: int
    timeout: float | None  # the default bound of every blocking wait (seconds)
    hidden_size: int
    dtype: mx.Dtype | None  # of the hidden states this rank's layers exchange
    kv_dims: tuple[int, ...] = ()  # the whole model's cached key/value widths, which kv_group_size must divide
    unquantizable: tuple[tuple[int, str], ...] = ()
    """The whole model's layers whose caches ``kv_bits`` cannot quantize: ``(layer, cache class)``."""
    unquantizable_bounded: tuple[tuple[int, str], ...] = ()
    """Likewise for the caches ``make_prompt_cache(model, max_kv_size=...)`` makes."""
    lending: Lending = field(default_factory=Lending)
    head: Literal["all", "last", "split"] = "all"  # which ranks keep the output head (split: a share of its rows)
    vocab_shard: VocabShard | None = None  # this rank's rows of the output head, for greedy decodes that share it
    bounded_caches: Callable[[int], list[Any]] | None = None
    """``lend_heads``, the rank after a cut: its caches bounded by ``max_kv_size`` (see :meth:`PipelineStage.new_cache`)."""
    pair_caches: Callable[[list[Any]], None] | None = None
    """``lend_heads``, the rank after a cut: pairs the first cache of a list made without this rank's ``make_cache``
    (a caller's own, such as rotating caches) with a fresh one of its kind for the lent heads."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def describe(self) -> str:
        """``rank 1/3 (layers 4..7 of 12)`` for messages."""
        return (
            f"rank {self.rank}/{self.world_size} "
            f"(layers {self.layers.start}..{self.layers.stop - 1} of {self.total_layers})"
        )


class PipelineStage:
    """What :func:`pipemlx.shard_model` attaches to a model: one rank's part of the pipeline.

    :attr:`info` is what the rank is (fixed when the model is sharded); the
    rest is what changes at run time: the send mode (set by
    :func:`pipemlx.send_mode`), the sends and receives in flight, whether a
    failed wait left the wire unusable, an open request, and the group's cost
    model once calibrated. In ``"immediate"`` mode the last local layer sends
    its output to the next rank inside the model's graph, tied to the layer's
    cache (so evaluating the caches alone, as mlx-lm's ``generate_step`` does
    while prefilling, still sends), then every rank receives the final hidden
    state (an all-gather), so each rank computes the same logits. In
    ``"queue"`` mode it puts its output on the :class:`SendQueue`, and the
    first local layer's receives are recorded in :attr:`received`.
    """

    def __init__(self, info: StageInfo, group: mx.distributed.Group) -> None:
        self.info = info
        self.group = group
        self.compute_stream = mx.new_thread_unsafe_stream(mx.default_device())
        self.send_queue = SendQueue(group, mx.new_thread_unsafe_stream(mx.default_device()))
        self.received: list[mx.array] = []  # the receives built and not yet waited for (immediate mode: the last)
        self.broken: str | None = None
        self._mode: SendMode = "immediate"
        self._detached = False
        self._broadcast = True
        self._executing_plan = False
        self.outstanding: deque[mx.array] = deque(maxlen=OUTSTANDING_OUTPUTS)
        self.open_request: OpenRequest | None = None
        self.cost_model: Any = None  # set by pipemlx.runtime.calibrate once the group has agreed measured costs
        # (start, length, seconds) of the chunks a prefill planned without measured costs computed on this rank:
        # pipemlx.runtime.calibrate.refine turns them into measured costs after it (None: not observing)
        self.observed: list[tuple[int, int, float]] | None = None
        self.calibration_s = 0.0  # seconds this rank spent timing costs and agreeing on them (calibrate, refine)
        if self.world_size > 1:
            _LIVE_STAGES.add(self)
            _finish_at_exit(self)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def mode(self) -> SendMode:
        return self._mode

    @property
    def is_first(self) -> bool:
        return self.info.is_first

    @property
    def is_last(self) -> bool:
        return self.info.is_last

    @property
    def head_needed(self) -> bool:
        """Whether a forward pass now needs this rank's logits: in immediate mode with the broadcast (mlx-lm's decoding)."""
        return self._mode == "immediate" and self._broadcast and not self._detached

    def set_mode(self, mode: SendMode) -> None:
        """Switch the send mode; only :func:`pipemlx.send_mode` (which checks ``mode``) should call this."""
        self._mode = mode

    @contextmanager
    def detached(self) -> Generator[None, None, None]:
        """Within the block the edges neither receive nor send: the local layers run on their own (calibration)."""
        self._detached = True
        try:
            yield
        finally:
            self._detached = False
            self._broadcast = True

    @contextmanager
    def without_broadcast(self) -> Generator[None, None, None]:
        """Within the block an immediate send is not followed by the final hidden state's all-gather (the decode
        steps of :func:`pipemlx.generate_step` gather only what they need)."""
        self._broadcast = False
        try:
            yield
        finally:
            self._broadcast = True

    @contextmanager
    def executing_plan(self) -> Generator[None, None, None]:
        """Within the block the prefill executor drives the model: forward passes in queue mode are allowed.

        Outside it they raise :class:`PipelineError`: the logits would come from this rank's partial hidden state.
        """
        self._executing_plan = True
        try:
            yield
        finally:
            self._executing_plan = False

    def settle(self, timeout: float | None) -> None:
        """Leave nothing in flight before a new collective: finish an open request, drain what mlx-lm left.

        mlx-lm's ``generate_step`` evaluates step n+1 before yielding token n; a
        pipemlx decode whose consumer stopped without closing it leaves a step
        unagreed. A collective started before they complete would interleave
        with theirs on the wire, so every pipemlx entry point calls this first.
        The drain is bounded by ``timeout``; a failure marks the stage broken.

        Every sharded model of the process shares the wire, so the other
        models' stages are settled first: a request on one model cannot read
        another model's step off the wire.
        """
        self.check_usable()
        for other in [s for s in _LIVE_STAGES if s is not self and s.broken is None]:
            try:
                other.settle_own(timeout)
            except Exception as exc:  # the other model's wait failed: the shared wire is not usable either
                self.mark_broken(exc)
                raise
        self.settle_own(timeout)

    def settle_own(self, timeout: float | None) -> None:
        """:meth:`settle` for this stage alone: finish its open request, drain what mlx-lm left in flight."""
        self.check_usable()
        request, self.open_request = self.open_request, None
        if request is not None:
            request.finish()
            self.check_usable()
        pending = list(self.outstanding)
        self.outstanding.clear()
        if pending:
            try:
                wait_for_scheduled(
                    pending, timeout, lambda: f"{self.describe()} completing the step mlx-lm left in flight"
                )
            except Exception as exc:
                self.mark_broken(exc)
                raise

    def _check_previous_pass(self) -> None:
        """Refuse to build a forward pass while the previous one was built but never handed to MLX.

        Two passes evaluated together (``mx.eval(model(a), model(b))``) would
        interleave their messages on the wire in an order the ranks need not
        agree on. A previous pass that was evaluated or scheduled is waited for
        (bounded); one that was not raises here, on every rank, before anything
        of the new pass is sent.
        """
        if not self.outstanding:
            return
        previous = self.outstanding[-1]
        try:
            skipped = wait_for_scheduled(
                [previous], self.info.timeout, lambda: f"{self.describe()} completing the previous forward pass"
            )
        except Exception as exc:
            self.mark_broken(exc)
            raise
        if skipped:
            self.outstanding.clear()
            raise PipelineError(
                f"{self.describe()}: a forward pass of the sharded model was built while the previous one was "
                "never evaluated; evaluate each pass (mx.eval or mx.async_eval) before building the next: two "
                "passes evaluated together would interleave their messages between the ranks. Discard the cache "
                "both passes wrote to"
            )

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
        shape = (*like.shape[:-1], self.info.lending.incoming_width or like.shape[-1])  # lend_heads: a wider message
        if self._detached:
            return like if shape == tuple(like.shape) else mx.zeros(shape, like.dtype)
        if self._mode == "immediate":
            self._check_previous_pass()
        received = mx.distributed.recv(shape, like.dtype, self.rank - 1, group=self.group)
        if self._mode == "immediate":  # one receive per pass: only the latest can still be waited for
            self.received.clear()
        self.received.append(received)
        return received

    def take_received(self) -> list[mx.array]:
        """The receives built since they were last taken (the prefill executor and the stand-ins wait on them)."""
        received = list(self.received)
        self.received.clear()
        return received

    def emit(self, output: mx.array, cache: Any) -> mx.array:
        """Route the last local layer's ``output`` according to the send mode.

        What it returns is the hidden state the model's head may read: a wider
        message (``lend_heads``) is sent whole, but only its hidden state goes on.
        """
        self.check_usable()
        if self._detached:
            return self._hidden_part(output)
        if self._mode == "queue":
            if not self._executing_plan:
                self.send_queue.discard()
                self.received.clear()
                raise PipelineError(
                    f"{self.describe()}: the model was called inside send_mode(model, 'queue') outside "
                    "pipemlx.pipeline_prefill; in queue mode the last local layer only queues its output, so "
                    "the logits would come from this rank's partial hidden state. Decode outside the block "
                    "(pipemlx.generate_step)"
                )
            if not self.is_last:
                self.send_queue.put(output, self.rank + 1)
            return self._hidden_part(output)
        if self.is_first:
            self._check_previous_pass()
        if not self.is_last:
            output = self._hidden_part(mx.distributed.send(output, self.rank + 1, group=self.group))
        if self.world_size > 1 and self._broadcast:
            output = mx.distributed.all_gather(output, group=self.group)[-output.shape[0] :]
        if cache is not None:
            attach_dependency(cache, output)
        self.outstanding.append(output)
        return output

    def new_cache(self, model: nn.Module, max_kv_size: int | None = None) -> list[Any]:
        """Fresh caches for this rank's layers: mlx-lm's ``make_prompt_cache(model, max_kv_size)``.

        mlx-lm bounds the caches only of a model without its own ``make_cache``;
        the rank after a ``lend_heads`` cut has one, so here it gets the rotating
        caches mlx-lm gives every other layer of that model.
        """
        if max_kv_size is not None and self.info.bounded_caches is not None:
            return self.info.bounded_caches(max_kv_size)
        return make_prompt_cache(model, max_kv_size=max_kv_size)

    def _hidden_part(self, output: mx.array) -> mx.array:
        """``output`` without what a wider outgoing message carries beyond the hidden state."""
        info = self.info
        if info.lending.outgoing_width and output.shape[-1] != info.hidden_size:
            return output[..., : info.hidden_size]
        return output

    def wire_zeros(self, rows: int, length: int, *, incoming: bool) -> mx.array:
        """Zeros shaped as a message from the previous rank (``incoming``) or to the next one, for stand-ins."""
        info = self.info
        width = (info.lending.incoming_width if incoming else info.lending.outgoing_width) or info.hidden_size
        return mx.zeros((rows, length, width), dtype=info.dtype or mx.float32)

    def check_stream(self, stream: object, not_a_stream: type[Exception] = TypeError) -> None:
        """Raise unless ``stream`` (mlx-lm's ``stream`` argument) is ``None`` or a stream or device on this stage's
        compute device: the ranks compute on :attr:`compute_stream` whatever is passed, because the bounded waits
        evaluate from helper threads. A stream on another device raises ``ValueError``; something that is no
        stream or device, ``not_a_stream``."""
        if stream is None:
            return
        device = stream if isinstance(stream, mx.Device) else getattr(stream, "device", None)
        if not isinstance(device, mx.Device):
            raise not_a_stream(
                f"stream must be an mx.Stream (or mlx-lm's generation_stream), an mx.Device or None, got {stream!r}"
            )
        own = self.compute_stream.device
        if device == own:
            return
        given = f"device {device}: " if stream is device else f"stream is on {device}, but "
        raise ValueError(
            f"{given}{self.describe()} computes on its own stream, so it computes on {own} (the default device "
            f"when the model was sharded) whatever stream is passed: pass a stream or device on {own}, or None"
        )

    def describe(self) -> str:
        """``rank 1/3 (layers 4..7 of 12)`` for messages."""
        return self.info.describe()


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
    """Whether :func:`pipemlx.shard_model` attached a stage to ``model`` (else the API runs mlx-lm's own functions)."""
    return isinstance(getattr(model, STAGE_ATTRIBUTE, None), PipelineStage)


def ensure_unsharded(model: nn.Module) -> None:
    if isinstance(getattr(model, STAGE_ATTRIBUTE, None), PipelineStage):
        raise PipelineError(f"{type(model).__name__} is already sharded; shard a fresh model")


_LIVE_STAGES: weakref.WeakSet[PipelineStage] = weakref.WeakSet()
"""Every multi-rank stage of this process that is still alive: they share the wire (see :meth:`PipelineStage.settle`)."""


def _finish_at_exit(stage: PipelineStage) -> None:
    """At interpreter exit, finish what ``stage`` left in flight so that peers are not cut off mid-step."""
    reference = weakref.ref(stage)

    def finish() -> None:
        live = reference()
        if live is None or live.broken is not None:
            return
        try:
            live.settle_own(min(EXIT_TIMEOUT, live.info.timeout or EXIT_TIMEOUT))
        except Exception:  # the program is ending: a peer that went first is not this rank's error
            pass

    atexit.register(finish)
