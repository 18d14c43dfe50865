"""Blocking waits with a deadline: a stalled peer becomes an error, not a hang."""

from __future__ import annotations

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
    """Run ``work`` in a daemon thread and wait at most ``timeout`` seconds for it (``None``: no limit)."""
    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="pipemlx-wait", daemon=True).start()
    if not done.wait(timeout):
        raise PipelineTimeoutError(f"{describe()}: no progress after {timeout:g} s")
    if failure:
        _translate(lambda: _reraise(failure[0]), describe)


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
