"""Chrome traces: the tracer and merge tools, and a real 2-rank run whose trace follows the plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_ranks

from pipemlx.cli.timeline import main
from pipemlx.observe.trace import Span, Tracer, find_rank_traces, merge_traces, read_spans, tracer_for
from pipemlx.schedule.plan import Agree, Compute, Handshake, Progress, Recv, Send, build_plans
from pipemlx.schedule.simulate import describe, simulate

M, STEP, RANKS = 23, 4, 2  # 22 positions: 6 chunks, the last of 2 tokens


def expected_spans(rank: int) -> list[tuple[str, Any]]:
    """The spans the executor records for rank ``rank``'s plan, in order (without the optional waits)."""
    out: list[tuple[str, Any]] = []
    for a in build_plans(M, STEP, RANKS)[rank].actions:
        if isinstance(a, Handshake):
            out.append(("handshake", None))
        elif isinstance(a, (Send, Recv, Compute)):
            out.append((type(a).__name__.lower(), a.chunk.index))
        elif isinstance(a, Agree):
            out.append(("agree", a.step))
        elif isinstance(a, Progress):
            out.append(("progress", a.processed))
    return out


def observed(spans: list[Span], rank: int) -> list[tuple[str, Any]]:
    key = {"agree": lambda s: s.step, "progress": lambda s: s.args["processed"], "handshake": lambda s: None}
    return [
        (s.kind, key[s.kind](s) if s.kind in key else s.chunk) for s in spans if s.rank == rank and s.kind != "wait"
    ]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    directory = tmp_path_factory.mktemp("trace")
    spec = {"arch": "llama", "seed": 5, "M": M, "step": STEP, "trace_dir": str(directory), "repeats": 1}
    reports = run_ranks(RANKS, "timed_prefill.py", spec, timeout=180)
    return reports, directory / "run0"


def test_real_run_writes_a_valid_merged_trace(traced_run: tuple[list[dict[str, Any]], Path], tmp_path: Path) -> None:
    _, directory = traced_run
    paths = find_rank_traces(directory)
    assert [p.name for p in paths] == ["trace-rank0.json", "trace-rank1.json"]
    merged = json.loads(merge_traces(paths, tmp_path / "merged.json").read_text())
    events = merged["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(
        isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0 and e["pid"] in (0, 1)
        for e in spans
    )
    for pid in (0, 1):  # spans on one row of one rank never overlap
        for tid in {e["tid"] for e in spans if e["pid"] == pid}:
            row = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if (e["pid"], e["tid"]) == (pid, tid))
            assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(row, row[1:]))


def test_real_run_follows_the_simulated_plan(traced_run: tuple[list[dict[str, Any]], Path], tmp_path: Path) -> None:
    reports, directory = traced_run
    spans = read_spans(merge_traces(find_rank_traces(directory), tmp_path / "merged.json"))
    plans = build_plans(M, STEP, RANKS)
    simulated = simulate(plans).raise_for_failure()
    for rank, report in enumerate(reports):
        # the executor built and ran the very plan the simulator checked
        assert report["plans_built"] == 1
        assert report["plan_actions"] == [describe(a) for a in plans[rank].actions]
        assert [tuple(c) for c in report["progress"]] == list(simulated.progress[rank])
        assert observed(spans, rank) == expected_spans(rank)
        computes = [s for s in spans if s.rank == rank and s.kind == "compute"]
        assert [(s.chunk, s.args["tokens"]) for s in computes] == [(c.index, c.length) for c in plans[rank].chunks]
    sends = [(s.chunk, s.peer) for s in spans if s.kind == "send"]
    recvs = [(s.chunk, s.peer) for s in spans if s.kind == "recv"]
    assert sends == [(c.index, 1) for c in plans[0].chunks] and recvs == [(c.index, 0) for c in plans[1].chunks]
    assert {s.rank for s in spans if s.kind == "wait"} <= {0} and all(s.peer == 1 for s in spans if s.kind == "wait")
    # causality across processes (one host, one clock): rank 1 finishes chunk k after rank 0 finished it
    done = {(s.rank, s.chunk): s.end_us for s in spans if s.kind == "compute"}
    assert all(done[(1, c.index)] > done[(0, c.index)] for c in plans[0].chunks)


def test_align_lines_ranks_up_on_the_handshake(tmp_path: Path) -> None:
    paths = []
    for rank, shift in ((0, 0.0), (1, 5_000_000.0)):  # rank 1's clock 5 s ahead
        events = [
            {"name": "handshake", "cat": "handshake", "ph": "X", "ts": 100.0 + shift, "dur": 50.0 + rank, "pid": rank, "tid": 2},
            {"name": "compute 0", "cat": "compute", "ph": "X", "ts": 200.0 + shift, "dur": 10.0, "pid": rank, "tid": 0,
             "args": {"chunk": 0}},
        ]  # fmt: skip
        paths.append(tmp_path / f"trace-rank{rank}.json")
        paths[-1].write_text(json.dumps({"traceEvents": events}))
    spans = read_spans(merge_traces(paths, tmp_path / "aligned.json", align=True))
    starts = {(s.rank, s.kind): s.start_us for s in spans}
    assert starts[(0, "compute")] == 200.0 and starts[(1, "compute")] == 199.0
    assert read_spans(merge_traces(paths, tmp_path / "raw.json"))[-1].start_us == 5_000_200.0


def test_tracer_records_only_when_enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPEMLX_TRACE", raising=False)
    off = tracer_for(0, None)
    with off.span("compute", 3):
        pass
    assert not off.enabled and off.events == [] and off.save() is None
    monkeypatch.setenv("PIPEMLX_TRACE", str(tmp_path / "env"))
    on = tracer_for(1, None)
    with on.span("recv", 2, 0):
        pass
    path = on.save()
    assert path == tmp_path / "env" / "trace-rank1.json"
    (span,) = read_spans(path)
    assert (span.rank, span.kind, span.chunk, span.peer) == (1, "recv", 2, 0)
    assert 0 <= span.dur_us < 10_000_000  # microseconds of the block that just ran
    # A directory given to the call wins over $PIPEMLX_TRACE; an empty variable is no directory.
    given = tracer_for(2, tmp_path / "given")
    with given.span("compute", 4, tokens=7):
        pass
    assert given.enabled and given.save() == tmp_path / "given" / "trace-rank2.json"
    (span,) = read_spans(tmp_path / "given" / "trace-rank2.json")
    assert (span.rank, span.kind, span.chunk, span.args["tokens"]) == (2, "compute", 4, 7)
    monkeypatch.setenv("PIPEMLX_TRACE", "")
    assert not tracer_for(0, None).enabled


def test_command_line_merge_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["merge", str(tmp_path)]) == 1
    assert "no trace-rank*.json files" in capsys.readouterr().err
    (tmp_path / "trace-rank0.json").write_text("not json")
    with pytest.raises(ValueError, match="is not a Chrome trace written by pipemlx"):
        read_spans(tmp_path / "trace-rank0.json")
    tracer = Tracer(0, tmp_path)
    with tracer.span("handshake"):
        pass
    tracer.save()
    assert main(["merge", str(tmp_path), "-o", str(tmp_path / "m.json")]) == 0
    assert [s.kind for s in read_spans(tmp_path / "m.json")] == ["handshake"]
    with pytest.raises(ValueError, match="at least one"):
        merge_traces([], tmp_path / "x.json")
