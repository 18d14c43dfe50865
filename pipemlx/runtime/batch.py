"""Many requests decoded together on a sharded model: a pipelined ``BatchGenerator``.

:class:`BatchGenerator` is shaped like mlx-lm's ``BatchGenerator``:
:meth:`~BatchGenerator.insert` queues prompts and returns their uids,
:meth:`~BatchGenerator.next` runs one *tick* and returns one
:class:`Response` per request that decoded in it, :meth:`~BatchGenerator.remove`
drops requests. Every rank must make the **same calls in the same order with
the same arguments** (an engine on rank 0 broadcasts the operations to the
other ranks, as ``pipemlx.serve.broadcast`` does for requests): every
decision (who joins, who finishes, who is dropped, which chunk of which prompt
each rank computes) is then made from data every rank has, so the ranks stay
in step without asking each other.

A tick (:mod:`pipemlx.runtime.batch_tick`) is one decode step of every active
request plus at most one prefill chunk per rank: queued prompts are prefilled
in chunks that travel the ranks like a pipeline, *between* the decode steps of
the others (rank 0 computes chunk k while rank 1 computes chunk k-1), so a long
prompt neither stalls the others nor waits for them. Which chunk each rank
computes in a tick, and when a prefilled request joins the batch, is plain
data from a pure function (:func:`pipemlx.schedule.batch_plan.plan_tick`) of
the queue; the tick's all-gather carries its fingerprint, so ranks that
planned differently fail with :class:`PipelineMismatchError`. Insertions,
removals, completions and failures take effect at tick boundaries only.

The batch caches are mlx-lm's ``BatchKVCache`` (left-padded, merged and
filtered as mlx-lm's ``BatchGenerator`` does); each prompt is prefilled into
its own ``KVCache`` per local layer, merged in when it joins. A finished or
removed request's row stays in them as a dead row until half the rows are
dead (see :meth:`BatchGenerator._compact_if_worth_it`); a joining request
takes a dead row's place (:func:`fill_rows`).
Nothing is left in flight between calls, and every wait is bounded by
``timeout``: a stalled peer raises :class:`PipelineTimeoutError`, a dead one
:class:`PeerLostError`, and the stage is then unusable (start every rank
again). Greedy tokens of each request equal a solo run of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import StopSequences
from mlx_lm.generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats
from mlx_lm.models.cache import (  # pyright: ignore[reportUnknownVariableType]
    BatchKVCache,
    KVCache,
    RotatingKVCache,
)

from ..schedule.batch_plan import (
    Admission,
    AdmissionLimits,
    Chunk,
    ChunkSizes,
    EqualCostChunks,
    Job,
    PlanState,
    Tick,
    drop,
    enqueue,
    fingerprint,
    plan_tick,
)
from .batch_memory import exchange_admission
from .batch_tick import UNKNOWN_PREFIXES, TickRunner, TickWork
from .caches import UNCOUNTED, cache_parts, cache_state, counted_offset, trim_to
from .calibrate import calibrated
from .prefill import check_timeout
from .stage import PipelineStage, stage_of

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
FinishReason = Literal["length", "stop", "error"]

COMPACT_DEAD_FRACTION = 0.5
"""Dead rows (finished or removed requests) are filtered out of the batch caches once they are this share of
the rows (or when no live row is left, or a request that joins finds too few of them to take their places)."""
DEAD_ROW_INPUT = 0
"""The token a dead row's decode step feeds (its output is ignored)."""


@dataclass(frozen=True)
class Response:
    """One request's token from one :meth:`BatchGenerator.next` tick, the same on every rank.

    The fields are those of mlx-lm's ``BatchGenerator`` responses, in its order.
    ``finish_reason`` is ``None`` while the request goes on, ``"length"`` when
    it reached its ``max_tokens``, ``"stop"`` when ``token`` ends one of its
    stop sequences, and ``"error"`` (``token`` is -1) when the model raised
    on some rank while computing this request (its prefill chunk, or a decode
    step of the batch it was in); in all three the request has left.

    ``logprobs``: on the last rank, the log-probabilities this token was
    sampled from (``[vocabulary]``, after the request's logits processors),
    computed only when read; ``None`` on the other ranks (they never see the
    logits) and on an ``"error"`` response.

    ``prompt_cache`` and ``all_tokens``, on a ``"length"`` or ``"stop"``
    response only (as in mlx-lm): this rank's per-layer caches of the
    finished request, taken out of the batch, and the tokens they hold — its
    ``all_tokens`` given at insert, its prompt and every generated token but
    this last one, which was never fed back. Pass the cache to
    :meth:`BatchGenerator.insert` with the next turn's tokens, starting with
    ``token``, to continue the conversation without prefilling it again.
    ``None`` otherwise (a failed request's cache may hold a stand-in's zeros).
    """

    uid: int
    token: int
    logprobs: mx.array | None = field(default=None, compare=False)
    finish_reason: FinishReason | None = None
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] | None = None


@dataclass
class _Sequence:
    uid: int
    prompt: list[int]  # the tokens not in the cache at insert
    max_tokens: int
    sampler: Sampler | None
    stop: StopSequences.Matcher  # where the request's generated tokens stand in its stop sequences
    processors: tuple[LogitsProcessor, ...] = ()
    prefix: int = 0  # positions the caller's cache held at insert (a reused prefix); UNCOUNTED: this rank can't tell
    generated: int = 0
    before: list[int] = field(default_factory=list[int])  # all_tokens at insert: what a reused cache holds
    answer: list[int] = field(default_factory=list[int])  # the tokens generated so far
    filled: int = 0  # prompt positions every rank has prefilled into ``cache``
    cache: list[Any] | None = None
    boundaries: tuple[int, ...] = ()  # prompt positions no prefill chunk crosses (ends of insert_segments' segments)
    done: bool = False  # finished or removed; its batch row, if any, stays until the batch caches are compacted

    @property
    def held(self) -> list[int]:
        """The tokens an active request's cache holds: ``all_tokens``, the prompt, the answer but its last token."""
        return [*self.before, *self.prompt, *self.answer[:-1]]

    @property
    def reserve(self) -> int:
        """Cache positions this request may reach: its prompt and every token it may generate."""
        return max(self.prefix, 0) + len(self.prompt) + max(self.max_tokens, 0)


class BatchGenerator:
    """Continuous batching on a sharded model; call every method identically on every rank.

    ``max_tokens`` is the default per request (-1: no limit); ``stop_tokens``
    end a request after yielding one of them (``finish_reason="stop"``): token
    ids, or sequences of them as mlx-lm's ``BatchGenerator`` takes (a request
    stops at the token that completes one, counting its generated tokens only);
    ``sampler`` is the default sampler (greedy when ``None``) and
    ``logits_processors`` the default processors (mlx-lm's
    ``make_logits_processors``: repetition penalty, logit bias, ...), both used
    only on the last rank; ``timeout`` bounds every wait (default: the model's).

    ``prefill_chunk_tokens`` is the size of the prompt chunks computed in a
    tick while other requests decode: each rank adds about one chunk's work to
    each decode step, so it trades the decoding requests' time between tokens
    against the new request's time to first token. ``prefill_step_size`` is
    the chunk size while nothing decodes (a prompt prefilled alone).
    ``prefill_budget`` is the former name of ``prefill_chunk_tokens``.

    ``prefill_chunking="equal-cost"`` keeps that trade steady over a long
    prompt: a chunk attends to every position before it, so at a fixed length
    the late chunks of a long prompt cost several times the first ones and the
    others' time between tokens grows as it fills. With it, the chunk at the
    start of a prompt has ``prefill_chunk_tokens`` positions and every later
    one is as long as the cost model allows for the same predicted cost
    (:class:`~pipemlx.schedule.batch_plan.EqualCostChunks`). The constructor
    then calibrates the cost model on the group, as ``step_size="auto"`` does
    (a collective, once per model: construct on every rank). ``"fixed"``
    (the default): every chunk has ``prefill_chunk_tokens`` positions.

    ``memory_budget`` (bytes this rank may spend on KV caches) turns on
    admission control: the constructor then exchanges every rank's budget and
    cache bytes per position (one all-gather: construct on every rank), and a
    queued request starts its prefill only when the batch, left-padded to its
    longest reservation (prompt + ``max_tokens``), fits every rank's budget
    with it; requests start in order. A request that could never fit raises
    ``ValueError`` in :meth:`insert`.

    ``completion_batch_size`` (as mlx-lm's): at most this many requests
    decode or are prefilled at once; the others wait in the queue, in order.
    ``None`` (the default; mlx-lm's is 32): no limit.

    ``prefill_batch_size`` (as mlx-lm's): at most this many requests are
    started and not yet decoding at once (chunks in flight on some rank,
    or prefilled and waiting to join); the next one starts when one joins.
    Our ticks prefill one chunk per rank, so at most one request per rank is
    computed at once (up to ``world_size`` over the pipeline, more only
    counting one-token prompts, which need no prefill): this caps that.
    ``None`` (the default; mlx-lm's is 8): no cap. As in mlx-lm, a
    ``completion_batch_size`` below it is raised to it.

    ``max_kv_size`` (as mlx-lm's): each request's caches are made with
    ``make_prompt_cache(model, max_kv_size)``, rotating caches that keep
    the last ``max_kv_size`` positions (a cache passed to :meth:`insert` is
    used as it is). Admission control still reserves a request's whole
    length (conservative).

    ``stream`` (mlx-lm's computes on it): the ranks compute on the stage's
    own stream (``stage.compute_stream``, which the waits in helper threads
    need), so a stream or device is accepted only on that stream's device
    (``ValueError`` otherwise); :attr:`stream` is the stream computed on.

    Raises ``ValueError`` for a bad value of any of these before anything
    is sent.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_tokens: int = 128,
        stop_tokens: Iterable[int | Sequence[int]] = (),
        sampler: Sampler | None = None,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        prefill_step_size: int = 512,
        prefill_chunk_tokens: int = 64,
        prefill_budget: int | None = None,
        prefill_chunking: Literal["fixed", "equal-cost"] = "fixed",
        timeout: float | None = None,
        memory_budget: int | None = None,
        completion_batch_size: int | None = None,
        prefill_batch_size: int | None = None,
        max_kv_size: int | None = None,
        stream: mx.Stream | mx.ThreadLocalStream | mx.Device | None = None,
    ) -> None:
        self.model = model
        self.stage: PipelineStage = stage_of(model)
        _check_max_tokens(max_tokens)
        check_timeout(timeout)
        chunk = prefill_chunk_tokens if prefill_budget is None else prefill_budget
        for name, value in (("prefill_step_size", prefill_step_size), ("prefill_chunk_tokens", chunk)):
            _check_positive(name, value)
        optional = {
            "memory_budget": memory_budget,
            "completion_batch_size": completion_batch_size,
            "prefill_batch_size": prefill_batch_size,
            "max_kv_size": max_kv_size,
        }
        for name, limit in optional.items():
            if limit is not None:
                _check_positive(name, limit)
        self.stage.check_stream(stream, not_a_stream=ValueError)  # ValueError: this class's bad values
        if prefill_chunking not in ("fixed", "equal-cost"):
            raise ValueError(f"prefill_chunking must be 'fixed' or 'equal-cost', got {prefill_chunking!r}")
        self.max_tokens = max_tokens
        self.stop_sequences = _stop_sequences(stop_tokens, "stop_tokens")
        self.sampler = sampler
        self.logits_processors: tuple[LogitsProcessor, ...] = tuple(logits_processors or ())
        self.prefill_step_size = prefill_step_size
        self.prefill_chunk_tokens = chunk
        self.timeout = timeout or self.stage.timeout
        self.max_kv_size = max_kv_size
        fresh = self._new_cache()
        unbatchable = sorted({type(c).__name__ for c in fresh if not hasattr(c, "merge")})
        self._fresh_kept = _kept_window(fresh)
        if unbatchable:
            raise TypeError(f"{self.stage.describe()}: mlx-lm cannot batch these layer caches: {unbatchable}")
        self._next_uid = 0
        self._plan = PlanState(self.stage.world_size)
        self._sequences: dict[int, _Sequence] = {}  # every request inserted and not yet finished
        self._rows: list[_Sequence] = []  # per batch-cache row, in order; a ``done`` one is a dead row
        self._inputs: list[int] = []  # per row: the token its next step feeds
        self._cache: list[Any] = []  # one BatchKVCache per local layer; empty while no request is active
        self._runner = TickRunner(model, self.stage, self.timeout)
        self.admission: Admission | None = (
            None if memory_budget is None else exchange_admission(model, self.stage, memory_budget, self.timeout)
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
        self._counters = BatchCounters()
        self._logprobs: mx.array | None = None  # the last tick's, on the last rank: read by its responses
        self.chunk_sizes: int | ChunkSizes = chunk
        if prefill_chunking == "equal-cost":
            self.chunk_sizes = EqualCostChunks(chunk, calibrated(model, self.stage, self.timeout).layer)

    @property
    def stream(self) -> mx.Stream:
        """The stream this rank computes the ticks on (the stage's ``compute_stream``; mlx-lm's ``stream``)."""
        return self.stage.compute_stream

    def _new_cache(self) -> list[Any]:
        """A new request's per-layer caches: ``make_prompt_cache(model, max_kv_size)``, as mlx-lm's makes them."""
        return self.stage.new_cache(self.model, self.max_kv_size)

    @property
    def active_uids(self) -> list[int]:
        """Requests in the batch, in row order."""
        return [s.uid for s in self._active]

    @property
    def _active(self) -> list[_Sequence]:
        """The live rows' requests, in row order (without the dead rows)."""
        return [s for s in self._rows if not s.done]

    @property
    def queued_uids(self) -> list[int]:
        """Requests inserted and not yet decoding (queued, or their prompts being prefilled), in order."""
        active = set(self.active_uids)
        return [u for u in self._sequences if u not in active]

    @property
    def shared_head_ticks(self) -> int:
        """Ticks whose decode step shared the output head among the ranks (every row greedy: see ``next``)."""
        return self._runner.shared_ticks

    @property
    def last_error(self) -> BaseException | None:
        """The first model error this rank stood in for (requests failed with ``finish_reason="error"``)."""
        return self._runner.error

    def prefilled(self, uid: int) -> int:
        """Prompt positions of a queued request that every rank has prefilled (0 for an unknown uid)."""
        sequence = self._sequences.get(uid)
        return 0 if sequence is None or any(s is sequence for s in self._rows) else sequence.filled

    def __len__(self) -> int:
        return len(self._sequences)

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int] | int | None = None,
        caches: Sequence[list[Any] | None] | None = None,
        all_tokens: Sequence[Sequence[int] | None] | None = None,
        samplers: Sequence[Sampler | None] | None = None,
        logits_processors: Sequence[Sequence[LogitsProcessor] | None] | None = None,
        stop_sequences: Sequence[StopSequences | Iterable[int | Sequence[int]] | None] | None = None,
    ) -> list[int]:
        """Queue ``prompts`` (token ids); return their uids. Nothing is sent: the next ticks prefill them.

        The arguments are mlx-lm's ``BatchGenerator.insert``'s, in its order.
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
        solo run of the whole prompt.

        ``logits_processors`` is one list per prompt, as in mlx-lm's
        ``BatchGenerator`` (default: the generator's for every prompt; a
        ``None`` or empty entry: none for that prompt). A processor is called
        as mlx-lm's ``generate_step`` calls it, on the last rank only, with the
        request's tokens so far (``all_tokens[i]``, then the prompt, then the
        tokens generated before this one) and its ``[1, vocabulary]`` logits.
        ``all_tokens[i]`` names the tokens a reused cache holds (seen by the
        processors, and handed back with the cache; default none).
        ``stop_sequences`` is one entry per prompt: mlx-lm's
        ``StopSequences``, or token ids and sequences of them as the
        generator's ``stop_tokens`` takes (``None``: the generator's); they
        replace the generator's for that request. Raises ``ValueError`` for an
        empty prompt, a bad count, a cache that does not fit the model, a
        request that could never fit the memory budget or one that could
        outgrow a ``RotatingKVCache`` that keeps its first positions (what
        ``max_kv_size`` makes; see the class), on every rank alike, before
        anything changes.
        """
        return self._insert(
            [[[int(t) for t in p]] for p in prompts],
            max_tokens,
            caches,
            all_tokens,
            samplers,
            logits_processors,
            stop_sequences,
            segmented=False,
        )

    def insert_segments(
        self,
        segments: Sequence[Sequence[Sequence[int]]],
        max_tokens: Sequence[int] | int | None = None,
        caches: Sequence[list[Any] | None] | None = None,
        all_tokens: Sequence[Sequence[int] | None] | None = None,
        samplers: Sequence[Sampler | None] | None = None,
        logits_processors: Sequence[Sequence[LogitsProcessor] | None] | None = None,
        stop_sequences: Sequence[StopSequences | Iterable[int | Sequence[int]] | None] | None = None,
    ) -> list[int]:
        """Queue prompts given as segments (mlx-lm's ``insert_segments``); return their uids.

        ``segments[i]`` is request ``i``'s prompt cut into segments (empty ones
        are skipped); the other arguments are :meth:`insert`'s. A request's
        tokens are those of :meth:`insert` of its segments joined, and, as in
        mlx-lm, no prefill chunk crosses a segment boundary: a chunk that would
        ends there (the prompt's last token is fed by the first decode step,
        not prefilled). A request whose every segment is empty raises
        ``ValueError`` ("has an empty prompt"), as mlx-lm's does, before
        anything changes.
        """
        return self._insert(
            [[[int(t) for t in part] for part in request] for request in segments],
            max_tokens,
            caches,
            all_tokens,
            samplers,
            logits_processors,
            stop_sequences,
            segmented=True,
        )

    def _insert(
        self,
        segments: list[list[list[int]]],
        max_tokens: Sequence[int] | int | None,
        caches: Sequence[list[Any] | None] | None,
        all_tokens: Sequence[Sequence[int] | None] | None,
        samplers: Sequence[Sampler | None] | None,
        logits_processors: Sequence[Sequence[LogitsProcessor] | None] | None,
        stop_sequences: Sequence[StopSequences | Iterable[int | Sequence[int]] | None] | None,
        *,
        segmented: bool,
    ) -> list[int]:
        """:meth:`insert` of each request's segments joined, its prefill chunks ending at the segments' ends."""
        count = len(segments)
        limits = (
            [self.max_tokens] * count
            if max_tokens is None
            else [max_tokens] * count
            if isinstance(max_tokens, int)
            else list(max_tokens)
        )
        chosen: list[Sampler | None] = [None] * count if samplers is None else list(samplers)
        given: list[list[Any] | None] = [None] * count if caches is None else list(caches)
        processors = (
            [self.logits_processors] * count
            if logits_processors is None
            else [tuple(p or ()) for p in logits_processors]
        )
        earlier = [[] if t is None else [int(x) for x in t] for t in all_tokens or [None] * count]
        stops = [
            self.stop_sequences if s is None else s if isinstance(s, StopSequences) else _stop_sequences(s)
            for s in (stop_sequences or [None] * count)
        ]
        lengths = {
            "max_tokens": len(limits),
            "samplers": len(chosen),
            "caches": len(given),
            "logits_processors": len(processors),
            "all_tokens": len(earlier),
            "stop_sequences": len(stops),
        }
        wrong = {name: n for name, n in lengths.items() if n != count}
        if wrong:
            shown = ", ".join(f"{n} {name}" for name, n in wrong.items())
            raise ValueError(f"{count} prompts need one entry each of every per-prompt option, got {shown}")
        tokens = [[t for part in request for t in part] for request in segments]
        boundaries = [_boundaries(request) for request in segments]
        for i, (prompt, limit, cache) in enumerate(zip(tokens, limits, given)):
            if not prompt:
                raise ValueError(f"request {i} has an empty prompt" if segmented else f"prompt {i} is empty")
            _check_max_tokens(limit)
            if cache is not None:
                self._check_cache(i, cache)
        uids = list(range(self._next_uid, self._next_uid + count))
        sequences = [
            _Sequence(
                uid,
                prompt,
                limit,
                sampler,
                stop.matcher(),
                processors=chain,
                before=before,
                prefix=0 if cache is None else counted_offset(cache),
                cache=cache,
                boundaries=bounds,
            )
            for uid, prompt, limit, sampler, cache, chain, before, stop, bounds in zip(
                uids, tokens, limits, chosen, given, processors, earlier, stops, boundaries
            )
        ]
        for i, (s, cache) in enumerate(zip(sequences, given)):
            kept = self._fresh_kept if cache is None else _kept_window(cache)
            if kept is not None and (s.max_tokens == -1 or s.reserve - 1 > kept[0]):
                size, keep = kept
                held = "no limit (max_tokens=-1)" if s.max_tokens == -1 else f"{s.reserve - 1} positions"
                raise ValueError(
                    f"request {i} may grow to {held}, past its RotatingKVCache(max_size={size}, keep={keep}) layer "
                    f"caches (max_kv_size makes those): mlx-lm's BatchRotatingKVCache cannot keep their first {keep} "
                    f"positions, so its tokens would differ from a solo run once it outgrows {size}; keep prompt + "
                    f"max_tokens within {size + 1}, or construct the generator without max_kv_size"
                )
        if self.admission is not None and any(c is not None for c in given):
            blind = [r for r, b in enumerate(self.admission.bytes_per_position) if b == 0]
            if blind:  # their caches count no positions: they could not reserve a reused prefix alike
                raise ValueError(
                    f"caches= with memory_budget needs every rank's caches to count positions; rank(s) {blind} "
                    "hold only recurrent layers (linear attention, convolutions, Mamba): insert without caches, "
                    "or construct the generator without memory_budget"
                )
        if self.admission is not None:
            for i, s in enumerate(sequences):
                if not self.admission.fits([s.reserve]):
                    raise ValueError(
                        f"request {i} ({s.reserve} positions with max_tokens) would never fit the memory budget "
                        f"of some rank: {self.admission}"
                    )
        self._next_uid += count
        for s in sequences:
            self._sequences[s.uid] = s
        self._plan = enqueue(self._plan, [Job(s.uid, len(s.prompt) - 1, s.reserve, s.boundaries) for s in sequences])
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

    def remove(
        self, uids: Iterable[int], return_prompt_caches: bool = False
    ) -> dict[int, tuple[list[Any] | None, list[int]]]:
        """Drop requests, queued (even partly prefilled) or active; unknown uids are ignored.

        Takes effect before the next tick; a dropped request's own caches are
        freed, and its batch row is left out of every later step's results
        (the row itself is freed when the batch caches are next compacted).

        With ``return_prompt_caches`` (as mlx-lm's ``BatchGenerator``), returns
        ``{uid: (cache, tokens)}`` per dropped request: this rank's per-layer
        caches of it and the tokens they hold (``all_tokens`` given at insert,
        then its prompt and answer as far as every rank computed them). An
        active request's cache is a copy of its batch row (its prompt and every
        token it generated but the last, which was never fed back); a queued
        one's holds the prompt positions every rank prefilled (:meth:`prefilled`),
        or ``None`` when a part only some ranks prefilled cannot be cut off
        (recurrent layers); one not started yet gets back the cache it was
        inserted with (a new empty one if none). Otherwise ``{}``.
        """
        gone = {u for u in uids if u in self._sequences}
        if not gone:
            return {}
        handed_back = {u: self._handed_back(self._sequences[u]) for u in sorted(gone)} if return_prompt_caches else {}
        self._plan = drop(self._plan, gone)
        self._runner.drop(gone)
        for uid in gone:
            self._sequences.pop(uid).done = True
        self._compact_if_worth_it()
        return handed_back

    def extract_cache(self, uids: Iterable[int]) -> dict[int, tuple[list[Any] | None, list[int]]]:
        """``{uid: (cache, tokens)}`` of requests that stay in the generator (as mlx-lm's ``extract_cache``).

        An active request's cache is a copy of its batch row and ``tokens``
        what it holds (``all_tokens``, the prompt, the answer but its last
        token); a queued request's prefill is under way, so its cache is
        ``None`` (``tokens``: ``all_tokens`` and the prompt positions every
        rank prefilled). Unknown uids are left out. Nothing is sent.
        """
        found: dict[int, tuple[list[Any] | None, list[int]]] = {}
        for uid in uids:
            sequence = self._sequences.get(uid)
            if sequence is None:
                continue
            row = next((i for i, s in enumerate(self._rows) if s is sequence), None)
            if row is None:
                found[uid] = None, [*sequence.before, *sequence.prompt[: sequence.filled]]
            else:
                found[uid] = self._extract(row), sequence.held
        self._settle_extracted([c for c, _ in found.values() if c is not None])
        return found

    def _handed_back(self, sequence: _Sequence) -> tuple[list[Any] | None, list[int]]:
        """A request's caches and the tokens they hold, for :meth:`remove` (before it forgets the request)."""
        row = next((i for i, s in enumerate(self._rows) if s is sequence), None)
        if row is not None:
            cache = self._extract(row)
            self._settle_extracted([cache])
            return cache, sequence.held
        tokens = [*sequence.before, *sequence.prompt[: sequence.filled]]
        cache = sequence.cache
        if cache is None:
            return self._new_cache(), tokens
        # Chunks still travelling the ranks are in some ranks' caches only: cut them off, or give nothing back.
        ahead = any(c is not None and c.uid == sequence.uid for c in self._plan.inflight)
        if ahead and (sequence.prefix == UNCOUNTED or not trim_to(cache, sequence.prefix + sequence.filled)):
            return None, tokens
        with mx.stream(self.stage.compute_stream):
            mx.eval(cache_state(cache))  # pyright: ignore[reportUnknownMemberType]
        return cache, tokens

    def next(self) -> list[Response]:
        """Run one tick: a decode step of every active request and one prefill chunk per rank.

        Returns the decode step's :class:`Response` per active request (and an
        ``"error"`` response per request that failed in the tick); the same
        on every rank. ``[]`` when nothing is active: a tick that only
        prefilled, or nothing at all to do (then nothing is sent). (mlx-lm's
        ``BatchGenerator.next`` returns these as the second of a pair, after
        its prompt-progress responses; :meth:`next_generated` is mlx-lm's.)
        """
        stage = self.stage
        stage.settle(self.timeout)
        if self._plan.idle() and not self._rows:
            return []
        started = time.perf_counter()
        tick, after = self._plan_tick()
        if self._dead_rows() and self._limits is not None and self._plan.queue and tick.chunks[0] is None:
            self._compact()  # the dead rows may hold back a queued request: free them and plan again
            tick, after = self._plan_tick()
        self._join(tick.joins)
        if not self._rows and all(c is None for c in tick.chunks):
            self._plan = after
            return []
        work = TickWork(
            tick=tick,
            rows=len(self._rows),
            inputs=self._inputs,
            batch_cache=self._cache,
            uids_fingerprint=self._fingerprint(),
            prefixes_fingerprint=self._prefixes_fingerprint(),
            chunk_tokens=lambda c: self._sequences[c.uid].prompt[c.start : c.stop],
            chunk_cache=self._chunk_cache,
            sample=self._sample,
            greedy=self._greedy_rows(),
        )
        self._logprobs = None
        outcome = self._runner.run(work)
        self._plan = after
        done = tick.chunks[-1]
        if done is not None and done.uid in self._sequences:
            self._sequences[done.uid].filled = done.stop
        responses: list[Response] = []
        failed: set[int] = set(outcome.failed_uids)
        if outcome.failed_decode:
            failed.update(self.active_uids)
        extracted: list[list[Any]] = []
        for i, sequence in enumerate(self._rows):
            if sequence.done or sequence.uid in failed:
                continue
            token = outcome.tokens[i]
            sequence.generated += 1
            sequence.answer.append(token)
            reason: FinishReason | None = None
            if sequence.stop.advance(token):
                reason = "stop"
            elif sequence.max_tokens != -1 and sequence.generated >= sequence.max_tokens:
                reason = "length"
            prompt_cache = None if reason is None else self._extract(i)
            if prompt_cache is not None:
                extracted.append(prompt_cache)
            responses.append(
                Response(
                    sequence.uid,
                    token,
                    logprobs=None if self._logprobs is None else self._logprobs[i],
                    finish_reason=reason,
                    prompt_cache=prompt_cache,
                    all_tokens=None if reason is None else sequence.held,
                )
            )
        responses.extend(Response(uid, -1, finish_reason="error") for uid in sorted(failed) if uid in self._sequences)
        self._settle_extracted(extracted)
        self._inputs = [DEAD_ROW_INPUT if s.done else t for s, t in zip(self._rows, outcome.tokens)]
        self.remove({r.uid for r in responses if r.finish_reason is not None})
        self._count(tick, responses, time.perf_counter() - started)
        return responses

    def next_generated(self) -> list[Response]:
        """Run ticks until one decodes (as mlx-lm's ``next_generated``): its responses, or ``[]`` with nothing to do."""
        while True:
            responses = self.next()
            if responses or (self._plan.idle() and not self._rows):
                return responses

    def _count(self, tick: Tick, responses: list[Response], seconds: float) -> None:
        """Add a tick to the counters :meth:`stats` reads (a tick that decodes counts as decode time)."""
        counters = self._counters
        done = tick.chunks[-1]
        counters.prompt_tokens += 0 if done is None else done.length
        if any(r.finish_reason != "error" for r in responses):
            counters.generation_tokens += sum(1 for r in responses if r.finish_reason != "error")
            counters.generation_steps += 1
            counters.decode_time += seconds
        else:
            counters.prompt_time += seconds

    @contextlib.contextmanager
    def stats(self) -> Generator[BatchStats]:
        """The work done while the block runs, as mlx-lm's ``BatchGenerator.stats()`` reports it.

        Yields mlx-lm's ``BatchStats``, filled in on leaving the block:
        ``prompt_tokens`` counts prompt positions every rank prefilled (a
        reused prefix is not counted), ``generation_tokens`` the tokens
        returned and ``generation_steps`` the ticks that returned any. A tick
        computes a decode step and prefill chunks at once: its time counts as
        ``decode_time`` when it returned tokens, else as ``prompt_time``.
        ``peak_memory`` is this process's (GB).
        """
        stats = BatchStats()
        start = BatchCountersSnapshot(**asdict(self._counters))
        try:
            yield stats
        finally:
            stats += BatchCountersSnapshot.between(start, BatchCountersSnapshot(**asdict(self._counters)))

    @property
    def prompt_cache_nbytes(self) -> int:
        """Bytes of KV cache this rank holds: the batch caches (dead rows included) and the queued prompts'."""
        held = [*self._cache, *(c for s in self._sequences.values() if s.cache is not None for c in s.cache)]
        return sum(int(c.nbytes) for c in held)

    def close(self) -> None:
        """Drop every request (as :meth:`remove` does) and free the batch caches; nothing is sent.

        Call it on every rank alike. The generator stays usable: later
        requests start from an empty batch.
        """
        self.remove(list(self._sequences))
        self._compact()

    def _plan_tick(self) -> tuple[Tick, PlanState]:
        # Dead rows keep their reservation until compacted: their cache positions are still held.
        return plan_tick(
            self._plan,
            [s.reserve for s in self._rows],
            self.chunk_sizes,
            self.prefill_step_size,
            self._limits,
            self.prefill_batch_size,
        )

    def _chunk_cache(self, chunk: Chunk) -> list[Any]:
        sequence = self._sequences[chunk.uid]
        if sequence.cache is None:
            sequence.cache = self._new_cache()
        return sequence.cache

    def _join(self, uids: tuple[int, ...]) -> None:
        """Merge the caches of requests whose prefill every rank completed into the batch caches.

        Joining requests take the first dead rows' places when there are
        enough of them (:func:`fill_rows`); otherwise the dead rows are
        filtered out and the requests appended. Which rows they take is
        decided from data every rank has, so the rows stay in one order on
        every rank, whatever each rank's caches let it do in place.
        """
        if not uids:
            return
        joining = [self._sequences[u] for u in uids]
        caches = [s.cache if s.cache is not None else self._new_cache() for s in joining]
        for s in joining:
            s.cache = None
            s.filled = len(s.prompt) - 1
        dead = [i for i, s in enumerate(self._rows) if s.done]
        if self._cache and len(dead) >= len(joining):
            slots = dead[: len(joining)]
            fill_rows(self._cache, len(self._rows), slots, caches)
            for slot, s in zip(slots, joining):
                self._rows[slot] = s
                self._inputs[slot] = s.prompt[-1]
        else:
            if dead:
                self._compact()
            # Each layer cache's own batch class, as mlx-lm's BatchGenerator does: KVCache -> BatchKVCache
            # (left-padded).
            merged = [caches[0][layer].merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
            if self._cache:
                for batch, extra in zip(self._cache, merged):
                    batch.extend(extra)
            else:
                self._cache = merged
            self._rows.extend(joining)
            self._inputs = [*self._inputs, *(s.prompt[-1] for s in joining)]
        self._settle_cache()

    def _dead_rows(self) -> int:
        return sum(1 for s in self._rows if s.done)

    def _compact_if_worth_it(self) -> None:
        """Filter the dead rows out once they are at least :data:`COMPACT_DEAD_FRACTION` of the batch.

        A finished or removed request's row is not filtered out at once: a
        ``filter`` rebuilds every batch cache (a copy of all of them), and
        the first decode step after it cost about 35 ms more than a steady
        one (measured, benchmark model, 8 rows), where one more dead row in a
        step costs a few ms. Requests prefilled through the ticks join one
        tick apart and so finish one tick apart: filtering each would pay the
        rebuild once per request. The decision is made from data every rank
        has (the rows and who finished), so every rank compacts alike.
        """
        dead = self._dead_rows()
        if dead and dead >= COMPACT_DEAD_FRACTION * len(self._rows):
            self._compact()

    def _compact(self) -> None:
        """Filter the dead rows out of the batch caches (all of them: the caches go)."""
        keep = [i for i, s in enumerate(self._rows) if not s.done]
        self._rows = [self._rows[i] for i in keep]
        self._inputs = [self._inputs[i] for i in keep]
        if not keep:
            self._cache = []
            return
        for c in self._cache:
            c.filter(keep)
        self._settle_cache()

    def _extract(self, row: int) -> list[Any]:
        """Row ``row``'s caches, taken out of the batch caches on the compute stream (see :meth:`_settle_extracted`)."""
        with mx.stream(self.stage.compute_stream):
            return [c.extract(row) for c in self._cache]

    def _settle_extracted(self, caches: list[list[Any]]) -> None:
        """Evaluate extracted caches now: a copy of their rows only.

        Left lazy, they would hold the batch caches' current buffers, and the
        next decode step could not update those in place: it would copy
        every batch cache (measured: about 25 ms more for that step, 8 rows).
        """
        if caches:
            with mx.stream(self.stage.compute_stream):
                mx.eval([cache_state(c) for c in caches])  # pyright: ignore[reportUnknownMemberType]

    def _settle_cache(self) -> None:
        """Evaluate the batch caches after a merge or filter (local work, on the stage's compute stream)."""
        with mx.stream(self.stage.compute_stream):
            mx.eval(cache_state(self._cache))  # pyright: ignore[reportUnknownMemberType]

    def _fingerprint(self) -> int:
        """Of the rows' uids, a dead row counting as 0."""
        return fingerprint(0 if s.done else s.uid + 1 for s in self._rows)

    def _prefixes_fingerprint(self) -> int:
        """Of the rows' reused prefix lengths (a dead row: 0); ``UNKNOWN_PREFIXES`` when this rank cannot count one."""
        if any(not s.done and s.prefix == UNCOUNTED for s in self._rows):
            return UNKNOWN_PREFIXES
        return fingerprint(0 if s.done else s.prefix + 1 for s in self._rows)

    def _greedy_rows(self) -> bool:
        """Whether the output head may be shared this tick: the rows all greedy, none with logits processors."""
        if self.stage.vocab_shard is None or not self._rows:
            return False
        return all((s.sampler or self.sampler) is None and not s.processors for s in self._active)

    def _sample(self, logits: mx.array) -> mx.array:
        """Sample every row with its request's sampler (one batched call when all rows share one).

        Samplers get log-probabilities, as mlx-lm's do; they are kept (lazily)
        for the responses. An all-greedy batch takes the argmax of the logits
        instead: the same tokens (the log-softmax only shifts each row), and
        the vocabulary-wide ``logsumexp`` per row (measured on the CPU backend
        at 32000 entries: about 1.2 ms a row, 10 ms of a 50 ms tick at 8 rows)
        is computed only if a response's ``logprobs`` is read.

        Dead rows (their tokens are ignored) are left out of every sampler
        call: a sampler may keep state (a seeded request's random key), so it
        sees exactly the rows it would see without them. Their tokens are 0.
        Rows with logits processors have their logits processed first, one
        row at a time, as mlx-lm's ``BatchGenerator`` does.
        """
        logits = self._processed(logits)
        logprobs = self._logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [s.sampler or self.sampler for s in self._active]
        if all(s is None for s in samplers):
            return _greedy(logits)
        live = [i for i, s in enumerate(self._rows) if not s.done]
        if len(live) == len(self._rows):
            return _sample_rows(logprobs, samplers)
        index = mx.array(live)
        sampled = _sample_rows(logprobs[index], samplers)
        tokens = mx.zeros((len(self._rows),), dtype=sampled.dtype)
        tokens[index] = sampled
        return tokens

    def _processed(self, logits: mx.array) -> mx.array:
        """``logits`` with each live row's processors applied to it (the rows without any: as they are)."""
        if not any(s.processors and not s.done for s in self._rows):
            return logits
        rows: list[mx.array] = []
        for i, sequence in enumerate(self._rows):
            row = logits[i : i + 1]
            if sequence.processors and not sequence.done:  # what they see: all_tokens, the prompt, the answer
                context = mx.array([*sequence.before, *sequence.prompt, *sequence.answer])
                for processor in sequence.processors:
                    row = processor(context, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)


def _sample_rows(logprobs: mx.array, samplers: list[Sampler | None]) -> mx.array:
    """Row ``i`` of ``logprobs`` sampled with ``samplers[i]`` (``None``: greedy); one call when all are one."""
    first = samplers[0]
    if all(s is first for s in samplers):
        sampled = _greedy(logprobs) if first is None else first(logprobs)
        return mx.reshape(sampled, (-1,))
    rows = [
        mx.reshape(_greedy(logprobs[i : i + 1]) if s is None else s(logprobs[i : i + 1]), (-1,))
        for i, s in enumerate(samplers)
    ]
    return mx.concatenate(rows)


def fill_rows(batch_caches: list[Any], rows: int, slots: list[int], caches: list[list[Any]]) -> None:
    """Put request ``k``'s per-layer ``caches[k]`` into row ``slots[k]`` of the ``rows``-row batch caches.

    What those rows held (dead rows) is dropped. A ``BatchKVCache`` layer is
    written in place: each joining row right-aligned at the batch's current
    position, its left padding the rest (what the dead row left there is
    masked, as padding is). Only when a joining row is longer than the
    batch's are all rows first moved right by the difference (one copy, as
    ``extend`` makes one or two and the ``filter`` of the dead row another).
    In place, only the joining rows are copied; the first step after an
    ``extend`` cost about 35 ms more than a steady one (benchmark model, 8
    rows). Any other layer cache is extended and then filtered into the
    same row order.
    """
    for layer, batch in enumerate(batch_caches):
        joining = [c[layer] for c in caches]
        parts, joining_parts = cache_parts([batch]), [cache_parts([c]) for c in joining]
        if all(len(p) == len(parts) and all(map(_fits_in_place, parts, p)) for p in joining_parts):
            for i, part in enumerate(parts):  # a CacheList's parts (lend_heads) alike, in step with the other layers
                _widen(part, max(p[i].offset for p in joining_parts))
                for slot, p in zip(slots, joining_parts):
                    _write_row(part, slot, p[i])
            continue
        batch.extend(joining[0].merge(joining))
        order = list(range(rows))
        for k, slot in enumerate(slots):
            order[slot] = rows + k
        batch.filter(order)


def _fits_in_place(batch: Any, cache: Any) -> bool:
    """Whether ``cache`` (one request's, of the same layer) can be written into a row of ``batch``."""
    return (type(batch), type(cache)) == (BatchKVCache, KVCache) and batch.keys is not None


def _widen(batch: Any, positions: int) -> None:
    """Move every row of ``batch`` (a ``BatchKVCache``) right, so that it holds at least ``positions``."""
    shift = positions - batch.size()
    if shift <= 0:
        return
    keys, values, offset, left_padding, end = batch.state
    widths = [(0, 0), (0, 0), (shift, 0), (0, 0)]
    batch.state = (mx.pad(keys, widths), mx.pad(values, widths), offset, left_padding + shift, end + shift)


def _write_row(batch: Any, row: int, cache: Any) -> None:
    """Row ``row`` of ``batch`` (a ``BatchKVCache``) becomes ``cache``'s positions, right-aligned, left-padded."""
    end, length = batch.size(), cache.offset
    if length:
        batch.keys[row : row + 1, :, end - length : end, :] = cache.keys[..., :length, :]
        batch.values[row : row + 1, :, end - length : end, :] = cache.values[..., :length, :]
    batch.left_padding[row] = end - length
    batch.offset[row] = length


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _stop_sequences(entries: Iterable[int | Sequence[int]], name: str = "stop_sequences") -> StopSequences:
    """Token ids and sequences of them (an int is a sequence of one) as mlx-lm's matcher; an empty one refused."""
    sequences: list[list[int]] = []
    for entry in entries:
        sequence = [int(entry)] if isinstance(entry, int) else [int(t) for t in entry]
        if not sequence:
            raise ValueError(f"{name} holds an empty sequence; every stop sequence needs at least one token")
        sequences.append(sequence)
    return StopSequences(sequences)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _kept_window(cache: list[Any]) -> tuple[int, int] | None:
    """``(max_size, keep)`` of the smallest layer cache that is a ``RotatingKVCache`` keeping its first positions
    (``keep > 0``, as ``max_kv_size`` makes them); ``None`` when there is none (sliding windows keep none)."""
    kept: list[tuple[int, int]] = []
    for layer in cache:
        parts = getattr(layer, "caches", None)
        for c in cast(list[Any], parts) if isinstance(parts, (list, tuple)) else [layer]:
            keep = int(getattr(c, "keep", 0))
            if isinstance(c, RotatingKVCache) and keep > 0:
                kept.append((int(getattr(c, "max_size")), keep))
    return min(kept) if kept else None


def _boundaries(segments: list[list[int]]) -> tuple[int, ...]:
    """Where the segments of a prompt end, but the last: positions before the prompt's last token, which the first
    decode step feeds (mlx-lm cuts that token off into a segment of its own)."""
    ends: list[int] = []
    for segment in segments[:-1]:
        if segment:
            ends.append((ends[-1] if ends else 0) + len(segment))
    positions = sum(len(s) for s in segments) - 1
    return tuple(e for e in ends if 0 < e <= positions)


def _check_max_tokens(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"max_tokens must be a positive int or -1 (no limit), got {value!r}")
