"""The ranks wait for each other while they fetch and load their weights, as long as each one makes progress.

A rank that resolves, downloads or reads its weights more slowly than the others (a slower link to the Hub, a
colder disk) must not make the first collective with a deadline fail on the fast ones: while this rank loads,
:func:`while_ranks_load` has a thread tell the others, once a second, how far it is (bytes in its Hub cache and fetched,
stages, whether it is done). The ranks leave the exchange together, in the same round,
once every rank is done; they fail together, each with a line naming the rank, when one made no progress for
``timeout`` seconds, or its loading raised (that rank raises its own error, the others name it), or it died
(the exchange's bounded wait turns the lost peer into :class:`pipemlx.PeerLostError`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from ..errors import PipelineError, PipelineTimeoutError
from ..runtime.waits import wait_for
from .weights import FetchCount

T = TypeVar("T")

REPORT_EVERY_S = 1.0
"""How often the ranks tell each other how far their loading is."""
FIRST_MEETING_TIMEOUTS = 10
"""The first exchange waits this many ``timeout`` s for ranks still before :func:`while_ranks_load` (reading the
config and the tokenizer): they report nothing until they arrive."""
SHOW_AFTER_S = 5.0
"""A rank that waits this long for another says whom it waits for, and again every this many seconds."""
MESSAGE_BYTES = 240
"""The most bytes of a failed rank's error that the others repeat."""
RUNNING, DONE, FAILED = 0, 1, 2
LOGGER = logging.getLogger("pipemlx")


@dataclass
class LoadProgress:
    """How far this rank's loading is, written by the loading (the calling thread), read by the exchange."""

    cache: Path | None = None
    """The Hub cache folder of the repo being fetched (``None``: a local folder, nothing to download)."""
    steps: int = 0
    """Stages finished (the repo located, the files fetched, the model built): progress without bytes."""
    fetched: FetchCount = field(default_factory=FetchCount)
    """Tensor bytes fetched so far into this rank's weight folder (from the Hub or a peer)."""
    state: int = RUNNING
    failure: str = ""
    """This rank's error when its loading raised (repeated by the others)."""
    changed: threading.Event = field(default_factory=threading.Event)
    """Set when ``state`` leaves ``RUNNING``: the exchange reports at once."""

    def figure(self) -> int:
        """A number that grows while the loading makes progress: KiB in the repo's cache and fetched, the stages."""
        return _cached_kib(self.cache) + (self.fetched.fetched >> 10) + self.fetched.requests + self.steps

    def end(self, failure: BaseException | None) -> None:
        self.failure = "" if failure is None else f"{type(failure).__name__}: {failure}"
        self.state = DONE if failure is None else FAILED
        self.changed.set()


def while_ranks_load(
    group: Any, timeout: float | None, load: Callable[[LoadProgress], T], what: str = "its part of the model"
) -> T:
    """Run ``load`` (this rank's fetching and loading, no collectives) here while a thread tells the other ranks
    of ``group`` how far it is; return what ``load`` returned once every rank is done, or raise (see the module).

    ``load`` runs in the calling thread (MLX's default stream is per thread); when the exchange ends in an error
    while ``load`` still runs (a peer failed, stalled or died), the error is raised once ``load`` returns."""
    if group.size() == 1:
        return load(LoadProgress())
    progress = LoadProgress()
    exchange = _Exchange(group, timeout, progress, what)
    thread = threading.Thread(target=exchange.run, name="pipemlx-load-exchange", daemon=True)
    thread.start()
    try:
        value = load(progress)
    except BaseException as exc:
        progress.end(exc)
        thread.join()  # the others hear of it before this rank raises
        raise
    progress.end(None)
    thread.join()  # until every rank is done, or the exchange failed
    if exchange.error is not None:
        raise exchange.error
    return value


class _Exchange:
    """The reporting thread: one all-gather of every rank's progress per round, until every rank is done."""

    def __init__(self, group: Any, timeout: float | None, progress: LoadProgress, what: str) -> None:
        self.group = group
        self.timeout = timeout
        self.progress = progress
        self.what = what
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._rounds()
        except BaseException as exc:  # a lost or stalled peer while exchanging: raised by while_ranks_load
            self.error = exc

    def _rounds(self) -> None:
        group, timeout, progress, what = self.group, self.timeout, self.progress, self.what
        rank, size = group.rank(), group.size()
        # Counted in rounds, not in each rank's own seconds, so that every rank decides alike from the same rows.
        patience = None if timeout is None else max(1, math.ceil(timeout / REPORT_EVERY_S))
        unchanged = [0] * size
        last_figure = [-1] * size
        shown = time.monotonic()
        stream = mx.new_thread_unsafe_stream(mx.default_device())
        first = True
        while True:
            progress.changed.wait(REPORT_EVERY_S)
            wait = None if timeout is None else timeout * (FIRST_MEETING_TIMEOUTS if first else 1)
            mine = [progress.state, progress.figure()]
            rows = _exchange(group, stream, mine, progress.failure.encode()[:MESSAGE_BYTES], wait, what, first)
            first = False
            states = [row[0] for row in rows]
            for r, row in enumerate(rows):
                unchanged[r] = unchanged[r] + 1 if row[1] == last_figure[r] and row[0] == RUNNING else 0
                last_figure[r] = row[1]
            if FAILED in states:
                failed = states.index(FAILED)
                if failed != rank and progress.state != FAILED:
                    text = bytes(rows[failed][2:]).rstrip(b"\0").decode(errors="replace")
                    self.error = PipelineError(f"rank {rank}/{size}: rank {failed} could not load {what}: {text}")
                return
            if all(s == DONE for s in states):
                return
            stalled = [r for r in range(size) if patience is not None and unchanged[r] >= patience]
            if stalled:
                self.error = PipelineTimeoutError(
                    f"rank {rank}/{size}: rank {stalled[0]} made no progress loading {what} for {timeout:g} s "
                    f"({_amount(rows[stalled[0]][1])} fetched or cached)"
                )
                return
            if time.monotonic() - shown >= SHOW_AFTER_S:
                shown = time.monotonic()
                waiting = [
                    f"rank {r} ({_amount(rows[r][1])} so far)"
                    for r in range(size)
                    if states[r] == RUNNING and r != rank
                ]
                if waiting:
                    LOGGER.warning("pipemlx: rank %d/%d waits for %s to load %s", rank, size, ", ".join(waiting), what)


def _exchange(
    group: Any, stream: Any, figures: list[int], message: bytes, timeout: float | None, what: str, first: bool
) -> list[list[int]]:
    """Every rank's ``figures`` and the bytes of its error, all-gathered within ``timeout`` seconds."""
    row = figures + list(message.ljust(MESSAGE_BYTES, b"\0"))
    with mx.stream(stream):  # a stream wait_for's thread can run
        gathered = mx.distributed.all_gather(mx.array(row, dtype=mx.int32), group=group)
    where = "waiting for every rank to start loading" if first else "sharing how far each rank is in loading"
    wait_for(gathered, timeout, lambda: f"rank {group.rank()}/{group.size()} {where} {what}")
    flat: list[int] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
    width = len(row)
    return [flat[r * width : (r + 1) * width] for r in range(group.size())]


def _cached_kib(cache: Path | None) -> int:
    """KiB of the files under ``cache`` (finished and ``.incomplete`` downloads alike)."""
    if cache is None:
        return 0
    total = 0
    try:
        for path in cache.rglob("*"):
            try:
                if path.is_file() and not path.is_symlink():
                    total += path.stat().st_size
            except OSError:
                continue  # a download renamed while we looked
    except OSError:
        return 0
    return total >> 10


def _amount(figure: int) -> str:
    return f"{figure / 1024:,.1f} MB" if figure >= 1024 else f"{figure} KB"
