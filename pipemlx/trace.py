"""Recording what a rank did and when, as a Chrome/Perfetto trace.

Opt in with ``pipeline_prefill(..., trace_dir=DIR)`` or ``PIPEMLX_TRACE=DIR``:
each rank writes ``DIR/trace-rank<r>.json`` (Chrome trace-event format, one
process per rank). :func:`merge_traces` joins the ranks' files into one that
https://ui.perfetto.dev or chrome://tracing opens.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TRACE_VARIABLE = "PIPEMLX_TRACE"
THREADS = {"compute": 0, "recv": 0, "send": 1, "wait": 1, "agree": 2, "progress": 2, "handshake": 2}


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
    def span(self, kind: str, chunk: int | None = None, peer: int | None = None, **extra: Any) -> Generator[None, None, None]:
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
            name = kind if chunk is None else f"{kind} {chunk}"
            self.events.append(
                {
                    "name": name,
                    "cat": kind,
                    "ph": "X",
                    "ts": start / 1000.0,
                    "dur": (end - start) / 1000.0,
                    "pid": self.rank,
                    "tid": THREADS.get(kind, 3),
                    "args": args,
                }
            )

    def save(self) -> Path | None:
        """Write this rank's trace file; returns its path (None when tracing is off)."""
        if self.directory is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace-rank{self.rank}.json"
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            *(
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                for tid, name in enumerate(("compute / recv", "send", "agreement / progress"))
            ),
        ]
        path.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        return path


def tracer_for(rank: int, trace_dir: str | os.PathLike[str] | None) -> Tracer:
    """A tracer writing to ``trace_dir``, else to ``$PIPEMLX_TRACE``, else a disabled one."""
    chosen = trace_dir if trace_dir is not None else os.environ.get(TRACE_VARIABLE) or None
    return Tracer(rank, Path(chosen) if chosen is not None else None)


def merge_traces(paths: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str]) -> Path:
    """Join per-rank trace files into one Chrome trace at ``output``."""
    events: list[dict[str, Any]] = []
    for p in paths:
        events.extend(json.loads(Path(p).read_text())["traceEvents"])
    out = Path(output)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
