"""pipeline_prefill: carry out the prefill plan on a sharded model."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import RotatingKVCache  # pyright: ignore[reportUnknownVariableType]

from ..errors import PeerLostError, PipelineError, PipelineTimeoutError, PrefillCancelled, renamed
from ..observe.trace import Tracer, tracer_for
from ..schedule.autostep import DEFAULT_MAX_CHUNK_SECONDS, AutoRequest, choose_chunks
from ..schedule.costmodel import CostModel
from ..schedule.plan import (
    Agree,
    Compute,
    Handshake,
    PrefillPlan,
    Progress,
    Recv,
    Send,
    build_plan,
    check_prefill_args,
    default_agreement_spacing,
)
from .agreement import agree_on_step, agreed_offset, handshake
from .caches import cache_parts, cache_state, cannot_quantize, counted_offset, trim_to
from .calibrate import (
    agreed_prior_figures,
    held_calibration,
    must_calibrate,
    prior_cost_model,
    prior_figures,
    refine,
)
from .calibration_cache import fingerprint
from .failure import stand_in
from .protocol import Status, Table
from .send_mode import send_mode
from .stage import PipelineStage, stage_of
from .waits import wait_for

ProgressCallback = Callable[[int, int], Any]
CancelCheck = Callable[[], bool]
DEFAULT_QUANTIZED_KV_START = 5000
MLX_LM_PREFILL_STEP = 2048
"""mlx-lm's ``generate_step`` default ``prefill_step_size``: ``"auto"``'s chunks where the chunks decide the tokens
(:func:`chunks_decide_attention`)."""


@renamed(step_size="prefill_step_size", progress_callback="prompt_progress_callback")
def pipeline_prefill(
    model: nn.Module,
    prompt: mx.array,
    cache: list[Any],
    *,
    prefill_step_size: int | Literal["auto"] = "auto",
    prompt_progress_callback: ProgressCallback | None = None,
    should_cancel: CancelCheck | None = None,
    timeout: float | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    trace_dir: str | os.PathLike[str] | None = None,
    agree_every: int | None = None,
    max_chunk_seconds: float = DEFAULT_MAX_CHUNK_SECONDS,
) -> int:
    """Fill ``cache`` with ``prompt[:-1]``, the ranks working on different chunks at once.

    Call it on every rank with the same ``prompt`` (a 1-D integer array of M
    tokens) and ``prefill_step_size``. The prompt minus its last token is processed in
    chunks (``"auto"``, the default: the ranks choose them, see below; an int: chunks of that many tokens,
    exactly as mlx-lm's ``generate_step`` does with the same ``prefill_step_size``); afterwards every rank's cache holds
    M-1 positions and decoding continues from ``prompt[-1:]`` (for instance
    ``generate_step(prompt[-1:], model, prompt_cache=cache)``), giving the tokens
    one process holding the whole model would give. ``kv_bits``,
    ``kv_group_size`` and ``quantized_kv_start`` quantize the cache as
    ``generate_step`` does; pass the same values to it when decoding.
    ``kv_bits`` is refused (``ValueError``, on every rank, before anything is
    sent) on a model with layers whose caches mlx-lm cannot quantize (a
    ``RotatingKVCache``: sliding-window layers), whatever the prompt's length:
    the rule does not depend on whether a cache would reach ``quantized_kv_start``.
    A ``cache`` holding rotating caches the model does not make is refused at
    the handshake: the ranks holding one raise that ``ValueError``, the others
    :class:`PrefillCancelled`.

    ``prompt_progress_callback(processed, M)`` is called on every rank with the same
    sequence ``generate_step`` reports before its first token: ``(0, M)``, then
    ``(processed, M)`` as each chunk leaves the last rank, ending at ``(M-1, M)``.
    No logits are computed. It returns once every rank has done its part,
    with the step size it used.

    ``should_cancel()`` is polled on every rank at every agreement point; when
    it returns true on any rank, all ranks stop at that point and raise
    :class:`PrefillCancelled`. An error raised by ``prompt_progress_callback`` on one
    rank stops all ranks the same way at the next agreement point: that rank
    re-raises its error, the others raise :class:`PrefillCancelled`. Either way
    no send is left queued and every rank's cache is trimmed to the positions
    all ranks completed (``error.processed``, the last progress reported) when
    its caches can be trimmed; otherwise ``error.cache_trimmed`` is false and
    the cache must be discarded.

    ``prefill_step_size="auto"`` takes mlx-lm's ``generate_step`` default (2048) where ``cache`` holds a rotating
    cache that keeps its first positions (``max_kv_size`` makes them) and the prompt would fill it past its size:
    the chunks then decide which positions each one attends to (:func:`chunks_decide_attention`), so only
    mlx-lm's chunks give mlx-lm's tokens. Otherwise ``"auto"`` (the default) lets the ranks cut the prompt together, with nothing timed
    before it: the first such call on a sharded model plans with what an earlier run measured (the
    calibration cache, :mod:`pipemlx.runtime.calibration_cache`: keyed by the model, the split and the
    machines; every rank must hold the same figures), else with the prior (the cache's figures for any model
    with the same layer shapes, else the arithmetic of the layers' shapes), and times the chunks it runs
    anyway: after it, one small all-gather turns them into measured costs for the next calls and runs
    (:func:`pipemlx.runtime.calibrate.refine`). Every call takes the cut the cost model predicts to be
    fastest for M tokens: chunks of one size, or of one size with smaller
    chunks at both ends where the pipeline fills and drains, never a chunk
    predicted to take longer than ``max_chunk_seconds`` on any rank (see
    :mod:`pipemlx.schedule.autostep`). The progress sequence is then ``(0, M)``,
    the end of each chunk as it leaves the last rank (strictly increasing),
    ending at ``(M-1, M)``; the call returns the largest chunk.

    ``timeout`` bounds every blocking wait (seconds); it defaults to the one
    given to :func:`pipemlx.shard_model`. ``agree_every`` spaces the agreement
    points (steps between two; default: about 8 per prefill): between them the
    ranks run free, and cancellations, errors and progress reports are acted on
    at the next one. ``trace_dir`` (or ``$PIPEMLX_TRACE``)
    records a Chrome trace per rank. Raises ``TypeError``/``ValueError`` for
    bad arguments before anything is sent, :class:`PipelineMismatchError` when
    the ranks disagree, :class:`PipelineTimeoutError` / :class:`PeerLostError`
    when a wait fails.
    """
    return prefill_before_decode(
        model,
        prompt,
        cache,
        PrefillOptions(
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=prompt_progress_callback,
            should_cancel=should_cancel,
            timeout=timeout,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
            trace_dir=trace_dir,
            agree_every=agree_every,
            max_chunk_seconds=max_chunk_seconds,
        ),
    )


@dataclass(frozen=True)
class PrefillOptions:
    """:func:`pipeline_prefill`'s keyword arguments, and ``decode_settings``: what the decode after it exchanges.

    ``decode_settings`` indexes :data:`~pipemlx.runtime.protocol.DECODE_SETTINGS` (0: no decode follows): the
    handshake compares it, so ranks whose decodes would exchange messages of different sizes raise
    :class:`PipelineMismatchError` there rather than wait out their timeout in the first decode step.
    """

    prefill_step_size: int | Literal["auto"]
    prompt_progress_callback: ProgressCallback | None
    should_cancel: CancelCheck | None
    timeout: float | None
    kv_bits: int | None
    kv_group_size: int
    quantized_kv_start: int
    trace_dir: str | os.PathLike[str] | None = None
    agree_every: int | None = None
    max_chunk_seconds: float = DEFAULT_MAX_CHUNK_SECONDS
    decode_settings: int = 0
    speculation: int = 0  # the decode's proposer's fingerprint (0: it does not speculate): the handshake compares it


def prefill_before_decode(model: nn.Module, prompt: mx.array, cache: list[Any], options: PrefillOptions) -> int:
    """:func:`pipeline_prefill` with its arguments as one value; the handshake also compares ``decode_settings``."""
    stage = stage_of(model)
    stage.check_usable()
    tokens = check_prompt(prompt)
    step_size, kv_bits, kv_group_size = options.prefill_step_size, options.kv_bits, options.kv_group_size
    if isinstance(step_size, str) and step_size != "auto":
        raise ValueError(f"prefill_step_size must be a positive int or 'auto', got {step_size!r}")
    check_prefill_args(tokens.size, 1 if step_size == "auto" else step_size, stage.world_size)
    check_timeout(options.timeout)
    check_kv_quantization(kv_bits, kv_group_size, stage.info.kv_dims)
    check_rotating_caches(kv_bits, stage.info.unquantizable, stage.info.total_layers)
    if isinstance(cache, list) and cache and stage.info.pair_caches is not None:  # pyright: ignore[reportUnnecessaryIsInstance]
        stage.info.pair_caches(cache)  # caches the caller made itself, on the rank that borrows heads
    if not isinstance(cache, list) or len(cache) != len(stage.info.layers):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(
            f"cache must be a list with one entry per local layer ({len(stage.info.layers)} on "
            f"{stage.describe()}); make it with mlx_lm.models.cache.make_prompt_cache(model) after sharding"
        )
    # A cache list made otherwise may hold rotating caches on some ranks only: refused at the handshake.
    refused = _refuse_rotating_cache(kv_bits, cache, stage)
    timeout = options.timeout or stage.info.timeout
    stage.settle(timeout)
    mx.eval(tokens, cache_state(cache))  # pyright: ignore[reportUnknownMemberType]
    prefix = counted_offset(cache)  # UNCOUNTED on a rank of recurrent layers only: the handshake tells it
    if step_size == "auto" and chunks_decide_attention(cache, tokens.size):
        step_size = MLX_LM_PREFILL_STEP  # mlx-lm's chunks; ranks whose caches differ name it at the handshake
    prior: CostModel | None = None
    try:
        lengths, prior = (
            _agree_on_auto_chunks(model, stage, tokens.size, timeout, prefix, options)
            if step_size == "auto"
            else (None, None)
        )
    except (PipelineTimeoutError, PeerLostError) as exc:
        stage.mark_broken(exc)
        raise
    step = max(lengths, default=1) if lengths is not None else cast(int, step_size)
    spacing = options.agree_every
    if spacing is None:
        spacing = default_agreement_spacing(tokens.size, step, stage.world_size, lengths)
    plan = build_plan(tokens.size, step, stage.world_size, stage.rank, spacing, lengths)
    tracer = tracer_for(stage.rank, options.trace_dir)
    runner = _PlanRunner(model, stage, plan, tokens, cache, options, timeout, tracer, prefix, deferred=refused)
    stage.observed = [] if prior is not None else None  # the chunks of a prior's plan are timed: see refine
    try:
        with send_mode(model, "queue"), stage.executing_plan():
            runner.run()
        observed, stage.observed = stage.observed, None
        if prior is not None and observed is not None:  # the same on every rank: the prefill ended on all of them
            refine(model, stage, prior, observed, timeout)
    except (PipelineTimeoutError, PeerLostError) as exc:
        stage.mark_broken(exc)
        raise
    finally:
        stage.observed = None
        runner.tracer.save()
    return step


def _agree_on_auto_chunks(
    model: nn.Module,
    stage: PipelineStage,
    num_tokens: int,
    timeout: float | None,
    prefix: int,
    options: PrefillOptions,
) -> tuple[tuple[int, ...], CostModel | None]:
    """Handshake on an auto request and choose the chunks, timing nothing: with the measured cost model every rank
    holds (in memory or in the calibration cache), else with the agreed prior, which is then returned too (the
    prefill times its chunks to refine it)."""
    held = held_calibration(model, stage)
    prior = prior_figures(model, stage.info)
    table = handshake(
        stage,
        AutoRequest(num_tokens),
        Status.OK,
        timeout,
        calibration=held,
        prior=fingerprint(prior),
        cache_offset=prefix,
        decode_settings=options.decode_settings,
        speculation=options.speculation,
    )
    if not must_calibrate(table["calibration"]):
        return choose_chunks(num_tokens, stage.cost_model, options.max_chunk_seconds), None
    costs = prior_cost_model(model, stage, agreed_prior_figures(model, stage.info, prior, table["prior"]))
    return choose_chunks(num_tokens, costs, options.max_chunk_seconds), costs


def check_timeout(timeout: Any) -> None:
    """Raise ``ValueError`` unless ``timeout`` is a positive number of seconds or ``None``."""
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def check_kv_quantization(kv_bits: Any, kv_group_size: Any, dims: Sequence[int] = ()) -> None:
    """Raise ``ValueError`` unless MLX can quantize with ``kv_bits`` and ``kv_group_size`` (``kv_bits=None``: off).

    Checked on a tiny array, and against ``dims`` (the model's cached key/value widths, the same on every rank),
    which ``kv_group_size`` must divide, before anything is sent: every rank raises the same error, rather than
    the first rank to quantize a cache failing mid-prefill.
    """
    if kv_bits is None:
        return
    for name, value in (("kv_bits", kv_bits), ("kv_group_size", kv_group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    try:
        mx.eval(mx.quantize(mx.zeros((1, kv_group_size)), group_size=kv_group_size, bits=kv_bits))  # pyright: ignore[reportUnknownMemberType]
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(
            f"cannot quantize the KV cache with kv_bits={kv_bits!r}, kv_group_size={kv_group_size!r}: {exc}"
        ) from exc
    misfits = [d for d in dims if d % kv_group_size]
    if misfits:
        widths = " and ".join(map(str, dims))
        raise ValueError(
            f"cannot quantize the KV cache with kv_bits={kv_bits!r}, kv_group_size={kv_group_size!r}: "
            f"kv_group_size must divide the model's head dimension ({widths}), and {kv_group_size} does not "
            f"divide {' or '.join(map(str, misfits))}"
        )


def check_rotating_caches(
    kv_bits: Any, layers: Sequence[tuple[int, str]], total_layers: int, max_kv_size: int | None = None
) -> None:
    """Raise ``ValueError`` when ``kv_bits`` is set and ``layers`` (``(layer, cache class)``) is not empty.

    ``layers`` are the whole model's layers whose caches ``kv_bits`` cannot quantize (the same on every rank):
    mlx-lm's ``RotatingKVCache.to_quantized`` raises once such a cache reaches ``quantized_kv_start``, mid-prefill,
    on the ranks holding one. Every rank refuses alike, before anything is sent, however short the prompt: a decode
    grows the cache past any ``quantized_kv_start``.
    """
    if kv_bits is None or not layers:
        return
    kinds = " and ".join(sorted({kind for _, kind in layers}))
    if max_kv_size is not None and len(layers) == total_layers:
        where = f"max_kv_size={max_kv_size} gives every layer a {kinds}"
        fix = "leave kv_bits or max_kv_size unset"
    else:
        numbers = ", ".join(str(i) for i, _ in layers)
        plural = len(layers) > 1
        where = f"layer{'s' if plural else ''} {numbers} of {total_layers} keep{'' if plural else 's'} a {kinds} (a sliding window)"
        fix = "leave kv_bits unset for this model"
    raise _unquantizable(kv_bits, where, kinds, fix)


def chunks_decide_attention(cache: list[Any], num_tokens: int) -> bool:
    """Whether prefilling ``num_tokens - 1`` positions into ``cache`` attends to positions that depend on the chunks:
    some ``RotatingKVCache`` keeps its first positions (``keep > 0``, as ``max_kv_size`` makes them) and the prompt
    would fill it past its ``max_size``.

    Such a cache takes a chunk whole, then drops what it holds beyond ``max_size - 1`` positions before the next one:
    which earlier positions a token attends to (the first ones included or not) then depends on where the chunks
    start, in mlx-lm as in pipemlx, so the tokens are mlx-lm's only with mlx-lm's chunks. A cache that keeps none
    (sliding-window layers, mlx-lm's batch caches) gives each token the ``max_size`` positions up to it whatever the
    chunks, and a prompt that stays within ``max_size`` drops nothing.
    """
    return any(
        isinstance(c, RotatingKVCache)
        and int(getattr(c, "keep", 0)) > 0
        and int(getattr(c, "offset", 0)) + num_tokens - 1 > int(getattr(c, "max_size", 0))
        for c in cache_parts(cache)
    )


def _refuse_rotating_cache(kv_bits: Any, cache: list[Any], stage: PipelineStage) -> ValueError | None:
    """The error for a given cache list that holds caches ``kv_bits`` cannot quantize, to raise at the handshake."""
    local = [(stage.info.layers.start + i, type(c).__name__) for i, c in enumerate(cache) if cannot_quantize(c)]
    if kv_bits is None or not local:
        return None
    kinds = " and ".join(sorted({kind for _, kind in local}))
    numbers = ", ".join(str(i) for i, _ in local)
    where = f"the cache given on {stage.describe()} holds a {kinds} for layer{'s' if len(local) > 1 else ''} {numbers}"
    return _unquantizable(kv_bits, where, kinds, "leave kv_bits unset, or make the cache without max_kv_size")


def _unquantizable(kv_bits: Any, where: str, kinds: str, fix: str) -> ValueError:
    """The refusal of ``kv_bits`` on caches of the classes ``kinds``, found ``where``."""
    return ValueError(
        f"cannot quantize the KV cache with kv_bits={kv_bits!r}: {where}, which mlx-lm cannot quantize either "
        f"({kinds}.to_quantized raises NotImplementedError once the cache reaches quantized_kv_start); {fix}"
    )


def check_prompt(prompt: Any) -> mx.array:
    """``prompt`` if it is a non-empty 1-D integer ``mx.array``; else ``TypeError``/``ValueError`` naming the problem."""
    if not isinstance(prompt, mx.array):
        raise TypeError(f"prompt must be an mx.array of token ids, got {type(prompt).__name__}")
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be 1-D (M tokens), got shape {tuple(prompt.shape)}")
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise TypeError(f"prompt must hold integer token ids, got dtype {prompt.dtype}")
    if prompt.size == 0:
        raise ValueError("the prompt is empty (0 tokens); pipeline_prefill needs at least 1 token")
    return prompt


@dataclass(eq=False)
class _PlanRunner:
    """Executes one rank's :class:`PrefillPlan`, action by action."""

    model: nn.Module
    stage: PipelineStage
    plan: PrefillPlan
    tokens: mx.array
    cache: list[Any]
    options: PrefillOptions
    timeout: float | None
    tracer: Tracer
    prefix: int
    deferred: BaseException | None = None  # an error acted on at the next agreement point
    expected_receives: int = 0
    failed_chunk: int | None = None  # the first chunk the model raised on, on this rank

    def run(self) -> None:
        """Carry out every action; failures of the timeout kind end the run at once, on this rank."""
        for action in self.plan.actions:
            if isinstance(action, Handshake):
                with self.tracer.span("handshake"):
                    table = handshake(
                        self.stage,
                        self.plan,
                        self.status(),
                        self.timeout,
                        cache_offset=self.prefix,
                        decode_settings=self.options.decode_settings,
                        speculation=self.options.speculation,
                    )
                self.prefix = agreed_offset(table)
                self.stop_if_asked(table, step=None)
                self.embed_prompt()
            elif isinstance(action, Send):
                self.send(action)
            elif isinstance(action, Recv):
                self.expected_receives += 1
            elif isinstance(action, Compute):
                self.compute(action)
            elif isinstance(action, Agree):
                self.agree(action)
            else:
                self.progress(action)
        if len(self.stage.send_queue) or self.stage.received:
            raise PipelineError(f"{self.stage.describe()}: the plan ended with sends or receives left over")

    def embed_prompt(self) -> None:
        """``head="split"``: rank 0's embeddings of the prompt, summed from every rank's rows (a collective). After
        the handshake, which checked that every rank holds a prompt of the same length: a rank with another one
        would otherwise join the all-sum with another size and leave the group's connections out of step."""
        shard = self.stage.info.vocab_shard
        if shard is None or not shard.split or self.tokens.size <= 1:
            return
        stage = self.stage
        with mx.stream(stage.compute_stream):
            shard.embed(self.tokens[:-1], stage.group, self.timeout, lambda: f"{stage.describe()} embedding the prompt")

    def status(self) -> Status:
        """This rank's word at an agreement point: failed, cancel, or OK."""
        if self.deferred is not None:
            return Status.CHUNK_FAILED if self.failed_chunk is not None else Status.FAILED
        if self.options.should_cancel is not None:
            try:
                if self.options.should_cancel():
                    return Status.CANCEL
            except Exception as exc:
                self.deferred = exc
                return Status.FAILED
        return Status.OK

    def stop_if_asked(self, table: Table, step: int | None) -> None:
        """When any rank's status is not OK, leave a consistent state and raise, on every rank alike."""
        if table.all_ok:
            return
        processed = 0 if step is None else self.plan.completed_after(step)
        failed_at = [f for f in table.columns.get("failed_chunk", []) if f >= 0]
        if failed_at:  # a chunk the model failed on (and every later one) is in no cache of that rank
            processed = min(processed, self.plan.chunks[min(failed_at)].start)
        self.stage.send_queue.discard()
        trimmed = trim_to(self.cache, self.prefix + processed)
        if self.deferred is not None:
            raise self.deferred
        failed = list(table.ranks_with(Status.FAILED, Status.CHUNK_FAILED))
        asked = list(table.ranks_with(Status.CANCEL))
        where = "the handshake" if step is None else f"the agreement closing step {step}"
        reason = f"rank(s) {failed} raised an error" if failed else f"rank(s) {asked} asked to cancel"
        raise PrefillCancelled(
            f"prefill stopped on {self.stage.describe()} at {where}: {reason}; "
            f"{processed} of {self.plan.num_tokens - 1} prompt positions were processed by every rank"
            + (f" after a reused prefix of {self.prefix}" if self.prefix else ""),
            processed=processed,
            prefix=self.prefix,
            cache_trimmed=trimmed,
            failed_ranks=failed,
            cancelling_ranks=asked,
        )

    def send(self, action: Send) -> None:
        queue = self.stage.send_queue
        if len(queue) != 1 or queue.pending[0].peer != action.peer:
            raise PipelineError(
                f"{self.stage.describe()}: plan says send chunk {action.chunk.index} to rank {action.peer}, "
                f"but the queue holds sends to {[p.peer for p in queue.pending]}"
            )
        with self.tracer.span("send", action.chunk.index, action.peer):
            queue.flush()

    def compute(self, action: Compute) -> None:
        """Run the local layers on the chunk; an error of the model's own is deferred to the next agreement.

        From the chunk the model failed on to the next agreement point, the
        failing rank stands in for its layers (:func:`~.failure.stand_in`), so
        every message of the plan is still sent and received; it reports the
        failed chunk at the agreement point, where every rank stops.
        """
        stage, chunk = self.stage, action.chunk
        if self.failed_chunk is None:
            try:
                self._compute(action)
                return
            except (PipelineTimeoutError, PeerLostError, PipelineError):
                raise
            except Exception as exc:
                self.deferred = self.deferred or exc
                self.failed_chunk = chunk.index
        self.expected_receives = 0
        where = f"{stage.describe()} draining chunk {chunk.index} from rank {stage.rank - 1} after an error"
        outgoing = stand_in(stage, 1, chunk.length, lambda received: wait_for(received, self.timeout, lambda: where))
        if outgoing is not None:
            stage.send_queue.put(outgoing, stage.rank + 1)

    def _compute(self, action: Compute) -> None:
        chunk, stage = action.chunk, self.stage
        with mx.stream(stage.compute_stream):
            self.model(self.tokens[None, chunk.start : chunk.stop], cache=self.cache)
            options = self.options
            maybe_quantize_kv_cache(self.cache, options.quantized_kv_start, options.kv_group_size, options.kv_bits)
        if len(stage.received) != self.expected_receives:
            raise PipelineError(
                f"{stage.describe()}: plan expects {self.expected_receives} receive(s) for chunk "
                f"{chunk.index}, the model made {len(stage.received)}"
            )
        if stage.received:
            peer = stage.rank - 1
            with self.tracer.span("recv", chunk.index, peer):
                wait_for(
                    stage.received,
                    self.timeout,
                    lambda: f"{stage.describe()} receiving chunk {chunk.index} from rank {peer}",
                )
            stage.received.clear()
            self.expected_receives = 0
        queued = [p.array for p in stage.send_queue.pending]
        began = time.perf_counter()
        with self.tracer.span("compute", chunk.index, tokens=chunk.length):
            wait_for(
                [cache_state(self.cache), queued],
                self.timeout,
                lambda: f"{stage.describe()} computing chunk {chunk.index}",
            )
        if stage.observed is not None:  # its input has arrived: this is the chunk's compute on this rank
            stage.observed.append((self.prefix + chunk.start, chunk.length, time.perf_counter() - began))

    def agree(self, action: Agree) -> None:
        stage, queue = self.stage, self.stage.send_queue
        in_flight = queue.in_flight()
        if in_flight:
            with self.tracer.span("wait", peer=stage.rank + 1, step=action.step):
                wait_for(
                    in_flight,
                    self.timeout,
                    lambda: f"{stage.describe()} completing its send to rank {stage.rank + 1} in step {action.step}",
                )
            queue.mark_complete()
        with self.tracer.span("agree", step=action.step):
            failed = -1 if self.failed_chunk is None else self.failed_chunk
            table = agree_on_step(stage, action.step, self.status(), self.timeout, failed)
        self.stop_if_asked(table, action.step)

    def progress(self, action: Progress) -> None:
        callback = self.options.prompt_progress_callback
        if callback is None or self.deferred is not None:
            return
        with self.tracer.span("progress", processed=action.processed):
            try:
                callback(action.processed, action.total)
            except Exception as exc:  # acted on at the next agreement point, on every rank
                self.deferred = exc
