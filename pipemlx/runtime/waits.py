"""Blocking waits with a deadline: a stalled peer becomes an error, not a hang."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..errors import PeerLostError, PipelineTimeoutError

PEER_LOST_MARKERS = ("connection to a peer was lost", "Connection reset", "Broken pipe")


def wait_for(arrays: Any, timeout: float | None, describe: Callable[[], str]) -> None:
    """Evaluate ``arrays``, raising if that takes longer than ``timeout`` seconds.

    MLX has no way to interrupt an evaluation, so the evaluation runs in a
    helper thread (the arrays must live on streams any thread may use) and the
    caller gives up on it when the deadline passes. ``describe()`` names what
    was waited for (rank, chunk, peer); it goes into the error message.
    Raises :class:`PipelineTimeoutError` on a timeout and :class:`PeerLostError`
    when MLX reports a lost peer; any other error is re-raised as is.
    """
    if timeout is None:
        _translate(lambda: mx.eval(arrays), describe)  # pyright: ignore[reportUnknownMemberType, reportUnknownLambdaType]
        return
    _in_helper_thread(lambda: mx.eval(arrays), timeout, describe)  # pyright: ignore[reportUnknownMemberType, reportUnknownLambdaType]


def issue(arrays: Any, timeout: float | None, describe: Callable[[], str]) -> None:
    """Hand ``arrays`` to MLX to evaluate in the background (``mx.async_eval``), raising after ``timeout`` seconds.

    ``mx.async_eval`` itself blocks while MLX has too many tasks in flight: a
    forward pass behind a receive its peer has not sent yet keeps it from
    returning until the peer sends. So issuing is a wait like any other: it
    runs in a helper thread and fails with :class:`PipelineTimeoutError` (or
    :class:`PeerLostError`) rather than hang.
    """
    _in_helper_thread(lambda: mx.async_eval(arrays), timeout, describe)  # pyright: ignore[reportUnknownMemberType, reportUnknownLambdaType]


def _in_helper_thread(work: Callable[[], None], timeout: float | None, describe: Callable[[], str]) -> None:
    """Run ``work`` in a helper thread and wait at most ``timeout`` seconds for it (``None``: no limit)."""
    job = _Job(work)
    _HELPERS.run(job)
    if not job.done.wait(timeout):
        raise PipelineTimeoutError(f"{describe()}: no progress after {timeout:g} s")
    if job.failure is not None:
        failure = job.failure
        _translate(lambda: _reraise(failure), describe)


class _Job:
    """One piece of work handed to a helper thread, and what became of it."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.work = work
        self.done = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.work()
        except BaseException as exc:  # handed to the waiting thread
            self.failure = exc
        finally:
            self.done.set()


class _Helpers:
    """The process's idle helper threads: a wait reuses one rather than starting a thread per wait.

    Starting a thread costs a fraction of a millisecond (more on a busy machine), and a decode step waits two or
    three times per token. A helper whose work never ends (an evaluation blocked on a stalled peer: the caller
    gave up on it at its deadline) never comes back to the idle list, so a later wait gets a fresh thread and is
    never queued behind a blocked one. Threads are daemons: a blocked one does not keep the process alive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Job]] = []

    def run(self, job: _Job) -> None:
        """Start ``job`` on an idle helper, or on a new one when none is idle."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue[_Job]()
            threading.Thread(target=self._serve, args=(inbox,), name="pipemlx-wait", daemon=True).start()
        inbox.put(job)

    def forget(self) -> None:
        """In a forked child: the idle helpers were the parent's threads, which the child does not have."""
        self._lock = threading.Lock()
        self._idle = []

    def _serve(self, inbox: queue.SimpleQueue[_Job]) -> None:
        while True:
            inbox.get().run()
            with self._lock:
                self._idle.append(inbox)


_HELPERS = _Helpers()
"""Process-wide like the threads themselves: which idle helper runs a wait carries no meaning."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HELPERS.forget)


NOT_THIS_THREAD_MARKER = "in current thread"


def wait_for_scheduled(arrays: list[mx.array], timeout: float | None, describe: Callable[[], str]) -> list[mx.array]:
    """Wait, as :func:`wait_for` does, for those of ``arrays`` that MLX was asked to evaluate; skip the rest.

    The arrays are evaluated in a helper thread. An array on a thread-local
    stream (mlx-lm's generation stream, the default stream) that its own thread
    never scheduled cannot be evaluated there: MLX says so, and such an array is
    not in flight, so it is skipped rather than evaluated (which would start
    communication the other ranks never will). Returns the arrays skipped.
    """
    skipped: list[mx.array] = []

    def evaluate() -> None:
        for array in arrays:
            try:
                mx.eval(array)  # pyright: ignore[reportUnknownMemberType]
            except RuntimeError as exc:
                if NOT_THIS_THREAD_MARKER not in str(exc):
                    raise
                skipped.append(array)

    _in_helper_thread(evaluate, timeout, describe)
    return skipped


def _reraise(exc: BaseException) -> None:
    raise exc


def _translate(run: Callable[[], None], describe: Callable[[], str]) -> None:
    try:
        run()
    except RuntimeError as exc:
        if any(marker in str(exc) for marker in PEER_LOST_MARKERS):
            raise PeerLostError(f"{describe()}: {exc}") from exc
        raise
