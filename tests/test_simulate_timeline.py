"""Timelines: the text Gantt of a plan, simulated Chrome traces, and (with matplotlib) PNG plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemlx.cli.timeline import main
from pipemlx.observe.timeline import gantt, plot_timeline, simulated_trace, write_trace
from pipemlx.observe.trace import read_spans
from pipemlx.schedule.costmodel import CostModel, LayerCosts, predict
from pipemlx.schedule.plan import build_plans


def parse(text: str) -> dict[str, list[str]]:
    rows = text.splitlines()[1:]
    return {
        " ".join(r.split()[:2]) if r.startswith("rank") else r.split()[0]: r.split()[2 if r.startswith("rank") else 1 :]
        for r in rows
    }


@pytest.mark.parametrize("num_tokens,step,ranks", [(13, 3, 3), (9, 4, 1), (30, 2, 5), (5, 8, 4)])
def test_gantt_shows_the_wavefront(num_tokens: int, step: int, ranks: int) -> None:
    plans = build_plans(num_tokens, step, ranks)
    n = len(plans[0].chunks)
    table = parse(gantt(plans, max_steps=1000))
    steps = n + ranks - 1
    assert table["step"] == [str(t) for t in range(steps)]
    for r in range(ranks):
        assert table[f"rank {r}"] == [str(t - r) if 0 <= t - r < n else "." for t in range(steps)], r
    assert table["done"] == [str(c) for c in range(n)]  # right-aligned under steps S-1 .. n+S-2
    header = gantt(plans).splitlines()[0]
    assert (
        header
        == f"{num_tokens - 1} prompt positions in {n} chunk(s) of <= {step} tokens on {ranks} rank(s): {steps} step(s)"
    )


def test_gantt_elides_the_middle_of_long_plans() -> None:
    text = gantt(build_plans(1001, 10, 3), max_steps=10)
    row = parse(text)["rank 1"]
    assert row == [".", "0", "1", "2", "3", "…", "96", "97", "98", "99", "."]
    with pytest.raises(ValueError, match="at least one plan"):
        gantt([])


def test_simulated_trace_has_the_executor_layout(tmp_path: Path) -> None:
    costs = CostModel(LayerCosts(1e-4, 1e-5, 1e-8), (2, 2), 64)
    prediction = predict(97, 16, costs)
    path = write_trace(simulated_trace(prediction.result), tmp_path / "predicted.json")
    spans = read_spans(path)
    assert len(spans) == len(prediction.result.events)
    computes = [(s.rank, s.chunk) for s in spans if s.kind == "compute"]
    assert computes == [(r, c) for r in (0, 1) for c in range(6)]
    end = max(s.end_us for s in spans) - min(s.start_us for s in spans)
    assert end == pytest.approx(prediction.prefill_s * 1e6)
    assert {(s.kind, s.peer) for s in spans if s.kind in ("send", "recv")} == {("send", 1), ("recv", 0)}


def test_gantt_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gantt", "13", "3", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "rank 0  0 1 2 3 . ."


def test_plot_timeline_writes_a_png(tmp_path: Path) -> None:
    """Only where matplotlib is installed (the optional ``plot`` extra); CI installs ``test`` only."""
    pytest.importorskip("matplotlib", reason="matplotlib (pipemlx[plot]) is not installed")
    prediction = predict(97, 16, CostModel(LayerCosts(1e-4, 1e-5, 1e-8), (2, 2), 64))
    trace = write_trace(simulated_trace(prediction.result), tmp_path / "p.json")
    out = plot_timeline([("predicted", read_spans(trace))], tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
