"""The front process's supervisor (:class:`Supervisor`): it brings the group of ranks up, blames and counts
faults, restarts the group, shrinks it, and hands each group to the relay (:mod:`.relay`).

With local ranks (``--ranks N``) it starts them (:func:`pipemlx.launch.spawn_ranks`) and rank 0 connects over
loopback; across hosts (``--hostfile`` with ``--front-listen``) each host runs ``pipemlx serve --worker`` under
a supervisor of its own, the workers join the front, and the front tells them which group to form. A fault (a
rank exits, rank 0 reports a pipeline error or falls silent) makes ``/health`` say ``recovering``; the local
group is killed and started again on new ports (across hosts the workers exit and their supervisors start
them), bounded by ``--recover-timeout`` (then the waiting clients get 503 with ``Retry-After``), and the relay
resumes every request. ``--allow-shrink`` goes on with fewer ranks; more than ``--max-restarts`` faults within
``--restart-window`` seconds end the front (503 saying why for ``--fault-grace`` seconds, then status 1).
docs/serve.md, "Recovery", tells it whole.
"""

from __future__ import annotations

import os
import queue
import secrets
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..launch import STOP_GRACE_S, cpu_shares, kill_all, pin, spawn_ranks
from .book import Book, log, warn
from .link import BEAT_S, FRONT_ADDRESS_VARIABLE, FRONT_KEY_VARIABLE, HANDSHAKE_S, Acceptor, Link
from .openai_api import ApiError, shutting_down
from .relay import Fault, Regroup, Relay
from .requests import from_json
from .settings import RankOptions, ServeSettings, rank_process

START_TIMEOUT_S = 300.0
"""The longest a group may take to load and greet the front before the start counts as failed."""
RETRY_AFTER_S = 2
SHRINK_AFTER = 3
"""With ``--allow-shrink``: faults in a row blamed on the same rank after which the group restarts one rank
smaller."""


@dataclass
class FrontOptions:
    """What the front process needs: HTTP, the model's tokenizer, and how it starts the ranks (local), or where it
    waits for them (``listen``: hosts)."""

    rank: RankOptions  # what each rank serves with (model_dir: a folder or a Hub repo id)
    ranks: int
    host: str = "127.0.0.1"
    port: int = 8080
    env: dict[str, str] = field(default_factory=dict[str, str])  # added to each local rank's environment
    recover_timeout: float = 60.0
    max_restarts: int = 5
    restart_window: float = 600.0
    listen: tuple[str, int] | None = None
    """Across hosts: the address rank 0 of the workers connects to (the front then starts no ranks)."""
    key: str | None = None
    """Across hosts: the link's shared key (``PIPEMLX_SERVE_FRONT_KEY``); random for local ranks."""
    allow_shrink: bool = False
    """Fewer ranks after a fault (``--allow-shrink``): local ranks, one fewer after a rank was killed in several
    faults in a row; across hosts, the hosts that came back when the others stay gone for ``shrink_after`` s."""
    shrink_after: float = 20.0
    hosts: list[list[str]] = field(default_factory=list[list[str]])
    """Across hosts: the hostfile's entries (the front tells each joining worker which of them form the group)."""
    model: Path | None = None
    """The model folder, for planning the split again for fewer hosts."""


@dataclass
class Joined:
    """A worker that joined the front and waits to be told which group to form."""

    link: Link
    memory: int  # bytes it can give (0: unknown)


RESPAWN_PAUSE_S = 1.0
"""Seconds the front waits before trying again to start ranks that could not be started."""


class Supervisor:
    """The front's main loop: bring the group up, relay the requests, bring it up again after a fault."""

    def __init__(self, book: Book, options: FrontOptions) -> None:
        self.book = book
        self.options = options
        self.settings: ServeSettings = book.settings
        self.hosts = options.listen is not None  # workers on hosts under their own supervisors: start nothing
        self.key = options.key or secrets.token_hex(32)
        host, port = options.listen or ("127.0.0.1", 0)
        self.acceptor = Acceptor(host, port, self.key)  # OSError when the address cannot be listened on
        self.relay = Relay(book, STOP_GRACE_S)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ranks = options.ranks  # the local ranks started now (fewer after a shrink)
        self.blamed: list[int | None] = []  # the rank each fault in a row was blamed on (None: none could be)
        self.workdir = tempfile.TemporaryDirectory(prefix="pipemlx-serve-")  # the ranks' hostfile
        # The CPUs the ranks share out (the front itself joins rank 0's share once the ranks are pinned).
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.faults: list[float] = []  # when each fault happened (monotonic)
        self.started_once = False
        self.joined: dict[int, Joined] = {}  # across hosts: by hostfile entry
        self.unheard: list[tuple[Link, float]] = []  # links that have not said which worker they are yet
        self.group: list[int] = list(range(options.ranks))  # across hosts: the entries of the group formed last
        self.cannot_shrink: str | None = None  # why the hosts that came back cannot hold the model (said once)
        self.recovery: dict[str, Any] = {
            "restarts": 0,
            "last_fault": None,
            "start_s": None,  # the first start: spawn to rank 0's greeting (loading, warming up, calibrating)
            "last_recovery_s": None,  # the fault seen to the new group's greeting
            "times_s": [],  # the last 16 recoveries
            "ranks": options.ranks,  # fewer after a shrink (--allow-shrink)
        }
        book.recovery = self.recovery

    # --- the main loop -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped (0), or until restarts are used up (1) or the first start fails on bad input (2)."""
        try:
            return self._run()
        finally:
            self.close()

    def close(self) -> None:
        """Kill the local ranks, stop listening, remove the ranks' hostfile."""
        kill_all(self.procs)
        self.acceptor.close()
        self.workdir.cleanup()

    def _run(self) -> int:
        fault_at: float | None = None
        started = time.monotonic()
        while True:
            link = self._bring_up(fault_at)
            if isinstance(link, int):
                return link
            if self.recovery["start_s"] is None:
                took = time.monotonic() - started
                self.recovery["start_s"] = round(took, 2)
                self.book.log_start(took, "workers" if self.hosts else "ranks")
            elif fault_at is not None:
                took = time.monotonic() - fault_at
                self.recovery["last_recovery_s"] = round(took, 2)
                self.recovery["times_s"] = (self.recovery["times_s"] + [round(took, 2)])[-16:]
                log(f"the group is back after {took:.2f} s; resuming {len(self.book.unfinished())} request(s)")
            try:
                return self.relay.serve(link, self)
            except Regroup as regroup:
                fault_at = time.monotonic()
                self.book.recover_expired = False
                self.book.status = "recovering"
                link.close()  # rank 0 stops the group; the workers' supervisors start them, and they join
                log(f"{regroup}; the group stops and forms again with it")
            except Fault as fault:
                fault_at = time.monotonic()
                self.book.recover_expired = False
                link.close()
                if not self._note_fault(str(fault)):
                    return self._give_up()

    def _blame(self) -> int | None:
        """The local rank a fault is blamed on: the first one killed by a signal (the others then exit on the lost
        peer), waiting up to a second for it to be seen; None when none was (a stall, a pipeline error)."""
        deadline = time.monotonic() + 1.0
        while True:
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None and code < 0:
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _shrink(self) -> None:
        """``--allow-shrink``: after :data:`SHRINK_AFTER` faults in a row blamed on one rank, start one fewer."""
        if self.ranks <= 2:
            return
        culprit = self.blamed[-1]
        if culprit is None or self.blamed[-SHRINK_AFTER:] != [culprit] * SHRINK_AFTER:
            return
        self.ranks -= 1
        self.blamed.clear()
        self.recovery["ranks"] = self.ranks
        log(
            f"rank {culprit} failed {SHRINK_AFTER} times in a row: going on with {self.ranks} ranks (--allow-shrink), "
            "the split planned again"
        )

    def _rank_process(self) -> tuple[list[str], dict[str, str]]:
        """The ranks' command and environment for :attr:`ranks` ranks (``--split`` dropped after a shrink)."""
        options = self.options.rank
        if self.ranks != self.options.ranks:
            options = replace(options, split=None)
        return rank_process(replace(options, expected_ranks=self.ranks))

    def _note_fault(self, message: str) -> bool:  # a failed start counts too, the first one included
        """Record a fault; False when it is one too many in the window (--max-restarts)."""
        if self.options.allow_shrink and not self.hosts:
            self.blamed.append(self._blame())
            self._shrink()
        now = time.monotonic()
        self.faults = [t for t in self.faults if now - t <= self.options.restart_window] + [now]
        self.recovery["last_fault"] = message
        self.book.fault = message
        if len(self.faults) > self.options.max_restarts:
            return False
        self.recovery["restarts"] += 1
        self.book.status = "recovering"
        if self.hosts:
            warn(f"the pipeline failed ({message}); waiting for the workers' supervisors to restart them")
        else:
            warn(f"the pipeline failed ({message}); restarting the ranks")
        return True

    def _give_up(self) -> int:
        window = self.options.restart_window
        why = (
            f"gave up restarting the ranks: {len(self.faults)} faults within {window:g} s (--max-restarts "
            f"{self.options.max_restarts}); the last: {self.recovery['last_fault']}"
        )
        kill_all(self.procs)
        self.book.status = "failed"
        self.book.fault = why
        self.book.fail_running(ApiError(503, why, type="server_error", code="pipeline_unavailable"))
        warn(f"{why}; answering 503 for {self.settings.process.fault_grace:g} s, then exiting")
        self.book.stopping.wait(self.settings.process.fault_grace)
        self.book.fail_running(ApiError(503, why, type="server_error", code="pipeline_unavailable"))
        time.sleep(0.2)  # let the HTTP thread deliver the last answers
        return 1

    # --- bringing the group up ---------------------------------------------------------------------------------------

    def _spawn(self) -> None:
        kill_all(self.procs)
        while not self.acceptor.accepted.empty():  # a link of the old group that came late
            self.acceptor.accepted.get_nowait().close()
        host, port = self.acceptor.address
        command, env = self._rank_process()
        self.procs = []  # filled as each rank starts: a second signal meanwhile kills those started
        spawn_ranks(  # on new ports each time: the old group's may linger
            command,
            self.ranks,
            directory=Path(self.workdir.name),
            env={**self.options.env, **env, FRONT_ADDRESS_VARIABLE: f"{host}:{port}", FRONT_KEY_VARIABLE: self.key},
            outputs=lambda rank: (None if rank == 0 else subprocess.DEVNULL, None),
            stdin=subprocess.DEVNULL,
            cpus=self.cpus,
            on_start=self.procs.append,
        )
        shares = cpu_shares(self.ranks, self.cpus)
        if shares is not None:  # HTTP and the requests' text on rank 0's CPUs, as when rank 0 serves them itself
            pin(os.getpid(), shares[0])

    def _bring_up(self, fault_at: float | None) -> Link | int:
        """Start a group and wait for rank 0's hello; the link, or the exit status when the front is done."""
        recover_deadline = None if fault_at is None else fault_at + self.options.recover_timeout
        if self.hosts:
            return self._await_workers(recover_deadline)
        while True:
            try:
                self._spawn()
            except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as exc:
                # No ports, no descriptors, no processes to be had (a flood of connections, a full machine): a
                # fault like any other, counted and tried again, never the front's end.
                if not self._note_fault(f"the ranks could not be started ({type(exc).__name__}: {exc})"):
                    return self._give_up()
                time.sleep(RESPAWN_PAUSE_S)
                continue
            started = time.monotonic()
            while True:
                if not self._waiting(recover_deadline):
                    kill_all(self.procs)
                    return 0
                now = time.monotonic()
                codes = [p.poll() for p in self.procs]
                exited = [(r, c) for r, c in enumerate(codes) if c is not None]
                failure: str | None = None
                if exited:
                    rank, code = exited[0]
                    if code == 2 and not self.started_once:  # bad input: every rank said why on stderr
                        kill_all(self.procs)
                        return 2
                    failure = f"rank {rank} exited with status {code} while starting"
                elif now - started > START_TIMEOUT_S:
                    failure = f"the ranks did not start within {START_TIMEOUT_S:g} s"
                else:
                    link = self._hello(0.1)
                    if link is not None:
                        self.started_once = True
                        return link
                    continue
                if not self._note_fault(failure):
                    return self._give_up()
                break  # start again

    def _waiting(self, recover_deadline: float | None) -> bool:
        """Go on waiting for a group: False when the front is stopping (every request is told so); past
        ``recover_deadline`` the waiting clients get 503 (once)."""
        if self.book.stopping.is_set():
            self.book.fail_running(shutting_down())
            return False
        if recover_deadline is not None and time.monotonic() >= recover_deadline and not self.book.recover_expired:
            self._recovery_expired()
        return True

    def _await_workers(self, recover_deadline: float | None) -> Link | int:
        """Across hosts: wait for the workers to join, tell them which group to form, and wait for its rank 0 to
        greet; the link, or 0 when the front is stopped.

        Nothing is started here: the hosts' supervisors restart their workers, each of which joins the front
        before it forms a group. The group is every host of the hostfile; with ``--allow-shrink``, once
        ``--shrink-after`` seconds passed, the hosts that joined (2 at least) when their memory holds the model.
        The wait is unbounded (the front keeps answering ``/health``); past ``--recover-timeout`` the waiting
        clients get 503 with ``Retry-After``."""
        waiting_since = time.monotonic()
        beat_sent = 0.0
        while True:
            if not self._waiting(recover_deadline):
                self._drop_joined()
                return 0
            now = time.monotonic()
            self._take_joins(0.1)
            if now - beat_sent >= BEAT_S:  # a joined worker starts over when the front falls silent
                beat_sent = now
                for entry, joined in list(self.joined.items()):
                    if not joined.link.send({"t": "beat"}):
                        self._drop(entry)
            chosen = self._choose(now - waiting_since)
            if chosen is None:
                continue
            entries, split = chosen
            link = self._form(entries, split)
            if link is not None:
                self.started_once = True
                return link

    def _take_joins(self, wait: float) -> None:
        """Read the ``join`` of every new link (a link silent for :data:`HANDSHAKE_S` is closed); notice a joined
        worker that went away."""
        try:
            self.unheard.append((self.acceptor.accepted.get(timeout=wait), time.monotonic()))
        except queue.Empty:
            pass
        still: list[tuple[Link, float]] = []
        for link, since in self.unheard:
            if not link.poll(0):
                if time.monotonic() - since < HANDSHAKE_S:
                    still.append((link, since))
                else:
                    link.close()
                continue
            message = link.recv()
            try:
                if message is None or message.get("t") != "join":
                    raise ValueError("not a join")
                entry = from_json(int, message.get("entry", -1))
                memory = from_json(int, message.get("memory") or 0)
            except ValueError:  # a malformed join: that link's fault, not the front's
                entry, memory = -1, 0
            if not 0 <= entry < len(self.options.hosts):
                link.close()  # not a worker of this hostfile (or one from an older pipemlx)
                continue
            self._drop(entry)  # a worker that joins again replaces its older self
            self.joined[entry] = Joined(link, memory)
        self.unheard = still
        for entry, joined in list(self.joined.items()):
            while joined.link.poll(0):
                if joined.link.recv() is None:
                    self._drop(entry)
                    break

    def _drop(self, entry: int) -> None:
        joined = self.joined.pop(entry, None)
        if joined is not None:
            joined.link.close()

    def _drop_joined(self) -> None:
        for entry in list(self.joined):
            self._drop(entry)

    def _choose(self, waited: float) -> tuple[list[int], list[int] | None] | None:
        """The entries of the group to form and its split (``None``: the workers' own), or None to wait on."""
        entries = sorted(self.joined)
        if len(entries) == len(self.options.hosts):
            return entries, None
        if not self.options.allow_shrink or len(entries) < 2 or waited < self.options.shrink_after:
            return None
        try:
            split = self._plan(entries)
        except (ValueError, OSError) as exc:  # MemoryPlanError: the hosts there cannot hold the model
            why = f"{len(entries)} hosts cannot hold the model: {exc}"
            if why != self.cannot_shrink:
                self.cannot_shrink = why
                warn(f"not going on without the missing hosts: {why}")
            return None
        missing = [e for e in range(len(self.options.hosts)) if e not in self.joined]
        log(
            f"hosts {missing} did not come back within {self.options.shrink_after:g} s (--shrink-after): going on "
            f"with the {len(entries)} others (--allow-shrink), split {split}"
        )
        return entries, split

    def _plan(self, entries: list[int]) -> list[int]:
        """The split of the model over the hosts ``entries``, for the memory each said it can give."""
        from ..models.hub import model_bytes_of
        from ..schedule.memory_split import plan_split

        if self.options.model is None:
            raise ValueError("no model folder to plan the split from")
        memory = [self.joined[e].memory for e in entries]
        budgets = memory if all(m > 0 for m in memory) else None
        return list(plan_split(model_bytes_of(self.options.model), len(entries), budgets).split)

    def _form(self, entries: list[int], split: list[int] | None) -> Link | None:
        """Tell each joined worker of ``entries`` the group and its rank in it, and wait for rank 0's ``hello``
        (bounded by :data:`START_TIMEOUT_S`); the link, or None when the group did not come up."""
        hosts = [self.options.hosts[e] for e in entries]
        links = [self.joined.pop(e).link for e in entries]
        self._drop_joined()  # workers not in the group join again later
        for rank, link in enumerate(links):
            link.send({"t": "group", "hosts": hosts, "rank": rank, "split": split})
        for link in links[1:]:
            link.close()
        self.group = entries
        self.recovery["ranks"] = len(entries)
        self.recovery["hosts"] = entries
        link = links[0]
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not self.book.stopping.is_set():
            if not link.poll(0.1):
                self._take_joins(0.0)  # the workers of the next group may join meanwhile
                continue
            message = link.recv()
            if message is None:
                break
            if message.get("t") == "hello" and self._greeted(message):
                return link
        link.close()
        warn(f"the group of hosts {entries} did not come up; waiting for the workers to join again")
        return None

    def _hello(self, wait: float) -> Link | None:
        """A link whose first message is rank 0's ``hello``, if one comes within ``wait`` seconds."""
        try:
            link = self.acceptor.accepted.get(timeout=wait)
        except queue.Empty:
            return None
        if not link.poll(HANDSHAKE_S):
            link.close()
            return None
        message = link.recv()
        if message is None or message.get("t") != "hello" or not self._greeted(message):
            link.close()
            return None
        return link

    def _greeted(self, message: dict[str, Any]) -> bool:
        """Rank 0's ``hello``: the split and the ranks' slots, the prefix cache's budget; False (said once) when the
        message is malformed: that link is no group, and the front waits for another."""
        try:
            split = from_json(list[int], message.get("split"))
            slots = from_json(list[dict[str, int]], message.get("slots"))
            budget = from_json(int, message.get("prefix_budget") or 0)
        except ValueError as exc:
            warn(f"a malformed hello from rank 0 ({exc}); waiting for another")
            return False
        self.book.split = split
        self.book.slots = slots
        counts = self.book.remote_prefix or {"hits": 0, "misses": 0}  # the counts go on across restarts
        self.book.remote_prefix = {**counts, "budget_tokens": budget}
        return True

    def _recovery_expired(self) -> None:
        """``--recover-timeout`` passed without a group: every waiting client gets 503 with ``Retry-After``."""
        self.book.recover_expired = True
        message = (
            f"the pipeline is recovering from a fault and did not come back within {self.options.recover_timeout:g} s "
            f"(--recover-timeout): {self.recovery['last_fault']}"
        )
        warn(f"{message}; answering 503 to the waiting requests")
        self.book.fail_running(recovering_error(message))

    # --- what the relay asks (relay.Group) -------------------------------------------------------------------------

    def check(self) -> None:
        """A rank process that exited is a :class:`Fault`; across hosts after a shrink, a host back a
        :class:`Regroup`."""
        report = self._exit_report()
        if report is not None:
            raise Fault(report)
        if self.hosts and len(self.group) < len(self.options.hosts):  # shrunk: grow again when a host is back
            self._take_joins(0.0)
            back = sorted(e for e in self.joined if e not in self.group)
            if back:
                raise Regroup(f"host {back[0]} is back")

    def gone(self, link_closed: bool) -> bool:
        return all(p.poll() is not None for p in self.procs) if self.procs else link_closed

    def kill(self) -> None:
        kill_all(self.procs)

    def _exit_report(self) -> str | None:
        """Which rank process exited, if one did."""
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                return f"rank {rank} exited with status {code}" + (f" (signal {-code})" if code < 0 else "")
        return None


def recovering_error(message: str) -> ApiError:
    """503 with ``Retry-After``: the group is being restarted."""
    return ApiError(
        503, message, type="server_error", code="pipeline_recovering", headers={"Retry-After": str(RETRY_AFTER_S)}
    )
