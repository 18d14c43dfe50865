"""Bounded waits (pipemlx.runtime.waits): helper threads are reused, and a blocked one never holds up a later wait."""

from __future__ import annotations

import os
import threading
import time

import mlx.core as mx
import pytest

from pipemlx.errors import PipelineTimeoutError
from pipemlx.runtime import waits

STREAM = mx.new_thread_unsafe_stream(mx.default_device())  # any thread may evaluate on it, as on a stage's


def value(x: float) -> mx.array:
    with mx.stream(STREAM):
        return mx.array([x]) + 1


def test_waits_reuse_an_idle_helper_thread() -> None:
    waits.wait_for(value(1.0), 5.0, lambda: "warm-up")
    helpers: set[int] = set()
    for i in range(50):
        waits.wait_for(value(float(i)), 5.0, lambda: "a wait")
        waits._in_helper_thread(lambda: helpers.add(threading.get_ident()), 5.0, lambda: "a wait")  # pyright: ignore[reportPrivateUsage]
    assert len(helpers) == 1  # one thread served every wait, none started per wait
    assert threading.get_ident() not in helpers


def test_a_wait_after_a_timed_out_one_gets_a_fresh_helper() -> None:
    release = threading.Event()

    def blocked() -> None:
        release.wait(30)

    with pytest.raises(PipelineTimeoutError, match="the blocked wait: no progress after 0.2 s"):
        waits._in_helper_thread(blocked, 0.2, lambda: "the blocked wait")  # pyright: ignore[reportPrivateUsage]
    started = time.monotonic()
    try:
        waits.wait_for(value(3.0), 5.0, lambda: "the next wait")
        assert time.monotonic() - started < 2.0  # not queued behind the blocked helper
    finally:
        release.set()


def test_errors_from_the_helper_reach_the_caller() -> None:
    def fail() -> None:
        raise RuntimeError("[ring] connection to a peer was lost")

    with pytest.raises(waits.PeerLostError, match="rank 1 receiving: .*connection to a peer was lost"):
        waits._in_helper_thread(fail, 5.0, lambda: "rank 1 receiving")  # pyright: ignore[reportPrivateUsage]
    with pytest.raises(ValueError, match="other"):
        waits._in_helper_thread(lambda: (_ for _ in ()).throw(ValueError("other")), 5.0, lambda: "x")  # pyright: ignore[reportPrivateUsage]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_wait_on_its_parents_helpers() -> None:
    waits.wait_for(value(1.0), 5.0, lambda: "in the parent")  # leaves an idle helper the child will not have
    pid = os.fork()
    if pid == 0:  # the child: a wait must run (on a thread of its own), not time out
        try:
            waits._in_helper_thread(lambda: None, 5.0, lambda: "in the child")  # pyright: ignore[reportPrivateUsage]
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
