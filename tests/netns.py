"""Test hosts on one machine: network namespaces joined by veth links to a bridge, like PCs on a switch.

``namespace_hosts(n)`` makes n "host" namespaces and one "switch" namespace:

    host namespace  <name>-h<r>   lo up, eth0 = 10.213.0.<r+1>/24
                                   |  (veth pair)
    switch namespace <name>-sw    h<r> -- br0 (a bridge joining every h<r>)

so every host reaches every other one over its own address, as ranks on separate
machines on one LAN do (MLX's ring backend needs rank r to reach r-1 and r+1).
Nothing is added to the root namespace but the namespace names; the addresses
exist only inside the switch's broadcast domain, which is private to one call,
so parallel runs (unique names: pid + random suffix) never meet. The context
manager always deletes its namespaces, whatever happened inside it.

``unavailable()`` says why namespaces cannot be made here (not root, no ``ip``,
no permission), for a skip that names the reason.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipemlx.launch import LaunchError, launch

RANKS_DIR = Path(__file__).parent / "ranks"
SUBNET = "10.213.0"
PREFIX_LENGTH = 24
PORT = 5000
NAME_PREFIX = "pmx"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise with its stderr when it fails and ``check`` is set."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class NamespaceHosts:
    """S host namespaces on one bridge; rank r runs in ``hosts[r]`` and listens on ``addresses[r]``."""

    name: str
    hosts: tuple[str, ...]
    switch: str
    ips: tuple[str, ...]

    @property
    def addresses(self) -> list[str]:
        """The ring hostfile entries, one ``ip:port`` per rank."""
        return [f"{a}:{PORT}" for a in self.ips]

    def prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[rank]]

    def cut(self, rank: int, side: str) -> None:
        """Take rank ``rank``'s link down: its own ``eth0`` (``side="host"``) or its switch port (``"switch"``)."""
        if side == "host":
            ip("-n", self.hosts[rank], "link", "set", "eth0", "down")
        elif side == "switch":
            ip("-n", self.switch, "link", "set", f"h{rank}", "down")
        else:
            raise ValueError(f"side must be 'host' or 'switch', got {side!r}")


def unavailable() -> str | None:
    """Why network namespaces cannot be made on this machine, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed (tests/run.sh installs it where apt-get works)"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    probe = f"{NAME_PREFIX}{os.getpid()}probe{secrets.token_hex(2)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    try:
        bridge = ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot make a bridge inside a network namespace: {bridge.stderr.strip()}"
    finally:
        ip("netns", "delete", probe, check=False)
    return None


def skip_unless_available() -> None:
    """Skip the calling test, naming the reason, when namespaces cannot be made.

    With ``PIPEMLX_REQUIRE_HOSTS=1`` (CI on a root machine) the reason fails the test instead.
    """
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("PIPEMLX_REQUIRE_HOSTS") == "1":
        pytest.fail(f"PIPEMLX_REQUIRE_HOSTS=1 but namespace hosts are unavailable: {reason}")
    pytest.skip(f"namespace hosts unavailable: {reason}")


@contextmanager
def namespace_hosts(count: int) -> Generator[NamespaceHosts]:
    """Make ``count`` host namespaces on one bridge (see the module docstring); always delete them."""
    if not 1 <= count <= 250:
        raise ValueError(f"count must be 1..250 hosts, got {count}")
    name = f"{NAME_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
    hosts = tuple(f"{name}-h{r}" for r in range(count))
    switch = f"{name}-sw"
    made: list[str] = []
    try:
        for namespace in (switch, *hosts):
            ip("netns", "add", namespace)
            made.append(namespace)
            ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        ips = tuple(f"{SUBNET}.{r + 1}" for r in range(count))
        for rank, (host, address) in enumerate(zip(hosts, ips)):
            # The pair is made with each end already in its namespace: nothing appears in the root one.
            ip(
                "link",
                "add",
                "name",
                "eth0",
                "netns",
                host,
                "type",
                "veth",
                "peer",
                "name",
                f"h{rank}",
                "netns",
                switch,
            )
            ip("-n", switch, "link", "set", f"h{rank}", "master", "br0", "up")
            ip("-n", host, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", "eth0")
            ip("-n", host, "link", "set", "eth0", "up")
        yield NamespaceHosts(name, hosts, switch, ips)
    finally:
        remove(made)


def remove(namespaces: list[str]) -> None:
    """Kill whatever still runs in ``namespaces`` (only our own ranks can) and delete them."""
    for namespace in namespaces:
        pids = ip("netns", "pids", namespace, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    errors = [ip("netns", "delete", n, check=False).stderr.strip() for n in namespaces]
    errors = [e for e in errors if e]
    if errors:
        raise RuntimeError(f"could not delete network namespaces {namespaces}: {errors}")


def existing(name: str) -> list[str]:
    """The network namespaces whose names start with ``name``."""
    listed = ip("netns", "list").stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(name)]


def finish_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process until one shared deadline, kill those still running (a test never hangs), and
    return each one's ``(returncode, stdout, stderr)``."""
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        p.kill()
    return [(p.wait(), *p.communicate()) for p in procs]


def every_stderr(results: list[tuple[int, str, str]]) -> str:
    """Each rank's exit status and the end of its stderr, for an assertion's message."""
    return "\n".join(f"--- rank {r} (status {code}):\n{err[-2000:]}" for r, (code, _, err) in enumerate(results))


def run_namespaced_ranks(
    hosts: NamespaceHosts,
    program: str,
    spec: dict[str, Any],
    timeout: float,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``tests/ranks/<program>``, rank r inside ``hosts.hosts[r]``; return each rank's JSON report.

    The ranks meet over the ring backend through a hostfile of the namespaces'
    addresses. Every rank is killed when one fails or ``timeout`` passes, and
    the test fails with every rank's stderr.
    """
    count = len(hosts.hosts)
    command = [sys.executable, str(RANKS_DIR / program), json.dumps(spec)]
    try:
        results = launch(
            count,
            command,
            timeout=timeout,
            env=env,
            addresses=hosts.addresses,
            prefixes=[hosts.prefix(r) for r in range(count)],
        )
    except LaunchError as exc:
        pytest.fail(f"{program} on {count} namespace hosts failed: {exc}", pytrace=False)
    reports: list[dict[str, Any]] = []
    for r in results:
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank {r.rank} printed no report; stderr:\n{r.stderr[-4000:]}"
        reports.append(json.loads(lines[-1]))
    return reports
