"""The prefill's agreement points: the handshake that opens a plan and the all-gather that closes each step."""

from __future__ import annotations

from typing import Protocol

from ..errors import PipelineMismatchError
from .caches import UNCOUNTED
from .protocol import AGREE, HANDSHAKE, Status, Table, dtype_code, per_rank
from .stage import PipelineStage


class HandshakeRequest(Protocol):
    """What ranks compare in a handshake: a :class:`~pipemlx.schedule.plan.PrefillPlan`, or an auto-step request."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def step_size(self) -> int: ...
    def fingerprint(self) -> int: ...


def handshake(
    stage: PipelineStage,
    plan: HandshakeRequest,
    status: Status,
    timeout: float | None,
    calibration: int = 0,
    cache_offset: int = 0,
    prior: int = 0,
    decode_settings: int = 0,
    speculation: int = 0,
) -> Table:
    """Check that every rank is about to run the same plan over one contiguous layer split.

    Raises :class:`PipelineMismatchError` on every rank, naming the field of
    :data:`~pipemlx.runtime.protocol.HANDSHAKE` that differs and each rank's
    value. ``cache_offset`` is how many positions the cache already holds (a
    reused prefix; :data:`~pipemlx.runtime.caches.UNCOUNTED` on a rank whose
    caches count none); ``decode_settings`` is what a decode after the prefill
    will exchange (:class:`~pipemlx.runtime.prefill.PrefillOptions`), ``speculation`` the fingerprint of its
    speculative decoding's proposer (0: none). Returns
    the table: every rank's ``status``, ``calibration`` (the fingerprint of the cost model it holds, 0: none) and
    ``prior`` (the fingerprint of the untimed cost model it would plan with otherwise) too.
    """
    values = {
        "calibration": calibration,
        "prior": prior,
        "num_tokens": plan.num_tokens,
        "prefill_step_size": plan.step_size,
        "plan_fingerprint": plan.fingerprint(),
        "total_layers": stage.info.total_layers,
        "hidden_size": stage.info.hidden_size,
        "dtype": dtype_code(stage.info.dtype),
        "decode_settings": decode_settings,
        "lend_mlp": int(stage.info.lending.mlp),
        "lend_heads": stage.info.lending.heads,
        "cache_offset": cache_offset,
        "speculation": speculation,
        "layer_start": stage.info.layers.start,
        "layer_stop": stage.info.layers.stop,
    }
    table = HANDSHAKE.exchange(
        stage.group,
        stage.compute_stream,
        values,
        status=status,
        timeout=timeout,
        where="the handshake",
        who=stage.describe(),
    )
    starts, stops = table["layer_start"], table["layer_stop"]
    if starts != [0, *stops[:-1]] or stops[-1] != table["total_layers"][0]:
        ranges = [f"{a}..{b - 1}" for a, b in zip(starts, stops)]
        raise PipelineMismatchError(
            f"layer ranges do not split {table['total_layers'][0]} layers contiguously: {per_rank(ranges)}"
        )
    return table


def agreed_offset(table: Table) -> int:
    """The reused prefix a handshake's ranks hold: the offset of the ranks whose caches count positions."""
    return max((v for v in table["cache_offset"] if v != UNCOUNTED), default=0)


def agree_on_step(
    stage: PipelineStage, step: int, status: Status, timeout: float | None, failed_chunk: int = -1
) -> Table:
    """Close step ``step`` with this rank's ``status``; returns every rank's status and ``failed_chunk``.

    It returns once every rank has finished the step (:attr:`Status.CHUNK_FAILED`: the model raised while computing
    chunk ``failed_chunk`` since the last agreement point); the caller stops when any rank's status is not OK.
    """
    where = f"the agreement closing step {step}"
    values = {"step": step, "failed_chunk": failed_chunk}
    return AGREE.exchange(
        stage.group, stage.compute_stream, values, status=status, timeout=timeout, where=where, who=stage.describe()
    )
