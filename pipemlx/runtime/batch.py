"""Many requests decoded together on a sharded model: a pipelined ``BatchGenerator``.

:class:`BatchGenerator` is shaped like mlx-lm's ``BatchGenerator``:
:meth:`~BatchGenerator.insert` queues prompts and returns their uids,
:meth:`~BatchGenerator.next` runs one decode step of every active request and
returns one :class:`Response` per request, :meth:`~BatchGenerator.remove`
drops requests. Every rank must make the **same calls in the same order with
the same arguments** (an engine on rank 0 broadcasts the operations to the
other ranks, as ``pipemlx.serve.broadcast`` does for requests): every
decision (who joins, who finishes, who is dropped, the cache layout) is then
made from data every rank has, so the ranks stay in step without asking each
other.

Within :meth:`~BatchGenerator.next`:

1. Queued requests are prefilled one after another, each with
   :func:`pipemlx.pipeline_prefill` into its own cache (one mlx-lm
   ``KVCache`` per local layer), then merged into the batch caches
   (mlx-lm's ``BatchKVCache``, left-padded, exactly as mlx-lm's
   ``BatchGenerator`` builds and extends them). With ``prefill_budget`` only
   one slice of the first queued prompt is prefilled per call (pipelined
   across the ranks), so prompts are prefilled between the decode steps of
   the others; without it a prompt is prefilled whole and the others wait.
2. One forward pass of the whole batch runs through the pipeline (edges in
   immediate mode without the final broadcast); the last rank applies the
   head and samples every row with that request's sampler.
3. One all-gather carries ``[kind, step, status, rows, uid fingerprint]``
   plus the R token ids from every rank; the ranks check they ran the same
   step over the same requests (:class:`PipelineMismatchError` otherwise).
4. Requests that reached ``max_tokens`` or yielded a stop token leave the
   batch (``finish_reason`` ``"length"`` / ``"stop"``); their rows are
   filtered out of the caches before the next step.

Nothing is left in flight between calls, and every wait is bounded by
``timeout``: a stalled peer raises :class:`PipelineTimeoutError`, a dead one
:class:`PeerLostError`, and the stage is then unusable (start every rank
again). Greedy tokens of each request equal a solo run of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..errors import PipelineMismatchError
from .agreement import STATUS_OK
from .caches import cache_offset, cache_state
from .prefill import check_timeout, pipeline_prefill
from .stage import PipelineStage, stage_of
from .waits import wait_for

Sampler = Callable[[mx.array], mx.array]
FinishReason = Literal["length", "stop"]

BATCH_KIND = 7_772
"""First field of every batch-decode all-gather (``generate_step`` uses 7771): another phase shows as a mismatch."""
HEADER = ("kind", "step", "status", "rows", "uids")
FINGERPRINT_MODULUS = 1 << 23  # exact in float32, like every field of the share vector


@dataclass(frozen=True)
class Response:
    """One request's token from one :meth:`BatchGenerator.next` step, the same on every rank.

    ``finish_reason`` is ``None`` while the request goes on, ``"length"`` when
    it reached its ``max_tokens`` and ``"stop"`` when ``token`` is one of the
    generator's stop tokens; either way the request has left the batch.
    """

    uid: int
    token: int
    finish_reason: FinishReason | None


@dataclass
class _Sequence:
    uid: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None
    prefix: int = 0  # positions the caller's cache already held at insert (a reused prefix)
    generated: int = 0
    filled: int = 0  # prompt positions prefilled into ``cache`` so far
    cache: list[Any] | None = None


class BatchGenerator:
    """Continuous batching on a sharded model; call every method identically on every rank.

    ``max_tokens`` is the default per request; ``stop_tokens`` end a request
    after yielding one of them (``finish_reason="stop"``); ``sampler`` is the
    default sampler (greedy when ``None``), used only on the last rank;
    ``prefill_step_size`` is the chunk size of each new prompt's
    :func:`pipemlx.pipeline_prefill`; ``timeout`` bounds every wait (default:
    the model's).

    ``prefill_budget`` interleaves new prompts with the decode steps: each
    :meth:`next` prefills at most that many positions of the first queued
    prompt (one pipelined :func:`pipemlx.pipeline_prefill` over the slice)
    before the decode step of the active requests, so a long prompt delays
    each step by about one slice instead of stalling everyone for its whole
    prefill. A multiple of ``prefill_step_size`` keeps the chunks where a solo
    run cuts them. ``None`` (the default): every queued prompt is prefilled
    whole in the next :meth:`next`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_tokens: int = 128,
        stop_tokens: Iterable[int] = (),
        sampler: Sampler | None = None,
        prefill_step_size: int = 512,
        prefill_budget: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.model = model
        self.stage: PipelineStage = stage_of(model)
        _check_max_tokens(max_tokens)
        check_timeout(timeout)
        if isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int) or prefill_step_size < 1:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"prefill_step_size must be a positive int, got {prefill_step_size!r}")
        if prefill_budget is not None and (
            isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int) or prefill_budget < 1  # pyright: ignore[reportUnnecessaryIsInstance]
        ):
            raise ValueError(f"prefill_budget must be a positive int or None, got {prefill_budget!r}")
        self.prefill_budget = prefill_budget
        self.max_tokens = max_tokens
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.sampler = sampler
        self.prefill_step_size = prefill_step_size
        self.timeout = timeout or self.stage.timeout
        self._next_uid = 0
        self._step_index = 0
        self._queued: list[_Sequence] = []
        self._active: list[_Sequence] = []
        self._inputs: list[int] = []  # per active row: the token its next step feeds
        self._cache: list[Any] = []  # one BatchKVCache per local layer; empty while no request is active
        unbatchable = sorted({type(c).__name__ for c in make_prompt_cache(model) if not hasattr(c, "merge")})
        if unbatchable:
            raise TypeError(f"{self.stage.describe()}: mlx-lm cannot batch these layer caches: {unbatchable}")

    @property
    def active_uids(self) -> list[int]:
        """Requests in the batch, in row order."""
        return [s.uid for s in self._active]

    @property
    def queued_uids(self) -> list[int]:
        """Requests inserted and not yet in the batch (their prompts not yet wholly prefilled), in order."""
        return [s.uid for s in self._queued]

    def prefilled(self, uid: int) -> int:
        """Prompt positions of a queued request prefilled so far (0 for an unknown uid)."""
        return next((s.filled for s in self._queued if s.uid == uid), 0)

    def __len__(self) -> int:
        return len(self._queued) + len(self._active)

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int] | int | None = None,
        samplers: Sequence[Sampler | None] | None = None,
        caches: Sequence[list[Any] | None] | None = None,
    ) -> list[int]:
        """Queue ``prompts`` (token ids); return their uids. Nothing is sent: the next :meth:`next` prefills them.

        ``max_tokens`` is one int for all or one per prompt (default: the
        generator's); ``samplers`` one per prompt (``None`` entries: the
        default). ``caches`` reuses prefixes per request: ``caches[i]`` is
        ``None`` or a per-layer list of mlx-lm caches of this rank's local
        layers (``make_prompt_cache(model)`` on the sharded model) that
        already holds a prefix of request ``i``; ``prompts[i]`` is then only
        the tokens not yet in it (at least one: the last prompt token feeds
        the first decode step). The generator takes the cache over (it is
        extended, merged into the batch and not handed back); every rank must
        pass caches holding the same number of positions. Tokens then equal a
        solo run of the whole prompt. Raises ``ValueError`` for an empty
        prompt, a bad count or a cache that does not fit the model, on every
        rank alike, before anything changes.
        """
        count = len(prompts)
        limits = (
            [self.max_tokens] * count
            if max_tokens is None
            else [max_tokens] * count
            if isinstance(max_tokens, int)
            else list(max_tokens)
        )
        chosen: list[Sampler | None] = [None] * count if samplers is None else list(samplers)
        given: list[list[Any] | None] = [None] * count if caches is None else list(caches)
        if len(limits) != count or len(chosen) != count or len(given) != count:
            raise ValueError(
                f"{count} prompts need as many max_tokens, samplers and caches, "
                f"got {len(limits)}, {len(chosen)} and {len(given)}"
            )
        for i, cache in enumerate(given):
            if cache is not None:
                self._check_cache(i, cache)
        tokens = [[int(t) for t in p] for p in prompts]
        for i, (prompt, limit) in enumerate(zip(tokens, limits)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            _check_max_tokens(limit)
        uids = list(range(self._next_uid, self._next_uid + count))
        self._next_uid += count
        for uid, prompt, limit, sampler, cache in zip(uids, tokens, limits, chosen, given):
            prefix = 0 if cache is None else cache_offset(cache)
            self._queued.append(_Sequence(uid, prompt, limit, sampler, prefix=prefix, cache=cache))
        return uids

    def _check_cache(self, index: int, cache: object) -> None:
        """Raise ``ValueError`` unless ``cache`` is one batchable mlx-lm cache per local layer."""
        layers = len(self.stage.layers)
        if not isinstance(cache, list) or len(cast(list[Any], cache)) != layers:
            raise ValueError(
                f"caches[{index}] must be a list of {layers} layer caches ({self.stage.describe()}), made with "
                "mlx_lm.models.cache.make_prompt_cache(model) on the sharded model"
            )
        entries = cast(list[Any], cache)
        if any(not hasattr(c, "merge") for c in entries):
            kinds = sorted({type(c).__name__ for c in entries})
            raise ValueError(f"caches[{index}] holds caches mlx-lm cannot batch: {kinds}")

    def remove(self, uids: Iterable[int]) -> None:
        """Drop requests, queued (even partly prefilled) or active; unknown uids are ignored.

        Takes effect before the next step; a dropped request's caches are freed.
        """
        gone = set(uids)
        self._queued = [s for s in self._queued if s.uid not in gone]
        keep = [i for i, s in enumerate(self._active) if s.uid not in gone]
        if len(keep) < len(self._active):
            self._filter(keep)

    def next(self) -> list[Response]:
        """Prefill queued requests, then run one decode step of every active request; same result on every rank."""
        stage = self.stage
        stage.settle(self.timeout)
        self._admit()
        if not self._active:
            return []
        tokens = self._step()
        responses: list[Response] = []
        keep: list[int] = []
        for i, (sequence, token) in enumerate(zip(self._active, tokens)):
            sequence.generated += 1
            reason: FinishReason | None = None
            if token in self.stop_tokens:
                reason = "stop"
            elif sequence.max_tokens != -1 and sequence.generated >= sequence.max_tokens:
                reason = "length"
            else:
                keep.append(i)
            responses.append(Response(sequence.uid, token, reason))
        self._inputs = tokens
        if len(keep) < len(self._active):
            self._filter(keep)
        return responses

    def _admit(self) -> None:
        """Prefill queued prompts (all, or one slice of the first within the budget); merge the finished ones."""
        admitted: list[_Sequence] = []
        budget = self.prefill_budget
        while self._queued:
            sequence = self._queued[0]
            if sequence.cache is None:
                sequence.cache = make_prompt_cache(self.model)
            remaining = len(sequence.prompt) - 1 - sequence.filled
            take = remaining if budget is None else min(remaining, budget)
            if take > 0:
                # Fills positions filled .. filled+take-1; the cache already holds the ones before.
                pipeline_prefill(
                    self.model,
                    mx.array(sequence.prompt[sequence.filled : sequence.filled + take + 1], dtype=mx.int32),
                    sequence.cache,
                    step_size=self.prefill_step_size,
                    timeout=self.timeout,
                )
                sequence.filled += take
            if sequence.filled < len(sequence.prompt) - 1:
                break  # the budget is spent: the rest of this prompt in the next steps
            admitted.append(self._queued.pop(0))
            if budget is not None and take > 0:
                break  # one slice per step, so the chunks stay where a solo run cuts them
        if not admitted:
            return
        caches = [cast(list[Any], s.cache) for s in admitted]
        for s in admitted:
            s.cache = None
        # Each layer cache's own batch class, as mlx-lm's BatchGenerator does: KVCache -> BatchKVCache (left-padded).
        merged = [caches[0][layer].merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
        if self._cache:
            for batch, extra in zip(self._cache, merged):
                batch.extend(extra)
        else:
            self._cache = merged
        self._active.extend(admitted)
        self._inputs.extend(s.prompt[-1] for s in admitted)
        self._settle_cache()

    def _filter(self, keep: list[int]) -> None:
        self._active = [self._active[i] for i in keep]
        self._inputs = [self._inputs[i] for i in keep]
        if not keep:
            self._cache = []
            return
        for c in self._cache:
            c.filter(keep)
        self._settle_cache()

    def _settle_cache(self) -> None:
        """Evaluate the batch caches after a merge or filter (local work on this thread's stream).

        The decode step is waited for in a helper thread, which cannot run
        work left pending on this thread's default stream.
        """
        mx.eval(cache_state(self._cache))  # pyright: ignore[reportUnknownMemberType]

    def _fingerprint(self) -> int:
        value = 0
        for s in self._active:
            value = (value * 1_000_003 + s.uid + 1) % FINGERPRINT_MODULUS
            value = (value * 1_000_003 + s.prefix) % FINGERPRINT_MODULUS
        return value

    def _step(self) -> list[int]:
        """One forward pass of the batch on every rank and the all-gather that shares the R tokens."""
        stage = self.stage
        rows = len(self._active)
        index = self._step_index
        self._step_index += 1
        inputs = mx.array(self._inputs, dtype=mx.int32)
        mx.eval(inputs)  # pyright: ignore[reportUnknownMemberType]
        header = mx.array([BATCH_KIND, index, STATUS_OK, rows, self._fingerprint()], dtype=mx.float32)
        try:
            with mx.stream(stage.compute_stream), stage.without_broadcast():
                stage.last_receive = None
                output = cast(mx.array, self.model(inputs[:, None], cache=self._cache))
                if stage.is_last:
                    tokens = self._sample(output[:, -1, :]).astype(mx.float32)
                else:
                    # Issued after this rank's send, which is tied to its cache: evaluating the share sends.
                    leaves = cast(list[tuple[str, Any]], tree_flatten(cache_state(self._cache)))
                    evaluated = [a for _, a in leaves if isinstance(a, mx.array)]
                    header = cast(mx.array, mx.depends(header, evaluated))  # pyright: ignore[reportUnknownMemberType]
                    tokens = mx.zeros((rows,), dtype=mx.float32)
                share = mx.concatenate([header, tokens])
                if stage.world_size > 1:
                    share = mx.distributed.all_gather(share, group=stage.group)
            wait_for(share, self.timeout, lambda: f"{stage.describe()} in batch decode step {index} ({rows} rows)")
            stage.outstanding.clear()  # this pass is complete: nothing for the next one to wait for
        except Exception as exc:  # a stalled or lost peer, or the model failed mid-pass: peers may be blocked
            stage.mark_broken(exc)
            raise
        flat = cast(list[float], share.tolist())
        width = len(HEADER) + rows
        gathered = [flat[r * width : (r + 1) * width] for r in range(len(flat) // width)]
        _check_rows(gathered, stage)
        return [int(t) for t in gathered[-1][len(HEADER) :]]

    def _sample(self, logits: mx.array) -> mx.array:
        """Sample every row with its request's sampler (one batched call when all rows share one)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [s.sampler or self.sampler for s in self._active]
        first = samplers[0]
        if all(s is first for s in samplers):
            sampled = _greedy(logprobs) if first is None else first(logprobs)
            return mx.reshape(sampled, (-1,))
        rows = [
            mx.reshape(_greedy(logprobs[i : i + 1]) if s is None else s(logprobs[i : i + 1]), (-1,))
            for i, s in enumerate(samplers)
        ]
        return mx.concatenate(rows)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _check_max_tokens(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"max_tokens must be a positive int or -1 (no limit), got {value!r}")


def _check_rows(rows: list[list[float]], stage: PipelineStage) -> None:
    """Raise :class:`PipelineMismatchError` (on every rank alike) when the ranks ran different steps."""
    widths = {len(row) for row in rows}
    columns = {name: [int(row[i]) for row in rows] for i, name in enumerate(HEADER)}
    if any(k != BATCH_KIND for k in columns["kind"]) or len(widths) > 1 or len(rows) != stage.world_size:
        raise PipelineMismatchError(f"{stage.describe()}: a rank is not in the same batch decode step as the others")
    for name in ("step", "rows", "uids"):
        if len(set(columns[name])) > 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(columns[name]))
            raise PipelineMismatchError(f"ranks disagree on the batch decode's {name}: {shown}")
