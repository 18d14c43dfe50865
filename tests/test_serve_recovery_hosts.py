"""`pipemlx serve --recover` across hosts: workers in restart loops on network-namespace hosts, a worker killed and
a link cut mid-stream, every stream continued.

One namespace host runs the front (``--recover --hostfile --front-listen``, HTTP on its own address); each of the
ranks' hosts runs ``pipemlx serve --worker`` in a shell restart loop (``while true; do ...; sleep 0.5; done``), the
process supervisor of the docs' systemd unit. After a fault every worker exits, the loops start them again, they
re-form the ring group from the hostfile and rank 0 reconnects to the front, which resumes every request. Streaming
greedy clients (in threads that enter the front's namespace) must get exactly the text of one process running
mlx-lm on the whole model, with no error. Every wait is bounded; whatever happens, every process is killed, the
namespaces are removed, and a failure shows the front's and each worker's stderr.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
import pytest
from netns import NamespaceHosts, ip, namespace_hosts, skip_unless_available
from test_serve import Reference
from test_serve_recovery import MAX_TOKENS, Client, stream

pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Mr. Bingley", "Lady Catherine", "Mrs. Bennet said", "It is a truth universally acknowledged"]
TIMEOUT = 5.0  # --timeout: a rank whose peer went silent (a cut link) gives up after this many seconds (less fails
# start-ups on a busy 2-core machine: timing the collectives waits on every rank)
LINK_PORT = 7000  # the front's --front-listen port on its host
HTTP_PORT = 8080
KEY = "pipemlx-test-key-34"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def enter_namespace(name: str) -> None:
    """Move the calling thread (only it: network namespaces are per thread) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class HostsServer:
    """The front on host ``ranks`` and a worker restart loop on each of hosts 0..ranks-1; all logs in ``folder``."""

    def __init__(self, hosts: NamespaceHosts, ranks: int, folder: Path, *extra: str) -> None:
        self.hosts, self.ranks, self.folder = hosts, ranks, folder
        front_ip = hosts.ips[ranks]
        self.url = f"http://{front_ip}:{HTTP_PORT}"
        self.hostfile = folder / "hosts.json"
        self.hostfile.write_text("[" + ", ".join(f'["{a}"]' for a in hosts.addresses[:ranks]) + "]")
        self.pool = ThreadPoolExecutor(16, "front-netns", initializer=enter_namespace, initargs=(hosts.hosts[ranks],))
        self.logs: list[IO[bytes]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        env = {**os.environ, "PIPEMLX_SERVE_FRONT_KEY": KEY, "MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "1"}
        serving = [
            "--decode-concurrency",
            "4",
            "--timeout",
            str(TIMEOUT),
            "--prompt-cache-bytes",
            "16M",
            "--prefill-chunking",
            "fixed",
            *extra,
        ]
        front = [
            *hosts.prefix(ranks), sys.executable, "-m", "pipemlx", "serve", "--recover", "--hostfile",
            str(self.hostfile), "--front-listen", f"{front_ip}:{LINK_PORT}", "--host", front_ip, "--port",
            str(HTTP_PORT), "--recover-timeout", "90", "--max-restarts", "10", "--grace", "5", *serving,
        ]  # fmt: skip
        self._start(front, "front", env)
        worker = [
            sys.executable, "-m", "pipemlx", "serve", "--worker", "--hostfile", str(self.hostfile), "--front",
            f"{front_ip}:{LINK_PORT}", *serving,
        ]  # fmt: skip
        self.loop = f'while true; do {" ".join(worker)}; echo "worker exited with status $?" >&2; sleep 0.5; done'
        self.env = env
        for rank in range(ranks):
            self._start([*hosts.prefix(rank), "sh", "-c", self.loop], f"worker{rank}", env)

    def _start(self, command: list[str], name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.folder / f"{name}.err", "a+b")  # noqa: SIM115 (closed in close())
        self.logs.append(log)
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def host_gone(self, rank: int) -> None:
        """Host ``rank`` gone for good: its restart loop killed with the worker it runs."""
        os.killpg(self.procs[1 + rank].pid, signal.SIGKILL)

    def host_back(self, rank: int) -> None:
        """Host ``rank`` back: a new restart loop (the old one stays in :attr:`procs` for :meth:`stop`)."""
        proc = self._start([*self.hosts.prefix(rank), "sh", "-c", self.loop], f"worker{rank}", self.env)
        self.procs[1 + rank], self.procs[-1] = proc, self.procs[1 + rank]

    @property
    def front(self) -> subprocess.Popen[bytes]:
        return self.procs[0]

    def stderr(self) -> str:
        parts = []
        for name in ["front", *(f"worker{r}" for r in range(self.ranks))]:
            text = (self.folder / f"{name}.err").read_text(errors="replace")
            parts.append(f"--- {name} stderr (last 3000 characters):\n{text[-3000:]}")
        return "\n".join(parts)

    def fail(self, message: str) -> None:
        pytest.fail(f"{message}\n{self.stderr()}", pytrace=False)

    def call(self, function: Callable[..., T], *args: Any, timeout: float = 30.0) -> T:
        """``function(*args)`` in a thread inside the front's namespace."""
        return self.pool.submit(function, *args).result(timeout)

    def health(self) -> dict[str, Any] | None:
        def get() -> dict[str, Any] | None:
            try:
                return httpx.get(self.url + "/health", timeout=5.0).json()
            except (httpx.HTTPError, ValueError):
                return None

        return self.call(get)

    def wait_for(self, what: str, check: Callable[[], T | None], timeout: float, every: float = 0.1) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value is not None and value is not False:
                return value
            if self.front.poll() is not None:
                self.fail(f"the front exited (status {self.front.returncode}) while waiting for {what}")
            time.sleep(every)
        self.fail(f"timed out after {timeout:g} s waiting for {what}")
        raise AssertionError  # not reached

    def ready(self, timeout: float = 150.0) -> dict[str, Any]:
        return self.wait_for("the front to say ready", lambda: (h := self.health()) and h["status"] == "ready" and h,
                             timeout)  # fmt: skip

    def worker_pid(self, rank: int) -> int:
        """The running worker process of rank ``rank`` (the loop shell's child)."""
        loop = self.procs[1 + rank]
        return self.wait_for(f"worker {rank} to run", lambda: (c := children(loop.pid)) and c[0], 30.0)

    def link(self, rank: int, up: bool) -> None:
        """Rank ``rank``'s cable: its port on the switch down or up."""
        ip("-n", self.hosts.switch, "link", "set", f"h{rank}", "up" if up else "down")

    def stop(self) -> int | None:
        """SIGTERM the front (it tells rank 0 to stop the group); then kill every loop and what runs in it."""
        if self.front.poll() is None:
            self.front.send_signal(signal.SIGTERM)
        try:
            self.front.wait(30.0)
        except subprocess.TimeoutExpired:
            pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        return self.front.returncode

    def close(self) -> None:
        self.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for log in self.logs:
            log.close()


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    ref = Reference()
    return {p: ref.text(ref.generate(ref.text_tokens(p), MAX_TOKENS)) for p in PROMPTS}


@contextmanager
def hosts_server(ranks: int, folder: Path, *extra: str) -> Iterator[HostsServer]:
    """Namespace hosts with a ready front and workers; on leaving, the front must stop cleanly (status 0, no
    traceback), and everything is killed and removed whatever happened."""
    skip_unless_available()
    with namespace_hosts(ranks + 1) as hosts:
        server = HostsServer(hosts, ranks, folder, *extra)
        try:
            server.ready()
            yield server
            status = server.stop()
            front = (folder / "front.err").read_text(errors="replace")
            if status != 0 or "Traceback" in front:
                server.fail(f"the front did not stop cleanly (status {status})")
        finally:
            server.close()


def run_clients(server: HostsServer, fault: Callable[[], None] | None) -> list[Client]:
    """Streaming greedy clients at once; ``fault`` runs once two of them have text under way."""
    clients = [Client(p) for p in PROMPTS]
    futures = [server.pool.submit(stream, server.url, c, MAX_TOKENS) for c in clients]
    if fault is not None:
        server.wait_for("the streams to be under way", lambda: sum(c.chunks >= 3 for c in clients) >= 2, 60.0, 0.01)
        fault()
    deadline = time.monotonic() + 150.0
    for f in futures:
        try:
            f.result(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            server.fail("a client was still streaming after 150 s")
    return clients


def check_continued(server: HostsServer, clients: list[Client], expected: dict[str, str]) -> None:
    for c in clients:
        if c.errors or not c.done:
            server.fail(f"client {c.prompt!r} saw {c.errors} (done: {c.done}, text so far {c.text!r})")
        assert c.text == expected[c.prompt], (c.prompt, c.text, expected[c.prompt])


def recovered(server: HostsServer, before: int) -> float:
    """Wait for the front to be ready again after a fault; the recovery time it measured."""
    health = server.wait_for("ready again", lambda: (h := server.health()) and h["status"] == "ready" and h, 120.0)
    recovery = health["recovery"]
    assert recovery["restarts"] >= before + 1, recovery
    return float(recovery["last_recovery_s"])


def kill_worker(server: HostsServer, rank: int) -> None:
    os.kill(server.worker_pid(rank), signal.SIGKILL)


def cut_link(server: HostsServer, rank: int) -> None:
    """Take rank ``rank``'s cable out, and plug it back in once the front has seen the fault (and a second more)."""
    server.link(rank, up=False)

    def plug_back() -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            health = server.health()
            if health is not None and health["status"] == "recovering":
                break
            time.sleep(0.1)
        time.sleep(1.0)
        server.link(rank, up=True)

    threading.Thread(target=plug_back, daemon=True).start()


def faults_in_turn(server: HostsServer, expected: dict[str, str], faults: list[tuple[str, Callable[[], None]]]) -> None:
    """An undisturbed round, then one round of clients per fault: every text equal to one process's."""
    check_continued(server, run_clients(server, None), expected)
    times: dict[str, float] = {}
    for name, fault in faults:
        health = server.health()
        assert health is not None
        check_continued(server, run_clients(server, fault), expected)
        times[name] = recovered(server, health["recovery"]["restarts"])
    health = server.health()
    assert health is not None
    print(f"\nrecovery across namespace hosts (s): {times}; first start {health['recovery']['start_s']} s")


@pytest.mark.slow  # the suite's time budget: run with -m slow
@pytest.mark.timeout(300)
def test_worker_killed_and_link_cut_across_hosts(tmp_path: Path, expected: dict[str, str]) -> None:
    """2 ranks on 2 namespace hosts, the front on a third: rank 1's worker killed (kill -9) mid-stream, then rank
    1's link cut mid-stream (down, then up once the front saw it): every stream continues, equal to one process."""
    with hosts_server(2, tmp_path) as server:
        faults_in_turn(
            server,
            expected,
            [("kill rank 1", lambda: kill_worker(server, 1)), ("cut rank 1's link", lambda: cut_link(server, 1))],
        )


@pytest.mark.slow  # 40-60 s: the suite's budget; run it with -m slow
@pytest.mark.timeout(420)
def test_a_host_that_stays_gone_is_left_out_then_taken_back(tmp_path: Path, expected: dict[str, str]) -> None:
    """``--allow-shrink`` on 3 namespace hosts: host 2 gone for good mid-stream (its restart loop killed): after
    ``--shrink-after`` the other 2 form a group, split again, and every stream continues equal to one process; host
    2 back: the group grows back to 3, and the next streams are equal too."""
    with hosts_server(3, tmp_path, "--allow-shrink", "--shrink-after", "3") as server:
        check_continued(server, run_clients(server, lambda: server.host_gone(2)), expected)
        health = server.wait_for("ready again", lambda: (h := server.health()) and h["status"] == "ready" and h, 120.0)
        assert health["recovery"]["ranks"] == 2 and health["recovery"]["hosts"] == [0, 1], health["recovery"]
        assert len(health["split"]) == 2 and sum(health["split"]) == 8, health["split"]
        shrunk_s = health["recovery"]["last_recovery_s"]
        server.host_back(2)
        health = server.wait_for(
            "the group to grow back to 3 hosts",
            lambda: (h := server.health()) and h["status"] == "ready" and h["recovery"]["ranks"] == 3 and h,
            150.0,
        )
        assert health["recovery"]["hosts"] == [0, 1, 2] and len(health["split"]) == 3, health
        grew_s = health["recovery"]["last_recovery_s"]
        check_continued(server, run_clients(server, None), expected)
        front = (tmp_path / "front.err").read_text(errors="replace")
        assert "going on with the 2 others (--allow-shrink)" in front and "host 2 is back" in front, front[-3000:]
    print(f"\nhost 2 gone: served by 2 hosts after {shrunk_s} s; host 2 back: by 3 after {grew_s} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_worker_killed_and_each_link_cut_across_hosts(tmp_path: Path, expected: dict[str, str]) -> None:
    """Rank 0's worker killed, rank 0's link cut (which also cuts it from the front), then the same for rank 1."""
    with hosts_server(2, tmp_path) as server:
        faults_in_turn(
            server,
            expected,
            [
                ("kill rank 0", lambda: kill_worker(server, 0)),
                ("cut rank 0's link", lambda: cut_link(server, 0)),
                ("kill rank 1", lambda: kill_worker(server, 1)),
                ("cut rank 1's link", lambda: cut_link(server, 1)),
            ],
        )
