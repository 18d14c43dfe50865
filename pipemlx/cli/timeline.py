"""``python -m pipemlx.cli.timeline``: timelines of a prefill from the command line.

``gantt M STEP RANKS`` prints the text Gantt of a plan; ``merge TRACE_DIR [-o OUT]
[--align]`` joins the ranks' trace files of a run; ``plot [LABEL=]TRACE.json ...
-o timeline.png`` draws traces as a PNG (needs matplotlib). See
:mod:`pipemlx.observe.timeline` and docs/timeline.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..observe.timeline import gantt, plot_timeline
from ..observe.trace import Span, find_rank_traces, merge_traces, read_spans
from ..schedule.plan import build_plans


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipemlx.cli.timeline", description="Timelines of a prefill.")
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("gantt", help="print the text Gantt of a plan")
    g.add_argument("num_tokens", type=int)
    g.add_argument("step_size", type=int)
    g.add_argument("world_size", type=int)
    g.add_argument("--max-steps", type=int, default=24)
    m = commands.add_parser("merge", help="merge a run's per-rank traces (trace_dir / $PIPEMLX_TRACE)")
    m.add_argument("directory")
    m.add_argument("-o", "--output", help="merged trace (default: DIR/trace.json)")
    m.add_argument("--align", action="store_true", help="align ranks on the handshake (ranks on several hosts)")
    p = commands.add_parser("plot", help="draw Chrome traces (merged, one per panel) as a PNG")
    p.add_argument("traces", nargs="+", help="trace files; label one as LABEL=PATH")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--title", default="pipemlx prefill timeline")
    args = parser.parse_args(argv)
    if args.command == "gantt":
        print(gantt(build_plans(args.num_tokens, args.step_size, args.world_size), max_steps=args.max_steps))
        return 0
    if args.command == "merge":
        try:
            paths = find_rank_traces(args.directory)
            out = merge_traces(paths, args.output or Path(args.directory) / "trace.json", align=args.align)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"merged {len(paths)} rank trace(s) into {out}; open it at https://ui.perfetto.dev")
        return 0
    panels: list[tuple[str, Sequence[Span]]] = []
    for item in args.traces:
        label, _, path = item.rpartition("=") if "=" in item else (Path(item).stem, "", item)
        panels.append((label, read_spans(path)))
    print(plot_timeline(panels, args.output, title=args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
