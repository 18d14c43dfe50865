"""A cost model of the pipelined prefill: predicted time and bubble fraction, by simulating the plan.

The model is deliberately small:

- a decoder layer spends ``chunk_s + token_s * L + attention_s * P`` seconds on a
  chunk of ``L`` tokens starting at position ``s``, where ``P = L*s + L*(L+1)/2``
  is the number of query-key pairs under the causal mask: later chunks attend
  to more positions, so they cost more;
- rank ``r`` holding ``layers[r]`` layers spends ``layers[r]`` times that, except
  that the model's very last layer costs only ``last_layer_share`` of a layer:
  a prefill evaluates only the caches (mlx-lm's ``generate_step`` and
  :func:`pipemlx.pipeline_prefill` alike), and MLX's lazy evaluation then skips
  everything of the last layer after its key and value projections
  (:func:`cache_only_share` estimates the share from the layer's shapes);
- with ``lend_mlp`` (``lent_share`` > 0), each rank but the last hands its
  last layer's feed-forward half, ``lent_share`` of a layer's per-token cost,
  to the next rank; with ``lend_heads`` also ``lent_pair_share`` of that
  layer's attention to earlier positions (and the heads' projections, counted
  in ``lent_share``);
- a hidden state of ``L x hidden_size`` elements arrives ``latency_s + bytes /
  bandwidth`` seconds after it is sent;
- an agreement point (or the handshake) ends ``collective_s`` after the last
  rank enters it.

:func:`predict` runs the real plans through :func:`pipemlx.schedule.simulate.simulate`
with these durations and the executor's send semantics (sends issued
asynchronously, awaited before the next agreement point). :func:`fit_layer_costs`
calibrates a layer's costs from chunk timings of one process holding the whole
model. Pure Python: no MLX. ``python -m pipemlx.cli.costmodel --help`` prints a
table of predictions for 1..16 ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .plan import Action, Chunk, Compute, build_plans, default_agreement_spacing
from .simulate import Durations, SimulationResult, simulate
from .split import even_split


def cache_only_share(hidden_size: int, kv_size: int, intermediate_size: int) -> float:
    """The share of a decoder layer's matmul work that filling its cache alone needs.

    A layer multiplies each token by q and o (``hidden x hidden``), k and v
    (``hidden x kv_size``, where ``kv_size`` is key-value heads x head size) and
    a gated MLP (three ``hidden x intermediate``); the cache needs only k and v.
    """
    return 2 * kv_size / (2 * hidden_size + 2 * kv_size + 3 * intermediate_size)


def feed_forward_share_of(hidden_size: int, kv_size: int, intermediate_size: int) -> float:
    """The share of a decoder layer's per-token matmul work in its gated MLP (three ``hidden x intermediate``)."""
    return 3 * intermediate_size / (2 * hidden_size + 2 * kv_size + 3 * intermediate_size)


def lent_heads_share_of(hidden_size: int, kv_size: int, intermediate_size: int, lent_fraction: float) -> float:
    """The share of a layer's per-token matmul work ``lend_heads`` moves: the gated MLP, the output projection, and
    ``lent_fraction`` (lent key-value heads over all) of the q, k and v projections."""
    moved = 3 * intermediate_size + hidden_size + lent_fraction * (hidden_size + 2 * kv_size)
    return moved / (2 * hidden_size + 2 * kv_size + 3 * intermediate_size)


def lent_halves(rank: int, world_size: int) -> int:
    """Feed-forward halves rank ``rank`` runs beyond its own layers' with ``lend_mlp``: +1 borrowed, -1 lent."""
    return (rank > 0) - (rank < world_size - 1)


def attention_pairs(chunk: Chunk) -> float:
    """Query-key pairs the causal attention of ``chunk`` computes: ``L*start + L*(L+1)/2``."""
    length = chunk.length
    return length * chunk.start + length * (length + 1) / 2


@dataclass(frozen=True)
class LayerCosts:
    """Seconds one decoder layer spends on a chunk: fixed, per token, per query-key pair.

    ``at_start``, when given, holds ``(length, seconds)`` of chunks measured at
    position 0, lengths ascending and seconds never falling. A chunk then
    costs what a chunk of its length costs at position 0 (interpolated, see
    :meth:`seconds_at_start`) plus ``attention_s`` per query-key pair *before*
    its start; ``chunk_s`` and ``token_s`` remain the straight-line summary of
    those measurements. BLAS multiplies some lengths of chunk markedly more
    slowly per token than others, a curve no straight line follows.

    ``far_pairs``, when given, holds ``(length, seconds per pair)`` of chunks
    measured far into a prompt (lengths ascending): a pair then costs what the
    chunk's length measured there (:meth:`pair_seconds`) instead of
    ``attention_s``: far in, longer chunks can pay more per pair.
    """

    chunk_s: float
    token_s: float
    attention_s: float
    at_start: tuple[tuple[int, float], ...] = ()
    far_pairs: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        lengths = [length for length, _ in self.at_start]
        seconds = [s for _, s in self.at_start]
        if lengths != sorted(set(lengths)) or (lengths and lengths[0] < 1) or seconds != sorted(seconds):
            raise ValueError(
                f"at_start must have ascending lengths >= 1 and seconds never falling, got {self.at_start}"
            )
        far = [length for length, _ in self.far_pairs]
        if far != sorted(set(far)) or (far and far[0] < 1) or any(s < 0 for _, s in self.far_pairs):
            raise ValueError(f"far_pairs must have ascending lengths >= 1 and no negative cost, got {self.far_pairs}")

    def seconds(self, chunk: Chunk) -> float:
        if not self.at_start:
            return self.chunk_s + self.token_s * chunk.length + self.attention_s * attention_pairs(chunk)
        return self.seconds_at_start(chunk.length) + self.pair_seconds(chunk.length) * chunk.length * chunk.start

    def pair_seconds(self, length: int) -> float:
        """Seconds per query-key pair of a ``length``-token chunk's attention to earlier positions: :attr:`far_pairs`
        interpolated linearly in the length (the nearest measured length outside them); without them, ``attention_s``.
        """
        if not self.far_pairs:
            return self.attention_s
        return _interpolated(self.far_pairs, length)

    def seconds_at_start(self, length: int) -> float:
        """Seconds of a ``length``-token chunk at position 0: :attr:`at_start` interpolated linearly in the length.

        Below the shortest measured length, at its cost per token; above the
        longest, at its cost per token plus the attention to the extra
        positions inside the chunk. Without measurements, the straight line.
        """
        if not self.at_start:
            return self.seconds(Chunk(0, 0, length))
        (shortest, low), (longest, high) = self.at_start[0], self.at_start[-1]
        if length <= shortest:
            return low * length / shortest
        if length >= longest:
            return high * length / longest + self.pair_seconds(length) * length * (length - longest) / 2
        return _interpolated(self.at_start, length)

    def token_seconds(self, length: int) -> float:
        """Seconds per token of a ``length``-token chunk's work that grows with its tokens (``lend_mlp``'s moved share)."""
        return self.seconds_at_start(length) / length if self.at_start else self.token_s


def _interpolated(points: Sequence[tuple[int, float]], length: int) -> float:
    """``points`` (lengths ascending) interpolated linearly at ``length``; the end values outside them."""
    if length <= points[0][0]:
        return points[0][1]
    for (a, sa), (b, sb) in zip(points, points[1:]):
        if length <= b:
            return sa + (sb - sa) * (length - a) / (b - a)
    return points[-1][1]


@dataclass(frozen=True)
class CostModel:
    """Durations of a pipeline whose rank ``r`` holds ``layers[r]`` layers (a :class:`~pipemlx.schedule.simulate.Durations`)."""

    layer: LayerCosts
    layers: tuple[int, ...]
    hidden_size: int
    bytes_per_element: int = 4
    latency_s: float = 1e-4
    bandwidth: float = 1e9
    collective_s: float = 2e-4
    last_layer_share: float = 1.0
    lent_share: float = 0.0
    lent_pair_share: float = 0.0

    def __post_init__(self) -> None:
        if not self.layers or min(self.layers) < 1:
            raise ValueError(f"every rank needs at least one layer, got layers {self.layers}")
        if self.bandwidth <= 0 or min(self.latency_s, self.collective_s, self.hidden_size) < 0:
            raise ValueError("bandwidth must be positive; latency, collective time and hidden size non-negative")
        shares = (
            ("last_layer_share", self.last_layer_share),
            ("lent_share", self.lent_share),
            ("lent_pair_share", self.lent_pair_share),
        )
        for name, share in shares:
            if not 0 <= share <= 1:
                raise ValueError(f"{name} must be in 0..1, got {share}")

    @property
    def world_size(self) -> int:
        return len(self.layers)

    def effective_layers(self, rank: int) -> float:
        """Layers' worth of work rank ``rank`` does per chunk (the last rank's last layer counts its share)."""
        saved = 1.0 - self.last_layer_share if rank == len(self.layers) - 1 else 0.0
        return self.layers[rank] - saved

    def compute(self, rank: int, chunk: Chunk) -> float:
        halves = lent_halves(rank, len(self.layers))
        moved = halves * self.lent_share * self.layer.token_seconds(chunk.length) * chunk.length
        moved += halves * self.lent_pair_share * self.layer.pair_seconds(chunk.length) * attention_pairs(chunk)
        return self.effective_layers(rank) * self.layer.seconds(chunk) + moved

    def transfer(self, source: int, dest: int, shape: tuple[int, int]) -> float:
        return self.latency_s + shape[0] * shape[1] * self.bytes_per_element / self.bandwidth

    def collective(self, action: Action) -> float:
        return self.collective_s

    def with_ranks(self, world_size: int) -> CostModel:
        """The same model and costs with the layers split evenly over ``world_size`` ranks."""
        layers = even_split(sum(self.layers), world_size)
        return dataclasses.replace(self, layers=layers)


@dataclass(frozen=True)
class Prediction:
    """What the cost model expects of one prefill.

    ``prefill_s``: from the start of the handshake until the closing agreement
    ends on every rank. ``busy_s[r]``: rank ``r``'s compute time.
    ``bubble_fraction``: ``1 - sum(busy_s) / (S * prefill_s)``.
    """

    num_tokens: int
    step_size: int
    world_size: int
    prefill_s: float
    busy_s: tuple[float, ...]
    result: SimulationResult

    @property
    def bubble_fraction(self) -> float:
        if self.prefill_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (self.world_size * self.prefill_s)


def predict(
    num_tokens: int,
    step_size: int,
    costs: CostModel,
    chunk_lengths: Sequence[int] | None = None,
    agree_every: int | None = 1,
    *,
    durations: Durations | None = None,
) -> Prediction:
    """Simulate the plans for ``costs.world_size`` ranks with ``costs``' durations; raises if they do not run.

    ``chunk_lengths`` and ``agree_every`` are :func:`~pipemlx.schedule.plan.build_plan`'s
    (``agree_every=None``: the executor's default spacing). ``durations``, when given, stands in for ``costs``'
    own (a wrapper that remembers ``costs.compute``, say: the same seconds, computed once).
    """
    if agree_every is None:
        agree_every = default_agreement_spacing(num_tokens, step_size, costs.world_size, chunk_lengths)
    plans = build_plans(num_tokens, step_size, costs.world_size, agree_every, chunk_lengths)
    result = simulate(
        plans,
        capacity=None,
        await_sends=True,
        hidden_size=costs.hidden_size,
        durations=costs if durations is None else durations,
    ).raise_for_failure()
    busy = [0.0] * costs.world_size
    for event in result.events:
        if isinstance(event.action, Compute):
            busy[event.rank] += event.end - event.start
    return Prediction(num_tokens, step_size, costs.world_size, result.makespan, tuple(busy), result)


def fit_layer_costs(
    samples: Sequence[tuple[Chunk, float]], num_layers: int, last_layer_share: float = 1.0
) -> LayerCosts:
    """Least-squares layer costs from ``(chunk, seconds)`` timings of a whole ``num_layers``-layer model.

    Fits ``seconds = (num_layers - 1 + last_layer_share) * (chunk_s + token_s * L + attention_s * P)``;
    a coefficient that would come out negative is dropped (set to 0) and the
    rest refitted, so the costs are never negative. Needs at least one sample.
    """
    if not samples:
        raise ValueError("fit_layer_costs needs at least one (chunk, seconds) sample")
    rows = [(1.0, float(c.length), attention_pairs(c)) for c, _ in samples]
    times = [t / (num_layers - 1 + last_layer_share) for _, t in samples]
    active = [0, 1, 2]
    while True:
        solution = _least_squares([[row[i] for i in active] for row in rows], times)
        if solution is not None and min(solution) >= 0:
            break
        # drop the most negative coefficient and refit; when singular (all chunks alike), the fixed cost first
        drop = active[solution.index(min(solution))] if solution is not None else active[0]
        active.remove(drop)
        if not active:
            return LayerCosts(0.0, 0.0, 0.0)
    coefficients = [0.0, 0.0, 0.0]
    for i, value in zip(active, solution):
        coefficients[i] = value
    chunk_s, token_s, attention_s = coefficients
    return LayerCosts(chunk_s, token_s, attention_s)


def _least_squares(rows: list[list[float]], values: list[float]) -> list[float] | None:
    """Solve the normal equations by Gaussian elimination; None when they are singular."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    x = [[r[j] / scale[j] for j in range(n)] for r in rows]
    a = [[sum(r[i] * r[j] for r in x) for j in range(n)] + [sum(r[i] * v for r, v in zip(x, values))] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row[:n])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for k in range(n):
            if k != col:
                f = a[k][col] / a[col][col]
                a[k] = [u - f * w for u, w in zip(a[k], a[col])]
    return [a[i][n] / a[i][i] / scale[i] for i in range(n)]


ASSUMED_FLOPS = {"cpu": 5e10, "gpu": 3e12}
"""Floating-point operations per second the arithmetic cost model (:func:`arithmetic_layer_costs`) assumes, by kind
of device: the planning of a first request, before anything is timed, only needs the shape of the costs (fixed
versus per token versus per pair, and compute against messages); the real prefill's chunks rescale them."""
ASSUMED_BANDWIDTH = {"cpu": 1e10, "gpu": 2e11}
"""Bytes per second a layer's weights are assumed to be read at: every chunk reads them all once, whatever its
length, which is what makes short chunks dear per token (a matrix product of few rows is bound by its weights)."""
ASSUMED_CHUNK_OVERHEAD_S = {"cpu": 3e-5, "gpu": 5e-5}
"""Seconds a decoder layer is assumed to spend on a chunk besides that (dispatching its operations)."""


def arithmetic_layer_costs(
    hidden_size: int,
    query_size: int,
    kv_size: int,
    intermediate_size: int,
    lengths: Sequence[int],
    device: str = "cpu",
    bytes_per_weight: float = 4.0,
) -> tuple[list[float], float]:
    """One decoder layer's seconds at each of ``lengths`` (a chunk at position 0) and per query-key pair, from its
    arithmetic alone: nothing is timed, so every rank derives the very same figures from the model's shapes.

    The layer holds ``W = 2 * hidden * query + 2 * hidden * kv + 3 * hidden * intermediate`` weights (the q, o, k,
    v projections and a gated MLP; ``query_size`` is heads x head size) of ``bytes_per_weight`` bytes each. A chunk
    reads them once (at :data:`ASSUMED_BANDWIDTH`), then each token costs ``2 * W`` operations and each query-key
    pair ``4 * query`` (scores and the weighted sum), at :data:`ASSUMED_FLOPS`; plus
    :data:`ASSUMED_CHUNK_OVERHEAD_S`. ``device`` is ``"cpu"`` or ``"gpu"``. A chunk of ``L`` tokens at position 0
    holds ``L*(L+1)/2`` pairs.
    """
    kind = "gpu" if device == "gpu" else "cpu"
    rate = ASSUMED_FLOPS[kind]
    weights = 2 * hidden_size * query_size + 2 * hidden_size * kv_size + 3 * hidden_size * intermediate_size
    fixed = ASSUMED_CHUNK_OVERHEAD_S[kind] + weights * bytes_per_weight / ASSUMED_BANDWIDTH[kind]
    per_token = 2.0 * weights / rate
    per_pair = 4.0 * query_size / rate
    seconds = [fixed + per_token * n + per_pair * n * (n + 1) / 2 for n in lengths]
    return seconds, per_pair
