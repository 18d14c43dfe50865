"""Timelines of a prefill: a text Gantt of a plan, Chrome traces of simulations, PNG plots of traces.

A simulation's trace (:func:`simulated_trace`) has the format the executor records, so prediction and measurement
open side by side in https://ui.perfetto.dev. Command line: :mod:`pipemlx.cli.timeline`. Pure Python (no MLX); see
docs/timeline.md.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..schedule.plan import Agree, Compute, Handshake, PrefillPlan, Progress, Recv, Send
from ..schedule.simulate import SimulationResult
from .trace import Span, rank_metadata, span_event

IDLE = "."
KIND_OF: Mapping[type, str] = MappingProxyType(
    {Compute: "compute", Recv: "recv", Send: "send", Agree: "agree", Handshake: "handshake", Progress: "progress"}
)
COMPUTE_SHADES = ("#4c72b0", "#8fb0e0")
BAR_COLORS: Mapping[str, str] = MappingProxyType(
    {"recv": "#dd8452", "send": "#55a868", "wait": "#c44e52", "agree": "#bbbbbb"}
)
BAR_OFFSETS: Mapping[str, float] = MappingProxyType({"recv": -0.45, "send": -0.45, "wait": 0.37, "agree": 0.37})


def gantt(plans: Sequence[PrefillPlan], *, max_steps: int = 24) -> str:
    """One row per rank, one column per step: the chunk the rank computes in that step, ``.`` when idle.

    Steps are read from each plan's actions (a compute belongs to the step its
    next ``Agree`` closes); a last row marks the chunk whose progress is reported
    after each step. With more than ``max_steps`` steps the middle ones are
    replaced by ``…``.
    """
    if not plans:
        raise ValueError("gantt needs at least one plan")
    rows: list[dict[int, str]] = []
    done: dict[int, str] = {}
    steps = 0
    for plan in plans:
        cells: dict[int, str] = {}
        step = 0
        stops = {c.stop: c.index for c in plan.chunks}
        for action in plan.actions:
            if isinstance(action, Compute):
                cells[step] = str(action.chunk.index)
            elif isinstance(action, Agree):
                step += 1
            elif isinstance(action, Progress) and step > 0 and action.processed in stops:
                done[step - 1] = str(stops[action.processed])
        rows.append(cells)
        steps = max(steps, step - 1)
    columns: list[int | None] = list(range(steps))
    if steps > max_steps:
        half = max(max_steps // 2, 1)
        columns = [*range(half), None, *range(steps - half, steps)]
    width = max([len(str(max(steps - 1, 0)))] + [len(v) for cells in rows for v in cells.values()])

    def line(label: str, cells: dict[int, str], blank: str) -> str:
        parts = [("…" if c is None else cells.get(c, blank)).rjust(width) for c in columns]
        return f"{label:<7} " + " ".join(parts).rstrip()

    p = plans[0]
    head = (
        f"{p.num_tokens - 1} prompt positions in {len(p.chunks)} chunk(s) of <= {p.step_size} tokens "
        f"on {len(plans)} rank(s): {steps} step(s)"
    )
    body = [line("step", {c: str(c) for c in range(steps)}, "")]
    body += [line(f"rank {r}", cells, IDLE) for r, cells in enumerate(rows)]
    body.append(line("done", done, ""))
    return "\n".join([head, *body])


def simulated_trace(result: SimulationResult, *, seconds_per_unit: float = 1.0) -> dict[str, Any]:
    """A Chrome trace (the executor's layout: one process per rank) of a timed simulation.

    Event times are in units of ``seconds_per_unit`` seconds (1.0 for a
    :mod:`pipemlx.schedule.costmodel` run). Progress actions and zero-length sends are
    kept, so the spans match the executor's one for one.
    """
    scale = 1e6 * seconds_per_unit
    events: list[dict[str, Any]] = []
    for rank in range(len(result.plans)):
        events += rank_metadata(rank, f"rank {rank} (simulated)")
    for e in result.events:
        kind = KIND_OF[type(e.action)]
        args: dict[str, Any] = {}
        if isinstance(e.action, (Compute, Send, Recv)):
            args["chunk"] = e.action.chunk.index
        if isinstance(e.action, Compute):
            args["tokens"] = e.action.chunk.length
        if isinstance(e.action, (Send, Recv)):
            args["peer"] = e.action.peer
        if isinstance(e.action, Agree):
            args["step"] = e.action.step
        if isinstance(e.action, Progress):
            args["processed"] = e.action.processed
        events.append(span_event(e.rank, kind, e.start * scale, (e.end - e.start) * scale, args))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_timeline(
    panels: Sequence[tuple[str, Sequence[Span]]],
    output: str | os.PathLike[str],
    *,
    title: str = "pipemlx prefill timeline",
) -> Path:
    """Draw each ``(label, spans)`` panel (one row per rank, ms from the end of the handshake) into a PNG.

    Compute spans are boxes labelled with their chunk (alternating shades);
    receives, waits for sends and agreements are thinner bars under them.
    Needs matplotlib (``pip install 'pipemlx[plot]'``); raises ``RuntimeError``
    saying so when it is missing.
    """
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
        patch: Any = importlib.import_module("matplotlib.patches").Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plot_timeline needs matplotlib: pip install 'pipemlx[plot]'") from exc
    if not panels:
        raise ValueError("plot_timeline needs at least one panel")
    height = 1.3 + sum(0.7 + 0.5 * _ranks(spans) for _, spans in panels)
    figure, axes = plt.subplots(len(panels), 1, figsize=(12, height), squeeze=False, sharex=True)
    for ax, (label, spans) in zip(axes[:, 0], panels):
        origin = _origin(spans)
        length_ms = (max((s.end_us for s in spans), default=origin) - origin) / 1000.0
        ranks = _ranks(spans)
        for s in spans:
            x, w = (s.start_us - origin) / 1000.0, s.dur_us / 1000.0
            y = ranks - 1 - s.rank
            if s.kind == "handshake":
                continue
            if s.kind == "compute":
                shade = COMPUTE_SHADES[(s.chunk or 0) % 2]
                ax.broken_barh([(x, w)], (y - 0.35, 0.7), facecolors=shade, edgecolors="black", linewidth=0.4)
                if s.chunk is not None:
                    ax.text(x + w / 2, y, str(s.chunk), ha="center", va="center", fontsize=7, color="white")
            elif s.kind in BAR_COLORS and w > 0:
                ax.broken_barh([(x, w)], (y + BAR_OFFSETS[s.kind], 0.08), facecolors=BAR_COLORS[s.kind])
        ax.set_yticks(range(ranks))
        ax.set_yticklabels([f"rank {r}" for r in reversed(range(ranks))])
        ax.set_ylim(-0.6, ranks - 0.4)
        ax.set_title(f"{label}: {length_ms:.0f} ms", fontsize=9, loc="left")
        ax.grid(axis="x", linewidth=0.3)
    axes[-1, 0].set_xlabel("ms since the handshake")
    legend = [
        patch(facecolor=COMPUTE_SHADES[0], label="compute (chunk)"),
        patch(facecolor=BAR_COLORS["recv"], label="recv"),
        patch(facecolor=BAR_COLORS["send"], label="send issued"),
        patch(facecolor=BAR_COLORS["wait"], label="wait for send"),
        patch(facecolor=BAR_COLORS["agree"], label="agreement (incl. waiting)"),
    ]
    figure.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    figure.suptitle(title, x=0.01, ha="left", fontsize=10)
    figure.tight_layout(rect=(0, 0.05, 1, 0.97))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def _origin(spans: Sequence[Span]) -> float:
    """Time zero of a plot: the first rank leaving the handshake, else the first span."""
    handshakes = [s.end_us for s in spans if s.kind == "handshake"]
    return min(handshakes) if handshakes else min((s.start_us for s in spans), default=0.0)


def _ranks(spans: Sequence[Span]) -> int:
    return max((s.rank for s in spans), default=0) + 1


def write_trace(trace: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a Chrome trace dict (e.g. from :func:`simulated_trace`) to ``path``."""
    out = Path(path)
    out.write_text(json.dumps(trace))
    return out
