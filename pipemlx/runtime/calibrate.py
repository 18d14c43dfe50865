"""Calibrating ``prefill_step_size="auto"`` on the group: the MLX side of :mod:`pipemlx.schedule.autostep`.

The first auto request calibrates: every rank times its own layers on a chunk
of each of :data:`CALIBRATION_LENGTHS` at position 0 and on one chunk after the
longest (no communication: the edges are detached), turns the timings into the
per-layer costs of :class:`pipemlx.schedule.costmodel.LayerCosts` (a cost per
chunk length, and the attention to earlier positions), and times a small
collective. The ranks all-gather what they measured and keep the slowest
rank's figures, so every rank holds the very same
:class:`~pipemlx.schedule.costmodel.CostModel` and
:func:`pipemlx.schedule.autostep.choose_step` derives the very same step on
every rank. The agreed figures go to the calibration cache
(:mod:`pipemlx.runtime.calibration_cache`), so that the next run with the same
model, split and machines reads them instead of measuring again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from ..errors import PeerLostError, PipelineTimeoutError
from ..schedule.costmodel import (
    CostModel,
    LayerCosts,
    cache_only_share,
    feed_forward_share_of,
    fit_layer_costs,
    lent_halves,
    lent_heads_share_of,
)
from ..schedule.plan import Chunk
from . import calibration_cache
from .caches import cache_parts, cache_state
from .protocol import CALIBRATE, gather
from .stage import PipelineStage, StageInfo
from .waits import wait_for

CALIBRATION_LENGTHS = (16, 32, 64, 128, 256, 512)
"""Chunk lengths timed at position 0 (each on a fresh cache): the costs per length of :class:`LayerCosts`."""
ATTENTION_CHUNK = 128
"""A chunk of this length is timed again after the longest one, at its end: its extra time is attention."""
FAR_POSITION = 4096
FAR_LENGTHS = (128, 256)
"""Chunk lengths timed again after :data:`FAR_POSITION` positions (zeros in the caches, not computed): their time
beyond the same chunk at position 0 is attention, :attr:`LayerCosts.far_pairs`. Shorter chunks pay what 128-token
ones do per pair, so timing them would only add noise."""
CALIBRATION_PASSES = 2
COLLECTIVE_SAMPLES = 5


def layer_shapes(model: nn.Module) -> tuple[int, int, int] | None:
    """``(hidden, key-value width, intermediate)`` of ``model``'s decoder layers from its ``args``; ``None`` if unknown."""
    args: Any = getattr(model, "args", None)

    def size(name: str) -> int:
        value = getattr(args, name, None)
        return value if isinstance(value, int) and value > 0 else 0

    hidden, heads, intermediate = size("hidden_size"), size("num_attention_heads"), size("intermediate_size")
    kv_heads = size("num_key_value_heads") or heads
    head_dim = size("head_dim") or (hidden // heads if heads else 0)
    if not (hidden and kv_heads and intermediate and head_dim):
        return None
    return hidden, kv_heads * head_dim, intermediate


def last_layer_share(model: nn.Module) -> float:
    """The share of a layer the model's last layer costs in a prefill (only its cache is needed)."""
    shapes = layer_shapes(model)
    return 1.0 if shapes is None else cache_only_share(*shapes)


def feed_forward_share(model: nn.Module, lent_fraction: float = 0.0) -> float:
    """The share of a layer's per-token work ``lend="mlp"`` moves (its feed-forward half; with ``lent_fraction`` of the
    key-value heads lent, also the output projection and those heads' projections); 0 if unknown."""
    shapes = layer_shapes(model)
    if shapes is None:
        return 0.0
    return lent_heads_share_of(*shapes, lent_fraction) if lent_fraction else feed_forward_share_of(*shapes)


def plain_leaves(cache: Sequence[Any]) -> list[Any] | None:
    """Every :class:`KVCache` in ``cache`` (inside a ``CacheList`` too); ``None`` if it holds a cache of another kind."""
    leaves = cache_parts(list(cache))
    return leaves if all(type(c) is KVCache for c in leaves) else None


def has_position_table(model: nn.Module) -> bool:
    """Whether ``model`` looks positions up in a table (gpt2's ``wpe``), which may hold fewer rows than the far
    chunks' positions: those would read past its end."""
    modules = cast(list[tuple[str, nn.Module]], model.named_modules())  # pyright: ignore[reportUnknownMemberType]
    return any(
        isinstance(module, nn.Embedding) and (name.rsplit(".", 1)[-1] == "wpe" or "position" in name)
        for name, module in modules
    )


def far_cache(model: nn.Module, stage: PipelineStage, position: int, timeout: float | None) -> list[Any] | None:
    """A fresh cache of ``model`` holding ``position`` positions, all but the first zeros written straight into it
    (cheap: nothing is computed); ``None`` when some cache is not a plain :class:`KVCache` (then the positions
    cannot be faked) or the model has a table of positions."""
    if has_position_table(model):
        return None
    cache = make_prompt_cache(model)
    leaves = plain_leaves(cache)
    if leaves is None:
        return None
    with mx.stream(stage.compute_stream):
        model(mx.array([[0]], dtype=mx.int32), cache=cache)
        for leaf in leaves:
            keys, values = cast(mx.array, leaf.keys), cast(mx.array, leaf.values)
            rows, heads, _, _ = keys.shape
            leaf.update_and_fetch(
                mx.zeros((rows, heads, position - 1, keys.shape[-1]), keys.dtype),
                mx.zeros((rows, heads, position - 1, values.shape[-1]), values.dtype),
            )
    wait_for(cache_state(cache), timeout, lambda: f"{stage.describe()} filling a cache to calibrate")
    return cache


Timings = tuple[list[tuple[int, float]], float, list[tuple[int, float]]]
"""Seconds at each of :data:`CALIBRATION_LENGTHS` at position 0, of :data:`ATTENTION_CHUNK` tokens after the
longest, and at each of :data:`FAR_LENGTHS` after :data:`FAR_POSITION` positions (none when not timed)."""


def fastest_timings(
    timed: Callable[[list[Any], int, int], float],
    fresh: Callable[[], list[Any]],
    far: Callable[[], list[Any] | None],
) -> Timings:
    """:data:`Timings`, each the fastest of :data:`CALIBRATION_PASSES` passes after a warm-up pass (the least
    disturbed by other work). ``timed(cache, start, stop)`` runs positions ``start:stop`` on ``cache``;
    ``fresh()`` makes empty caches; ``far()`` caches holding :data:`FAR_POSITION` positions, or ``None``."""
    longest = CALIBRATION_LENGTHS[-1]
    best = [math.inf] * (len(CALIBRATION_LENGTHS) + 1)
    far_best = [math.inf] * len(FAR_LENGTHS)
    spans = [(0, length) for length in CALIBRATION_LENGTHS] + [(longest, longest + ATTENTION_CHUNK)]
    for attempt in range(1 + CALIBRATION_PASSES):
        cache: list[Any] = []
        for i, (start, stop) in enumerate(spans):
            if start == 0:
                cache = fresh()
            seconds = timed(cache, start, stop)
            if attempt:
                best[i] = min(best[i], seconds)
        filled = far() if attempt else None
        for i, length in enumerate(FAR_LENGTHS):
            if filled is None:
                break
            far_best[i] = min(far_best[i], timed(filled, 0, length))
            trim_prompt_cache(filled, length)
    at_start: list[tuple[int, float]] = list(zip(CALIBRATION_LENGTHS, best))
    far_timed = [(n, s) for n, s in zip(FAR_LENGTHS, far_best) if s < math.inf]
    return at_start, best[-1], far_timed


def time_local_layers(model: nn.Module, stage: PipelineStage, timeout: float | None) -> Timings:
    """:data:`Timings` of this rank's layers (the edges detached: nothing is sent)."""
    tokens = mx.array([[0] * (CALIBRATION_LENGTHS[-1] + ATTENTION_CHUNK)], dtype=mx.int32)  # data, not a lazy op

    def timed(cache: list[Any], start: int, stop: int) -> float:
        began = time.perf_counter()
        with mx.stream(stage.compute_stream):
            model(tokens[:, start:stop], cache=cache)
        wait_for(cache_state(cache), timeout, lambda: f"{stage.describe()} calibrating its layers")
        return time.perf_counter() - began

    with stage.detached():
        return fastest_timings(
            timed, lambda: make_prompt_cache(model), lambda: far_cache(model, stage, FAR_POSITION, timeout)
        )


def per_layer(
    at_start: Sequence[tuple[int, float]],
    attention_chunk_s: float,
    token_layers: float,
    attention_layers: float,
    far_timed: Sequence[tuple[int, float]] = (),
) -> list[float]:
    """A rank's timings as one layer's: the seconds at each length (over ``token_layers``, the layers' worth of
    per-token work the rank does), then ``attention_s``, the seconds per query-key pair of the
    :data:`ATTENTION_CHUNK`-token chunk's attention to the positions before it (its time beyond a chunk of its
    length at position 0, over ``attention_layers``), then the same per pair for each of ``far_timed``'s chunks
    after :data:`FAR_POSITION` positions."""
    lengths = [length for length, _ in at_start]
    rank = layer_costs(lengths, [s for _, s in at_start], 0.0)

    def per_pair(length: int, seconds: float, before: int) -> float:
        return max(0.0, (seconds - rank.seconds_at_start(length)) / attention_layers / (length * before))

    attention_s = per_pair(ATTENTION_CHUNK, attention_chunk_s, lengths[-1])
    far = [per_pair(length, seconds, FAR_POSITION) for length, seconds in far_timed]
    return [s / token_layers for _, s in rank.at_start] + [attention_s, *far]


def layer_costs(
    lengths: Sequence[int],
    seconds: Sequence[float],
    attention_s: float,
    far_pairs: tuple[tuple[int, float], ...] = (),
) -> LayerCosts:
    """:class:`LayerCosts` from a layer's seconds at ``lengths`` at position 0 (made non-decreasing in the length:
    the timings are noisy, and a longer chunk never costs less), with ``chunk_s`` and ``token_s`` the straight
    line through them, and the seconds per pair ``far_pairs`` measured far in."""
    at_start = tuple(zip(lengths, itertools.accumulate(seconds, max)))
    line = fit_layer_costs([(Chunk(i, 0, n), t) for i, (n, t) in enumerate(at_start)], num_layers=1)
    return LayerCosts(line.chunk_s, line.token_s, attention_s, at_start, far_pairs)


def time_collective(stage: PipelineStage, timeout: float | None) -> float:
    """Median seconds of a tiny all-gather on this group."""
    seconds: list[float] = []
    for _ in range(COLLECTIVE_SAMPLES):
        start = time.perf_counter()
        with mx.stream(stage.compute_stream):
            gathered = mx.distributed.all_gather(mx.array([0], dtype=mx.int32), group=stage.group)
        wait_for(gathered, timeout, lambda: f"{stage.describe()} timing a collective")
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def over_ranks(
    group: mx.distributed.Group,
    stream: mx.Stream,
    measured: Sequence[float],
    timeout: float | None,
    who: str,
    what: str,
) -> tuple[list[float], list[float]]:
    """Every rank's ``measured`` all-gathered: the largest and the smallest value of each entry over the ranks."""
    with mx.stream(stream):
        gathered = gather(CALIBRATE.row({}, payload=[mx.array(list(measured), dtype=mx.float32)]), group)
    wait_for(gathered, timeout, lambda: f"{who} sharing {what}")
    figures = mx.array(CALIBRATE.read(gathered, group.size(), f"sharing {what}").payloads)
    return cast(list[float], figures.max(axis=0).tolist()), cast(list[float], figures.min(axis=0).tolist())


def calibrate(model: nn.Module, stage: PipelineStage, timeout: float | None) -> CostModel:
    """Measure this group and return the cost model every rank agrees on (a collective: all ranks call it).

    The agreed figures are written to the calibration cache (:mod:`.calibration_cache`) for the next run.
    """
    share = last_layer_share(model)
    local_layers = len(stage.info.layers) - (1 - share if stage.is_last else 0)
    halves = lent_halves(stage.rank, stage.world_size)
    token_layers = local_layers + halves * stage.info.lending.share
    attention_layers = local_layers + halves * stage.info.lending.pair_share
    at_start, attention_chunk_s, far_timed = time_local_layers(model, stage, timeout)
    measured = per_layer(at_start, attention_chunk_s, token_layers, attention_layers, far_timed)
    missing = [-1.0] * (len(CALIBRATION_LENGTHS) + 1 + len(FAR_LENGTHS) - len(measured))  # no far timings here
    figures = [*measured, *missing, time_collective(stage, timeout)]
    slowest, fastest = over_ranks(
        stage.group, stage.compute_stream, figures, timeout, stage.describe(), "the calibration"
    )
    if min(fastest) < 0:  # some rank timed no far chunks: none are used
        slowest = [*slowest[: len(CALIBRATION_LENGTHS) + 1], *slowest[-1:]]
    calibration_cache.store("stage", stage_key(model, stage), slowest)
    return stage_cost_model(model, stage, slowest)


def stage_cost_model(model: nn.Module, stage: PipelineStage, figures: Sequence[float]) -> CostModel:
    """The cost model of :func:`calibrate`'s agreed ``figures``: the seconds at each of :data:`CALIBRATION_LENGTHS`,
    the attention per pair, per far pair at each of :data:`FAR_LENGTHS` (or none), and a collective's seconds."""
    n = len(CALIBRATION_LENGTHS)
    seconds, attention_s, far, collective_s = figures[:n], figures[n], figures[n + 1 : -1], figures[-1]
    far_pairs = tuple(zip(FAR_LENGTHS, far))
    return CostModel(
        layer=layer_costs(CALIBRATION_LENGTHS, seconds, attention_s, far_pairs),
        layers=stage.info.split,
        hidden_size=stage.info.hidden_size or 1,
        collective_s=collective_s,
        latency_s=collective_s / 2,
        last_layer_share=last_layer_share(model),
        lent_share=stage.info.lending.share,
        lent_pair_share=stage.info.lending.pair_share,
    )


CALIBRATION_SETTINGS = {
    "lengths": CALIBRATION_LENGTHS,
    "attention_chunk": ATTENTION_CHUNK,
    "far_position": FAR_POSITION,
    "far_lengths": FAR_LENGTHS,
    "passes": CALIBRATION_PASSES,
}
"""What the calibration times: part of every calibration cache key."""


def quantization(model: nn.Module) -> list[list[int]]:
    """The ``(bits, group size)`` pairs of the model's quantized modules: part of the cache key (the configuration
    mlx-lm keeps in ``args`` does not say)."""
    pairs: set[tuple[int, int]] = set()
    for _, module in cast(list[tuple[str, nn.Module]], model.named_modules()):  # pyright: ignore[reportUnknownMemberType]
        bits, size = getattr(module, "bits", None), getattr(module, "group_size", None)
        if isinstance(bits, int) and isinstance(size, int):
            pairs.add((bits, size))
    return [list(p) for p in sorted(pairs)]


def group_key(model: nn.Module, info: StageInfo) -> dict[str, Any]:
    """What a group's timings depend on, besides what is lent: model, split, dtype, machines and software."""
    return {
        **calibration_cache.environment(),
        "config": calibration_cache.model_config(model),
        "quantization": quantization(model),
        "split": list(info.split),
        "world_size": info.world_size,
        "hidden_size": info.hidden_size,
        "dtype": str(info.dtype),
        "settings": CALIBRATION_SETTINGS,
    }


def stage_key(model: nn.Module, stage: PipelineStage) -> dict[str, Any]:
    """The calibration cache key of :func:`calibrate`'s figures: :func:`group_key` and what each cut lends."""
    lending = stage.info.lending
    return {**group_key(model, stage.info), "lending": [lending.mlp, lending.heads, lending.share, lending.pair_share]}


def cached_cost_model(model: nn.Module, stage: PipelineStage) -> CostModel | None:
    """The cost model an earlier :func:`calibrate` stored for this stage; ``None`` if none can be trusted."""
    n = len(CALIBRATION_LENGTHS)
    stored = calibration_cache.figures(calibration_cache.load("stage", stage_key(model, stage)))
    if stored is None or len(stored) not in (n + 2, n + 2 + len(FAR_LENGTHS)):
        return None
    return stage_cost_model(model, stage, stored)


def held_calibration(model: nn.Module, stage: PipelineStage) -> int:
    """This rank's cost model, read from the calibration cache if it has none yet, as the fingerprint the ranks
    compare (0: none). Ranks whose fingerprints differ, or any 0, calibrate together (:func:`calibrate`)."""
    if stage.cost_model is None:
        stage.cost_model = cached_cost_model(model, stage)
    if stage.cost_model is None:
        return 0
    return calibration_cache.fingerprint(dataclasses.asdict(stage.cost_model))


def must_calibrate(held: Sequence[int]) -> bool:
    """Whether the ranks holding cost models of fingerprints ``held`` (0: none) must calibrate again."""
    return 0 in held or len(set(held)) > 1


def time_layer(layer: nn.Module, hidden_size: int, dtype: mx.Dtype) -> Timings:
    """:data:`Timings` of one decoder layer called on its own (``layer(x, mask, cache)``, random hidden states, a
    fresh ``KVCache``): before the model is cut, on the calling thread, nothing sent."""
    shape = (1, CALIBRATION_LENGTHS[-1] + ATTENTION_CHUNK, hidden_size)
    hidden = mx.random.normal(shape, key=mx.random.key(0)).astype(dtype)
    mx.eval(hidden)  # pyright: ignore[reportUnknownMemberType]
    call = cast(Any, layer)

    def timed(cache: list[Any], start: int, stop: int) -> float:
        began = time.perf_counter()
        mx.eval(call(hidden[:, start:stop], "causal" if stop - start > 1 else None, cache[0]), cache_state(cache))  # pyright: ignore[reportUnknownMemberType]
        return time.perf_counter() - began

    def far() -> list[Any]:
        cache: list[Any] = [KVCache()]
        timed(cache, 0, 1)
        keys, values = cast(mx.array, cache[0].keys), cast(mx.array, cache[0].values)
        cache[0].update_and_fetch(
            mx.zeros((1, keys.shape[1], FAR_POSITION - 1, keys.shape[-1]), keys.dtype),
            mx.zeros((1, values.shape[1], FAR_POSITION - 1, values.shape[-1]), values.dtype),
        )
        mx.eval(cache_state(cache))  # pyright: ignore[reportUnknownMemberType]
        return cache

    return fastest_timings(timed, lambda: [KVCache()], far)


def group_layer_costs(model: nn.Module, layer: nn.Module, info: StageInfo, group: mx.distributed.Group) -> LayerCosts:
    """One decoder layer's costs as the slowest rank measures them (:func:`time_layer` on each rank's own
    ``layer``, then an all-gather: the same costs on every rank; a collective, all ranks call it).

    Read from the calibration cache when every rank holds the same figures there (one small all-gather compares
    their fingerprints); measured, and stored, otherwise.
    """
    n = len(CALIBRATION_LENGTHS)
    key = group_key(model, info)
    stored = calibration_cache.figures(calibration_cache.load("layer", key), n + 1 + len(FAR_LENGTHS))
    stream = mx.new_thread_unsafe_stream(mx.default_device())
    held = 0 if stored is None else calibration_cache.fingerprint(stored)
    if group.size() > 1:
        where = "asking whether the ranks hold the same layer costs (lend='auto')"
        table = CALIBRATE.exchange(
            group, stream, {"calibration": held}, timeout=info.timeout, where=where, who=info.describe()
        )
        if must_calibrate(table["calibration"]):
            stored = None
    if stored is None:
        at_start, attention_chunk_s, far_timed = time_layer(layer, info.hidden_size, info.dtype or mx.float32)
        measured = per_layer(at_start, attention_chunk_s, 1.0, 1.0, far_timed)
        what = "a layer's costs (lend='auto')"
        stored, _ = over_ranks(group, stream, measured, info.timeout, info.describe(), what)
        calibration_cache.store("layer", key, stored)
    far_pairs = tuple(zip(FAR_LENGTHS, stored[n + 1 :]))
    return layer_costs(CALIBRATION_LENGTHS, stored[:n], stored[n], far_pairs)


def calibrated(model: nn.Module, stage: PipelineStage, timeout: float | None) -> CostModel:
    """The group's agreed cost model, calibrated first unless every rank holds the same one (a collective: all ranks
    call it).

    Each rank takes its cost model from memory (a rank may have calibrated for ``prefill_step_size="auto"``
    already) or the calibration cache; one small all-gather compares what they hold; then every rank calibrates
    together or none does, so the ranks keep the same model.
    """
    held = held_calibration(model, stage)
    try:
        needs = held == 0
        if stage.world_size > 1:
            where, who = "asking whether the group has calibrated", stage.describe()
            values = {"calibration": held}
            table = CALIBRATE.exchange(stage.group, stage.compute_stream, values, timeout=timeout, where=where, who=who)
            needs = must_calibrate(table["calibration"])
        if needs:
            stage.cost_model = calibrate(model, stage, timeout)
    except (PipelineTimeoutError, PeerLostError) as exc:
        stage.mark_broken(exc)
        raise
    return stage.cost_model


SPEED_TOKENS = 128
SLOWDOWN_VARIABLE = "PIPEMLX_TEST_SLOWDOWN"
"""For tests: a factor this rank's measured time is multiplied by (a slower machine, simulated)."""
SPEED_PASSES = 3


def measure_speeds(
    group: mx.distributed.Group, hidden: int, intermediate: int, dtype: mx.Dtype, timeout: float | None
) -> list[float]:
    """Every rank's speed (higher is faster), the same list on every rank (a collective: all ranks call it).

    Each rank times the two matrix products of an MLP of the model's widths
    (capped to 256..1024) on :data:`SPEED_TOKENS` tokens, best of
    :data:`SPEED_PASSES` after a warm-up, so that what makes a rank slow (its
    BLAS, its share of the cores, its chip) shows.
    """
    width = max(256, min(1024, hidden))
    inner = max(256, min(1024, intermediate or 4 * hidden))
    key = mx.random.key(0)
    x = mx.random.normal((SPEED_TOKENS, width), key=key).astype(dtype)
    up = (mx.random.normal((width, inner), key=key) * 0.02).astype(dtype)
    down = (mx.random.normal((inner, width), key=key) * 0.02).astype(dtype)
    mx.eval(x, up, down)  # pyright: ignore[reportUnknownMemberType]
    best = math.inf
    for attempt in range(1 + SPEED_PASSES):
        start = time.perf_counter()
        y = x
        for _ in range(4):
            y = (y @ up) @ down
        mx.eval(y)  # pyright: ignore[reportUnknownMemberType]
        if attempt:
            best = min(best, time.perf_counter() - start)
    best *= float(os.environ.get(SLOWDOWN_VARIABLE, "1") or 1)
    mine = mx.array([best], dtype=mx.float32)
    if group.size() == 1:
        return [1.0 / best]
    with mx.stream(mx.new_thread_unsafe_stream(mx.default_device())):  # a stream wait_for's thread can run
        gathered = mx.distributed.all_gather(mine, group=group)
    wait_for(gathered, timeout, lambda: f"rank {group.rank()}/{group.size()} sharing its speed")
    seconds: list[float] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
    return [1.0 / max(s, 1e-9) for s in seconds]
