"""Agreement points: small collectives in which ranks check they follow the same plan."""

from __future__ import annotations

import mlx.core as mx

from .errors import PipelineMismatchError
from .plan import PrefillPlan
from .stage import PipelineStage
from .waits import wait_for

HANDSHAKE_FIELDS = ("num_tokens", "step_size", "plan_fingerprint", "total_layers", "layer_start", "layer_stop")
SHARED_FIELDS = ("num_tokens", "step_size", "plan_fingerprint", "total_layers")


def gather_ints(stage: PipelineStage, values: list[int], timeout: float | None, what: str) -> list[list[int]]:
    """All-gather one small integer vector per rank; returns the rows, indexed by rank."""
    with mx.stream(stage.compute_stream):
        gathered = mx.distributed.all_gather(mx.array(values, dtype=mx.int32), group=stage.group)
    wait_for(gathered, timeout, lambda: f"{stage.describe()} in {what}")
    flat: list[int] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
    width = len(values)
    return [flat[r * width : (r + 1) * width] for r in range(stage.world_size)]


def handshake(stage: PipelineStage, plan: PrefillPlan, timeout: float | None) -> None:
    """Check that every rank is about to run the same plan over one contiguous layer split.

    Raises :class:`PipelineMismatchError` on every rank (they all see the same
    table), naming the field that differs and each rank's value.
    """
    mine = [
        plan.num_tokens,
        plan.step_size,
        plan.fingerprint(),
        stage.total_layers,
        stage.layers.start,
        stage.layers.stop,
    ]
    rows = gather_ints(stage, mine, timeout, "the handshake")
    table = {name: [row[i] for row in rows] for i, name in enumerate(HANDSHAKE_FIELDS)}
    for name in SHARED_FIELDS:
        if len(set(table[name])) > 1:
            raise PipelineMismatchError(f"ranks disagree on {name}: {_per_rank(table[name])}")
    starts, stops = table["layer_start"], table["layer_stop"]
    expected_starts = [0, *stops[:-1]]
    if starts != expected_starts or stops[-1] != table["total_layers"][0]:
        ranges = [f"{a}..{b - 1}" for a, b in zip(starts, stops)]
        raise PipelineMismatchError(
            f"layer ranges do not split {table['total_layers'][0]} layers contiguously: {_per_rank(ranges)}"
        )


def agree_on_step(stage: PipelineStage, step: int, timeout: float | None) -> None:
    """Close step ``step``: returns once every rank has finished it."""
    steps = [row[0] for row in gather_ints(stage, [step], timeout, f"the agreement closing step {step}")]
    if len(set(steps)) > 1:
        raise PipelineMismatchError(f"ranks are at different steps of the plan: {_per_rank(steps)}")


def _per_rank(values: list[object] | list[int] | list[str]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
