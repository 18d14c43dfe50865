"""Costs for ``prefill_step_size="auto"`` and ``lend="auto"``: the MLX side of :mod:`pipemlx.schedule.autostep`.

**Nothing is timed on a request's critical path.** Until the group agrees on measured costs (in memory or in the
calibration cache), an auto request plans with the *prior* (:func:`prior_figures`): the per-layer costs the
calibration cache holds for any model with the same layer shapes on these machines, else the arithmetic of the
layer's shapes (:func:`pipemlx.schedule.costmodel.arithmetic_layer_costs`), which needs no timing at all. The ranks
compare the prior's fingerprint in the handshake that was there already; where they differ, every rank takes the
arithmetic one (the same on every rank: it comes from the model's shapes). While that prefill runs, each rank
times the chunks it computes anyway; after it, one small all-gather turns those timings into measured costs
(:func:`refine`: the prior rescaled to what the chunks took, the slowest rank's figures kept), which every rank
then holds and the calibration cache keeps for the next run.

:func:`calibrate`, the explicit calibration below, is no longer run by a request: it stays for benchmarks and
tools, and logs its progress and the time it expects to take. It works as follows: every rank times its own layers on a chunk
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
import logging
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
    arithmetic_layer_costs,
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
PRIOR_COLLECTIVE_S = 2e-4
"""Seconds of a small collective the prior assumes (a refinement keeps it: the chunks time no collective)."""
LOGGER = logging.getLogger("pipemlx.calibrate")


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
    progress: Callable[[int, int], None] | None = None,
) -> Timings:
    """:data:`Timings`, each the fastest of :data:`CALIBRATION_PASSES` passes after a warm-up pass (the least
    disturbed by other work). ``timed(cache, start, stop)`` runs positions ``start:stop`` on ``cache``;
    ``fresh()`` makes empty caches; ``far()`` caches holding :data:`FAR_POSITION` positions, or ``None``;
    ``progress(done, passes)``, when given, is called after each pass (the warm-up included)."""
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
        if progress is not None:
            progress(attempt + 1, 1 + CALIBRATION_PASSES)
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

    def progress(done: int, passes: int) -> None:
        LOGGER.info("%s: calibration pass %d of %d done", stage.describe(), done, passes)

    with stage.detached():
        return fastest_timings(
            timed, lambda: make_prompt_cache(model), lambda: far_cache(model, stage, FAR_POSITION, timeout), progress
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
    expected = expected_calibration_s(model, stage)
    LOGGER.info("%s: calibrating its layers, expected to take about %.1f s", stage.describe(), expected)
    began = time.perf_counter()
    at_start, attention_chunk_s, far_timed = time_local_layers(model, stage, timeout)
    stage.calibration_s += time.perf_counter() - began
    LOGGER.info("%s: calibrated in %.1f s", stage.describe(), time.perf_counter() - began)
    measured = per_layer(at_start, attention_chunk_s, token_layers, attention_layers, far_timed)
    missing = [-1.0] * (len(CALIBRATION_LENGTHS) + 1 + len(FAR_LENGTHS) - len(measured))  # no far timings here
    figures = [*measured, *missing, time_collective(stage, timeout)]
    slowest, fastest = over_ranks(
        stage.group, stage.compute_stream, figures, timeout, stage.describe(), "the calibration"
    )
    if min(fastest) < 0:  # some rank timed no far chunks: none are used
        slowest = [*slowest[: len(CALIBRATION_LENGTHS) + 1], *slowest[-1:]]
    calibration_cache.store("stage", stage_key(model, stage), slowest)
    calibration_cache.store("shape", shape_key(model, stage.info), slowest[: len(CALIBRATION_LENGTHS) + 1])
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
    """One decoder layer's costs for ``lend="auto"``, the same on every rank, timed on none (a collective: all ranks
    call it; ``layer`` is kept for callers that time it themselves with :func:`time_layer`).

    The figures the calibration cache holds for this model and split (written by :func:`refine` after a prefill)
    when every rank holds the same; else the prior (:func:`prior_figures`), agreed the same way. One small
    all-gather compares the fingerprints; nothing is measured before the model is cut.
    """
    n = len(CALIBRATION_LENGTHS)
    key = group_key(model, info)
    stored = calibration_cache.figures(calibration_cache.load("layer", key), n + 1 + len(FAR_LENGTHS))
    prior = prior_figures(model, info)
    held = 0 if stored is None else calibration_cache.fingerprint(stored)
    priors = [calibration_cache.fingerprint(prior)]
    if group.size() > 1:
        stream = mx.new_thread_unsafe_stream(mx.default_device())
        where = "asking whether the ranks hold the same layer costs (lend='auto')"
        values = {"calibration": held, "prior": priors[0]}
        table = CALIBRATE.exchange(group, stream, values, timeout=info.timeout, where=where, who=info.describe())
        if must_calibrate(table["calibration"]):
            stored = None
        priors = table["prior"]
    if stored is None:
        figures = agreed_prior_figures(model, info, prior, priors)
        return layer_costs(CALIBRATION_LENGTHS, figures[:n], figures[n])
    far_pairs = tuple(zip(FAR_LENGTHS, stored[n + 1 :]))
    return layer_costs(CALIBRATION_LENGTHS, stored[:n], stored[n], far_pairs)


def calibrated(model: nn.Module, stage: PipelineStage, timeout: float | None) -> CostModel:
    """The group's agreed cost model, timed on no rank (a collective: all ranks call it).

    Each rank takes its measured cost model from memory (an earlier auto prefill may have refined one) or the
    calibration cache; one small all-gather compares those and the priors' fingerprints. When every rank holds
    the same measured model, that one; else the agreed prior (:func:`agreed_prior_figures`), which nothing timed.
    """
    held = held_calibration(model, stage)
    prior = prior_figures(model, stage.info)
    try:
        holds, priors = [held], [calibration_cache.fingerprint(prior)]
        if stage.world_size > 1:
            where, who = "asking whether the group holds measured costs", stage.describe()
            values = {"calibration": held, "prior": priors[0]}
            table = CALIBRATE.exchange(stage.group, stage.compute_stream, values, timeout=timeout, where=where, who=who)
            holds, priors = table["calibration"], table["prior"]
        if must_calibrate(holds):
            return prior_cost_model(model, stage, agreed_prior_figures(model, stage.info, prior, priors))
    except (PipelineTimeoutError, PeerLostError) as exc:
        stage.mark_broken(exc)
        raise
    return stage.cost_model


def query_size(model: nn.Module) -> int:
    """Query heads x head size of ``model``'s decoder layers from its ``args``; 0 if unknown."""
    args: Any = getattr(model, "args", None)
    hidden, heads = getattr(args, "hidden_size", 0), getattr(args, "num_attention_heads", 0)
    head_dim = getattr(args, "head_dim", None)
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return 0
    return heads * (head_dim if isinstance(head_dim, int) and head_dim > 0 else hidden // heads)


def prior_shapes(model: nn.Module, info: StageInfo) -> tuple[int, int, int, int]:
    """``(hidden, query, key-value, intermediate)`` widths of a decoder layer for the prior: from the model's
    ``args``, else a plain layer of the stage's hidden size (query and key-value as wide as it, a 4x MLP)."""
    shapes = layer_shapes(model)
    query = query_size(model)
    if shapes is None or not query:
        hidden = max(1, info.hidden_size)
        return hidden, hidden, hidden, 4 * hidden
    hidden, kv, intermediate = shapes
    return hidden, query, kv, intermediate


def shape_key(model: nn.Module, info: StageInfo) -> dict[str, Any]:
    """The calibration cache key of one layer's measured figures by its shapes alone: any model with the same layer
    shapes, quantization and dtype on the same kind of machine and software reads them, whatever its depth,
    vocabulary, split or world size (the hosts are left out too: a layer's compute does not depend on them)."""
    environment = {k: v for k, v in calibration_cache.environment().items() if k != "hosts"}
    return {
        **environment,
        "shapes": list(prior_shapes(model, info)),
        "quantization": quantization(model),
        "dtype": str(info.dtype),
        "settings": CALIBRATION_SETTINGS,
    }


def arithmetic_figures(model: nn.Module, info: StageInfo) -> list[float]:
    """One layer's seconds at each of :data:`CALIBRATION_LENGTHS` and per pair, from its arithmetic alone
    (:func:`~pipemlx.schedule.costmodel.arithmetic_layer_costs`): the same on every rank, nothing timed."""
    device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    pairs = quantization(model)
    bits, group_size = pairs[0] if pairs else (0, 0)  # a quantized weight: its bits, a 16-bit scale and bias a group
    size = bits / 8 + 4 / group_size if bits and group_size else float((info.dtype or mx.float32).size)
    seconds, per_pair = arithmetic_layer_costs(*prior_shapes(model, info), CALIBRATION_LENGTHS, device, size)
    return [*seconds, per_pair]


def prior_figures(model: nn.Module, info: StageInfo) -> list[float]:
    """The figures this rank would plan with before the group holds measured ones: one layer's seconds at each of
    :data:`CALIBRATION_LENGTHS` and per pair, as the calibration cache holds them for the same layer shapes
    (:func:`shape_key`), else :func:`arithmetic_figures`."""
    stored = calibration_cache.figures(
        calibration_cache.load("shape", shape_key(model, info)), len(CALIBRATION_LENGTHS) + 1
    )
    return stored if stored is not None else arithmetic_figures(model, info)


def agreed_prior_figures(model: nn.Module, info: StageInfo, prior: list[float], priors: Sequence[int]) -> list[float]:
    """``prior`` (this rank's :func:`prior_figures`) when every rank's fingerprint in ``priors`` is the same, else
    :func:`arithmetic_figures`: either way the very same figures on every rank."""
    return prior if len(set(priors)) == 1 else arithmetic_figures(model, info)


def prior_cost_model(model: nn.Module, stage: PipelineStage, figures: Sequence[float]) -> CostModel:
    """The cost model of a prior's per-layer ``figures`` (no far pairs; :data:`PRIOR_COLLECTIVE_S`)."""
    return stage_cost_model(model, stage, [*figures, PRIOR_COLLECTIVE_S])


def expected_calibration_s(model: nn.Module, stage: PipelineStage) -> float:
    """What :func:`calibrate` is expected to take on this rank, by its cost model if it holds one, else the prior's:
    every pass (and the warm-up) times each chunk of :data:`CALIBRATION_LENGTHS`, one after the longest, and the
    far chunks."""
    costs = stage.cost_model if isinstance(stage.cost_model, CostModel) else None
    costs = costs or prior_cost_model(model, stage, prior_figures(model, stage.info))
    longest = CALIBRATION_LENGTHS[-1]
    chunks = [Chunk(0, 0, n) for n in CALIBRATION_LENGTHS] + [Chunk(0, longest, longest + ATTENTION_CHUNK)]
    far = [Chunk(0, FAR_POSITION, FAR_POSITION + n) for n in FAR_LENGTHS]
    once = sum(costs.compute(stage.rank, c) for c in chunks)
    return (1 + CALIBRATION_PASSES) * once + CALIBRATION_PASSES * sum(costs.compute(stage.rank, c) for c in far)


REFINE_MIN_TOKENS = 64
"""The fewest tokens a refinement's chunks must hold together: a shorter prompt's chunks mostly time fixed costs,
which would rescale the whole curve wrongly (the group then keeps the prior until a longer prompt)."""


def refined_figures(costs: CostModel, rank: int, observed: Sequence[tuple[int, int, float]]) -> list[float] | None:
    """``costs``' per-layer figures (seconds at each of :data:`CALIBRATION_LENGTHS`, per pair) rescaled to the
    chunks this rank computed: ``observed`` holds ``(start, length, seconds)``; the first is left out when there
    are more (a process's first chunk also warms up what it touches).

    Each chunk's time is fitted as ``a * at_start + b * earlier``, where ``at_start`` is what ``costs`` predict for a
    chunk of its length at position 0 on this rank and ``earlier`` the rest (its attention to earlier positions):
    least squares, both factors non-negative (with no chunk past position 0, ``b = a``). ``None`` when the chunks
    hold fewer than :data:`REFINE_MIN_TOKENS` tokens or the fit says nothing (``a <= 0``)."""
    usable = observed[1:] if len(observed) > 1 else observed
    if sum(length for _, length, _ in usable) < REFINE_MIN_TOKENS:
        return None
    rows: list[tuple[float, float, float]] = []
    for start, length, seconds in usable:
        at_start = costs.compute(rank, Chunk(0, 0, length))
        rows.append((at_start, costs.compute(rank, Chunk(0, start, start + length)) - at_start, seconds))
    if not rows:
        return None
    sxx = sum(x * x for x, _, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    determinant = sxx * syy - sxy * sxy
    a = b = -1.0
    if syy > 0 and determinant > 1e-12 * sxx * syy:
        a, b = (sxt * syy - syt * sxy) / determinant, (syt * sxx - sxt * sxy) / determinant
    if a <= 0 or b < 0:  # one factor for both parts
        a = b = (sxt + syt) / (sxx + 2 * sxy + syy) if sxx + syy > 0 else -1.0
    if not (a > 0 and math.isfinite(a) and math.isfinite(b)):
        return None
    return [a * s for _, s in costs.layer.at_start] + [b * costs.layer.attention_s]


def refine(
    model: nn.Module,
    stage: PipelineStage,
    costs: CostModel,
    observed: Sequence[tuple[int, int, float]],
    timeout: float | None,
) -> None:
    """After a prefill planned with the prior ``costs``: agree on measured costs from the chunks it ran (a
    collective: every rank calls it after the same prefill; one small all-gather, nothing else is timed).

    Each rank rescales ``costs`` to its own chunks (:func:`refined_figures`); the slowest rank's figures are kept,
    so every rank holds the same :class:`~pipemlx.schedule.costmodel.CostModel`, set as ``stage.cost_model`` and
    stored in the calibration cache (for this model and split, for ``lend="auto"``, and for any model with the same
    layer shapes). When some rank has nothing to offer (a prompt of one chunk), nothing changes on any rank.
    """
    n = len(CALIBRATION_LENGTHS)
    if len(costs.layer.at_start) != n:
        return
    began = time.perf_counter()
    try:
        mine = refined_figures(costs, stage.rank, observed) or [-1.0] * (n + 1)
        slowest, fastest = over_ranks(
            stage.group, stage.compute_stream, mine, timeout, stage.describe(), "the timings of the prefill's chunks"
        )
        if min(fastest) < 0:
            return
        figures = [*slowest, costs.collective_s]
        stage.cost_model = stage_cost_model(model, stage, figures)
        calibration_cache.store("stage", stage_key(model, stage), figures)
        calibration_cache.store("shape", shape_key(model, stage.info), slowest)
        calibration_cache.store("layer", group_key(model, stage.info), [*slowest, *[slowest[n]] * len(FAR_LENGTHS)])
        LOGGER.debug("%s: refined its cost model from %d chunks", stage.describe(), len(observed))
    finally:
        stage.calibration_s += time.perf_counter() - began


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
