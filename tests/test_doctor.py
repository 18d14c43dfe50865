"""``pipemlx doctor``: a healthy group passes; a version mismatch and a cut link fail, naming the host or link.

Locally (no root): 2 loopback ranks, healthy and with one rank reporting another pipemlx version. Across the
network-namespace hosts (root; tests/netns.py): the same command on every host with a ring hostfile, healthy,
with one host's link cut before the start, and with one host on another version. Every run is bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from netns import finish_all, namespace_hosts, skip_unless_available

import pipemlx
from pipemlx.errors import PipelineError
from pipemlx.launch import launch

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--timeout", "20", "--join-timeout", "40", "--json"]  # generous: a loaded 2-core machine starts slowly
CUT = ["--timeout", "10", "--join-timeout", "10", "--json"]  # the join is meant to fail: no need to wait long


def mlx_lm_tokens(model: Any = None) -> list[int]:
    """The tokens the doctor's end-to-end step must give: single-process mlx-lm's greedy decode of its prompt
    (``arange(96) % vocabulary``, 8 tokens, chunks of 16) on the demo model, or on ``model``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.utils import load

    from pipemlx.cli.doctor_rank import DOCTOR_DECODE_TOKENS, DOCTOR_PROMPT_TOKENS
    from pipemlx.demo import MODEL_DIR

    if model is None:
        model, _ = load(str(MODEL_DIR))
    prompt = mx.arange(DOCTOR_PROMPT_TOKENS, dtype=mx.int32) % int(model.args.vocab_size)
    steps = generate_step(prompt, model, max_tokens=DOCTOR_DECODE_TOKENS, prefill_step_size=16)
    tokens = [int(t) for t, _ in steps]
    mx.synchronize(generation_stream)
    assert len(tokens) == 8 and len(set(tokens)) > 1, tokens
    return tokens


def doctor_json(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON report in:\n{stdout}"
    return json.loads(lines[-1])


def test_doctor_passes_a_healthy_local_group() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipemlx", "doctor", "--ranks", "2", *FAST],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    report = doctor_json(done.stdout)
    assert report["ok"] and report["problems"] == []
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert len({(r["mlx"], r["mlx-lm"], r["pipemlx"]) for r in report["ranks"]}) == 1
    (link,) = report["links"]
    assert link["ranks"] == [0, 1] and 0 < link["latency_ms"] < 1000 and link["bandwidth"] > 1e6
    assert report["e2e"]["split"] == [4, 4] and report["e2e"]["tokens"] == mlx_lm_tokens()
    assert report["memory"]["needs"][0] > 0


def test_doctor_text_ends_with_a_verdict() -> None:
    from pipemlx.cli.doctor_rank import render

    ranks = [
        {"rank": r, "host": "h", "address": f"10.0.0.{r + 1}:5000", "mlx": "1", "mlx-lm": "2", "pipemlx": "3"}
        for r in range(2)
    ]
    ranks = [{**r, "available": 8 * 10**9} for r in ranks]
    link = {"ranks": [0, 1], "latency_ms": 0.25, "bandwidth": 1.2e9}
    e2e = {"split": [4, 4], "prompt_tokens": 96, "tokens": [1] * 8, "prefill_s": 0.3, "decode_tok_s": 80.0}
    memory = {"context": 2048, "split": [4, 4], "needs": [30 * 10**6] * 2}
    common = {"backend": "ring", "ranks": ranks, "links": [link], "e2e": e2e, "memory": memory}
    ok = render({**common, "ok": True, "problems": []}).splitlines()
    assert ok[-1] == "verdict: OK: 2 ranks, 1 links, end to end works"
    assert "link rank 0 <-> rank 1: latency 0.250 ms, bandwidth 1.20 GB/s" in ok
    assert ok[2].split()[:3] == ["0", "h", "10.0.0.1:5000"] and ok[2].endswith("8.00 GB    30.00 MB")
    bad = render({**common, "ok": False, "problems": ["link rank 0 -> rank 1: no answer"]}).splitlines()
    assert bad[-1] == "verdict: FAIL: link rank 0 -> rank 1: no answer"


def test_doctor_names_a_rank_on_another_version() -> None:
    command = [sys.executable, "-m", "pipemlx", "doctor", *FAST]
    results = launch(
        2,
        command,
        timeout=180,
        cwd=ROOT,
        fail_fast=False,
        prefixes=[["env"], ["env", "PIPEMLX_DOCTOR_VERSION=9.9.9"]],
    )
    assert [r.returncode for r in results] == [1, 1], [r.stderr for r in results]
    report = doctor_json(results[0].stdout)
    assert not report["ok"]
    assert any(
        "rank 1" in p and "pipemlx 9.9.9" in p and f"the others {pipemlx.__version__}" in p for p in report["problems"]
    )
    assert "version mismatch: rank 1" in results[1].stderr


def test_bad_doctor_arguments() -> None:
    from pipemlx.cli import main

    assert main(["doctor", "--ranks", "1"]) == 2
    assert main(["doctor", "--rank", "1"]) == 2
    assert main(["doctor", "--ranks", "9"]) == 2  # more ranks than the demo's 8 layers


def test_doctor_allow_unregistered_reaches_load_sharded(tmp_path: Path) -> None:
    """``--allow-unregistered`` parses as for generate / serve / bench, and the end-to-end run loads with it.

    The end-to-end step on one rank in this process (a doctor needs 2 ranks, and a launch costs seconds).
    """
    import mlx.core as mx
    from fakes import HELIUM_TIED

    from pipemlx.cli import build_parser
    from pipemlx.cli.doctor_rank import end_to_end
    from pipemlx.testing import build_model, save_model_dir

    path = save_model_dir(build_model(dict(HELIUM_TIED)), HELIUM_TIED, tmp_path / "helium")
    base = ["doctor", "--model", str(path), "--timeout", "20"]
    parser = build_parser()
    refused, allowed = parser.parse_args(base), parser.parse_args([*base, "--allow-unregistered"])
    assert (refused.allow_unregistered, allowed.allow_unregistered) == (False, True)
    group = mx.distributed.init()  # one rank
    with pytest.raises(PipelineError, match="--allow-unregistered to pipemlx generate / serve / bench / doctor"):
        end_to_end(refused, group)
    report = end_to_end(allowed, group)
    assert report["split"] == [4] and report["tokens"] == mlx_lm_tokens(build_model(dict(HELIUM_TIED)))


# --- across network-namespace hosts ----------------------------------------------------------------


def run_on_hosts(count: int, tmp_path: Path, *, cut: int | None = None, odd_version: int | None = None) -> list[Any]:
    """``pipemlx doctor --hostfile`` started on every namespace host; returns (status, stdout, stderr) per rank."""
    with namespace_hosts(count) as hosts:
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([[a] for a in hosts.addresses]))
        if cut is not None:
            hosts.cut(cut, "host")
        argv = [
            sys.executable,
            "-m",
            "pipemlx",
            "doctor",
            "--hostfile",
            str(hostfile),
            *(CUT if cut is not None else FAST),
        ]
        procs = []
        for r in range(count):
            env = ["env", "PIPEMLX_DOCTOR_VERSION=9.9.9"] if r == odd_version else []
            procs.append(
                subprocess.Popen(
                    [*hosts.prefix(r), *env, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        return finish_all(procs, 180)


@pytest.fixture
def needs_namespaces() -> None:
    skip_unless_available()


@pytest.mark.slow  # the suite's time budget: run with -m slow
@pytest.mark.usefixtures("needs_namespaces")
def test_doctor_across_namespace_hosts_names_the_host_on_another_version(tmp_path: Path) -> None:
    """Three hosts, the third on another pipemlx (simulated): links, memory and the end-to-end run all pass,
    and the verdict names that host and nothing else."""
    runs = run_on_hosts(3, tmp_path, odd_version=2)
    assert [status for status, _, _ in runs] == [1, 1, 1], [err[-2000:] for _, _, err in runs]
    report = doctor_json(runs[0][1])
    assert [r["address"] for r in report["ranks"]] == [f"10.213.0.{i}:5000" for i in (1, 2, 3)]
    assert [link["ranks"] for link in report["links"]] == [[0, 1], [1, 2], [2, 0]]
    assert all(link["bandwidth"] > 1e6 for link in report["links"])
    assert report["e2e"]["split"] == [3, 3, 2] and report["e2e"]["tokens"] == mlx_lm_tokens()
    problems = report["problems"]
    assert len(problems) == 1, problems
    assert "rank 2" in problems[0] and "10.213.0.3:5000" in problems[0] and "pipemlx 9.9.9" in problems[0]
    assert all("version mismatch: rank 2" in err for _, _, err in runs)


@pytest.mark.slow  # the suite's time budget: run with -m slow
@pytest.mark.usefixtures("needs_namespaces")
def test_doctor_names_the_cut_link(tmp_path: Path) -> None:
    runs = run_on_hosts(3, tmp_path, cut=1)
    statuses = [status for status, _, _ in runs]
    assert statuses == [1, 1, 1], [err[-2000:] for _, _, err in runs]
    report = doctor_json(runs[0][1])
    assert not report["ok"]
    shown = "\n".join(report["problems"])
    assert "link rank 0 (10.213.0.1:5000) -> rank 1 (10.213.0.2:5000)" in shown, shown
    assert "rank 0 could not join" in shown
