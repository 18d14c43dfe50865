"""Agreement points: small collectives in which ranks check they follow the same plan."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from ..errors import PipelineMismatchError
from .caches import UNCOUNTED
from .stage import PipelineStage
from .waits import wait_for

HANDSHAKE_FIELDS = (
    "status",
    "needs_calibration",
    "num_tokens",
    "step_size",
    "plan_fingerprint",
    "total_layers",
    "hidden_size",
    "dtype",
    "layer_start",
    "layer_stop",
    "cache_offset",
    "decode_settings",
    "lend_mlp",
    "lend_heads",
)
SHARED_FIELDS = (
    "num_tokens",
    "step_size",
    "plan_fingerprint",
    "total_layers",
    "hidden_size",
    "dtype",
    "decode_settings",
    "lend_mlp",
    "lend_heads",
)
DECODE_SETTINGS = ("none (pipeline_prefill)", "share_logprobs=False", "share_logprobs=True")
"""What the ``decode_settings`` field's values mean: what the decode after the prefill will exchange."""
DTYPES = (mx.float16, mx.bfloat16, mx.float32, mx.float64)


def gather_ints(stage: PipelineStage, values: list[int], timeout: float | None, what: str) -> list[list[int]]:
    """All-gather one small integer vector per rank; returns the rows, indexed by rank."""
    with mx.stream(stage.compute_stream):
        gathered = mx.distributed.all_gather(mx.array(values, dtype=mx.int32), group=stage.group)
    wait_for(gathered, timeout, lambda: f"{stage.describe()} in {what}")
    flat: list[int] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
    width = len(values)
    return [flat[r * width : (r + 1) * width] for r in range(stage.world_size)]


class Request(Protocol):
    """What ranks compare in a handshake: a :class:`~pipemlx.schedule.plan.PrefillPlan`, or an auto-step request."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def step_size(self) -> int: ...
    def fingerprint(self) -> int: ...


def handshake(
    stage: PipelineStage,
    plan: Request,
    status: int,
    timeout: float | None,
    needs_calibration: bool = False,
    cache_offset: int = 0,
    decode_settings: int = 0,
) -> dict[str, list[int]]:
    """Check that every rank is about to run the same plan over one contiguous layer split.

    Raises :class:`PipelineMismatchError` on every rank (they all see the same
    table), naming the field that differs and each rank's value. Returns the
    table, one list per field indexed by rank: like :func:`agree_on_step` it
    exchanges a ``status``, and, for auto-step requests, ``needs_calibration``.
    ``cache_offset`` is how many positions the cache already holds (a reused
    prefix; :data:`~pipemlx.runtime.caches.UNCOUNTED` on a rank whose caches
    count none): ranks holding different prefixes would compute different
    tokens. :func:`agreed_offset` gives the prefix every rank holds.
    ``decode_settings`` (an index of :data:`DECODE_SETTINGS`) is what a decode
    after the prefill will exchange: ranks that would send differently sized
    messages in every decode step are told here, before anything is sent.
    ``lend_mlp`` (``shard_model``'s) says where each rank's layers end: a rank
    that sends the attention half's output to one that expects a whole layer's
    would compute wrong tokens without an error; ``lend_heads`` likewise says how wide the messages are.
    """
    mine = [
        status,
        int(needs_calibration),
        plan.num_tokens,
        plan.step_size,
        plan.fingerprint(),
        stage.total_layers,
        stage.hidden_size,
        DTYPES.index(stage.dtype) + 1 if stage.dtype in DTYPES else 0,
        stage.layers.start,
        stage.layers.stop,
        cache_offset,
        decode_settings,
        int(stage.lends_mlp),
        stage.lent_heads,
    ]
    rows = gather_ints(stage, mine, timeout, "the handshake")
    table = {name: [row[i] for row in rows] for i, name in enumerate(HANDSHAKE_FIELDS)}
    for name in SHARED_FIELDS:
        if len(set(table[name])) > 1:
            shown: list[object] = list(table[name])
            if name == "dtype":
                shown = [_dtype_name(v) for v in table[name]]
            elif name == "step_size":
                shown = ["auto" if v == 0 else v for v in table[name]]
            elif name == "decode_settings":
                shown = [DECODE_SETTINGS[v] if 0 <= v < len(DECODE_SETTINGS) else v for v in table[name]]
            raise PipelineMismatchError(f"ranks disagree on {name}: {_per_rank(shown)}")
    offsets = table["cache_offset"]
    if len({v for v in offsets if v != UNCOUNTED}) > 1:
        shown = ["uncounted" if v == UNCOUNTED else v for v in offsets]
        raise PipelineMismatchError(f"ranks disagree on cache_offset: {_per_rank(shown)}")
    starts, stops = table["layer_start"], table["layer_stop"]
    expected_starts = [0, *stops[:-1]]
    if starts != expected_starts or stops[-1] != table["total_layers"][0]:
        ranges = [f"{a}..{b - 1}" for a, b in zip(starts, stops)]
        raise PipelineMismatchError(
            f"layer ranges do not split {table['total_layers'][0]} layers contiguously: {_per_rank(ranges)}"
        )
    return table


def agreed_offset(table: dict[str, list[int]]) -> int:
    """The reused prefix a handshake's ranks hold: the offset of the ranks whose caches count positions."""
    return max((v for v in table["cache_offset"] if v != UNCOUNTED), default=0)


STATUS_OK = 0
STATUS_CANCEL = 1
STATUS_FAILED = 2
STATUS_CHUNK_FAILED = 3
"""Failed in the model itself: the failed chunk, and every later one, is not in this rank's cache."""


def agree_on_step(
    stage: PipelineStage, step: int, status: int, timeout: float | None, failed_chunk: int = -1
) -> tuple[list[int], list[int]]:
    """Close step ``step`` with this rank's ``status``; returns every rank's status and failed chunk, by rank.

    It returns once every rank has finished the step. ``status`` is
    :data:`STATUS_OK`, :data:`STATUS_CANCEL` (the caller's ``should_cancel`` said
    yes), :data:`STATUS_CHUNK_FAILED` (the model raised while computing chunk
    ``failed_chunk`` since the last agreement point) or :data:`STATUS_FAILED`
    (a callback raised on this rank since the last agreement point); the
    caller stops when any rank's status is not OK.
    """
    rows = gather_ints(stage, [step, status, failed_chunk], timeout, f"the agreement closing step {step}")
    steps = [row[0] for row in rows]
    if len(set(steps)) > 1:
        raise PipelineMismatchError(f"ranks are at different steps of the plan: {_per_rank(steps)}")
    return [row[1] for row in rows], [row[2] for row in rows]


def _per_rank(values: list[object] | list[int] | list[str]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _dtype_name(code: int) -> str:
    return str(DTYPES[code - 1]) if 0 < code <= len(DTYPES) else "unknown"
