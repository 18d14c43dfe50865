"""Run every rank's prefill plan together, without MLX, and report what happens.

:func:`simulate` executes the :class:`~pipemlx.schedule.plan.PrefillPlan` objects of
:func:`pipemlx.schedule.plan.build_plans` (the objects :func:`pipemlx.pipeline_prefill`
carries out; there is no second copy of the schedule here) as ``S`` sequential
programs that interact only through their actions, with these semantics:

- ``Compute(chunk)`` on rank ``r > 0`` consumes the hidden state of exactly that
  chunk, received from rank ``r - 1``; rank 0 consumes nothing. Positions must
  be computed in order, each once. On every rank but the last the output
  (``chunk.length x hidden_size``) goes on the rank's send queue, as the last
  local layer does in ``"queue"`` send mode.
- ``Send(chunk, peer)`` issues the send queue, which must hold exactly this
  chunk's output for ``peer`` (the executor checks the same). The message joins
  the link ``rank -> peer``. With ``capacity=K`` the send blocks until at most
  ``K`` of the link's messages are unreceived: ``K = 0`` blocks until its own
  message is received, ``K = None`` never blocks.
- ``Recv(chunk, peer)`` blocks until the link ``peer -> rank`` holds a message
  and takes the oldest, which must be ``chunk`` (same index and positions,
  hence shape ``chunk.length x hidden_size``).
- ``Handshake`` and ``Agree(step)`` are collectives: a rank stays in one until
  every rank has entered one, and then all must have entered the same one. At
  the handshake the ranks must agree on prompt length, step size, world size and
  plan fingerprint, as the executor's handshake checks. With
  ``await_sends=True`` a rank enters a collective only once everything it sent
  has been received: the executor issues sends asynchronously and waits for
  them before each agreement.
- ``Progress(processed, M)`` must be known to hold: through the messages and
  collectives it has seen, the reporting rank knows that every rank has
  computed positions ``0 .. processed - 1``.

Once every rank has finished, every send must have been received, every
queued output sent, every received state computed, every rank must have
processed positions ``0 .. M - 2`` and every rank must have reported the same
progress sequence.

The result is a :class:`SimulationResult`, never an exception: it finished
cleanly, deadlocked or has mismatches (:func:`check_plans` raises instead).

Given :class:`Durations` (see :mod:`pipemlx.schedule.costmodel`), every action gets a
start and end time: a compute takes its duration, a message arrives
``transfer`` seconds after it is sent, a receive ends when its message has
arrived, a blocked send ends when the receive that unblocks it ends, and a
collective ends ``collective`` seconds after the last rank enters it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from .plan import Action, Agree, Chunk, Compute, Handshake, PrefillPlan, Progress, Recv, Send

DEFAULT_HIDDEN_SIZE = 64


class Durations(Protocol):
    """How long things take, in seconds, for a timed simulation."""

    def compute(self, rank: int, chunk: Chunk) -> float:
        """Rank ``rank`` running its layers on ``chunk``."""
        ...

    def transfer(self, source: int, dest: int, shape: tuple[int, int]) -> float:
        """From the send of a ``shape`` hidden state until it can be received."""
        ...

    def collective(self, action: Action) -> float:
        """From the moment the last rank enters a collective until every rank leaves it."""
        ...


class TimedAction(NamedTuple):
    """Rank ``rank`` carried out ``action`` (``plan.actions[position]``) from ``start`` to ``end``.

    ``step`` is the number of ``Agree`` actions before it in the rank's plan:
    the wavefront step a ``Send``/``Recv``/``Compute`` belongs to.
    """

    rank: int
    position: int
    action: Action
    step: int
    start: float
    end: float


@dataclass(frozen=True)
class Blocked:
    """Rank ``rank`` cannot carry out ``action`` (``plan.actions[index]``), for ``reason``."""

    rank: int
    index: int
    action: Action
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank} is stuck on action #{self.index} ({describe(self.action)}): {self.reason}"


@dataclass(frozen=True)
class SimulationResult:
    """What happened when the plans ran together.

    ``finished``: every rank carried out its whole plan. ``blocked``: one entry
    per stuck rank when the run deadlocked. ``mismatches``: what did not match;
    when one stopped the run, it comes first, then one line per rank saying
    where it stood. ``computed[r]``: the chunks rank ``r`` computed, in order,
    ``compute_steps[r]`` the step of each; ``progress[r]``: the pairs it
    reported; ``steps[r]``: the ``Agree`` actions it completed; ``events``:
    every executed action in order (empty when not recorded).
    """

    plans: tuple[PrefillPlan, ...]
    capacity: int | None
    await_sends: bool
    finished: bool
    blocked: tuple[Blocked, ...]
    mismatches: tuple[str, ...]
    computed: tuple[tuple[Chunk, ...], ...]
    compute_steps: tuple[tuple[int, ...], ...]
    progress: tuple[tuple[tuple[int, int], ...], ...]
    steps: tuple[int, ...]
    actions_done: int
    events: tuple[TimedAction, ...] = field(repr=False)

    @property
    def ok(self) -> bool:
        """Every rank finished and nothing mismatched."""
        return self.finished and not self.mismatches

    @property
    def deadlocked(self) -> bool:
        return bool(self.blocked)

    @property
    def makespan(self) -> float:
        """The time the last action ended (0 for an untimed run)."""
        return max((e.end for e in self.events), default=0.0)

    def idle_slots(self, rank: int) -> int:
        """Wavefront steps in which ``rank`` computed nothing.

        A step is the stretch of a rank's plan closed by one of its ``Agree`` actions, all but the last (which
        closes the prefill and holds no work). With ``n >= 1`` chunks each rank idles in ``S - 1`` steps.
        """
        steps = max(self.steps[rank] - 1, 0)
        return steps - len(set(self.compute_steps[rank]))

    def report(self) -> str:
        """A readable account: ``ok``, or the deadlock / the mismatches."""
        k = "unbounded" if self.capacity is None else str(self.capacity)
        setting = f"send capacity {k}{', sends awaited at collectives' if self.await_sends else ''}"
        head = f"{self.plans[0].world_size} rank(s), M={self.plans[0].num_tokens}, {setting}"
        if self.ok:
            return f"{head}: finished after {self.actions_done} actions"
        lines: list[str] = []
        if self.blocked:
            lines.append(f"{head}: deadlock after {self.actions_done} actions:")
            lines += [f"  {b}" for b in self.blocked]
        else:
            lines.append(f"{head}: mismatch after {self.actions_done} actions:")
        lines += [f"  {m}" for m in self.mismatches]
        return "\n".join(lines)

    def raise_for_failure(self) -> SimulationResult:
        """Return ``self`` when ok; raise :class:`DeadlockError` / :class:`PlanMismatchError` otherwise."""
        if self.blocked:
            raise DeadlockError(self)
        if self.mismatches or not self.finished:
            raise PlanMismatchError(self)
        return self


class SimulationError(Exception):
    """The simulated plans did not run cleanly; ``result`` holds the details."""

    def __init__(self, result: SimulationResult) -> None:
        super().__init__(result.report())
        self.result = result


class DeadlockError(SimulationError):
    """Every unfinished rank is blocked; the message names each one and its action."""


class PlanMismatchError(SimulationError):
    """A send, receive, compute, collective or progress report did not match."""


def describe(action: Action) -> str:
    """A short readable form of an action, e.g. ``Recv chunk 3 [12:16) from rank 0``."""
    if isinstance(action, Send):
        return f"Send {_chunk(action.chunk)} to rank {action.peer}"
    if isinstance(action, Recv):
        return f"Recv {_chunk(action.chunk)} from rank {action.peer}"
    if isinstance(action, Compute):
        return f"Compute {_chunk(action.chunk)}"
    if isinstance(action, Agree):
        return f"Agree(step {action.step})"
    if isinstance(action, Progress):
        return f"Progress({action.processed}/{action.total})"
    return "Handshake"


def _chunk(chunk: Chunk) -> str:
    return f"chunk {chunk.index} [{chunk.start}:{chunk.stop})"


def simulate(
    plans: Sequence[PrefillPlan],
    *,
    capacity: int | None = 0,
    await_sends: bool = False,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    durations: Durations | None = None,
    record_events: bool = True,
    check_handshake: bool = True,
) -> SimulationResult:
    """Run ``plans`` (one per rank, indexed by rank) together; see the module docstring.

    ``check_handshake=False`` skips the comparison of plan headers at the handshake. Raises ``ValueError`` only
    when ``plans`` cannot be a group (empty, wrong ranks); everything about the plans' behaviour is in the result.
    """
    plans = tuple(plans)
    _check_group(plans)
    if capacity is not None and (isinstance(capacity, bool) or capacity < 0):
        raise ValueError(f"capacity must be a non-negative int or None (unbounded), got {capacity!r}")
    run = _Run(plans, capacity, await_sends, hidden_size, durations, record_events, check_handshake)
    return run.run()


def check_plans(plans: Sequence[PrefillPlan], **options: object) -> SimulationResult:
    """:func:`simulate` with ``options``, raising :class:`SimulationError` unless the run is ok."""
    return simulate(plans, **options).raise_for_failure()  # type: ignore[arg-type]


def _check_group(plans: tuple[PrefillPlan, ...]) -> None:
    if not plans:
        raise ValueError("simulate needs at least one plan (one per rank)")
    ranks = [p.rank for p in plans]
    if ranks != list(range(len(plans))):
        raise ValueError(f"plans must be given by rank, 0..{len(plans) - 1}; got ranks {ranks}")


class _Message:
    """A hidden state on its way from ``source`` to ``dest``."""

    __slots__ = ("source", "dest", "chunk", "shape", "sent_at", "received_at", "knowledge")

    def __init__(self, source: int, dest: int, chunk: Chunk, shape: tuple[int, int], knowledge: list[int]) -> None:
        self.source = source
        self.dest = dest
        self.chunk = chunk
        self.shape = shape
        self.sent_at = 0.0
        self.received_at: float | None = None
        self.knowledge = knowledge


class _Rank:
    """One rank's state during a run."""

    __slots__ = (
        "rank", "plan", "actions", "pc", "clock", "queue", "inbox", "unreceived", "known", "done",
        "gate", "entered", "entered_at", "agreed", "computed", "compute_steps", "progress",
    )  # fmt: skip

    def __init__(self, plan: PrefillPlan, world_size: int) -> None:
        self.rank = plan.rank
        self.plan = plan
        self.actions = plan.actions
        self.pc = 0
        self.clock = 0.0
        self.queue: list[_Message] = []  # computed, not yet sent
        self.inbox: list[_Message] = []  # received, not yet computed
        self.unreceived: list[_Message] = []  # sent, maybe not yet received (for await_sends)
        self.known = [0] * world_size  # positions each rank is known (here) to have computed
        self.done = 0  # positions this rank has computed
        self.gate: _Message | None = None  # a blocked send waits for this message's receipt
        self.entered = False  # inside the collective at pc
        self.entered_at = 0.0
        self.agreed = 0
        self.computed: list[Chunk] = []
        self.compute_steps: list[int] = []
        self.progress: list[tuple[int, int]] = []


class _Run:
    """The state of one simulation; :meth:`run` carries it out."""

    def __init__(
        self,
        plans: tuple[PrefillPlan, ...],
        capacity: int | None,
        await_sends: bool,
        hidden_size: int,
        durations: Durations | None,
        record_events: bool,
        check_handshake: bool,
    ) -> None:
        self.plans = plans
        self.check_headers = check_handshake
        self.size = len(plans)
        self.capacity = capacity
        self.await_sends = await_sends
        self.hidden = hidden_size
        self.durations = durations
        self.record = record_events
        self.ranks = [_Rank(p, self.size) for p in plans]
        self.links: dict[tuple[int, int], deque[_Message]] = {}
        self.entered = 0
        self.ready = deque(range(self.size))  # ranks that may be able to go on
        self.waiting = [False] * self.size  # not in ``ready``
        self.events: list[TimedAction] = []
        self.mismatches: list[str] = []
        self.actions_done = 0

    def run(self) -> SimulationResult:
        blocked: list[Blocked] = []
        while self.ready and not self.mismatches:
            state = self.ranks[self.ready.popleft()]
            self.waiting[state.rank] = True
            self.advance(state)
        if not self.mismatches and any(s.pc < len(s.actions) for s in self.ranks):
            blocked = [self.blocked(s) for s in self.ranks if s.pc < len(s.actions)]
        finished = not blocked and not self.mismatches
        if finished:
            self.final_checks()
        elif self.mismatches:
            self.mismatches += [f"(stopped there; {self.where(s)})" for s in self.ranks]
        return SimulationResult(
            plans=self.plans,
            capacity=self.capacity,
            await_sends=self.await_sends,
            finished=finished,
            blocked=tuple(blocked),
            mismatches=tuple(self.mismatches),
            computed=tuple(tuple(s.computed) for s in self.ranks),
            compute_steps=tuple(tuple(s.compute_steps) for s in self.ranks),
            progress=tuple(tuple(s.progress) for s in self.ranks),
            steps=tuple(s.agreed for s in self.ranks),
            actions_done=self.actions_done,
            events=tuple(self.events),
        )

    # -- carrying out actions ------------------------------------------------------------------

    def advance(self, s: _Rank) -> None:
        """Carry out rank ``s``'s actions until it blocks, finishes or a mismatch is found."""
        actions = s.actions
        while s.pc < len(actions) and not self.mismatches:
            action = actions[s.pc]
            kind = type(action)
            if kind is Compute:
                self.compute(s, action)  # type: ignore[arg-type]
            elif kind is Recv:
                if not self.recv(s, action):  # type: ignore[arg-type]
                    return
            elif kind is Send:
                if not self.send(s, action):  # type: ignore[arg-type]
                    return
            elif kind is Agree or kind is Handshake:
                if s.entered or not self.enter(s):
                    return  # inside the collective (woken when it is released), or waiting for its sends
            elif kind is Progress:
                self.report_progress(s, action)  # type: ignore[arg-type]
            else:
                return self.mismatch(f"rank {s.rank}: action #{s.pc} is not a plan action: {action!r}")

    def wake(self, rank: int) -> None:
        if self.waiting[rank]:
            self.waiting[rank] = False
            self.ready.append(rank)

    def finish(self, s: _Rank, action: Action, start: float, end: float) -> None:
        if self.record:
            self.events.append(TimedAction(s.rank, s.pc, action, s.agreed, start, end))
        s.clock = end
        s.pc += 1
        self.actions_done += 1

    def compute(self, s: _Rank, action: Compute) -> None:
        chunk = action.chunk
        wanted = f"rank {s.rank} computes {_chunk(chunk)}"
        if s.rank == 0:
            if s.inbox:
                return self.mismatch(f"{wanted} but holds received {self.names(s.inbox)} that nothing uses")
        elif len(s.inbox) != 1:
            got = f"has received {self.names(s.inbox)}" if s.inbox else "has received nothing"
            return self.mismatch(
                f"{wanted}, for which its first layer receives one hidden state from rank {s.rank - 1}, "
                f"but it {got} (a missing or extra Recv)"
            )
        elif s.inbox[0].chunk != chunk or s.inbox[0].source != s.rank - 1:
            got = s.inbox[0]
            return self.mismatch(f"{wanted} but its input is {_chunk(got.chunk)} from rank {got.source}")
        if chunk.start != s.done or chunk.stop <= chunk.start:
            so_far = f"after positions 0..{s.done - 1}" if s.done else "before any other"
            return self.mismatch(f"{wanted} {so_far}: positions must be computed in order, each once")
        s.inbox.clear()
        s.done = chunk.stop
        s.known[s.rank] = chunk.stop
        s.computed.append(chunk)
        s.compute_steps.append(s.agreed)
        if s.rank < self.size - 1:
            s.queue.append(_Message(s.rank, s.rank + 1, chunk, (chunk.length, self.hidden), []))
        took = self.durations.compute(s.rank, chunk) if self.durations is not None else 0.0
        self.finish(s, action, s.clock, s.clock + took)

    def send(self, s: _Rank, action: Send) -> bool:
        """Issue the queued send, or finish a blocked one; False while blocked."""
        if s.gate is None:
            queue = s.queue
            if len(queue) != 1 or queue[0].chunk != action.chunk or queue[0].dest != action.peer:
                held = f"holds {self.names(queue)}" if queue else "is empty"
                extra = " (a queued send was never issued)" if len(queue) > 1 else ""
                self.mismatch(
                    f"rank {s.rank} sends {_chunk(action.chunk)} to rank {action.peer} but its send queue {held}{extra}"
                )
                return True
            message = queue.pop()
            if not 0 <= action.peer < self.size or action.peer == s.rank:
                self.mismatch(f"rank {s.rank} sends {_chunk(action.chunk)} to rank {action.peer}, not a peer")
                return True
            message.sent_at = s.clock
            message.knowledge = list(s.known)
            link = self.links.setdefault((s.rank, action.peer), deque())
            link.append(message)
            self.wake(action.peer)
            s.unreceived.append(message)
            if self.capacity is None or len(link) <= self.capacity:
                self.finish(s, action, s.clock, s.clock)
                return True
            s.gate = link[len(link) - 1 - self.capacity]
            s.entered_at = s.clock
        received_at = s.gate.received_at
        if received_at is None:
            return False
        s.gate = None
        self.finish(s, action, s.entered_at, max(s.entered_at, received_at))
        return True

    def recv(self, s: _Rank, action: Recv) -> bool:
        link = self.links.get((action.peer, s.rank))
        if not link:
            return False
        message = link.popleft()
        if message.chunk != action.chunk or message.shape != (action.chunk.length, self.hidden):
            self.mismatch(
                f"rank {s.rank} expects {_chunk(action.chunk)} of shape {(action.chunk.length, self.hidden)} "
                f"from rank {action.peer}, but the next message is {_chunk(message.chunk)} of shape {message.shape}"
            )
            return True
        arrival = message.sent_at
        if self.durations is not None:
            arrival += self.durations.transfer(message.source, message.dest, message.shape)
        message.received_at = max(s.clock, arrival)
        self.wake(message.source)
        s.known = list(map(max, s.known, message.knowledge))
        s.inbox.append(message)
        self.finish(s, action, s.clock, message.received_at)
        return True

    def enter(self, s: _Rank) -> bool:
        """Enter the collective at ``s.pc``; release everyone when ``s`` is the last to enter."""
        at = s.clock
        if self.await_sends and s.unreceived:
            times = [m.received_at for m in s.unreceived]
            if any(t is None for t in times):
                return False
            at = max([at, *(t for t in times if t is not None)])
            s.unreceived.clear()
        s.entered, s.entered_at = True, at
        self.entered += 1
        if self.entered == self.size:
            self.release()
        return True

    def release(self) -> None:
        """Every rank is inside a collective: check they are the same one, then let all leave."""
        self.entered = 0
        actions = [r.actions[r.pc] for r in self.ranks]
        if any(a != actions[0] for a in actions):
            listed = ", ".join(f"rank {r.rank}: {describe(a)}" for r, a in zip(self.ranks, actions))
            return self.mismatch(f"the ranks entered different collectives ({listed})")
        if isinstance(actions[0], Handshake) and self.check_headers:
            self.check_handshake()
            if self.mismatches:
                return
        start = max(r.entered_at for r in self.ranks)
        end = start + (self.durations.collective(actions[0]) if self.durations is not None else 0.0)
        snapshot = [r.done for r in self.ranks]
        for r in self.ranks:
            r.entered = False
            r.known = list(snapshot)
            self.finish(r, actions[0], r.entered_at, end)
            if isinstance(actions[0], Agree):
                r.agreed += 1
            self.wake(r.rank)

    def check_handshake(self) -> None:
        fields = {
            "num_tokens": [p.num_tokens for p in self.plans],
            "step_size": [p.step_size for p in self.plans],
            "world_size": [p.world_size for p in self.plans],
            "plan fingerprint": [p.fingerprint() for p in self.plans],
        }
        for name, values in fields.items():
            if len(set(values)) > 1:
                listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                return self.mismatch(f"at the handshake the ranks disagree on {name} ({listed})")
        if self.plans[0].world_size != self.size:
            self.mismatch(f"the plans are for {self.plans[0].world_size} ranks, but {self.size} were given")

    def report_progress(self, s: _Rank, action: Progress) -> None:
        lagging = [r for r, k in enumerate(s.known) if k < action.processed]
        if lagging:
            known = ", ".join(f"rank {r}: {s.known[r]}" for r in lagging)
            return self.mismatch(
                f"rank {s.rank} reports progress ({action.processed}, {action.total}) but cannot know that "
                f"every rank has processed {action.processed} positions (known so far: {known})"
            )
        s.progress.append((action.processed, action.total))
        self.finish(s, action, s.clock, s.clock)

    def mismatch(self, text: str) -> None:
        self.mismatches.append(text)

    # -- reports -------------------------------------------------------------------------------

    @staticmethod
    def names(messages: Sequence[_Message]) -> str:
        return ", ".join(f"{_chunk(m.chunk)} for rank {m.dest}" for m in messages) or "nothing"

    def where(self, s: _Rank) -> str:
        if s.pc == len(s.actions):
            return f"rank {s.rank} has finished its plan"
        return f"rank {s.rank} is at action #{s.pc} ({describe(s.actions[s.pc])})"

    def blocked(self, s: _Rank) -> Blocked:
        """Why rank ``s`` cannot go on."""
        action = s.actions[s.pc]
        if isinstance(action, (Agree, Handshake)):
            if not s.entered:
                waiting = ", ".join(_chunk(m.chunk) for m in s.unreceived if m.received_at is None)
                reason = f"before entering it, it waits for its send(s) of {waiting} to be received"
            else:
                outside = [self.where(r) for r in self.ranks if not r.entered]
                reason = "inside the collective, waiting for the ranks outside it: " + "; ".join(outside)
        elif isinstance(action, Send):
            reason = (
                f"the send waits for rank {action.peer} to receive it (send capacity {self.capacity} per link is full)"
            )
        else:
            assert isinstance(action, Recv)
            peer = self.ranks[action.peer] if 0 <= action.peer < self.size else None
            reason = f"nothing has been sent on link {action.peer}->{s.rank}"
            if peer is not None and peer.queue:
                reason += f"; rank {action.peer}'s send queue holds {self.names(peer.queue)}, computed but never sent"
        return Blocked(s.rank, s.pc, action, reason)

    def final_checks(self) -> None:
        """Everything sent was received, queued was sent, received was used; every rank did all."""
        total = self.plans[0].num_tokens - 1
        for (source, dest), link in sorted(self.links.items()):
            for m in link:
                self.mismatch(f"rank {source} sent {_chunk(m.chunk)} to rank {dest}, which never received it")
        for s in self.ranks:
            if s.queue:
                self.mismatch(f"rank {s.rank} queued {self.names(s.queue)} and never sent it (no Send)")
            if s.inbox:
                self.mismatch(f"rank {s.rank} received {self.names(s.inbox)} and never computed it")
            if s.done != total:
                self.mismatch(f"rank {s.rank} processed {s.done} of the {total} prompt positions")
        sequences = [s.progress for s in self.ranks]
        if any(seq != sequences[0] for seq in sequences):
            differing = [s.rank for s in self.ranks if s.progress != sequences[0]]
            self.mismatch(f"ranks {differing} report a progress sequence different from rank 0's")
