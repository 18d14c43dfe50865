"""A small local launcher: N ranks as processes on this machine, over MLX's ring backend.

``mlx.launch`` busy-polls its children's pipes and burns a core; this one
sleeps. Each rank gets ``MLX_RANK`` and ``MLX_HOSTFILE`` (free loopback ports)
and ``PIPEMLX_BACKEND=ring``; a rank program calls :func:`init_group`. The
launcher kills every rank (and their children) on the first failure or when
the deadline passes, and reports each rank's exit status and stderr.

Usage: ``python -m pipemlx.launch -n 2 [--timeout S] -- python my_rank_program.py ...``
(across hosts, use ``mlx.launch`` or ``mpirun`` instead).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeAlias

import mlx.core as mx

BACKEND_VARIABLE = "PIPEMLX_BACKEND"
TAIL_CHARS = 4000
STOP_GRACE_S = 15.0
"""Seconds the other ranks of a server get to leave on their own once rank 0 stopped the group (or was told to)."""

RankFile: TypeAlias = int | IO[Any] | None
"""Where a rank's stdin, stdout or stderr goes, as :class:`subprocess.Popen` takes it (None: this process's)."""


@dataclass(frozen=True)
class RankResult:
    """What one rank process left behind."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


class LaunchError(RuntimeError):
    """A rank failed or the deadline passed; every rank was killed. ``results`` holds what each left."""

    def __init__(self, message: str, results: list[RankResult]) -> None:
        super().__init__(message + "\n" + _report(results))
        self.results = results


def init_group(backend: str | None = None) -> mx.distributed.Group:
    """Join the group this process was started in (by :func:`launch`, ``mlx.launch`` or ``mpirun``).

    The backend is ``backend``, else ``$PIPEMLX_BACKEND``, else MLX's choice.
    """
    chosen = backend or os.environ.get(BACKEND_VARIABLE, "any")
    return mx.distributed.init(backend=chosen, strict=chosen != "any")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_hostfile(addresses: Sequence[str], directory: Path) -> Path:
    """An MLX ring hostfile: one list of ``host:port`` per rank."""
    path = directory / "hostfile.json"
    path.write_text(json.dumps([[a] for a in addresses]))
    return path


def launch(
    num_ranks: int,
    command: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    passthrough_rank: int | None = None,
    fail_fast: bool = True,
    addresses: Sequence[str] | None = None,
    prefixes: Sequence[Sequence[str]] | None = None,
    pin_cpus: bool = True,
) -> list[RankResult]:
    """Run ``command`` as ranks ``0 .. num_ranks-1`` on loopback and wait for all of them.

    Returns one :class:`RankResult` per rank when every rank exits with status 0.
    Raises :class:`LaunchError` (after killing every rank) when a rank fails or
    ``timeout`` seconds pass. With ``fail_fast=False`` a failed rank does not
    stop the others: the launcher waits for every rank (up to ``timeout``) and
    returns every result, whatever the exit statuses (fault-injection tests).
    ``passthrough_rank``'s output goes to this process's stdout/stderr instead
    of being captured.

    ``addresses`` (one ``host:port`` per rank) replaces the loopback ports in
    the hostfile, and ``prefixes`` (one argument list per rank) goes before
    ``command`` for that rank: together they run each rank somewhere else on
    this machine, for instance ``["ip", "netns", "exec", name]`` with the
    address that network namespace owns.

    ``pin_cpus`` (Linux, when there are at least as many CPUs as ranks) gives
    each rank its own share of this process's CPUs (:func:`cpu_shares`):
    MLX's ring backend busy-waits in its receives, and a rank waiting on the
    same core as the rank it waits for slows that one down (docs/performance.md,
    "Decode").
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    listen = _check_addresses(num_ranks, addresses)
    if prefixes is not None and len(prefixes) != num_ranks:
        raise ValueError(f"prefixes must hold one argument list per rank ({num_ranks}), got {len(prefixes)}")
    with tempfile.TemporaryDirectory(prefix="pipemlx-launch-") as tmp:
        directory = Path(tmp)
        files: list[tuple[IO[str], IO[str]] | None] = []

        def capture(rank: int) -> tuple[RankFile, RankFile]:
            if rank == passthrough_rank:
                files.append(None)
                return None, None
            out = open(directory / f"rank{rank}.out", "w+")
            err = open(directory / f"rank{rank}.err", "w+")
            files.append((out, err))
            return out, err

        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs = spawn_ranks(
                command,
                num_ranks,
                directory=directory,
                env=env,
                outputs=capture,
                addresses=listen,
                prefixes=prefixes,
                cwd=cwd,
                pin_cpus=pin_cpus,
            )
            failure = _wait(procs, timeout, fail_fast)
        finally:
            kill_all(procs)
        results = [_result(rank, proc, files[rank]) for rank, proc in enumerate(procs)]
        if failure is not None:
            raise LaunchError(failure, results)
        return results


def spawn_ranks(
    command: Sequence[str],
    num_ranks: int,
    *,
    directory: Path,
    env: Mapping[str, str] | None = None,
    outputs: Callable[[int], tuple[RankFile, RankFile]] | None = None,
    stdin: RankFile = None,
    addresses: Sequence[str] | None = None,
    prefixes: Sequence[Sequence[str]] | None = None,
    cwd: str | Path | None = None,
    pin_cpus: bool = True,
    cpus: Collection[int] | None = None,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ``command`` as ranks ``0 .. num_ranks-1`` of a ring group on this machine; their processes, in rank order.

    The ring hostfile goes in ``directory`` and lists ``addresses`` (one ``host:port`` per rank; default: free
    loopback ports). Each rank's environment is this process's, then ``env``, then ``MLX_RANK``, ``MLX_HOSTFILE``,
    ``PIPEMLX_BACKEND=ring`` and ``PYTHONUNBUFFERED=1`` (one rank alone: no ``MLX_RANK``/``MLX_HOSTFILE`` and
    ``PIPEMLX_BACKEND=any``, as the ring backend cannot form a ring of one). ``outputs(rank)`` gives the rank's
    ``(stdout, stderr)`` (default: this process's), ``stdin`` is every rank's, and ``prefixes[rank]`` (one argument
    list per rank) goes before ``command``. Each rank starts in its own session (:func:`kill_all` ends its group)
    and, with ``pin_cpus``, on its own share of ``cpus`` (default: this process's CPUs; :func:`cpu_shares`).
    ``on_start`` sees each process as soon as it started (a signal handler can reach the ranks started so far).
    When starting one fails, the ranks already started are killed.
    """
    hostfile = write_hostfile(addresses or [f"127.0.0.1:{p}" for p in free_ports(num_ranks)], directory)
    shares = cpu_shares(num_ranks, cpus) if pin_cpus else None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(num_ranks):
            rank_env = {
                **os.environ,
                **(env or {}),
                "MLX_RANK": str(rank),
                "MLX_HOSTFILE": str(hostfile),
                BACKEND_VARIABLE: "ring",
                "PYTHONUNBUFFERED": "1",
            }
            if num_ranks == 1:  # the ring backend cannot form a ring of one: a singleton group instead
                del rank_env["MLX_RANK"], rank_env["MLX_HOSTFILE"]
                rank_env[BACKEND_VARIABLE] = "any"
            out, err = outputs(rank) if outputs is not None else (None, None)
            proc = subprocess.Popen(
                [*(prefixes[rank] if prefixes is not None else ()), *command],
                env=rank_env,
                cwd=cwd,
                stdin=stdin,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            procs.append(proc)
            if on_start is not None:
                on_start(proc)
            if shares is not None:
                pin(proc.pid, shares[rank])
    except BaseException:
        kill_all(procs)
        raise
    return procs


def cpu_shares(num_ranks: int, cpus: Collection[int] | None = None) -> list[set[int]] | None:
    """``cpus`` (default: this process's CPUs) cut into ``num_ranks`` contiguous shares as even as they go (a rank's
    threads stay on its own cores); ``None`` where CPUs cannot be pinned (not Linux) or there are fewer CPUs than
    ranks."""
    if not hasattr(os, "sched_getaffinity") or num_ranks < 2:
        return None
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < num_ranks:
        return None
    return [set(cpus[len(cpus) * r // num_ranks : len(cpus) * (r + 1) // num_ranks]) for r in range(num_ranks)]


def available_memory() -> int:
    """Bytes this machine can still give (Linux: MemAvailable; elsewhere: the physical memory; 0: unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def pin(pid: int, cpus: set[int]) -> None:
    """Keep process ``pid`` and every thread it has on ``cpus`` (threads it starts later inherit its mask).

    The main thread first, then each thread listed in ``/proc``: a thread started before the main thread was
    pinned is pinned too. A process that already ended is left alone.
    """
    try:
        os.sched_setaffinity(pid, cpus)
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), cpus)
    except (ProcessLookupError, FileNotFoundError, PermissionError):
        pass


def _check_addresses(num_ranks: int, addresses: Sequence[str] | None) -> list[str] | None:
    """``addresses`` as a list when each of the ``num_ranks`` entries looks like ``host:port``."""
    if addresses is None:
        return None
    if isinstance(addresses, str) or len(addresses) != num_ranks:
        raise ValueError(f"addresses must hold one 'host:port' per rank ({num_ranks}), got {addresses!r}")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address {address!r} is not 'host:port' with a port in 1..65535")
    return list(addresses)


def relaunch_as_ranks(num_ranks: int, *, timeout: float = 600.0) -> int:
    """Run this very script (``sys.argv``) as ``num_ranks`` local ranks; return the exit status for ``main``.

    For scripts that take ``--ranks N``: when the process is not already a rank
    (no ``MLX_RANK``), call this and return its status. Rank 0's output goes
    straight to this terminal; the other ranks' output follows when they end.
    On failure every rank is killed and their stderr is printed.
    """
    try:
        results = launch(num_ranks, [sys.executable, *sys.argv], timeout=timeout, passthrough_rank=0)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    for result in results[1:]:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    return 0


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float, fail_fast: bool) -> str | None:
    """Poll until all exit (None), one fails under ``fail_fast``, or time runs out (a message)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and fail_fast:
            rank, code = failed[0]
            return f"rank {rank} exited with status {code}; killed the other ranks"
        if all(c is not None for c in codes):
            return None
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            return f"timed out after {timeout:g} s with ranks {running} still running; killed every rank"
        time.sleep(0.05)


def kill_all(procs: Sequence[subprocess.Popen[Any]]) -> None:
    """SIGKILL each process's group (ranks start in their own session) and reap them all."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()


def _result(rank: int, proc: subprocess.Popen[bytes], files: tuple[IO[str], IO[str]] | None) -> RankResult:
    if files is None:
        return RankResult(rank, proc.returncode, "", "")
    texts: list[str] = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return RankResult(rank, proc.returncode, texts[0], texts[1])


def _report(results: list[RankResult]) -> str:
    parts: list[str] = []
    for r in results:
        tail = r.stderr[-TAIL_CHARS:] if r.stderr else "(empty)"
        out = r.stdout[-TAIL_CHARS // 4 :] if r.stdout else "(empty)"
        parts.append(f"--- rank {r.rank} (status {r.returncode}) stdout tail:\n{out}\n--- stderr:\n{tail}")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipemlx.launch", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("-n", "--ranks", type=int, required=True, help="number of local ranks")
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill every rank after this many seconds")
    parser.add_argument(
        "--no-pin", action="store_true", help="let the ranks share every CPU (default: each rank its own share)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the rank program (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the rank program after --")
    try:
        results = launch(args.ranks, command, timeout=args.timeout, passthrough_rank=0, pin_cpus=not args.no_pin)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    for r in results[1:]:
        sys.stderr.write(r.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
