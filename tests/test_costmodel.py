"""The cost model: exact answers where the arithmetic is known (its timing check is benchmarks/cost_model_accuracy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache

from pipemlx.cli.costmodel import main
from pipemlx.observe.timeline import simulated_trace, write_trace
from pipemlx.observe.trace import read_spans, samples_from_trace
from pipemlx.runtime.calibrate import FAR_POSITION, has_position_table, layer_costs, per_layer, plain_leaves
from pipemlx.schedule.autostep import choose_chunks
from pipemlx.schedule.costmodel import (
    CostModel,
    LayerCosts,
    attention_pairs,
    fit_layer_costs,
    predict,
)
from pipemlx.schedule.plan import Chunk, chunk_prompt
from pipemlx.testing import build_model, tiny_config


def uniform(world_size: int, *, collective_s: float = 0.0, latency_s: float = 0.0) -> CostModel:
    """One layer per rank, 1 ms per token, nothing else."""
    return CostModel(
        LayerCosts(0.0, 1e-3, 0.0), (1,) * world_size, 8, latency_s=latency_s, bandwidth=1e30, collective_s=collective_s
    )


def test_attention_pairs_count_the_causal_mask() -> None:
    for chunk in (Chunk(0, 0, 1), Chunk(3, 12, 16), Chunk(1, 5, 105)):
        assert attention_pairs(chunk) == sum(p + 1 for p in range(chunk.start, chunk.stop))


def test_a_later_chunk_costs_more_and_messages_cost_latency_plus_bytes() -> None:
    costs = CostModel(LayerCosts(1e-4, 1e-5, 1e-8), (2, 1), 128, latency_s=1e-4, bandwidth=1e9)
    early, late = Chunk(0, 0, 64), Chunk(9, 576, 640)
    assert costs.compute(0, late) > costs.compute(0, early) == 2 * costs.compute(1, early)
    assert costs.compute(0, late) - costs.compute(0, early) == pytest.approx(2 * 1e-8 * 64 * 576)
    assert costs.transfer(0, 1, (64, 128)) == pytest.approx(1e-4 + 64 * 128 * 4 / 1e9)


@pytest.mark.parametrize("world_size", range(1, 17))
def test_uniform_chunks_give_the_textbook_pipeline(world_size: int) -> None:
    """n equal chunks on S ranks, no communication cost: (n+S-1) steps of one chunk; bubble (S-1)/(n+S-1)."""
    n, step = 12, 8
    prediction = predict(n * step + 1, step, uniform(world_size))
    assert prediction.prefill_s == pytest.approx((n + world_size - 1) * step * 1e-3)
    assert prediction.bubble_fraction == pytest.approx((world_size - 1) / (n + world_size - 1))
    assert prediction.busy_s == pytest.approx((n * step * 1e-3,) * world_size)


@pytest.mark.parametrize("world_size", [2, 5, 16])
def test_collectives_and_latency_add_up_per_step(world_size: int) -> None:
    n, step, coll, lat = 7, 4, 2e-4, 5e-4
    got = predict(n * step + 1, step, uniform(world_size, collective_s=coll, latency_s=lat)).prefill_s
    # handshake + closing agreement, n+S-1 steps of compute + agreement, and in every step but the
    # first a receive that waits for a message sent at the step's start
    assert got == pytest.approx(2 * coll + (n + world_size - 1) * (step * 1e-3 + coll) + (n + world_size - 2) * lat)


def test_attention_growth_makes_later_steps_longer() -> None:
    costs = CostModel(LayerCosts(0.0, 1e-4, 1e-6), (1, 1), 8, latency_s=0.0, collective_s=0.0)
    prediction = predict(401, 50, costs)
    computes = [e for e in prediction.result.events if e.rank == 0 and type(e.action).__name__ == "Compute"]
    durations = [e.end - e.start for e in computes]
    assert durations == sorted(durations) and durations[-1] > 2 * durations[0]


def test_fit_recovers_known_costs_and_never_goes_negative() -> None:
    true = LayerCosts(2e-4, 3e-5, 4e-8)
    chunks = [Chunk(i, s, s + n) for i, (s, n) in enumerate([(0, 16), (16, 64), (80, 32), (112, 96), (208, 8)])]
    fitted = fit_layer_costs([(c, 4 * true.seconds(c)) for c in chunks], 4)
    for got, want in zip((fitted.chunk_s, fitted.token_s, fitted.attention_s), (2e-4, 3e-5, 4e-8)):
        assert got == pytest.approx(want, rel=1e-6)
    # timings that shrink with position would need a negative attention cost: it is dropped instead
    shrinking = fit_layer_costs([(c, 1.0 - 0.001 * c.start) for c in chunk_prompt(200, 20)], 1)
    assert min(shrinking.chunk_s, shrinking.token_s, shrinking.attention_s) >= 0
    assert shrinking.attention_s == 0
    # equal chunks cannot tell a fixed cost from a per-token one: all of it goes to the tokens
    alike = fit_layer_costs([(c, 0.5) for c in chunk_prompt(41, 10)], 1)
    assert alike.chunk_s == 0 and alike.token_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="at least one"):
        fit_layer_costs([], 2)


BY_LENGTH = ((32, 6e-3), (64, 9e-3), (128, 16e-3), (256, 36e-3))
"""A layer's seconds at position 0 by chunk length: 128 tokens cheapest per token, 32 and 256 dearer."""


def test_measured_costs_by_length_are_interpolated_and_attention_added_for_the_positions_before() -> None:
    layer = LayerCosts(0.0, 0.0, 1e-6, BY_LENGTH)
    for length, seconds in BY_LENGTH:
        assert layer.seconds(Chunk(0, 0, length)) == pytest.approx(seconds)
    assert layer.seconds_at_start(96) == pytest.approx((9e-3 + 16e-3) / 2)  # linear between 64 and 128
    assert layer.seconds_at_start(16) == pytest.approx(6e-3 / 2)  # below: the shortest's cost per token
    # above: the longest's cost per token, plus the extra positions each token attends to inside the chunk
    assert layer.seconds_at_start(512) == pytest.approx(2 * 36e-3 + 1e-6 * 512 * 256 / 2)
    assert layer.seconds(Chunk(3, 1000, 1128)) == pytest.approx(16e-3 + 1e-6 * 128 * 1000)
    assert layer.token_seconds(128) == pytest.approx(16e-3 / 128)
    line = LayerCosts(2e-3, 1e-4, 1e-6)  # without measurements: the straight line, as before
    assert line.seconds(Chunk(0, 10, 20)) == pytest.approx(2e-3 + 1e-3 + 1e-6 * attention_pairs(Chunk(0, 10, 20)))
    assert line.token_seconds(64) == 1e-4
    for bad in (((64, 1e-3), (32, 2e-3)), ((32, 2e-3), (64, 1e-3)), ((0, 0.0), (8, 1e-3))):
        with pytest.raises(ValueError, match="at_start"):
            LayerCosts(0.0, 0.0, 0.0, bad)


def test_auto_follows_the_measured_cost_of_each_chunk_length() -> None:
    """Chunks of 256 tokens dearer per token than chunks of 128 (as BLAS runs them here): auto's chunks stay at
    128; the same costs but 256 tokens cheaper per token, and auto takes 256."""

    def longest_chunk(at_256: float) -> int:
        at_start = (*BY_LENGTH[:-1], (256, at_256))
        return max(choose_chunks(2048, CostModel(LayerCosts(0.0, 0.0, 1.4e-7, at_start), (4, 4), hidden_size=512)))

    assert longest_chunk(36e-3) == 128
    assert longest_chunk(26e-3) == 256


def test_pairs_measured_far_in_price_each_chunk_length_apart() -> None:
    far = ((64, 1.5e-7), (128, 1.6e-7), (256, 2.0e-7))
    layer = LayerCosts(0.0, 0.0, 1e-7, BY_LENGTH, far)
    assert layer.pair_seconds(128) == 1.6e-7 and layer.pair_seconds(192) == pytest.approx(1.8e-7)
    assert layer.pair_seconds(16) == 1.5e-7 and layer.pair_seconds(512) == 2.0e-7  # the nearest measured length
    assert layer.seconds(Chunk(3, 1000, 1256)) == pytest.approx(36e-3 + 2.0e-7 * 256 * 1000)
    assert LayerCosts(0.0, 0.0, 1e-7, BY_LENGTH).pair_seconds(256) == 1e-7  # without them: attention_s
    for bad in (((128, 1e-7), (64, 1e-7)), ((64, -1e-7),), ((0, 1e-7),)):
        with pytest.raises(ValueError, match="far_pairs"):
            LayerCosts(0.0, 0.0, 0.0, BY_LENGTH, bad)


def test_auto_takes_shorter_chunks_at_long_prompts_when_longer_ones_pay_more_per_pair() -> None:
    """At 8192 tokens the attention to earlier positions is most of the work: the same position-0 costs, with
    256-token chunks paying 15% more per pair far in, and auto's chunks stay at 128 or shorter; with every length
    paying the same, it takes 256 (cheaper per token at position 0 here)."""
    at_start = (*BY_LENGTH[:-1], (256, 26e-3))

    def longest_chunk(far: tuple[tuple[int, float], ...]) -> int:
        layer = LayerCosts(0.0, 0.0, 1.5e-7, at_start, far)
        return max(choose_chunks(8192, CostModel(layer, (4, 4), hidden_size=512)))

    assert longest_chunk(((64, 1.5e-7), (256, 1.5e-7))) == 256
    assert longest_chunk(((64, 1.5e-7), (128, 1.5e-7), (256, 1.725e-7))) <= 128


def test_calibration_keeps_the_costs_growing_with_the_length_and_reads_attention_off_the_later_chunk() -> None:
    timings = [(16, 0.004), (32, 0.006), (64, 0.005), (128, 0.016), (256, 0.036), (512, 0.09)]  # 64: a noisy low
    *seconds, attention_s = per_layer(
        timings, attention_chunk_s=0.016 + 2 * 128 * 512 * 1e-7, token_layers=2, attention_layers=2
    )
    assert seconds == pytest.approx([0.002, 0.003, 0.003, 0.008, 0.018, 0.045])
    assert attention_s == pytest.approx(1e-7)
    costs = layer_costs([16, 32, 64], [0.002, 0.003, 0.0025], attention_s)
    assert costs.at_start == ((16, 0.002), (32, 0.003), (64, 0.003)) and costs.token_s > 0
    *_, near, far_64, far_128 = per_layer(
        timings,
        attention_chunk_s=0.016 + 2 * 128 * 512 * 1e-7,
        token_layers=2,
        attention_layers=2,
        far_timed=[(64, 0.006 + 2 * 64 * FAR_POSITION * 1.5e-7), (128, 0.016 + 2 * 128 * FAR_POSITION * 2e-7)],
    )
    assert (near, far_64, far_128) == pytest.approx((1e-7, 1.5e-7, 2e-7))


def test_only_plain_caches_are_filled_with_positions_to_time_far_chunks() -> None:
    """A rotating (sliding-window) cache cannot take faked positions, and a table of positions (gpt2's) may be
    shorter than the far chunks' positions: then no chunk is timed far in."""
    model = build_model(tiny_config("llama"))
    plain = make_prompt_cache(model)
    assert plain_leaves(plain) == plain
    assert plain_leaves([CacheList(plain[0], plain[1]), *plain[2:]]) == plain
    assert plain_leaves([*plain[:-1], RotatingKVCache(max_size=64)]) is None
    assert not has_position_table(model)
    gpt2 = {"model_type": "gpt2", "n_ctx": 64, "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 64}
    assert has_position_table(build_model({**gpt2, "layer_norm_epsilon": 1e-5, "vocab_size": 64}))


def test_bad_models_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        CostModel(LayerCosts(0, 0, 0), (2, 0), 8)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        CostModel(LayerCosts(0, 0, 0), (2,), 8, bandwidth=0)
    with pytest.raises(ValueError, match="more ranks than layers"):
        uniform(1).with_ranks(3)
    assert CostModel(LayerCosts(0, 0, 0), (10,), 8).with_ranks(3).layers == (4, 3, 3)


def test_command_line_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tokens", "2049", "--step", "256", "--layers", "16", "--max-ranks", "16"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert [int(r.split()[0]) for r in rows] == list(range(1, 17))
    speedups = [float(r.split()[2]) for r in rows]
    assert speedups[0] == 1.0 and speedups[1] > 1.5


def test_calibrating_from_a_one_rank_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 1-rank timeline's compute spans give the layer costs back; the CLI writes the predicted trace."""
    true = CostModel(LayerCosts(0.0, 2e-4, 1e-6), (6,), 32, collective_s=1e-4)
    one_rank = write_trace(simulated_trace(predict(201, 40, true).result), tmp_path / "one.json")
    samples = samples_from_trace(one_rank)
    assert [(c.start, c.stop) for c, _ in samples] == [(c.start, c.stop) for c in chunk_prompt(201, 40)]
    fitted = fit_layer_costs(samples, 6)
    assert fitted.token_s + fitted.chunk_s / 40 == pytest.approx(2e-4, rel=1e-3)
    assert fitted.attention_s == pytest.approx(1e-6, rel=1e-3)
    out = tmp_path / "predicted.json"
    assert main(["--calibrate", str(one_rank), "--layers", "6", "--hidden", "32", "--tokens", "201", "--step", "40",
                 "--max-ranks", "3", "--ranks", "3", "--trace", str(out)]) == 0  # fmt: skip
    assert "wrote the predicted 3-rank timeline" in capsys.readouterr().out
    assert {s.rank for s in read_spans(out)} == {0, 1, 2}
    with pytest.raises(ValueError, match="no compute spans of rank 4"):
        samples_from_trace(one_rank, rank=4)
