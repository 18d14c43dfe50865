"""The front process of ``pipemlx serve --recover``: HTTP and every request's state live apart from the ranks.

:class:`GroupFront` runs in the process the user started. It serves HTTP
(:mod:`.app`, over the same :class:`~.front.Front`) and talks to rank 0 over a
link (:mod:`.link`; rank 0's loop takes its requests from :class:`.worker.LinkRequests`). With local
ranks (``--ranks N``) it starts them itself and rank 0 connects over loopback;
across hosts (``--hostfile`` with ``--front-listen``) it starts nothing: each
host runs ``pipemlx serve --worker`` under a supervisor that restarts it, and
rank 0 of the group they form connects to the front's listening address. It
holds, for every request, the tokens its client was already sent (and
detokenizes them: stop strings, the answer), so a lost group costs no request:

1. A fault: a rank process exits, rank 0 reports a typed pipeline error
   (``fault``: a lost or stalled peer), or rank 0 is silent for
   :data:`.link.SILENCE_S` seconds (stalled itself). ``/health`` says
   ``recovering`` (503, ``Retry-After``); new requests still queue.
2. Every local rank is killed and a new group started (new ports); across
   hosts every worker exits (rank 0 after its fault, the others on the lost
   peer, or when the front closes the link) and the supervisors start them
   again. Both are bounded by ``--recover-timeout``: past it, every waiting
   client gets 503 with ``Retry-After`` (a stream: an ``error`` event), and new
   requests get it at once until the group is back.
3. When rank 0 greets the front again, every unfinished request is sent again,
   in order, as its prompt plus the tokens already generated, with
   ``max_tokens`` reduced by them: the client's stream pauses and continues.
   A greedy request continues with the tokens an undisturbed run gives.

With ``--allow-shrink`` (local ranks), a rank that is killed by a signal (the
OOM killer, ``kill -9``) in :data:`SHRINK_AFTER` faults in a row makes the
front start one rank fewer from then on (never fewer than 2), the split planned
again for them (``--split`` dropped).

More than ``--max-restarts`` faults within ``--restart-window`` seconds: the
front stops restarting, answers 503 saying why for ``--fault-grace`` seconds
and exits with status 1.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ..launch import BACKEND_VARIABLE, cpu_shares, free_ports, kill_all, pin, write_hostfile
from .front import Event, Front, Job, Outcome, Reply, RequestResult, ServeSettings, log
from .link import BEAT_S, FRONT_ADDRESS_VARIABLE, FRONT_KEY_VARIABLE, HANDSHAKE_S, SILENCE_S, Acceptor, Link
from .openai_api import ApiError, unavailable

START_TIMEOUT_S = 300.0
"""The longest a group may take to load and greet the front before the start counts as failed."""
STOP_GRACE_S = 15.0
"""Seconds the ranks get to leave on their own once the front told rank 0 to stop the group."""
RETRY_AFTER_S = 2
SHRINK_AFTER = 3
"""With ``--allow-shrink``: faults in a row blamed on the same rank after which the group restarts one rank
smaller."""


@dataclass
class RecoverOptions:
    """How the front starts and restarts the ranks (local), or where it waits for them (``listen``: hosts)."""

    ranks: int
    command: list[str]  # the rank program (``python -m pipemlx serve ...`` with the same flags); local only
    env: dict[str, str] = field(default_factory=dict[str, str])  # added to each rank's environment
    recover_timeout: float = 60.0
    max_restarts: int = 5
    restart_window: float = 600.0
    listen: tuple[str, int] | None = None  # across hosts: the address rank 0 connects to; the front starts nothing
    key: str | None = None  # the link's key: given across hosts, random for local ranks
    allow_shrink: bool = False  # fewer ranks: see GroupFront._shrink (local) and GroupFront._choose (hosts)
    shrink_after: float = 20.0  # across hosts: seconds to wait for every host before going on without some
    hosts: list[list[str]] = field(default_factory=list[list[str]])  # across hosts: the hostfile's entries
    model: Path | None = None  # the model folder: the split is planned again for fewer hosts


@dataclass
class Tracked:
    """A request the front handed to the ranks and has not answered: all it needs to hand it out again."""

    id: int
    job: Job
    reply: Reply
    generated: list[int] = field(default_factory=list[int])
    cached: int | None = None  # prompt tokens reused at its first admission (what usage reports)
    cancel_sent: bool = False
    complete: Outcome | None = None
    """The front has the whole answer (an end-of-sequence token, a stop string, ``max_tokens``): the client gets
    its end when rank 0 reports the request ended (the same step, or the next after the front's ``cancel``), with
    the ranks' figures; or at once when the group fails first."""


class Fault(Exception):
    """The group cannot go on (a rank exited, rank 0 reported a pipeline error or went silent)."""


class Regroup(Fault):
    """Across hosts, after a shrink: a missing host is back; the group stops and forms again with it."""


@dataclass
class Joined:
    """A worker that joined the front and waits to be told which group to form."""

    link: Link
    memory: int  # bytes it can give (0: unknown)


class GroupFront:
    """The front's main loop: bring the group up, relay the requests, bring it up again after a fault."""

    def __init__(self, front: Front, tokenizer: Any, options: RecoverOptions) -> None:
        self.front = front
        self.tokenizer = tokenizer
        self.options = options
        self.settings: ServeSettings = front.settings
        self.hosts = options.listen is not None  # workers on hosts under their own supervisors: start nothing
        self.key = options.key or secrets.token_hex(32)
        host, port = options.listen or ("127.0.0.1", 0)
        self.acceptor = Acceptor(host, port, self.key)  # OSError when the address cannot be listened on
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ranks = options.ranks  # the local ranks started now (fewer after a shrink)
        self.blamed: list[int | None] = []  # the rank each fault in a row was blamed on (None: none could be)
        self.workdir = tempfile.TemporaryDirectory(prefix="pipemlx-serve-")  # the ranks' hostfile
        # The CPUs the ranks share out (the front itself joins rank 0's share once the ranks are pinned).
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.tracked: dict[int, Tracked] = {}  # by id, in the order the requests came (dicts keep it)
        self.next_id = 0
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
        front.recovery = self.recovery

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
                split = self.front.split
                layers = ", ".join(
                    f"rank {r} layers {sum(split[:r])}-{sum(split[: r + 1]) - 1}" for r in range(len(split))
                )
                prefix = self.front.prefix_budget_tokens()
                log(
                    f"the {'workers' if self.hosts else 'ranks'} are up after {took:.2f} s ({layers}); prefix cache "
                    f"{self.settings.prefix_cache_mb:g} MB ({prefix} tokens); queue {self.settings.max_queue}"
                    + (
                        f"; up to {self.settings.max_concurrency} requests batched"
                        if self.settings.max_concurrency > 1
                        else ""
                    )
                    + (f"; speculative decoding: {self.settings.speculation}" if self.settings.speculation else "")
                )
            elif fault_at is not None:
                took = time.monotonic() - fault_at
                self.recovery["last_recovery_s"] = round(took, 2)
                self.recovery["times_s"] = (self.recovery["times_s"] + [round(took, 2)])[-16:]
                unfinished = sum(1 for t in self.tracked.values() if not t.job.finished)
                log(f"the group is back after {took:.2f} s; resuming {unfinished} request(s)")
            try:
                return self._serve(link)
            except Regroup as regroup:
                fault_at = time.monotonic()
                self.front.recover_expired = False
                self.front.status = "recovering"
                link.close()  # rank 0 stops the group; the workers' supervisors start them, and they join
                log(f"{regroup}; the group stops and forms again with it")
            except Fault as fault:
                fault_at = time.monotonic()
                self.front.recover_expired = False
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

    def _command(self) -> list[str]:
        """The ranks' command for :attr:`ranks` ranks: ``--ranks`` set to it, ``--split`` dropped after a shrink."""
        command = self.options.command
        if self.ranks == self.options.ranks:
            return command
        out: list[str] = []
        skip = False
        for arg in command:
            if skip:
                skip = False
            elif arg in ("--ranks", "--split"):
                skip = True  # and its value
                if arg == "--ranks":
                    out += ["--ranks", str(self.ranks)]
            elif arg.startswith("--ranks="):
                out.append(f"--ranks={self.ranks}")
            elif not arg.startswith("--split="):
                out.append(arg)
        return out

    def _note_fault(self, message: str) -> bool:  # a failed start counts too, the first one included
        """Record a fault; False when it is one too many in the window (--max-restarts)."""
        if self.options.allow_shrink and not self.hosts:
            self.blamed.append(self._blame())
            self._shrink()
        now = time.monotonic()
        self.faults = [t for t in self.faults if now - t <= self.options.restart_window] + [now]
        self.recovery["last_fault"] = message
        self.front.fault = message
        if len(self.faults) > self.options.max_restarts:
            return False
        self.recovery["restarts"] += 1
        self.front.status = "recovering"
        if self.hosts:
            log(f"the pipeline failed ({message}); waiting for the workers' supervisors to restart them")
        else:
            log(f"the pipeline failed ({message}); restarting the ranks")
        return True

    def _give_up(self) -> int:
        window = self.options.restart_window
        why = (
            f"gave up restarting the ranks: {len(self.faults)} faults within {window:g} s (--max-restarts "
            f"{self.options.max_restarts}); the last: {self.recovery['last_fault']}"
        )
        kill_all(self.procs)
        self.front.status = "failed"
        self.front.fault = why
        self._fail_all(ApiError(503, why, type="server_error", code="pipeline_unavailable"))
        log(f"{why}; answering 503 for {self.settings.fault_grace:g} s, then exiting")
        self.front.stopping.wait(self.settings.fault_grace)
        self._fail_all(ApiError(503, why, type="server_error", code="pipeline_unavailable"))
        time.sleep(0.2)  # let the HTTP thread deliver the last answers
        return 1

    def _fail_all(self, error: ApiError) -> None:
        """Every request the front holds, handed out or waiting, gets ``error``."""
        for tracked in list(self.tracked.values()):
            if tracked.complete is not None and not tracked.job.finished:  # its text was all sent: end it so
                self._finish(tracked, tracked.complete)
            elif not tracked.job.finished:
                tracked.job.emit(Event("error", error=error))
                self.front.count("failed")
        self.tracked.clear()
        self.front.running = ()
        self.front.reject_waiting(error)

    # --- bringing the group up ---------------------------------------------------------------------------------------

    def _spawn(self) -> None:
        kill_all(self.procs)
        while not self.acceptor.accepted.empty():  # a link of the old group that came late
            self.acceptor.accepted.get_nowait().close()
        ports = free_ports(self.ranks)  # new ones each time: the old group's may linger
        hostfile = write_hostfile([f"127.0.0.1:{p}" for p in ports], Path(self.workdir.name))
        host, port = self.acceptor.address
        self.procs = []
        command = self._command()
        shares = cpu_shares(self.ranks, self.cpus)
        for rank in range(self.ranks):
            env = {
                **os.environ,
                **self.options.env,
                "MLX_RANK": str(rank),
                "MLX_HOSTFILE": str(hostfile),
                BACKEND_VARIABLE: "ring",
                FRONT_ADDRESS_VARIABLE: f"{host}:{port}",
                FRONT_KEY_VARIABLE: self.key,
                "PYTHONUNBUFFERED": "1",
            }
            out = None if rank == 0 else subprocess.DEVNULL
            self.procs.append(
                subprocess.Popen(command, env=env, stdout=out, stdin=subprocess.DEVNULL, start_new_session=True)
            )
            if shares is not None:  # each rank on its own CPUs, as pipemlx.launch starts ranks
                pin(self.procs[-1].pid, shares[rank])
        if shares is not None:  # HTTP and the requests' text on rank 0's CPUs, as when rank 0 serves them itself
            pin(os.getpid(), shares[0])

    def _bring_up(self, fault_at: float | None) -> Link | int:
        """Start a group and wait for rank 0's hello; the link, or the exit status when the front is done."""
        recover_deadline = None if fault_at is None else fault_at + self.options.recover_timeout
        if self.hosts:
            return self._await_workers(recover_deadline)
        while True:
            self._spawn()
            started = time.monotonic()
            while True:
                if self.front.stopping.is_set():
                    kill_all(self.procs)
                    self._fail_all(unavailable("the server is shutting down", code="shutting_down"))
                    return 0
                now = time.monotonic()
                if recover_deadline is not None and now >= recover_deadline and not self.front.recover_expired:
                    self._recovery_expired()
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
            if self.front.stopping.is_set():
                self._drop_joined()
                self._fail_all(unavailable("the server is shutting down", code="shutting_down"))
                return 0
            now = time.monotonic()
            if recover_deadline is not None and now >= recover_deadline and not self.front.recover_expired:
                self._recovery_expired()
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
            entry = -1 if message is None or message.get("t") != "join" else int(message.get("entry", -1))
            if not 0 <= entry < len(self.options.hosts):
                link.close()  # not a worker of this hostfile (or one from an older pipemlx)
                continue
            self._drop(entry)  # a worker that joins again replaces its older self
            self.joined[entry] = Joined(link, int(message.get("memory") or 0) if message else 0)
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
                log(f"not going on without the missing hosts: {why}")
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
        while time.monotonic() < deadline and not self.front.stopping.is_set():
            if not link.poll(0.1):
                self._take_joins(0.0)  # the workers of the next group may join meanwhile
                continue
            message = link.recv()
            if message is None:
                break
            if message.get("t") == "hello":
                self._greeted(message)
                return link
        link.close()
        log(f"the group of hosts {entries} did not come up; waiting for the workers to join again")
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
        if message is None or message.get("t") != "hello":
            link.close()
            return None
        self._greeted(message)
        return link

    def _greeted(self, message: dict[str, Any]) -> None:
        """Rank 0's ``hello``: the split and the ranks' slots, the prefix cache's budget."""
        self.front.split = [int(n) for n in message["split"]]
        self.front.slots = list(message["slots"])
        counts = self.front.remote_prefix or {"hits": 0, "misses": 0}  # the counts go on across restarts
        self.front.remote_prefix = {**counts, "budget_tokens": int(message.get("prefix_budget") or 0)}

    def _recovery_expired(self) -> None:
        """``--recover-timeout`` passed without a group: every waiting client gets 503 with ``Retry-After``."""
        self.front.recover_expired = True
        message = (
            f"the pipeline is recovering from a fault and did not come back within {self.options.recover_timeout:g} s "
            f"(--recover-timeout): {self.recovery['last_fault']}"
        )
        log(f"{message}; answering 503 to the waiting requests")
        self._fail_all(recovering_error(message))

    # --- serving over one group --------------------------------------------------------------------------------------

    def _serve(self, link: Link) -> int:
        """Relay requests to the group behind ``link`` until stopped (0); :class:`Fault` when the group fails."""
        front = self.front
        front.status = "stopping" if front.stopping.is_set() else "ready"
        front.recover_expired = False
        for tracked in list(self.tracked.values()):  # resume, in order
            if tracked.complete is not None and not tracked.job.finished:  # whole when the old group failed
                self._finish(tracked, tracked.complete)
            if tracked.job.finished:  # answered; the old group's end of it is gone
                self._forget(tracked)
            else:
                self._send_job(link, tracked)
        last_heard = beat_sent = time.monotonic()
        stop_sent, stop_sent_at, closed = False, 0.0, False
        while True:
            if not closed and link.poll(0.02):
                while True:
                    message = link.recv()
                    if message is None:
                        if stop_sent:
                            closed = True
                            break
                        raise Fault(self._exit_report() or "rank 0 closed the link")
                    last_heard = time.monotonic()
                    self._handle(message)
                    if not link.poll(0):
                        break
            elif closed:
                time.sleep(0.02)
            now = time.monotonic()
            if now - beat_sent >= BEAT_S:  # rank 0 stops the group when the front falls silent
                beat_sent = now
                link.send({"t": "beat"})
            if link.broken and not stop_sent:
                raise Fault("a message to rank 0 could not be sent (the link broke)")
            codes = [p.poll() for p in self.procs]
            if stop_sent:
                gone = all(c is not None for c in codes) if self.procs else closed
                if gone or time.monotonic() - stop_sent_at > STOP_GRACE_S:
                    kill_all(self.procs)
                    self._fail_all(unavailable("the server is shutting down", code="shutting_down"))
                    return 0
                continue
            report = self._exit_report()
            if report is not None:
                raise Fault(report)
            if self.hosts and len(self.group) < len(self.options.hosts):  # shrunk: grow again when a host is back
                self._take_joins(0.0)
                back = sorted(e for e in self.joined if e not in self.group)
                if back:
                    raise Regroup(f"host {back[0]} is back")
            if time.monotonic() - last_heard > SILENCE_S:
                raise Fault(f"rank 0 sent nothing for {SILENCE_S:g} s (stalled)")
            for tracked in self.tracked.values():
                over = tracked.job.cancelled.is_set() or tracked.job.finished or tracked.complete is not None
                if over and not tracked.cancel_sent:
                    tracked.cancel_sent = True
                    link.send({"t": "cancel", "id": tracked.id})
            if front.stopping.is_set():
                front.begin_stop()
                if not self._unfinished() or front.stop_due():
                    link.send({"t": "stop"})
                    stop_sent, stop_sent_at = True, time.monotonic()
                continue
            while self._unfinished() < self.settings.max_concurrency:
                job = front.next_job(0.0)
                if job is None:
                    break
                self.next_id += 1
                tracked = Tracked(self.next_id, job, Reply(job, self.tokenizer, front.metrics))
                self.tracked[tracked.id] = tracked
                self._send_job(link, tracked)
                self._publish()

    def _exit_report(self) -> str | None:
        """Which rank process exited, if one did."""
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                return f"rank {rank} exited with status {code}" + (f" (signal {-code})" if code < 0 else "")
        return None

    def _unfinished(self) -> int:
        return sum(1 for t in self.tracked.values() if not t.job.finished)

    def _publish(self) -> None:
        self.front.running = tuple(t.job for t in self.tracked.values() if not t.job.finished)
        self.front.peak_running = max(self.front.peak_running, len(self.front.running))

    def _send_job(self, link: Link, tracked: Tracked) -> None:
        """Hand ``tracked`` to rank 0: its prompt and what it generated so far, for the tokens it still may."""
        job = tracked.job
        tracked.cancel_sent = False
        link.send(
            {
                "t": "job",
                "id": tracked.id,
                "tokens": job.tokens + tracked.generated,
                "max_tokens": job.max_tokens - len(tracked.generated),
                "temperature": job.temperature,
                "top_p": job.top_p,
                "seed": job.seed,
                "drawn": len(tracked.generated),
                "penalties": vars(job.penalties),
                "draft": job.draft,
            }
        )

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message.get("t")
        if kind == "fault":
            raise Fault(str(message.get("message")))
        if kind == "slots":
            self.front.slots = list(message["slots"])
            return
        if kind not in ("admitted", "progress", "token", "ended"):
            return
        tracked = self.tracked.get(int(message["id"]))
        if tracked is None:
            return
        job = tracked.job
        if kind == "admitted":
            job.seq = int(message["seq"])
            if tracked.cached is None:
                tracked.cached = int(message["cached"])
                job.cached = tracked.cached
                self.front.admitted_remotely(tracked.cached)
            if not tracked.generated:
                job.phase = "prefill"
        elif kind == "progress":
            if not tracked.generated:
                tracked.reply.progress(int(message["processed"]), int(message["total"]))
        elif kind == "token":
            if job.finished or tracked.complete is not None:
                return
            token = int(message["token"])
            tracked.generated.append(token)
            if tracked.reply.token(token):
                tracked.complete = "stop"
            elif len(tracked.generated) >= job.max_tokens:
                tracked.complete = "length"
        else:  # ended
            if not job.finished:
                outcome = str(message["outcome"])
                error = RuntimeError(str(message.get("error"))) if outcome == "failed" else None
                if tracked.complete is not None and outcome != "failed":
                    outcome = tracked.complete  # a stop string: rank 0 ended it as cancelled
                elif outcome not in ("failed", "cancelled"):
                    outcome = "stop" if outcome == "stop" else "length"
                self._finish(
                    tracked,
                    outcome,  # pyright: ignore[reportArgumentType]
                    error,
                    prefilled=int(message.get("prefilled") or 0),
                    cache_tokens=message.get("cache_tokens"),
                    guesses=(int(message.get("proposed") or 0), int(message.get("accepted") or 0)),
                )
            self._forget(tracked)

    def _finish(
        self,
        tracked: Tracked,
        outcome: Outcome,
        error: BaseException | None = None,
        prefilled: int = 0,
        cache_tokens: int | None = None,
        guesses: tuple[int, int] = (0, 0),
    ) -> None:
        """Answer ``tracked``: with the figures rank 0 reported when it ended the request, or (the group failed
        first) with what the front knows."""
        job = tracked.job
        generated = list(tracked.generated)
        cached = tracked.cached or 0
        result = RequestResult(
            outcome,
            generated,
            cached,
            len(job.tokens) + len(generated) if cache_tokens is None else int(cache_tokens),
            prefilled or len(job.tokens) - cached,
            error,
            *guesses,
        )
        self.front.answer(job, tracked.reply, result)  # job.finished: the next round tells rank 0 to remove it
        self._publish()

    def _forget(self, tracked: Tracked) -> None:
        self.tracked.pop(tracked.id, None)
        self._publish()


def recovering_error(message: str) -> ApiError:
    """503 with ``Retry-After``: the group is being restarted."""
    return ApiError(
        503, message, type="server_error", code="pipeline_recovering", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def stop_handler(front: Front, group: GroupFront) -> Any:
    """SIGTERM/SIGINT: a graceful stop (as a rank-0 server does); a second one kills the ranks and exits (130)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        if front.stopping.is_set():
            log(f"{signal.Signals(signum).name} again: exiting now")
            kill_all(group.procs)
            os._exit(130)
        log(
            f"{signal.Signals(signum).name}: new requests get 503; the running ones get {front.settings.grace:g} s "
            "(--grace) to finish, then every rank stops"
        )
        front.request_stop()

    return stop


def ranks_command(argv: Sequence[str]) -> list[str]:
    """The command each rank runs: this same ``pipemlx serve`` invocation."""
    return [sys.executable, "-m", "pipemlx", *argv]
