"""Recording what a rank did and when, as a Chrome/Perfetto trace.

Opt in with ``pipeline_prefill(..., trace_dir=DIR)`` or ``PIPEMLX_TRACE=DIR``:
each rank writes ``DIR/trace-rank<r>.json`` (Chrome trace-event format, one
process per rank). :func:`merge_traces` joins the ranks' files into one that
https://ui.perfetto.dev or chrome://tracing opens (``python -m pipemlx.cli.timeline
merge DIR``). See docs/timeline.md.

Spans: ``handshake``, ``compute <chunk>`` (args chunk, tokens), ``recv <chunk>``
(chunk, peer), ``send <chunk>`` (chunk, peer: the send being issued),
``wait`` (peer, step: waiting for issued sends before an agreement),
``agree`` (step), ``progress`` (processed: the callback). Timestamps are
microseconds of ``time.perf_counter_ns``, which all processes of one host
share; ranks on different hosts need ``align=True`` when merged.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from ..schedule.plan import Chunk

TRACE_VARIABLE = "PIPEMLX_TRACE"
THREADS: Mapping[str, int] = MappingProxyType(
    {"compute": 0, "recv": 0, "send": 1, "wait": 1, "agree": 2, "progress": 2, "handshake": 2}
)
THREAD_NAMES = ("compute / recv", "send", "agreement / progress")
TRACE_FILE_PATTERN = "trace-rank*.json"


class Tracer:
    """Collects spans (kind, chunk, peer, start, duration) for one rank; writes them on :meth:`save`."""

    def __init__(self, rank: int, directory: Path | None) -> None:
        self.rank = rank
        self.directory = directory
        self.events: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    @contextmanager
    def span(
        self, kind: str, chunk: int | None = None, peer: int | None = None, **extra: Any
    ) -> Generator[None, None, None]:
        """Time the block as a ``kind`` span; a no-op when tracing is off."""
        if self.directory is None:
            yield
            return
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            args = {k: v for k, v in {"chunk": chunk, "peer": peer, **extra}.items() if v is not None}
            self.events.append(span_event(self.rank, kind, start / 1000.0, (end - start) / 1000.0, args))

    def save(self) -> Path | None:
        """Write this rank's trace file; returns its path (None when tracing is off)."""
        if self.directory is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace-rank{self.rank}.json"
        meta = rank_metadata(self.rank, f"rank {self.rank}")
        path.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        return path


def span_event(rank: int, kind: str, start_us: float, dur_us: float, args: dict[str, Any]) -> dict[str, Any]:
    """A complete (``"X"``) trace event: rank ``rank`` did ``kind``, named after its chunk when ``args`` has one."""
    return {
        "name": f"{kind} {args['chunk']}" if "chunk" in args else kind,
        "cat": kind,
        "ph": "X",
        "ts": start_us,
        "dur": dur_us,
        "pid": rank,
        "tid": THREADS.get(kind, 3),
        "args": args,
    }


def rank_metadata(rank: int, label: str) -> list[dict[str, Any]]:
    """The events that name rank ``rank``'s process (``label``) and its threads in a trace."""
    threads = [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": n}}
        for t, n in enumerate(THREAD_NAMES)
    ]
    return [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}}, *threads]


def tracer_for(rank: int, trace_dir: str | os.PathLike[str] | None) -> Tracer:
    """A tracer writing to ``trace_dir``, else to ``$PIPEMLX_TRACE``, else a disabled one."""
    chosen = trace_dir if trace_dir is not None else os.environ.get(TRACE_VARIABLE) or None
    return Tracer(rank, Path(chosen) if chosen is not None else None)


def merge_traces(
    paths: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], *, align: bool = False
) -> Path:
    """Join per-rank trace files into one Chrome trace at ``output``.

    With ``align=True`` each rank's timestamps are shifted so that its
    handshake ends when the first file's does: the handshake is a collective,
    so it ends at (nearly) the same moment on every rank even when their clocks
    differ (ranks on different hosts). Raises ``ValueError`` when ``paths`` is
    empty, or with ``align`` when a file has no handshake span.
    """
    if not paths:
        raise ValueError("merge_traces needs at least one per-rank trace file")
    per_file = [_events(Path(p)) for p in paths]
    if align:
        ends = [_handshake_end(events, Path(p)) for events, p in zip(per_file, paths)]
        per_file = [
            [{**e, "ts": e["ts"] + ends[0] - end} if "ts" in e else e for e in events]
            for events, end in zip(per_file, ends)
        ]
    out = Path(output)
    out.write_text(json.dumps({"traceEvents": [e for events in per_file for e in events], "displayTimeUnit": "ms"}))
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        events = data["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a Chrome trace written by pipemlx ({type(exc).__name__}: {exc})") from None
    if not isinstance(events, list):
        raise ValueError(f"{path}: traceEvents is not a list")
    return events  # pyright: ignore[reportUnknownVariableType]


def _handshake_end(events: list[dict[str, Any]], path: Path) -> float:
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "handshake":
            return float(e["ts"]) + float(e["dur"])
    raise ValueError(f"{path} has no handshake span to align on")


class Span(NamedTuple):
    """One complete span of a trace: rank ``rank`` did ``kind`` from ``start_us`` for ``dur_us``."""

    rank: int
    kind: str
    start_us: float
    dur_us: float
    chunk: int | None
    peer: int | None
    step: int | None
    args: Mapping[str, Any]

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def read_spans(path: str | os.PathLike[str]) -> list[Span]:
    """The complete (``"ph": "X"``) events of a per-rank or merged trace, by rank then start time."""
    spans: list[Span] = []
    for e in _events(Path(path)):
        if e.get("ph") != "X":
            continue
        args: dict[str, Any] = dict(e.get("args") or {})
        spans.append(
            Span(
                rank=int(e["pid"]),
                kind=str(e.get("cat", e.get("name", ""))),
                start_us=float(e["ts"]),
                dur_us=float(e["dur"]),
                chunk=args.get("chunk"),
                peer=args.get("peer"),
                step=args.get("step"),
                args=MappingProxyType(args),
            )
        )
    spans.sort(key=lambda s: (s.rank, s.start_us))
    return spans


def find_rank_traces(directory: str | os.PathLike[str]) -> list[Path]:
    """``directory``'s per-rank trace files, in rank order."""
    found = sorted(Path(directory).glob(TRACE_FILE_PATTERN), key=lambda p: int(p.stem.removeprefix("trace-rank")))
    if not found:
        raise ValueError(f"no {TRACE_FILE_PATTERN} files in {directory}")
    return found


def samples_from_trace(path: str | os.PathLike[str], rank: int = 0) -> list[tuple[Chunk, float]]:
    """``(chunk, seconds)`` of rank ``rank``'s compute spans in a pipemlx trace, for :func:`pipemlx.schedule.costmodel.fit_layer_costs`.

    Chunk positions are rebuilt from the spans' ``tokens``, in order; a trace
    of a 1-rank run times the whole model, one process, chunk by chunk.
    """
    samples: list[tuple[Chunk, float]] = []
    start = 0
    for span in read_spans(path):
        if span.rank == rank and span.kind == "compute":
            length = int(span.args["tokens"])
            samples.append((Chunk(len(samples), start, start + length), span.dur_us / 1e6))
            start += length
    if not samples:
        raise ValueError(f"{path} has no compute spans of rank {rank}")
    return samples
