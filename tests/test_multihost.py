"""Ranks on separate network hosts: one network namespace per rank, joined by veth links to a bridge.

Each rank runs inside its own namespace (`ip netns exec`) and listens on that
namespace's own address; the ranks meet over MLX's ring backend through a
hostfile of those addresses, exactly as ranks on separate machines do. The
addresses exist only inside the namespaces, so a rank that was not in its
namespace could not even bind. Needs root (skips, naming the reason, without).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from netns import (
    SUBNET,
    every_stderr,
    existing,
    finish_all,
    ip,
    namespace_hosts,
    run_namespaced_ranks,
    skip_unless_available,
)
from test_equivalence import check_reports

from pipemlx.launch import free_ports, launch

M, STEP = 30, 4
TIMEOUT = 2.0
MARGIN = 3.0  # seconds of slack for a loaded 2-core machine


@pytest.fixture
def needs_namespaces() -> None:
    skip_unless_available()


def scenario() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"kind": "plain", "M": 12, "step": 4}]
    steps += [{"kind": "pipeline", "M": m, "step": 8} for m in (1, 8, 9, 51)]
    steps += [
        {"kind": "pipeline", "M": 6, "step": 1},
        {"kind": "queue_exception"},
        {"kind": "plain", "M": 20, "step": 8},
    ]
    return steps


@pytest.mark.usefixtures("needs_namespaces")
def test_namespace_hosts_are_private_and_always_removed() -> None:
    name = ""
    with pytest.raises(KeyError, match="inside"):
        with namespace_hosts(3) as hosts:
            name = hosts.name
            assert sorted(existing(name)) == sorted([*hosts.hosts, hosts.switch])
            for rank, host in enumerate(hosts.hosts):
                shown = ip("-n", host, "-o", "-4", "addr", "show").stdout
                assert f"{SUBNET}.{rank + 1}/24" in shown and "127.0.0.1/8" in shown, shown  # eth0 and lo are up
            route = ip("-n", hosts.hosts[0], "route", "get", f"{SUBNET}.3").stdout
            assert "dev eth0" in route, route
            assert SUBNET not in ip("-o", "-4", "addr", "show").stdout, (
                "the test addresses leaked into the root namespace"
            )
            raise KeyError("a failure inside the block")
    assert name and existing(name) == [], "namespaces left behind after a failure"


@pytest.mark.usefixtures("needs_namespaces")
@pytest.mark.parametrize(
    "num_ranks,arch", [(2, "llama"), pytest.param(3, "qwen3", marks=pytest.mark.slow)]
)  # the suite's time budget: run with -m slow
def test_pipeline_matches_single_device_across_namespace_hosts(num_ranks: int, arch: str) -> None:
    spec = {"arch": arch, "seed": 3, "max_tokens": 6, "steps": scenario()}
    with namespace_hosts(num_ranks) as hosts:
        reports = run_namespaced_ranks(hosts, "equivalence.py", spec, timeout=180)
        assert all(a.startswith(SUBNET + ".") for a in hosts.addresses)
    assert existing(hosts.name) == []
    assert [r["size"] for r in reports] == [num_ranks] * num_ranks
    assert check_reports(reports, num_ranks) == num_ranks * (len(scenario()) - 1)


def cut_on_request(request: Path, cut: Any, stop: threading.Event) -> None:
    """The harness's side of the cable pull: when a rank asks (writes ``request``), take its link down."""
    while not stop.is_set():
        if request.exists():
            cut()
            return
        stop.wait(0.01)


@pytest.mark.usefixtures("needs_namespaces")
@pytest.mark.parametrize(
    "num_ranks,side", [pytest.param(2, "switch", marks=pytest.mark.slow), (3, "host")]
)  # -m slow: S=2
def test_a_link_cut_mid_prefill_ends_in_an_error_on_every_rank(num_ranks: int, side: str, tmp_path: Path) -> None:
    victim, at = 1, 2
    request, cut_marker = tmp_path / "request", tmp_path / "cut"
    spec = {
        "timeout": TIMEOUT,
        "M": M,
        "step": STEP,
        "victim": victim,
        "at": at,
        "request": str(request),
        "cut": str(cut_marker),
        "wait_for_cut": 10.0,
    }
    stop = threading.Event()
    with namespace_hosts(num_ranks) as hosts:
        harness = threading.Thread(
            target=cut_on_request, args=(request, lambda: hosts.cut(victim, side), stop), daemon=True
        )
        harness.start()
        try:
            reports = run_namespaced_ranks(hosts, "link_cut.py", spec, timeout=60)
        finally:
            stop.set()
            harness.join()
    assert existing(hosts.name) == []
    cut_at = float(cut_marker.read_text())
    assert [r["rank"] for r in reports] == list(range(num_ranks))
    for report in reports:
        where = f"rank {report['rank']}/{num_ranks}, {side} side of rank {victim} cut: {report}"
        assert report["error"] in ("PipelineTimeoutError", "PeerLostError"), where
        assert f"rank {report['rank']}/{num_ranks}" in report["message"], where
        assert report["broken"], where
        assert max(report["progress_calls"], default=0) < M - 1, f"{where}: the prefill finished despite the cut"
        assert report["link_down"] == (report["rank"] == victim), where
        if report["rank"] != victim:
            assert 0 <= report["at_time"] - cut_at <= TIMEOUT + MARGIN, where
        print(
            f"S={num_ranks} {side}-side cut of rank {victim}: rank {report['rank']} raised {report['error']} "
            f"{report['at_time'] - cut_at:.2f} s after the cut (timeout {TIMEOUT:g} s)"
        )


@pytest.mark.usefixtures("needs_namespaces")
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_a_link_cut_mid_decode_ends_in_a_typed_error_on_every_rank(num_ranks: int, tmp_path: Path) -> None:
    """pipemlx.generate_step: the victim's link goes down at its 3rd token; every rank raises within the bound."""
    victim, at, max_tokens = 1, 3, 40
    request, cut_marker = tmp_path / "request", tmp_path / "cut"
    spec = {
        "timeout": TIMEOUT,
        "M": 9,
        "step": 4,
        "victim": victim,
        "at": at,
        "request": str(request),
        "cut": str(cut_marker),
        "wait_for_cut": 10.0,
        "phase": "decode",
        "max_tokens": max_tokens,
    }
    stop = threading.Event()
    with namespace_hosts(num_ranks) as hosts:
        harness = threading.Thread(
            target=cut_on_request, args=(request, lambda: hosts.cut(victim, "host"), stop), daemon=True
        )
        harness.start()
        try:
            reports = run_namespaced_ranks(hosts, "link_cut.py", spec, timeout=60)
        finally:
            stop.set()
            harness.join()
    cut_at = float(cut_marker.read_text())
    for report in reports:
        where = f"rank {report['rank']}/{num_ranks}, decode, rank {victim}'s link cut: {report}"
        assert report["error"] in ("PipelineTimeoutError", "PeerLostError"), where
        assert report["broken"], where
        assert report["tokens"] < max_tokens, where
        if report["rank"] != victim:
            assert 0 <= report["at_time"] - cut_at <= TIMEOUT + MARGIN, where


def test_launch_puts_each_prefix_before_the_command_and_the_addresses_in_the_hostfile() -> None:
    """launch()'s ``addresses`` and ``prefixes``, checked without root: ``env VAR=...`` as the prefix."""
    ports = free_ports(2)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    show = "import json, os; print(json.dumps([os.environ['WHERE'], os.environ['MLX_RANK'], open(os.environ['MLX_HOSTFILE']).read()]))"
    results = launch(
        2,
        [sys.executable, "-c", show],
        timeout=60,
        addresses=addresses,
        prefixes=[["env", f"WHERE=host{r}"] for r in range(2)],
    )
    for r in results:
        where, rank, hostfile = json.loads(r.stdout)
        assert (where, rank) == (f"host{r.rank}", str(r.rank))
        assert json.loads(hostfile) == [[a] for a in addresses]


@pytest.mark.parametrize(
    "options,problem",
    [
        ({"addresses": ["127.0.0.1:5000"]}, "one 'host:port' per rank"),
        ({"addresses": "127.0.0.1:5000"}, "one 'host:port' per rank"),
        ({"addresses": ["127.0.0.1:5000", "127.0.0.1"]}, "is not 'host:port'"),
        ({"addresses": ["127.0.0.1:5000", "10.0.0.1:70000"]}, "is not 'host:port'"),
        ({"prefixes": [["env"]]}, "one argument list per rank"),
    ],
)
def test_launch_rejects_bad_addresses_and_prefixes(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        launch(2, [sys.executable, "-c", "pass"], timeout=10, **options)


@pytest.mark.parametrize("form", ["ring", "distributed_config"])
def test_generate_with_a_hostfile_across_namespace_hosts(needs_namespaces: None, tmp_path: Path, form: str) -> None:
    """`pipemlx generate --hostfile FILE`, the same command on each host: each rank finds its rank by its own
    address (no --rank), and rank 0 reports the tokens single-device mlx-lm gives. The hostfile in the ring
    backend's form, or as ``mlx.distributed_config`` writes it (hosts by IP, ports as ``mlx.launch`` counts them,
    ``envs`` set on every rank)."""
    import subprocess

    from conftest import demo_reference_tokens as reference_tokens
    from test_cli import ROOT

    prompt = "It is a truth universally acknowledged, that a single man in possession"
    with namespace_hosts(2) as hosts:
        hostfile = tmp_path / "hosts.json"
        if form == "ring":
            hostfile.write_text(json.dumps([[a] for a in hosts.addresses]))
        else:  # mlx.distributed_config's Hostfile.to_json()
            config = {
                "backend": "ring",
                "envs": ["PIPEMLX_TEST_FROM_HOSTFILE=1"],
                "hosts": [{"ssh": f"host{r}", "ips": [ip], "rdma": []} for r, ip in enumerate(hosts.ips)],
            }
            hostfile.write_text(json.dumps(config))
        argv = [
            sys.executable,
            "-m",
            "pipemlx",
            "generate",
            "--hostfile",
            str(hostfile),
            "--prompt",
            prompt,
            "--prefill-step-size",
            "4",
            "--max-tokens",
            "12",
            "--temp",
            "0",
            "--json",
        ]
        procs = [
            subprocess.Popen(
                [*hosts.prefix(r), *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for r in range(2)
        ]
        results = finish_all(procs, 120)
    assert [code for code, _, _ in results] == [0, 0], every_stderr(results)
    report = json.loads(results[0][1])
    assert [[f["layer_start"], f["layer_stop"]] for f in report["per_rank"]] == [[0, 4], [4, 8]]
    assert report["tokens"] == reference_tokens(prompt, 4, 12)
