"""The requests of a :class:`~pipemlx.runtime.batch.BatchGenerator` and the checks of what they and it are given.

Every check raises before anything changes and looks only at the call's arguments and the generator's
settings, which every rank has alike, so every rank accepts or refuses the same calls with the same message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache  # pyright: ignore[reportUnknownVariableType]

from ...schedule.batch_plan import Admission, QueuedPrompt
from ..caches import cache_parts, counted_offset
from ..prefill import check_timeout
from ..sampling import LogitsProcessor, Sampler
from ..stage import PipelineStage
from ..stops import StopMatcher, Stops, StopSet

FinishReason = Literal["length", "stop", "error"]


@dataclass(frozen=True)
class Decided:
    """A request's token decided in one tick and returned in the next, the tick that feeds it (as mlx-lm's
    ``BatchGenerator`` returns a token in the step that feeds it): the token, its log-probabilities (lazy) and why
    the request ends after it (``None``: it goes on)."""

    token: int
    logprobs: mx.array | None
    reason: FinishReason | None


@dataclass
class BatchRequest:
    """One request inserted and not yet finished: what it asked for (checked) and how far it got."""

    uid: int
    prompt: list[int]  # the tokens not in the cache at insert
    max_tokens: int
    sampler: Sampler | None
    stop: StopMatcher  # where the request's generated tokens stand in its stop sequences
    processors: tuple[LogitsProcessor, ...]
    before: list[int]  # all_tokens at insert: what a reused cache holds
    cache: list[Any] | None  # its per-layer caches until it joins the batch: the caller's, or made for its prefill
    boundaries: tuple[int, ...]  # prompt positions no prefill chunk crosses (ends of insert_segments' segments)
    prefix: int = field(init=False)  # positions the caller's cache held (a reused prefix); UNCOUNTED: can't tell
    answer: list[int] = field(default_factory=list[int])  # the tokens generated so far
    filled: int = 0  # prompt positions every rank has prefilled into ``cache``
    done: bool = False  # finished or removed; its batch row, if any, stays until the batch caches are compacted
    decided: Decided | None = None  # the token decided in the last tick: this tick feeds it and returns it
    window: int | None = None  # every layer cache keeps at most this many positions (rotating caches): its bound
    ahead: list[Decided] = field(default_factory=list[Decided])  # confirmed guesses before ``decided`` (speculate.py)

    def __post_init__(self) -> None:
        self.prefix = 0 if self.cache is None else counted_offset(self.cache)

    @property
    def held(self) -> list[int]:
        """The tokens an active request's cache holds between ticks: ``all_tokens``, the prompt and every token
        returned so far (:attr:`answer` but the token decided in the last tick, which the next tick feeds)."""
        return [*self.before, *self.prompt, *self.answer[:-1]]

    @property
    def fed(self) -> list[int]:
        """The tokens a finished request's cache holds after its closing tick fed its last token: the whole
        conversation, as mlx-lm's ``BatchGenerator`` hands it back."""
        return [*self.before, *self.prompt, *self.answer]

    @property
    def prefilled_tokens(self) -> list[int]:
        """The tokens a queued request's cache holds on every rank: ``all_tokens``, the prompt positions prefilled."""
        return [*self.before, *self.prompt[: self.filled]]

    @property
    def context(self) -> list[int]:
        """What its logits processors see: ``all_tokens``, the prompt, the answer."""
        return [*self.before, *self.prompt, *self.answer]

    @property
    def reserve(self) -> int:
        """Cache positions this request may reach: its prompt and every token it may generate (the last one is fed
        too, by its closing tick), at most its caches' :attr:`window` (rotating caches keep no more)."""
        whole = max(self.prefix, 0) + len(self.prompt) + max(self.max_tokens, 0)
        return whole if self.window is None else min(whole, self.window)

    @property
    def queued(self) -> QueuedPrompt:
        """The request as the tick plan queues it: the prompt positions to prefill (all but the last token)."""
        return QueuedPrompt(self.uid, len(self.prompt) - 1, self.reserve, self.boundaries)

    def take(self, token: int) -> FinishReason | None:
        """Add a generated token; ``"stop"`` when it ends a stop sequence, ``"length"`` at ``max_tokens``."""
        self.answer.append(token)
        if self.stop.advance(token):
            return "stop"
        return "length" if self.max_tokens != -1 and len(self.answer) >= self.max_tokens else None


class GeneratorSettings(Protocol):
    """What a generator's requests are checked against and default to."""

    stage: PipelineStage
    max_tokens: int
    stop_sequences: StopSet
    logits_processors: tuple[LogitsProcessor, ...]
    admission: Admission | None


OPTIONAL = ("memory_budget", "completion_batch_size", "prefill_batch_size", "max_kv_size")
"""The generator's sizes that may be ``None`` (no limit)."""


def check_settings(
    stage: PipelineStage,
    stream: object,
    max_tokens: int,
    timeout: float | None,
    sizes: dict[str, int | None],
    chunking: str,
    stop_tokens: Iterable[int | Sequence[int]],
) -> StopSet:
    """The generator's ``stop_tokens`` as a :class:`StopSet`; raise ``ValueError`` for a bad setting of the generator:
    ``sizes`` must be positive ints (those named in :data:`OPTIONAL` may be ``None``), ``stream`` on the stage's device.
    """
    check_max_tokens(max_tokens)
    check_timeout(timeout)
    for name, size in sizes.items():
        if size is not None or name not in OPTIONAL:
            check_positive(name, size)
    stage.check_stream(stream, not_a_stream=ValueError)  # ValueError: the generator's bad values
    if chunking not in ("fixed", "equal-cost"):
        raise ValueError(f"prefill_chunking must be 'fixed' or 'equal-cost', got {chunking!r}")
    return StopSet.of(stop_tokens, "stop_tokens")


def check_batchable(cache: list[Any], stage: PipelineStage) -> None:
    """Raise ``TypeError`` when mlx-lm cannot batch the layer caches of a new request's ``cache``."""
    unbatchable = sorted({type(c).__name__ for c in cache if not hasattr(c, "merge")})
    if unbatchable:
        raise TypeError(f"{stage.describe()}: mlx-lm cannot batch these layer caches: {unbatchable}")


def as_batch_window(cache: list[Any]) -> list[Any]:
    """``cache`` with each ``RotatingKVCache`` that keeps its first positions (``keep > 0``, as ``max_kv_size`` makes
    them) turned, in place, into one that keeps none, holding what mlx-lm's ``BatchRotatingKVCache.merge`` takes of it
    (its last ``size()`` positions, in order); returns ``cache``.

    mlx-lm's ``BatchGenerator`` prefills a prompt in its batch caches, whose rotating kind has no ``keep``: every
    position attends to the ``max_size`` positions up to it (itself included), however the prompt is chunked. A
    prompt prefilled in such a cache, in pipemlx's chunks, therefore fills it as mlx-lm's batch does; one that kept
    its first positions would attend to them, and to another window in each chunk (it depends on the chunks).
    """
    for part in cache_parts(cache):
        if not isinstance(part, RotatingKVCache) or int(getattr(part, "keep", 0)) == 0:
            continue
        c = cast(Any, part)
        if c.keys is not None:
            size = int(c.size())
            c.keys = c._temporal_order(c.keys)[..., -size:, :]  # as mlx-lm's merge reads it
            c.values = c._temporal_order(c.values)[..., -size:, :]
            c._idx = size
        c.keep = 0
    return cache


@dataclass(frozen=True)
class Options:
    """``insert``'s per-prompt options as given: one entry per prompt (``max_tokens`` may be one int for all);
    ``None``: the generator's for every prompt."""

    max_tokens: Sequence[int] | int | None
    caches: Sequence[list[Any] | None] | None
    all_tokens: Sequence[Sequence[int] | None] | None
    samplers: Sequence[Sampler | None] | None
    logits_processors: Sequence[Sequence[LogitsProcessor] | None] | None
    stop_sequences: Sequence[Stops | None] | None


def checked_requests(
    settings: GeneratorSettings,
    first_uid: int,
    fresh_bound: int | None,
    prompts: Sequence[Sequence[Sequence[int]]],
    segmented: bool,
    options: Options,
) -> list[BatchRequest]:
    """The requests of an ``insert`` (uids from ``first_uid``); raise ``ValueError`` for a bad one.

    ``prompts[i]`` is request ``i``'s prompt in segments (``insert_segments`` when ``segmented``).
    ``fresh_bound`` is :func:`bound_of` a new request's caches.
    """
    segments = [[[int(t) for t in part] for part in request] for request in prompts]
    count = len(segments)
    max_tokens = settings.max_tokens if options.max_tokens is None else options.max_tokens
    limits = [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)
    chosen: list[Sampler | None] = [None] * count if options.samplers is None else list(options.samplers)
    given: list[list[Any] | None] = [None] * count if options.caches is None else list(options.caches)
    processors = [settings.logits_processors] * count
    if options.logits_processors is not None:
        processors = [tuple(p or ()) for p in options.logits_processors]
    earlier = [[] if t is None else [int(x) for x in t] for t in options.all_tokens or [None] * count]
    stops = [
        settings.stop_sequences if s is None else StopSet.given(s, "stop_sequences")
        for s in (options.stop_sequences or [None] * count)
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
    for i, (prompt, limit, cache) in enumerate(zip(tokens, limits, given)):
        if not prompt:
            raise ValueError(f"request {i} has an empty prompt" if segmented else f"prompt {i} is empty")
        check_max_tokens(limit)
        if cache is not None:
            _check_cache(i, cache, settings.stage)
    requests = [
        BatchRequest(uid, prompt, limit, sampler, stop.matcher(), chain, before, cache, _boundaries(parts))
        for uid, (prompt, limit, sampler, cache, chain, before, stop, parts) in enumerate(
            zip(tokens, limits, chosen, given, processors, earlier, stops, segments), first_uid
        )
    ]
    for request in requests:
        request.window = fresh_bound if request.cache is None else bound_of(request.cache)
    if settings.admission is not None:
        _check_admission(requests, settings.admission)
    return requests


def check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_max_tokens(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"max_tokens must be a positive int or -1 (no limit), got {value!r}")


def _check_cache(index: int, cache: object, stage: PipelineStage) -> None:
    """Raise ``ValueError`` unless ``cache`` is one batchable mlx-lm cache per local layer."""
    layers = len(stage.info.layers)
    if not isinstance(cache, list) or len(cast(list[Any], cache)) != layers:
        raise ValueError(
            f"caches[{index}] must be a list of {layers} layer caches ({stage.describe()}), made with "
            "mlx_lm.models.cache.make_prompt_cache(model) on the sharded model"
        )
    entries = cast(list[Any], cache)
    if any(not hasattr(c, "merge") for c in entries):
        kinds = sorted({type(c).__name__ for c in entries})
        raise ValueError(f"caches[{index}] holds caches mlx-lm cannot batch: {kinds}")


def bound_of(cache: list[Any]) -> int | None:
    """The most positions every layer cache of ``cache`` keeps: the smallest ``max_size`` when every one is a
    ``RotatingKVCache`` (as ``max_kv_size`` makes them on a model without a ``make_cache`` of its own); ``None``
    when some layer's cache grows without bound."""
    parts = cache_parts(cache)
    if not parts or not all(isinstance(c, RotatingKVCache) for c in parts):
        return None
    return min(int(getattr(c, "max_size")) for c in parts)


def _check_admission(requests: list[BatchRequest], admission: Admission) -> None:
    """Refuse requests the memory budget could never admit, or reused caches some rank cannot reserve alike."""
    blind = [r for r, b in enumerate(admission.bytes_per_position) if b == 0]
    if blind and any(r.cache is not None for r in requests):  # their caches count no positions
        raise ValueError(
            f"caches= with memory_budget needs every rank's caches to count positions; rank(s) {blind} "
            "hold only recurrent layers (linear attention, convolutions, Mamba): insert without caches, "
            "or construct the generator without memory_budget"
        )
    for i, request in enumerate(requests):
        if not admission.fits([request.reserve]):
            raise ValueError(
                f"request {i} ({request.reserve} positions with max_tokens) would never fit the memory budget "
                f"of some rank: {admission}"
            )


def _boundaries(segments: list[list[int]]) -> tuple[int, ...]:
    """Where the segments of a prompt end, but the last: positions before the prompt's last token, which the first
    decode step feeds (mlx-lm cuts that token off into a segment of its own)."""
    ends: list[int] = []
    for segment in segments[:-1]:
        if segment:
            ends.append((ends[-1] if ends else 0) + len(segment))
    positions = sum(len(s) for s in segments) - 1
    return tuple(e for e in ends if 0 < e <= positions)
