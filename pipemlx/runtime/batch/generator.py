"""The :class:`BatchGenerator` API: requests in, one tick per :meth:`~BatchGenerator.next`, responses out.

The work is elsewhere in the package: checking requests (:mod:`.requests`), the batch's rows and caches (:mod:`.rows`),
sampling (:mod:`.sample`), counting (:mod:`.stats`), and the tick itself (:mod:`pipemlx.runtime.batch.tick`, planned by
:func:`pipemlx.schedule.batch_plan.plan_tick`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator as MlxBatchGenerator
from mlx_lm.generate_utils import BatchStats

from ...errors import renamed
from ...schedule.batch_plan import (
    AUTO_SETTLE,
    FINGERPRINT_MODULUS,
    SERIAL,
    Admission,
    AdmissionLimits,
    AutoSteps,
    ChunkSizes,
    EqualCostChunks,
    GroupRule,
    GroupState,
    GroupTick,
    GroupTimings,
    Tick,
    TickChunk,
    TickState,
    drop,
    enqueue,
    fingerprint,
    plan_groups,
    plan_tick,
)
from ...schedule.costmodel import CostModel
from ...schedule.memory_split import parse_size
from ..caches import UNCOUNTED, cache_offset, trim_to
from ..calibrate import calibrated
from ..sampling import LogitsProcessor, Sampler, greedy, log_probabilities
from ..speculative import draft_fingerprint
from ..stage import PipelineStage, is_sharded, stage_of
from ..stops import Stops
from ..waits import wait_for
from .compiled import CompiledDecode
from .cut import cut_rows
from .memory import exchange_admission
from .requests import (
    BatchRequest,
    Decided,
    FinishReason,
    Options,
    as_batch_window,
    bound_of,
    check_batchable,
    check_settings,
    checked_requests,
)
from .rows import Rows, evaluate
from .sample import all_greedy, sample
from .speculate import BatchSpeculation, check_speculation, emitted, padded_inputs, speculable
from .stats import Counters
from .tick import DecodeJob, TickOutcome, TickRunner, TickWork


@dataclass(frozen=True)
class Response:
    """One request's token from one :meth:`BatchGenerator.next` tick (the tick that feeds it), the same on every rank.

    The fields are mlx-lm's ``BatchGenerator`` responses', in its order. ``finish_reason`` is ``None`` while the
    request goes on, ``"length"`` at its ``max_tokens``, ``"stop"`` when ``token`` ends one of its stop sequences, and
    ``"error"`` (``token`` -1) when the model raised on some rank while computing this request; in all three the
    request has left. ``logprobs``: the log-probabilities this token was sampled from (``[vocabulary]``, after the
    request's logits processors), computed only when read: on the last rank always; on the others in a tick where
    some row had a sampler or processors, or with ``share_logprobs`` (else ``None``); ``None`` on an ``"error"``
    response.

    ``prompt_cache`` and ``all_tokens``, on a ``"length"`` or ``"stop"`` response only (as in mlx-lm): this rank's
    per-layer caches of the finished request, taken out of the batch after its closing tick fed ``token``, and the
    tokens they hold — its ``all_tokens`` given at insert, its prompt and every generated token, this last one too
    (what mlx-lm's hold). Pass the cache to :meth:`BatchGenerator.insert` with the next turn's tokens to continue the
    conversation without prefilling it again.
    """

    uid: int
    token: int
    logprobs: mx.array | None = field(default=None, compare=False)
    finish_reason: FinishReason | None = None
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] | None = None


def cast_costs(costs: CostModel | None) -> CostModel:
    """``costs``, which ``prefill_step_size="auto"`` always calibrates."""
    assert costs is not None
    return costs


class BatchGenerator:
    """Continuous batching on a sharded model; call every method identically on every rank.

    ``max_tokens`` is the default per request (256, as mlx-lm's ``generate_step``; -1: no limit); ``stop_tokens`` end a request after yielding one of them
    (``finish_reason="stop"``): token ids, or sequences of them as mlx-lm's ``BatchGenerator`` takes (a request stops at
    the token that completes one, counting its generated tokens only); ``sampler`` is the default sampler (greedy when
    ``None``) and ``logits_processors`` the default processors (mlx-lm's ``make_logits_processors``: repetition penalty,
    logit bias, ...); ``timeout`` bounds every wait (default: the model's).

    Samplers and processors (the defaults and each request's) are called in every rank's process, with what mlx-lm's
    ``BatchGenerator`` calls them with: in a tick where some live row has one, the last rank's logits of every row go
    to every rank in the tick's message, and each rank runs the rows' processors and samplers on them. The tokens are
    the last rank's (a sampler drawing another token elsewhere is overruled, never splitting the ranks), and each
    rank's responses carry its own ``logprobs``. A processor or sampler that raises on any rank fails that tick's
    rows on every rank (``"error"`` responses): raised on the last rank, in that tick; on another, in the next
    (told in its header, no collective of its own), in place of the tokens the failing tick decided. Pass the same
    samplers and processors on every rank (ranks that differ raise ``PipelineMismatchError`` naming the payload
    width).
    ``share_logprobs`` sends the logits in every tick (greedy rows too), so every rank's responses carry
    ``logprobs``: mlx-lm's ``batch_generate(..., return_logprobs=True)`` needs it on the ranks before the last.
    ``logprobs=False`` (pipemlx's; ``serve`` passes it): every response's ``logprobs`` is ``None``; on a model sharded
    with ``head="split"`` greedy ticks then share the head (each rank's rows) and never gather the whole logits.

    ``prefill_chunk_tokens`` is the size of the prompt chunks computed in a tick while other requests decode: each rank
    adds about one chunk's work to each decode step, so it trades the decoding requests' time between tokens against the
    new request's time to first token. ``prefill_step_size`` is the chunk size while nothing decodes (a prompt prefilled
    alone): ``"auto"`` (the default) takes the step the calibrated cost model predicts fastest for that prompt's
    length, as :func:`pipemlx.pipeline_prefill` does.

    ``prefill_chunking="equal-cost"`` keeps that trade steady over a long prompt: a chunk attends to every position
    before it, so at a fixed length the late chunks of a long prompt cost several times the first ones and the others'
    time between tokens grows as it fills. With it, the chunk at the start of a prompt has ``prefill_chunk_tokens``
    positions and every later one is as long as the cost model allows for the same predicted cost
    (:class:`~pipemlx.schedule.batch_plan.EqualCostChunks`; the default, measured to keep the time between tokens
    lower at about the same time to first token: ``docs/batching.md``). The constructor then calibrates the cost model
    on the group, as ``prefill_step_size="auto"`` does (a collective, once per model and read from the calibration
    cache when the ranks hold it: construct on every rank). ``"fixed"``: every chunk has ``prefill_chunk_tokens``
    positions.

    ``memory_budget`` (what this rank may spend on KV caches: bytes, or a size like ``"24GB"`` as
    :func:`pipemlx.shard_model`'s ``memory`` takes) turns on admission control: the constructor then
    exchanges every rank's budget and cache bytes per position (one all-gather: construct on every rank), and a queued
    request starts its prefill only when the batch, left-padded to its longest reservation (prompt + ``max_tokens``),
    fits every rank's budget with it; requests start in order. A request that could never fit raises ``ValueError`` in
    :meth:`insert`.

    ``completion_batch_size`` (as mlx-lm's): at most this many requests decode or are prefilled at once; the others wait
    in the queue, in order. ``None`` (the default; mlx-lm's is 32): no limit.

    ``prefill_batch_size`` (as mlx-lm's): at most this many requests are started and not yet decoding at once (chunks in
    flight on some rank, or prefilled and waiting to join); the next one starts when one joins. A tick prefills one
    chunk per rank, so up to ``world_size`` requests are computed at once: this caps that. ``None`` (the default;
    mlx-lm's is 8): no cap. As in mlx-lm, a ``completion_batch_size`` below it is raised to it.

    ``max_kv_size`` (as mlx-lm's): each request's caches are made with ``make_prompt_cache(model, max_kv_size)``,
    rotating caches that keep the last ``max_kv_size`` positions. An answer may outgrow them (the batch caches rotate,
    as mlx-lm's), and so may a prompt: mlx-lm's prefills it in its batch caches, which keep none of the first
    positions, and pipemlx prefills it in caches turned into that kind (a cache passed to :meth:`insert` too:
    :func:`~.requests.as_batch_window`), so the tokens are mlx-lm's whatever the chunks. Admission control reserves
    such a request's bounded size.

    ``decode_groups`` (pipemlx's): ``1`` (the default) decodes the batch as one group, whose step every rank
    computes in turn within each tick (each rank waits while the others compute). With more rows than that serves
    well, the batch can be cut into up to ``world_size`` *groups in flight*: in each tick each rank computes another
    group's step (rank ``r`` what rank ``r - 1`` computed in the last tick, as prefill chunks travel), so every rank
    is busy; a group's tokens come once every ``world_size`` ticks. An int ``n >= 2``: groups whenever at least
    ``n`` rows are live; ``"auto"``: from :data:`~pipemlx.schedule.batch_plan.AUTO_MIN_ROWS_PER_GROUP` live rows
    per group on, where measured faster: every rank times its ticks and sends the time in the next tick's header,
    and every rank compares the steady ticks' seconds per token of one group and of groups at the batch's row count
    alike (:class:`~pipemlx.schedule.batch_plan.GroupTimings`; one way not measured yet is tried for a few ticks).
    Each request's tokens are the same either way;
    the order of the responses across requests differs (docs/batching.md, "Decode groups in flight").

    ``prompt_lookup`` (pipemlx's; ``None``, the default: no speculation) turns on speculative decoding by prompt
    lookup in the batch: each request that may guess (:meth:`insert`'s ``draft``) and decodes greedily with no logits
    processors feeds, in each step, its next token and up to ``num_draft_tokens`` guesses (what followed the latest
    earlier match of its last ``prompt_lookup``..1 tokens; ``"auto"``: 0 to 4 each step, from the rows' measured
    acceptance and the steps' measured cost by width, none where guesses lose),
    and keeps the guesses the step confirms: the tokens are those without guesses, several per tick. It speculates
    only while the batch decodes as one group, and needs plain KV caches on every rank (``ValueError`` otherwise, on
    every rank: the constructor then makes one small all-gather). See
    docs/batching.md, "Speculation".

    ``draft_model`` (as ``generate_step``'s: a small whole model with the target's tokenizer, the same on every rank;
    instead of ``prompt_lookup``) draws each guessing row's guesses greedily from the rows' batched draft caches, on every rank
    alike, so no message carries them (the constructor's all-gather checks that every rank holds the same draft).
    ``num_draft_tokens`` applies as with prompt lookup; with ``"auto"`` a step's count is chosen before the drafts
    draw, and the ticks it times include the drafts' own time.

    ``stream`` (mlx-lm's computes on it) is accepted only on the device of :attr:`stream`, the stage's own stream that
    the ranks compute on (``ValueError`` otherwise).

    ``compiled_decode`` (pipemlx's, default off): each rank runs its local layers' decode step as one
    ``mx.compile`` d graph (:mod:`pipemlx.runtime.batch.compiled`) wherever its batch caches are plain
    ``BatchKVCache`` s and the model's family is one it replays (llama, mistral, qwen2, qwen3); every other step
    runs eagerly. Same tokens; log-probabilities within rounding.

    Raises ``ValueError`` for a bad value of any of these before anything is sent.

    A model that is not sharded (an engine's one-machine path) gets mlx-lm's own ``BatchGenerator``, built with the
    arguments given and mlx-lm's defaults for the others (``prefill_step_size="auto"`` and ``None`` batch sizes are
    mlx-lm's defaults there); the arguments only pipemlx has (``prefill_chunk_tokens``, ``prefill_chunking``,
    ``timeout``, ``memory_budget``, ``share_logprobs``) raise ``ValueError`` there.
    """

    def __new__(cls, model: nn.Module, **kwargs: Any) -> BatchGenerator:
        if is_sharded(model):
            return super().__new__(cls)
        if "prefill_budget" in kwargs:  # as @renamed says it for a sharded model
            raise TypeError(
                "BatchGenerator() got the keyword argument 'prefill_budget', renamed 'prefill_chunk_tokens' in pipemlx 0.2.0"
            )
        pipemlx_only = sorted(
            name
            for name in (
                "prefill_chunk_tokens",
                "prefill_chunking",
                "timeout",
                "memory_budget",
                "share_logprobs",
                "logprobs",
                "decode_groups",
                "compiled_decode",
                "prompt_lookup",
                "draft_model",
                "num_draft_tokens",
            )
            if name in kwargs
        )
        if pipemlx_only:
            raise ValueError(
                f"BatchGenerator on a model that is not sharded is mlx-lm's; {', '.join(pipemlx_only)} exist only on a "
                "sharded model (pipemlx.shard_model / load_sharded): leave them out or shard the model"
            )
        options: dict[str, Any] = {
            name: value
            for name, value in kwargs.items()
            if not (value == "auto" and name == "prefill_step_size")
            and not (value is None and name in ("completion_batch_size", "prefill_batch_size"))
        }
        if "stop_tokens" in options:  # pipemlx takes a bare id as a sequence of one; mlx-lm takes sequences only
            options["stop_tokens"] = [[s] if isinstance(s, int) else list(s) for s in options["stop_tokens"]]
        # mlx-lm's own generator, not an instance of this class: Python then skips __init__ and the caller holds
        # exactly what mlx-lm's BatchGenerator(model, ...) gives.
        return cast(BatchGenerator, MlxBatchGenerator(model, **options))

    @renamed(prefill_budget="prefill_chunk_tokens")
    def __init__(
        self,
        model: nn.Module,
        *,
        max_tokens: int = 256,
        stop_tokens: Iterable[int | Sequence[int]] = (),
        sampler: Sampler | None = None,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        prefill_step_size: int | Literal["auto"] = "auto",
        prefill_chunk_tokens: int = 128,
        prefill_chunking: Literal["fixed", "equal-cost"] = "equal-cost",
        timeout: float | None = None,
        memory_budget: int | str | None = None,
        completion_batch_size: int | None = None,
        prefill_batch_size: int | None = None,
        max_kv_size: int | None = None,
        stream: mx.Stream | mx.ThreadLocalStream | mx.Device | None = None,
        share_logprobs: bool = False,
        logprobs: bool = True,
        decode_groups: int | Literal["auto"] = 1,
        prompt_lookup: int | None = None,
        num_draft_tokens: int | Literal["auto"] = 2,
        compiled_decode: bool = False,
        draft_model: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.stage: PipelineStage = stage_of(model)
        chunk = prefill_chunk_tokens
        budget = None if memory_budget is None else parse_size(memory_budget)
        sizes = {
            **({} if prefill_step_size == "auto" else {"prefill_step_size": prefill_step_size}),
            "prefill_chunk_tokens": chunk,
            "memory_budget": budget,
            "completion_batch_size": completion_batch_size,
            "prefill_batch_size": prefill_batch_size,
            "max_kv_size": max_kv_size,
        }
        self.stop_sequences = check_settings(
            self.stage, stream, max_tokens, timeout, sizes, prefill_chunking, stop_tokens
        )
        if not isinstance(share_logprobs, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"share_logprobs must be a bool, got {share_logprobs!r}")
        if not isinstance(compiled_decode, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"compiled_decode must be a bool, got {compiled_decode!r}")
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.share_logprobs = share_logprobs
        self.logprobs = bool(logprobs)  # False: every response's logprobs None (head="split": no logits gathered)
        self.logits_processors: tuple[LogitsProcessor, ...] = tuple(logits_processors or ())
        self.prefill_step_size = prefill_step_size
        self.prefill_chunk_tokens = chunk
        self.timeout = timeout or self.stage.info.timeout
        self.max_kv_size = max_kv_size
        fresh = self._new_cache()
        check_batchable(fresh, self.stage)
        self._fresh_bound = bound_of(fresh)
        self._next_uid = 0
        self._plan = TickState(self.stage.world_size)
        self._requests: dict[int, BatchRequest] = {}  # every request inserted and not yet finished
        self._groups: dict[int, Rows] = {SERIAL: Rows(self.stage.compute_stream)}  # by group id, in id order
        self._group_rule = GroupRule.of(decode_groups, self.stage.world_size)
        self._group_state = GroupState(self.stage.world_size)
        self._finishing = self._groups[SERIAL]  # the rows whose step ends in the tick under way (sampled)
        # decode_groups="auto": the steady ticks' measured costs, the last tick if steady ((groups, live rows,
        # tokens, index): recorded when the next tick's all-gather brings the ranks' times of it), this rank's time
        # of its last tick (sent in the next tick's header), and the splits and merges so far.
        self._timings = GroupTimings()
        self._steady: tuple[bool, int, int, int] | None = None
        self._settled = 0  # steady ticks since the last split, merge or join (the first AUTO_SETTLE are not timed)
        self._last_tick_us = 0
        self._group_switches = [0, 0]
        self._runner = TickRunner(model, self.stage, self.timeout)
        if compiled_decode:
            self._runner.compiled = CompiledDecode.of(model, self.stage)
        # The rows every rank sampled in the last tick that ran (none when only the last rank sampled): failed in
        # the next tick when some rank's sampling of them raised (TickOutcome.failed_sample); this rank leaves
        # them out of its own sampling meanwhile (_unsampled) when it is the one whose sampling raised.
        self._sampled: frozenset[int] = frozenset()
        self._unsampled: frozenset[int] = frozenset()
        self._speculation: BatchSpeculation | None = None
        if prompt_lookup is not None or draft_model is not None:
            check_speculation(prompt_lookup, num_draft_tokens, draft_model)
            speculation = BatchSpeculation(prompt_lookup, num_draft_tokens, draft_model)
            self._check_speculable(fresh, speculation)
            self._speculation = speculation
        self._guesses: list[list[int]] = []  # the tick under way's per row (empty: a step without guesses)
        self._timed: int | None = None  # the last tick's width where it was a plain decode step (prompt lookup)
        self._ahead_logprobs: mx.array | None = None  # its later positions' log-probabilities, [R, width-1, V]
        self.admission: Admission | None = (
            None if budget is None else exchange_admission(model, self.stage, budget, self.timeout, draft_model)
        )
        self.prefill_batch_size = prefill_batch_size
        if completion_batch_size is not None and prefill_batch_size is not None:
            completion_batch_size = max(completion_batch_size, prefill_batch_size)  # as mlx-lm does
        self.completion_batch_size = completion_batch_size
        self._limits = (
            None
            if self.admission is None and completion_batch_size is None
            else AdmissionLimits(self.admission, completion_batch_size)
        )
        self._counters = Counters()
        self._logprobs: mx.array | None = None  # the last tick's, on the last rank: read by its responses
        costs = (
            calibrated(model, self.stage, self.timeout)
            if prefill_chunking == "equal-cost" or prefill_step_size == "auto"
            else None
        )
        self.chunk_sizes: int | ChunkSizes = (
            chunk if costs is None or prefill_chunking == "fixed" else EqualCostChunks(chunk, costs.layer)
        )
        self.lone_steps: int | AutoSteps = (
            prefill_step_size if isinstance(prefill_step_size, int) else AutoSteps(cast_costs(costs))
        )

    @property
    def stream(self) -> mx.Stream:
        """The stream this rank computes the ticks on (the stage's ``compute_stream``; mlx-lm's ``stream``)."""
        return self.stage.compute_stream

    @property
    def active_uids(self) -> list[int]:
        """Requests in the batch, in row order."""
        return [r.uid for rows in self._groups.values() for r in rows.active]

    @property
    def queued_uids(self) -> list[int]:
        """Requests inserted and not yet decoding (queued, or their prompts being prefilled), in order."""
        active = set(self.active_uids)
        return [u for u in self._requests if u not in active]

    @property
    def shared_head_ticks(self) -> int:
        """Ticks whose decode step shared the output head among the ranks (every row greedy: see ``next``)."""
        return self._runner.shared_ticks

    @property
    def group_switches(self) -> tuple[int, int]:
        """``(splits, merges)``: how often the batch was cut into decode groups in flight, and merged back, so far."""
        return self._group_switches[0], self._group_switches[1]

    def group_costs(self) -> dict[str, float]:
        """``decode_groups="auto"``: the measured seconds per token of each way of decoding at each row count, as
        every rank holds them (``"one 16"``: one group of 16 live rows; ``"groups 16"``: 16 rows in groups in
        flight; only those measured, stale ticks counted too). For benchmarks and logs."""
        costs: dict[str, float] = {}
        for (grouped, rows), samples in sorted(self._timings.samples.items()):
            value = self._timings.cost(grouped, rows, max(t for t, _ in samples))
            if value is not None:
                costs[f"{'groups' if grouped else 'one'} {rows}"] = value
        return costs

    @property
    def guesses(self) -> tuple[int, int]:
        """``(proposed, confirmed)``: every request's guesses so far with ``prompt_lookup`` (``(0, 0)`` without)."""
        speculation = self._speculation
        return (0, 0) if speculation is None else (speculation.proposed, speculation.confirmed)

    def guesses_of(self, uid: int) -> tuple[int, int]:
        """``(proposed, confirmed)``: a request's guesses, while it is in the generator and until the next tick after
        it left (``(0, 0)`` for one that never guessed)."""
        return (0, 0) if self._speculation is None else self._speculation.of(uid)

    @property
    def compiled_decode(self) -> CompiledDecode | None:
        """The compiled decode step of this rank's layers (``compiled_decode=True`` on a model whose layers it can
        run: :class:`~.compiled.CompiledDecode`, whose ``steps`` and ``traces`` count what it ran); ``None``: every
        decode step eager."""
        return self._runner.compiled

    @property
    def last_error(self) -> BaseException | None:
        """The first model error this rank stood in for (requests failed with ``finish_reason="error"``)."""
        return self._runner.error

    def prefilled(self, uid: int) -> int:
        """Prompt positions of a queued request that every rank has prefilled (0 for an unknown uid)."""
        request = self._requests.get(uid)
        return 0 if request is None or self._row_of(request) is not None else request.filled

    def __len__(self) -> int:
        return len(self._requests)

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int] | int | None = None,
        caches: Sequence[list[Any] | None] | None = None,
        all_tokens: Sequence[Sequence[int] | None] | None = None,
        samplers: Sequence[Sampler | None] | None = None,
        logits_processors: Sequence[Sequence[LogitsProcessor] | None] | None = None,
        stop_sequences: Sequence[Stops | None] | None = None,
        draft: Sequence[bool] | None = None,
    ) -> list[int]:
        """Queue ``prompts`` (token ids); return their uids. Nothing is sent: the next ticks prefill them.

        The arguments are mlx-lm's ``BatchGenerator.insert``'s, in its order. ``max_tokens`` is one int for all or one
        per prompt (default: the generator's); ``samplers`` one per prompt (``None`` entries: the default). ``caches``
        reuses prefixes per request: ``caches[i]`` is ``None`` or a per-layer list of mlx-lm caches of this rank's local
        layers (``make_prompt_cache(model)`` on the sharded model) that already holds a prefix of request ``i``;
        ``prompts[i]`` is then only the tokens not yet in it (at least one). The generator takes the cache over; every
        rank must pass caches holding the same number of positions. Tokens then equal a solo run of the whole prompt.

        ``logits_processors`` is one list per prompt, as in mlx-lm's ``BatchGenerator`` (default: the generator's for
        every prompt; a ``None`` or empty entry: none for that prompt). A processor is called as mlx-lm's
        ``generate_step`` calls it, on every rank, with the request's tokens so far (``all_tokens[i]``, then the
        prompt, then the tokens generated before this one) and its ``[1, vocabulary]`` logits. ``all_tokens[i]`` names
        the tokens a reused cache holds (seen by the processors, and handed back with the cache; default none).
        ``stop_sequences`` is one entry per prompt: mlx-lm's ``StopSequences``, or token ids and sequences of them as
        the generator's ``stop_tokens`` takes (``None``: the generator's); they replace the generator's for that
        request. Raises ``ValueError`` for a bad request (an empty prompt, a bad count, a cache that does not fit the
        model, or one that could never fit the memory budget), on every rank alike, before anything changes.

        ``draft`` (pipemlx's, as ``pipemlx serve``'s requests' ``"draft"``): one bool per prompt, whether the request
        may guess when the generator was made with ``prompt_lookup`` or ``draft_model`` (default: every request may).
        """
        options = Options(max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences)
        return self._insert([[p] for p in prompts], False, options, draft)

    def insert_segments(
        self,
        segments: Sequence[Sequence[Sequence[int]]],
        max_tokens: Sequence[int] | int | None = None,
        caches: Sequence[list[Any] | None] | None = None,
        all_tokens: Sequence[Sequence[int] | None] | None = None,
        samplers: Sequence[Sampler | None] | None = None,
        logits_processors: Sequence[Sequence[LogitsProcessor] | None] | None = None,
        stop_sequences: Sequence[Stops | None] | None = None,
        draft: Sequence[bool] | None = None,
    ) -> list[int]:
        """Queue prompts given as segments (mlx-lm's ``insert_segments``); return their uids.

        ``segments[i]`` is request ``i``'s prompt cut into segments (empty ones are skipped); the other arguments are
        :meth:`insert`'s. A request's tokens are those of :meth:`insert` of its segments joined, and, as in mlx-lm, no
        prefill chunk crosses a segment boundary. A request whose every segment is empty raises ``ValueError``, as
        mlx-lm's does, before anything changes.
        """
        options = Options(max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences)
        return self._insert(segments, True, options, draft)

    def _insert(
        self,
        segments: Sequence[Sequence[Sequence[int]]],
        segmented: bool,
        options: Options,
        draft: Sequence[bool] | None = None,
    ) -> list[int]:
        """Check requests and queue them: the next ticks prefill them."""
        drafts = [True] * len(segments) if draft is None else list(draft)
        if len(drafts) != len(segments) or not all(isinstance(d, bool) for d in drafts):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"draft must be one bool per prompt ({len(segments)}), got {draft!r}")
        requests = checked_requests(self, self._next_uid, self._fresh_bound, segments, segmented, options)
        if self._speculation is not None:
            for request, guessing in zip(requests, drafts):
                if guessing:
                    self._speculation.enrol(request.uid)
        self._next_uid += len(requests)
        self._requests.update((r.uid, r) for r in requests)
        self._plan = enqueue(self._plan, [r.queued for r in requests])
        return [r.uid for r in requests]

    def remove(
        self, uids: Iterable[int], return_prompt_caches: bool = False
    ) -> dict[int, tuple[list[Any] | None, list[int]]]:
        """Drop requests, queued (even partly prefilled) or active; unknown uids are ignored.

        Takes effect before the next tick: a dropped request's caches are freed and its row is left out of every later
        step's results. With ``return_prompt_caches`` (as mlx-lm's ``BatchGenerator``), returns ``{uid: (cache,
        tokens)}`` per dropped request: this rank's per-layer caches of it and the tokens they hold, as
        :meth:`extract_cache` gives them, except that a queued request's holds the prompt positions every rank
        prefilled (:meth:`prefilled`), or is ``None`` when a part only some ranks prefilled cannot be cut off
        (recurrent layers); one not started yet gets back the cache it was inserted with (a new empty one if none).
        Otherwise ``{}``.
        """
        gone = {u for u in uids if u in self._requests}
        if not gone:
            return {}
        handed_back = {u: self._handed_back(self._requests[u]) for u in sorted(gone)} if return_prompt_caches else {}
        self._plan = drop(self._plan, gone)
        self._runner.drop(gone)
        for uid in gone:
            self._requests.pop(uid).done = True
        if self._speculation is not None:
            self._speculation.forget(gone)
        for group in self._idle_groups():
            self._groups[group].compact_if_worth_it()
        return handed_back

    def extract_cache(self, uids: Iterable[int]) -> dict[int, tuple[list[Any] | None, list[int]]]:
        """``{uid: (cache, tokens)}`` of requests that stay in the generator (as mlx-lm's ``extract_cache``).

        An active request's cache is a copy of its batch row and ``tokens`` what it holds (``all_tokens``, the prompt,
        every token returned so far, as mlx-lm's); a queued request's prefill is under way, so its cache is ``None`` (``tokens``:
        ``all_tokens`` and the prompt positions every rank prefilled). Unknown uids are left out. Nothing is sent.
        """
        found: dict[int, tuple[list[Any] | None, list[int]]] = {}
        for uid in uids:
            request = self._requests.get(uid)
            if request is None:
                continue
            place = self._row_of(request)
            found[uid] = (None, request.prefilled_tokens) if place is None else (self._extract(*place), request.held)
        evaluate([c for cache, _ in found.values() if cache is not None for c in cache], self.stage.compute_stream)
        return found

    def _extract(self, group: int, row: int) -> list[Any] | None:
        """A copy of a row's caches holding what every rank agreed on: a group's step under way is cut off where
        this rank has built it (``None`` when a cache cannot be cut back: a full rotating window)."""
        cache = self._groups[group].extract(row)
        position = self._group_state.position(group)
        if position is not None and self.stage.rank <= position:  # this rank built the step under way
            if not trim_to(cache, cache_offset(cache) - 1):
                return None
        return cache

    def _row_of(self, request: BatchRequest) -> tuple[int, int] | None:
        """The group and row of an active request (``None``: not in the batch)."""
        for group, rows in self._groups.items():
            row = rows.row_of(request)
            if row is not None:
                return group, row
        return None

    def _idle_groups(self) -> list[int]:
        """The groups no rank has a step of under way: their rows and caches may change between ticks."""
        return [SERIAL] if self._group_state.serial else [g for g in self._group_state.idle if g in self._groups]

    def _has_rows(self) -> bool:
        return any(len(rows) for rows in self._groups.values())

    def _busy(self) -> bool:
        """Whether a tick has work: rows in the batch, a step under way, a prompt to prefill or a request to join."""
        return self._has_rows() or self._group_state.in_flight() or not self._plan.idle()

    def _handed_back(self, request: BatchRequest) -> tuple[list[Any] | None, list[int]]:
        """A request's caches and the tokens they hold, for :meth:`remove` (before it forgets the request)."""
        if self._row_of(request) is not None:
            return self.extract_cache([request.uid])[request.uid]
        tokens, cache = request.prefilled_tokens, request.cache
        if cache is None:
            return self._new_cache(), tokens
        # Chunks still travelling the ranks are in some ranks' caches only: cut them off, or give nothing back.
        ahead = any(c is not None and c.uid == request.uid for c in self._plan.inflight)
        if ahead and (request.prefix == UNCOUNTED or not trim_to(cache, request.prefix + request.filled)):
            return None, tokens
        evaluate(cache, self.stage.compute_stream)
        return cache, tokens

    def next(self) -> list[Response]:
        """Run one tick: a decode step of every active request and one prefill chunk per rank.

        Returns a :class:`Response` per active request whose token the last tick decided and this one feeds (as
        mlx-lm's ``BatchGenerator`` returns a token in the step that feeds it: a request's first tick returns nothing
        for it, and its closing tick feeds its last token, calls its processors and sampler once more, and hands back
        its caches), and an ``"error"`` response per request that failed in the tick; the same on every rank. ``[]`` when nothing is active (with nothing at all to do, nothing
        is sent). mlx-lm's ``next`` returns these second, after prompt progress: :meth:`next_generated` is mlx-lm's.
        """
        self.stage.settle(self.timeout)
        if not self._busy():
            return []
        started = time.perf_counter()
        if self._speculation is not None:
            self._speculation.ended.clear()
        tick, after = self._plan_tick()
        dead = any(rows.dead for rows in self._groups.values())
        if dead and self._limits is not None and self._plan.queue and tick.chunks[0] is None:
            for group in self._idle_groups():  # the dead rows may hold back a queued request: free them, plan again
                self._groups[group].compact()
            tick, after = self._plan_tick()
        live = {g: len(rows.active) for g, rows in self._groups.items()}
        want = self._want_groups(sum(live.values()) + len(tick.joins), tick.index)
        groups, groups_after = plan_groups(self._group_state, live, len(tick.joins), self._group_rule, tick.index, want)
        self._group_switches[0] += bool(groups.split)
        self._group_switches[1] += groups.merge
        self._regroup(groups, tick.joins)
        in_flight = self._group_state.in_flight()
        if not self._has_rows() and not in_flight and all(c is None for c in tick.chunks):
            self._plan, self._group_state = after, groups_after
            return []
        work = self._work(tick, groups)
        self._logprobs = self._ahead_logprobs = None
        sampled_before, self._unsampled = self._sampled, self._sampled if self._runner.sample_failed else frozenset()
        work.last_tick_us = self._last_tick_us
        timed, self._timed = self._timed, None
        outcome = self._runner.run(work)
        self._time_groups(outcome, self._steady_tick(tick, groups, live, work))
        if self._speculation is not None and timed is not None and outcome.last_tick_us > 0:  # the ranks' mean
            self._speculation.costs.observe(timed, outcome.last_tick_us / 1e6)
        self._sampled = frozenset(r.uid for r in self._finishing.active) if work.processing else frozenset()
        if outcome.failed_sample:
            outcome = replace(outcome, failed_uids=outcome.failed_uids | sampled_before)
        self._plan, self._group_state = after, groups_after
        done = tick.chunks[-1]
        if done is not None and done.uid in self._requests:
            self._requests[done.uid].filled = done.stop
        if self._guesses:
            responses, inputs = self._guessed_responses(outcome, work.width)
        else:
            responses, inputs = self._responses(outcome), outcome.tokens
        if groups.finishing is not None:
            self._finishing.fed(inputs)
        self.remove({r.uid for r in responses if r.finish_reason is not None})
        generated = sum(1 for r in responses if r.finish_reason != "error")
        seconds = time.perf_counter() - started
        self._counters.count(0 if done is None else done.length, generated, seconds)
        self._last_tick_us = min(int(seconds * 1e6), FINGERPRINT_MODULUS - 1)
        speculation = self._speculation
        if speculation is not None and groups.serial and work.rows and all(c is None for c in tick.chunks):
            if not speculation.caught_up:  # (drafts reading a backlog, guesses or not: not a step's cost)
                self._timed = work.width  # a plain decode step's width: its time comes in the next tick's header
        return responses

    def _want_groups(self, rows: int, index: int) -> bool:
        """``decode_groups="auto"``: whether ``rows`` live rows should decode as groups in tick ``index``, from the
        steady ticks measured so far (:class:`~pipemlx.schedule.batch_plan.GroupTimings`): alike on every rank."""
        rule = self._group_rule
        if rule is None or not rule.measured or rows < rule.enter:
            return True
        return self._timings.want(rows, not self._group_state.serial, index)

    def _steady_tick(
        self, tick: Tick, groups: GroupTick, live: dict[int, int], work: TickWork
    ) -> tuple[bool, int, int, int] | None:
        """``(groups, live rows, tokens, index)`` of a tick whose time measures a way of decoding (no prefill, join,
        split, merge or guesses; groups: one on every rank), for :class:`GroupTimings`; ``None`` otherwise."""
        rule = self._group_rule
        if groups.split or groups.merge or tick.joins:
            self._settled = 0
        if rule is None or not rule.measured or work.width != 1 or tick.joins or any(tick.chunks):
            return None
        if self._speculation is not None and self._speculation.caught_up:  # drafts read a backlog in this tick
            return None
        if groups.split or groups.merge or groups.dropped or groups.formed:
            return None
        rows = sum(live.values())
        grouped = not groups.serial
        tokens = live.get(cast(int, groups.finishing), 0) if grouped else rows
        if not tokens or (grouped and any(g is None for g in groups.decode)):
            return None
        self._settled += 1
        if self._settled <= AUTO_SETTLE:
            return None
        return grouped, rows, tokens, tick.index

    def _time_groups(self, outcome: TickOutcome, steady: tuple[bool, int, int, int] | None) -> None:
        """Record the last tick, if steady, at the ranks' mean time of it (this tick's all-gather brought it)."""
        last, self._steady = self._steady, steady
        if last is None or outcome.last_tick_us <= 0 or outcome.failed_groups or outcome.failed_uids:
            return
        grouped, rows, tokens, index = last
        self._timings.record(grouped, rows, index, outcome.last_tick_us / 1e6 / tokens)

    def _regroup(self, groups: GroupTick, joins: tuple[int, ...]) -> None:
        """Carry out the tick's changes to the groups (:class:`~pipemlx.schedule.batch_plan.GroupTick`), in its
        order: dropped groups, the merge, the joins, the split. Only idle groups change: no step of theirs is under
        way on any rank."""
        stream = self.stage.compute_stream
        for group in groups.dropped:
            del self._groups[group]
        if groups.merge:
            serial = Rows(stream)
            serial.absorb([self._groups[g] for g in sorted(self._groups)])
            self._groups = {SERIAL: serial}
        if joins:
            target = cast(int, groups.joins_into)
            if groups.formed:
                self._groups[target] = Rows(stream)
            self._join(joins, self._groups[target])
        elif groups.decode[0] is not None and not groups.serial and not groups.split:
            self._groups[groups.decode[0]].compact_if_worth_it()  # (a split's groups are made below, fresh)
        if groups.split:
            parts = self._groups[SERIAL].split(len(groups.split))
            self._groups = dict(zip(groups.split, parts))
        self._finishing = self._groups[groups.finishing] if groups.finishing is not None else Rows(stream)

    def _work(self, tick: Tick, groups: GroupTick) -> TickWork:
        """This rank's inputs for the tick: the serial batch's step, or the groups' (their rows on this rank)."""
        self._guesses = []
        finishing = self._finishing.requests
        all_rows = list(self._groups.items())
        work = TickWork(
            tick=tick,
            rows=len(finishing),
            inputs=self._finishing.inputs,
            batch_cache=self._finishing.caches,
            uids_fingerprint=fingerprint(p for g, rows in all_rows for p in (g + 1, rows.uids_fingerprint())),
            prefixes_fingerprint=self._prefixes_fingerprint(),
            chunk_tokens=self._chunk_tokens,
            chunk_cache=self._chunk_cache,
            sample=self._sample,
            greedy=self.stage.info.vocab_shard is not None and all_greedy(finishing, self.sampler),
            processing=self.stage.world_size > 1
            and bool(finishing)
            and (self.share_logprobs or not all_greedy(finishing, self.sampler)),
            logprobs=self.logprobs,
            plan=fingerprint([tick.fingerprint(), groups.fingerprint()]),
        )
        if groups.serial:
            self._guess(work)
            return work
        work.groups = groups
        work.jobs = {
            g: DecodeJob(g, self._groups[g].inputs, self._groups[g].caches) for g in groups.decode if g is not None
        }
        first = groups.decode[0]
        work.inputs = [] if first is None else self._groups[first].inputs
        return work

    def _prefixes_fingerprint(self) -> int:
        """Of every group's rows' reused prefix lengths; ``UNCOUNTED`` when this rank cannot count one."""
        parts = [rows.prefixes_fingerprint() for rows in self._groups.values()]
        return UNCOUNTED if UNCOUNTED in parts else fingerprint(parts)

    def next_generated(self) -> list[Response]:
        """Run ticks until one decodes (as mlx-lm's ``next_generated``): its responses, or ``[]`` with nothing to do."""
        while True:
            responses = self.next()
            if responses or not self._busy():
                return responses

    def stats(self) -> AbstractContextManager[BatchStats]:
        """The work done while the block runs, as mlx-lm's ``BatchGenerator.stats()`` reports it.

        Yields mlx-lm's ``BatchStats``, filled in on leaving the block: ``prompt_tokens`` counts prompt positions every
        rank prefilled (a reused prefix is not counted), ``generation_tokens`` the tokens returned and
        ``generation_steps`` the ticks that returned any. A tick computes a decode step and prefill chunks at once: its
        time counts as ``decode_time`` when it returned tokens, else as ``prompt_time``. ``peak_memory`` is this
        process's (GB).
        """
        return self._counters.stats()

    @property
    def prompt_cache_nbytes(self) -> int:
        """Bytes of KV cache this rank holds: the batch caches (dead rows included) and the queued prompts'."""
        batches = [c for rows in self._groups.values() for c in rows.caches]
        held = [*batches, *(c for r in self._requests.values() if r.cache is not None for c in r.cache)]
        return sum(int(c.nbytes) for c in held)

    def close(self) -> None:
        """Drop every request (as :meth:`remove` does) and free the batch caches; nothing is sent.

        Call it on every rank alike. The generator stays usable: later requests start from an empty batch.
        """
        self.remove(list(self._requests))
        for group in self._idle_groups():  # a group's step under way goes on (its rows dead) and drains
            self._groups[group].compact()

    def _new_cache(self) -> list[Any]:
        """A new request's per-layer caches: ``make_prompt_cache(model, max_kv_size)``, as mlx-lm's makes them."""
        return self.stage.new_cache(self.model, self.max_kv_size)

    def _plan_tick(self) -> tuple[Tick, TickState]:
        # Dead rows keep their reservation until compacted: their cache positions are still held.
        return plan_tick(
            self._plan,
            [r.reserve for rows in self._groups.values() for r in rows.requests],
            self.chunk_sizes,
            self.lone_steps,
            self._limits,
            self.prefill_batch_size,
        )

    def _chunk_tokens(self, chunk: TickChunk) -> list[int]:
        return self._requests[chunk.uid].prompt[chunk.start : chunk.stop]

    def _chunk_cache(self, chunk: TickChunk) -> list[Any]:
        """The caches a chunk of a request is prefilled in: its own (the caller's, or new ones), in the form mlx-lm's
        batch prefills in (:func:`~.requests.as_batch_window`: rotating caches keep none of their first positions)."""
        request = self._requests[chunk.uid]
        if request.cache is None:
            request.cache = self._new_cache()
        return as_batch_window(request.cache)

    def _join(self, uids: tuple[int, ...], rows: Rows) -> None:
        """Move requests whose prefill every rank completed into the batch ``rows``, with their caches."""
        joining = [self._requests[u] for u in uids]
        caches = [r.cache if r.cache is not None else self._new_cache() for r in joining]
        for r in joining:
            r.cache = None
            r.filled = len(r.prompt) - 1
        rows.join(joining, caches)

    def _sample(self, logits: mx.array) -> mx.array:
        """Every row's token (:func:`.sample.sample`), keeping the log-probabilities for the responses."""
        tokens, self._logprobs = sample(logits, self._finishing.requests, self.sampler, self._unsampled)
        return tokens

    def _check_speculable(self, fresh: list[Any], speculation: BatchSpeculation) -> None:
        """Raise ``ValueError`` on every rank unless every rank's caches can be cut back per row and every rank
        holds the same draft model, if any (one all-gather)."""
        stage = self.stage
        drafts = speculation.drafts
        what = "prompt_lookup" if drafts is None else "draft_model"
        draft = 0 if drafts is None else draft_fingerprint(drafts.model)
        flags = [int(speculable(fresh)), draft]
        rows = [flags]
        if stage.world_size > 1:
            with mx.stream(stage.compute_stream):
                gathered = mx.distributed.all_gather(mx.array(flags, dtype=mx.int32), group=stage.group)
            wait_for(gathered, self.timeout, lambda: f"{stage.describe()} agreeing on {what}'s caches")
            rows = cast(list[list[int]], mx.reshape(gathered, (-1, 2)).tolist())
        unable = [r for r, (ok, _) in enumerate(rows) if not ok]
        if unable:
            raise ValueError(
                f"{what} needs plain KV caches on every rank (cut back per row after a step with guesses); "
                f"rank(s) {unable} hold rotating (max_kv_size), quantized or recurrent layer caches: leave "
                f"{what} out"
            )
        drafts = [d for _, d in rows]
        if len(set(drafts)) > 1:
            raise ValueError(
                f"draft_model differs between ranks (fingerprints {drafts}): every rank must pass the same whole "
                "draft model, whose guesses every rank draws alike"
            )

    def _guess(self, work: TickWork) -> None:
        """The serial batch's guesses for the tick (:mod:`.speculate`), from the rows' tokens every rank holds:
        the step then feeds each row's next token, its guesses and padding, and the guesses join the plan's
        fingerprint (ranks that guessed differently fail the tick's agreement)."""
        self._guesses = []
        speculation = self._speculation
        if speculation is None or not work.rows:
            return
        guesses = speculation.plan(self._finishing.requests, self.sampler)
        if not any(guesses):
            return
        work.fed, work.width = padded_inputs(work.inputs, guesses)
        work.sample_ahead = self._sample_ahead
        counts = [len(g) for g in guesses]
        work.plan = fingerprint([0 if work.plan is None else work.plan, *counts, *(t for g in guesses for t in g)])
        self._guesses = guesses

    def _sample_ahead(self, logits: mx.array) -> mx.array:
        """The guessed positions' tokens (``[rows, width - 1]``, greedy: only greedy rows guess), keeping their
        log-probabilities for the responses."""
        self._ahead_logprobs = log_probabilities(logits)
        return greedy(logits)

    def _logprob(self, row: int, position: int) -> mx.array | None:
        """A row's log-probabilities at a position of the tick's step, where this rank holds them."""
        if not self.logprobs:
            return None
        if position == 0:
            return None if self._logprobs is None else self._logprobs[row]
        return None if self._ahead_logprobs is None else self._ahead_logprobs[row, position - 1]

    def _guessed_responses(self, outcome: TickOutcome, width: int) -> tuple[list[Response], list[int]]:
        """:meth:`_responses` of a step with guesses, and each row's next input.

        Each live row keeps the tokens its pass yields (:func:`.speculate.emitted`, up to its stop: its own
        :meth:`BatchRequest.take` decides, as without guesses); they are returned in the next tick, which feeds the
        last of them. Every rank then cuts each row's batch caches back to the positions it kept
        (:func:`.speculate.cut_rows`) before a finished row's caches are handed back.
        """
        speculation = cast(BatchSpeculation, self._speculation)
        failed: set[int] = set(outcome.failed_uids)
        for group in outcome.failed_groups:
            if group in self._groups:
                failed.update(r.uid for r in self._groups[group].active)
        rows = self._finishing.requests
        kept = [1] * len(rows)  # positions of this step each row keeps
        fed: list[tuple[Decided | None, list[Decided]] | None] = []
        for i, request in enumerate(rows):
            if request.done or request.uid in failed:
                fed.append(None)
                continue
            fed.append((request.decided, request.ahead))
            request.ahead = []
            if request.decided is None or request.decided.reason is None:  # the request goes on
                guesses = self._guesses[i]
                samples = [outcome.tokens[i], *outcome.ahead[i * (width - 1) : (i + 1) * (width - 1)]]
                tokens = emitted(guesses, samples)
                speculation.record(request.uid, len(guesses), len(tokens) - 1)
                decided: list[Decided] = []
                for position, token in enumerate(tokens):
                    reason = request.take(token)
                    decided.append(Decided(token, self._logprob(i, position), reason))
                    if reason is not None:
                        break
                kept[i] = len(decided)
                request.ahead, request.decided = decided[:-1], decided[-1]
            else:
                request.decided = None
        with mx.stream(self.stage.compute_stream):
            cut_rows(self._finishing.caches, [width - k for k in kept])
        # Local work, evaluated now: its cost counts in this tick's seconds, which "auto" weighs (StepCosts).
        evaluate(self._finishing.caches, self.stage.compute_stream)
        responses: list[Response] = []
        extracted: list[list[Any]] = []
        for i, (request, entry) in enumerate(zip(rows, fed)):
            if entry is None:
                continue
            last, ahead = entry
            responses.extend(Response(request.uid, d.token, logprobs=d.logprobs) for d in ahead)
            if last is not None:  # (None: its first tick, it fed the prompt's last token)
                responses.append(self._fed_response(i, request, last, extracted))
        responses.extend(Response(uid, -1, finish_reason="error") for uid in sorted(failed) if uid in self._requests)
        self._finishing.settle(extracted)
        return responses, [0 if r.decided is None else r.decided.token for r in rows]

    def _responses(self, outcome: TickOutcome) -> list[Response]:
        """The tick's responses, as mlx-lm's ``BatchGenerator`` gives them: each live row's token decided in the
        last tick (this tick fed it), a finished request's caches taken out of the batch after its closing tick fed
        its last token; then an ``"error"`` response per failed request.

        A row's token decided in this tick is kept (:attr:`BatchRequest.decided`) for the next tick, which feeds it
        and returns it. A row in its closing tick (its last token decided) runs its processors and sampler once more,
        as mlx-lm's step after a request's last token does, and its new token is dropped.
        """
        failed: set[int] = set(outcome.failed_uids)
        for group in outcome.failed_groups:
            if group in self._groups:
                failed.update(r.uid for r in self._groups[group].active)
        responses: list[Response] = []
        extracted: list[list[Any]] = []
        for i, request in enumerate(self._finishing.requests):
            if request.done or request.uid in failed:
                continue
            fed, request.decided = request.decided, None
            ahead, request.ahead = request.ahead, []  # a step with guesses before: its confirmed guesses come first
            responses.extend(Response(request.uid, d.token, logprobs=d.logprobs) for d in ahead)
            if fed is None or fed.reason is None:  # the request goes on: this tick's token is returned next tick
                token = outcome.tokens[i]
                reason = request.take(token)
                logprobs = None if self._logprobs is None or not self.logprobs else self._logprobs[i]
                request.decided = Decided(token, logprobs, reason)
            if fed is not None:  # (None: its first tick, it fed the prompt's last token)
                responses.append(self._fed_response(i, request, fed, extracted))
        responses.extend(Response(uid, -1, finish_reason="error") for uid in sorted(failed) if uid in self._requests)
        self._finishing.settle(extracted)
        return responses

    def _fed_response(self, row: int, request: BatchRequest, fed: Decided, extracted: list[list[Any]]) -> Response:
        """The response for the token row ``row`` fed in this tick; a request it finishes has its caches taken out
        of the batch (added to ``extracted``, settled once the tick's responses are made)."""
        cache = None if fed.reason is None else self._finishing.extract(row)
        if cache is not None:
            extracted.append(cache)
        all_tokens = None if fed.reason is None else request.fed
        return Response(
            request.uid,
            fed.token,
            logprobs=fed.logprobs,
            finish_reason=fed.reason,
            prompt_cache=cache,
            all_tokens=all_tokens,
        )


# inspect.signature(BatchGenerator) reads __new__ (model, **kwargs) first: name __init__'s parameters instead.
setattr(  # noqa: B010
    BatchGenerator,
    "__signature__",
    inspect.signature(BatchGenerator.__init__).replace(
        parameters=list(inspect.signature(BatchGenerator.__init__).parameters.values())[1:]
    ),
)
