"""The first request's plan, timed on nothing: the prior from the layers' arithmetic, the refinement of it from
the chunks a prefill ran, and the agreement when ranks hold different priors (pure: no group)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

import pipemlx
from pipemlx.runtime import calibrate
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.autostep import choose_chunks
from pipemlx.schedule.costmodel import CostModel, arithmetic_layer_costs, cache_only_share
from pipemlx.schedule.plan import Chunk
from pipemlx.testing import build_model, tiny_config

LENGTHS = calibrate.CALIBRATION_LENGTHS
QWEN_05B = (896, 896, 128, 4864)  # hidden, query (14 heads x 64), key-value (2 x 64), intermediate
LLAMA_1B = (2048, 2048, 512, 8192)


def prior_model(shapes: tuple[int, int, int, int], layers: tuple[int, ...]) -> CostModel:
    seconds, per_pair = arithmetic_layer_costs(*shapes, LENGTHS)
    layer = calibrate.layer_costs(LENGTHS, seconds, per_pair)
    share = cache_only_share(shapes[0], shapes[2], shapes[3])
    return CostModel(layer, layers, shapes[0], last_layer_share=share)


def test_the_arithmetic_grows_with_the_work() -> None:
    small, small_pair = arithmetic_layer_costs(*QWEN_05B, LENGTHS)
    large, large_pair = arithmetic_layer_costs(*LLAMA_1B, LENGTHS)
    assert small == sorted(small) and all(b > a for a, b in zip(small, large)) and large_pair > small_pair > 0
    # 512 tokens cost about twice 256 (per-token work dominates; attention within the chunk adds a little)
    assert 1.9 < small[LENGTHS.index(512)] / small[LENGTHS.index(256)] < 2.3


@pytest.mark.parametrize("shapes", [QWEN_05B, LLAMA_1B], ids=["qwen2.5-0.5b", "llama-3.2-1b"])
@pytest.mark.parametrize("layers", [(12, 12), (8, 8, 8)], ids=["S=2", "S=3"])
def test_realistic_shapes_plan_pipelined_chunks_without_timing(
    shapes: tuple[int, int, int, int], layers: tuple[int, ...]
) -> None:
    """An 818-token prompt (the issue's) on the prior: cut into enough chunks to fill the pipeline, and chunks long
    enough that reading a layer's weights once per chunk does not dominate (the prior's fixed cost per chunk)."""
    lengths = choose_chunks(818, prior_model(shapes, layers))
    assert sum(lengths) == 817 and len(lengths) >= 2 * len(layers) and max(lengths) >= 32, lengths


def test_refinement_recovers_the_scale_of_the_chunks() -> None:
    """Chunks that took 3x the prior's per-token work and 2x its attention: the refined figures say so."""
    prior = prior_model(QWEN_05B, (12, 12))
    true = CostModel(
        calibrate.layer_costs(LENGTHS, [3 * s for _, s in prior.layer.at_start], 2 * prior.layer.attention_s),
        prior.layers,
        prior.hidden_size,
        last_layer_share=prior.last_layer_share,
    )
    for rank in (0, 1):
        chunks = [Chunk(i, 128 * i, 128 * (i + 1)) for i in range(7)]
        observed = [(c.start, c.length, true.compute(rank, c)) for c in chunks]
        observed[0] = (0, 128, 100.0)  # the first chunk (warming up) is left out
        figures = calibrate.refined_figures(prior, rank, observed)
        assert figures is not None
        expected = [3 * s for _, s in prior.layer.at_start] + [2 * prior.layer.attention_s]
        assert figures == pytest.approx(expected, rel=1e-6)


def test_refinement_needs_enough_tokens_and_a_positive_fit() -> None:
    prior = prior_model(QWEN_05B, (12, 12))
    assert calibrate.refined_figures(prior, 0, [(0, 16, 0.01), (16, 16, 0.01)]) is None  # too few tokens
    assert calibrate.refined_figures(prior, 0, [(0, 128, 0.0)]) is None  # nothing measured
    one = calibrate.refined_figures(prior, 0, [(0, 128, 2 * prior.compute(0, Chunk(0, 0, 128)))])
    assert one == pytest.approx([2 * s for _, s in prior.layer.at_start] + [2 * prior.layer.attention_s])


def test_ranks_whose_priors_differ_all_take_the_arithmetic_one() -> None:
    model = pipemlx.shard_model(build_model(tiny_config("llama"), seed=1), mx.distributed.init())
    info = stage_of(model).info
    arithmetic = calibrate.arithmetic_figures(model, info)
    cached = [2 * f for f in arithmetic]  # as if this rank read another machine's layer figures
    assert calibrate.agreed_prior_figures(model, info, cached, [7, 7]) == cached
    assert calibrate.agreed_prior_figures(model, info, cached, [7, 8]) == arithmetic
    assert calibrate.arithmetic_figures(build_model(tiny_config("llama"), seed=2), info) == arithmetic  # shapes only


def test_a_calibration_says_how_long_it_is_expected_to_take(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explicit calibration (no request runs it) logs its expected duration, each pass, and what it took (the
    passes themselves stand-ins here: what is checked is what it says, not what it measures)."""
    model = pipemlx.shard_model(build_model(tiny_config("llama"), seed=1), mx.distributed.init())
    stage = stage_of(model)
    expected = calibrate.expected_calibration_s(model, stage)
    assert expected > 0
    passes = 1 + calibrate.CALIBRATION_PASSES

    def stand_in(timed: Any, fresh: Any, far: Any, progress: Any = None) -> calibrate.Timings:
        for done in range(1, passes + 1):
            progress(done, passes)
        return [(n, 1e-4 * n) for n in LENGTHS], 0.02, []

    monkeypatch.setattr(calibrate, "fastest_timings", stand_in)
    with caplog.at_level("INFO", logger="pipemlx.calibrate"):
        calibrate.calibrate(model, stage, None)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"expected to take about {expected:.1f} s" in m for m in messages), messages
    assert [m for m in messages if "calibration pass" in m][-1].endswith(f"pass {passes} of {passes} done")
    assert any("calibrated in" in m for m in messages) and stage.calibration_s > 0
