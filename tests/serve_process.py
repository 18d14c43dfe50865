"""A real ``pipemlx serve --ranks N`` for tests: started as a subprocess, always stopped, its stderr at hand.

:class:`ServeProcess` starts the command on a free port and waits (bounded)
for ``/health`` to say ready; a server that exits or does not get ready in time
fails the test with its stderr. :meth:`ServeProcess.stop` asks it to stop
(SIGTERM), and kills the supervisor and every rank (pids from ``/health``) when
that takes too long, so no test leaves a rank behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
import pytest

from pipemlx.launch import free_ports

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0
GRACE = 5.0  # --grace unless a test gives its own
T = TypeVar("T")


class ServeProcess:
    """``pipemlx serve`` with ``args`` on 127.0.0.1 and a free port."""

    def __init__(
        self, *args: str, ranks: int = 2, launcher: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="pipemlx-serve-test-")
        self._err: IO[bytes] = open(Path(self._dir.name) / "stderr.txt", "w+b")  # noqa: SIM115 (closed in stop())
        if "--grace" not in args:  # a stop that waits for running requests stays within STOP_TIMEOUT
            args = (*args, "--grace", str(GRACE))
        # The first key of --api-key (several are comma-separated).
        self.key = args[args.index("--api-key") + 1].split(",")[0] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        serve = [sys.executable, "-m", "pipemlx", "serve", "--port", str(self.port), *args]
        # Local ranks (pipemlx's supervisor), or every rank started by a launcher such as mpirun.
        command = [*launcher, *serve] if launcher else [*serve, "--ranks", str(ranks)]
        self.launcher = launcher is not None
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.rank_pids: list[int] = []
        self.stopped = False

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return (Path(self._dir.name) / "stderr.txt").read_text(errors="replace")

    def fail(self, message: str) -> None:
        pytest.fail(f"{message}\n--- pipemlx serve stderr:\n{self.stderr()[-6000:]}", pytrace=False)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"pipemlx serve exited with status {self.proc.returncode} before it was ready")
            try:
                response = httpx.get(self.url + "/health", headers=self.headers, timeout=5.0)
                if response.status_code == 200:
                    health: dict[str, Any] = response.json()
                    self.rank_pids = [r["pid"] for r in health["rank_status"]]
                    return health
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        self.fail(f"pipemlx serve was not ready after {timeout:g} s")
        raise AssertionError  # not reached

    def health(self) -> dict[str, Any]:
        """``/health`` with its detail (the API key sent when the server has one)."""
        return httpx.get(self.url + "/health", headers=self.headers, timeout=10.0).json()

    def wait_for(self, what: str, check: Callable[[], T | None], timeout: float = 60.0, every: float = 0.05) -> T:
        """Poll ``check`` until it returns something other than None/False; fail (with stderr) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value is not None and value is not False:
                return value
            if self.proc.poll() is not None and not self.stopped:
                self.fail(f"pipemlx serve exited (status {self.proc.returncode}) while waiting for {what}")
            time.sleep(every)
        self.fail(f"timed out after {timeout:g} s waiting for {what}")
        raise AssertionError  # not reached

    def stop(self) -> int | None:
        """SIGTERM (rank 0 stops the group), then SIGKILL for whatever is left; returns the exit status."""
        if not self.stopped:
            self.stopped = True
            if self.proc.poll() is None:
                if self.launcher and self.rank_pids:  # rank 0 stops the group; the launcher then exits
                    os.kill(self.rank_pids[0], signal.SIGTERM)
                else:
                    self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            for pid in [self.proc.pid, *self.rank_pids]:
                for kill in (os.killpg, os.kill):  # a rank's own group (local ranks), else the rank itself
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            self.proc.wait()
            self._err.close()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def close_after_fault(self, stalled: bool) -> None:
        """Close after a fault test; a rank left stalled on purpose is killed first (it would never exit)."""
        if stalled:
            for pid in self.rank_pids[1:]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.close()


@contextmanager
def serving(*args: str, ranks: int = 2) -> Iterator[ServeProcess]:
    """A ready ``pipemlx serve`` with ``args``; on leaving, it must stop cleanly (status 0, no traceback)."""
    process = ServeProcess(*args, ranks=ranks)
    try:
        process.wait_ready()
        yield process
    finally:
        status = process.stop()
        stderr = process.stderr()
        process.close()
    assert status == 0, f"pipemlx serve did not stop cleanly (status {status}):\n{stderr[-4000:]}"
    assert "Traceback" not in stderr, stderr[-4000:]
