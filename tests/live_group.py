"""A live group of local ranks that take commands one at a time: for stateful tests over one group.

Each rank runs ``tests/ranks/<program>``, reads one JSON command per line on
stdin and answers one JSON line on stdout. :meth:`LiveGroup.ask` sends a
command to every rank and waits, with a deadline, for every answer; a rank
that dies or does not answer in time ends the group (every rank killed) and
fails the test with each rank's stderr.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import pytest

from pipemlx.launch import free_ports, write_hostfile

RANKS_DIR = Path(__file__).parent / "ranks"


class LiveGroup:
    """``num_ranks`` processes of ``program``, joined over the ring backend on loopback."""

    def __init__(self, num_ranks: int, program: str, spec: dict[str, Any], timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="pipemlx-live-")
        directory = Path(self._dir.name)
        hostfile = write_hostfile([f"127.0.0.1:{p}" for p in free_ports(num_ranks)], directory)
        self._stderr: list[IO[bytes]] = []
        self._buffers: list[bytes] = [b""] * num_ranks
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(num_ranks):
            err = open(directory / f"stderr-{rank}.txt", "w+b")  # noqa: SIM115 (closed in close())
            self._stderr.append(err)
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "PIPEMLX_BACKEND": "ring"}
            command = [sys.executable, str(RANKS_DIR / program), json.dumps(spec)]
            self.procs.append(
                subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
            )

    def ask(
        self, command: dict[str, Any], timeout: float | None = None, ranks: list[int] | None = None
    ) -> list[dict[str, Any]]:
        """Send ``command`` to every rank; return the answers (dicts) of ``ranks`` (default: all), by rank."""
        line = (json.dumps(command) + "\n").encode()
        for proc in self.procs:
            assert proc.stdin is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except BrokenPipeError:
                self.fail(f"a rank had exited before {command}")
        deadline = time.monotonic() + (timeout or self.timeout)
        wanted = range(len(self.procs)) if ranks is None else ranks
        return [json.loads(self._read_line(rank, deadline, command)) for rank in wanted]

    def read(self, rank: int, timeout: float | None = None) -> dict[str, Any]:
        """The next answer of ``rank`` (one that :meth:`ask` did not wait for)."""
        return json.loads(self._read_line(rank, time.monotonic() + (timeout or self.timeout), {"read": rank}))

    def end_input(self) -> None:
        """Close every rank's stdin: the rank programs end as they would in production, on their own."""
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.close()
            except BrokenPipeError:
                pass

    def _read_line(self, rank: int, deadline: float, command: dict[str, Any]) -> str:
        proc = self.procs[rank]
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffers[rank]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.fail(f"rank {rank} did not answer {command} in time")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.fail(f"rank {rank} exited (status {proc.wait()}) while answering {command}")
                self._buffers[rank] += chunk
        line, _, rest = self._buffers[rank].partition(b"\n")
        self._buffers[rank] = rest
        return line.decode()

    def stderr(self) -> str:
        parts = []
        for rank, err in enumerate(self._stderr):
            err.flush()
            err.seek(0)
            parts.append(f"--- rank {rank} stderr:\n{err.read().decode(errors='replace')[-4000:]}")
        return "\n".join(parts)

    def fail(self, message: str) -> None:
        self.kill()
        pytest.fail(f"{message}\n{self.stderr()}", pytrace=False)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def close(self) -> list[int | None]:
        """Ask every rank to exit normally; return their exit statuses (killed after the deadline)."""
        self.end_input()
        deadline = time.monotonic() + self.timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        statuses = [proc.poll() for proc in self.procs]
        self.kill()
        for err in self._stderr:
            err.close()
        self._dir.cleanup()
        return statuses
