"""``pipemlx bench``: one process against a pipeline of S ranks, on the same model and prompt.

Both sides run as fresh processes started by :func:`pipemlx.launch.launch`
(the single side as one rank holding the whole model, running plain mlx-lm
``generate_step``), each after a short warm-up; :mod:`.bench_rank` is the
program those processes run. Prefill time, prefill tokens/s and decode
tokens/s are those of :mod:`pipemlx.observe.metrics`; the prompt is seeded
random token ids, so both sides see the same prompt and should give the same
tokens.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..launch import LaunchError, launch
from ..observe.timeline import plot_timeline
from ..observe.trace import find_rank_traces, merge_traces, read_spans
from .common import UserError, check_ranks, model_name

LAUNCH_TIMEOUT = 24 * 3600.0


def run_bench(args: argparse.Namespace) -> int:
    """Run both sides, print the table (or JSON), optionally draw the timeline; returns the exit status."""
    check_ranks(args.ranks, args.model)
    if args.png is not None:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise UserError("--png needs matplotlib: pip install matplotlib") from None
    step_size: int | str = args.prefill_step_size
    spec: dict[str, Any] = {
        "model": str(args.model),
        "prompt_tokens": args.prompt_tokens,
        "prefill_step_size": step_size,
        "max_tokens": args.max_tokens,
        "timeout": args.timeout,
        "lend": args.lend,
        "allow_unregistered": args.allow_unregistered,
    }
    with tempfile.TemporaryDirectory(prefix="pipemlx-bench-") as tmp:
        try:
            single = _run_side(1, {**spec, "mode": "single"})
            pipeline = _run_side(args.ranks, {**spec, "mode": "pipeline", "trace_dir": tmp if args.png else None})
        except LaunchError as exc:
            print(f"pipemlx bench: {exc}", file=sys.stderr)
            return 1
        if args.png is not None:
            draw_timeline(Path(tmp), Path(args.png), f"{model_name(args.model)}, {args.ranks} ranks")
    report = {
        "model": str(args.model),
        "ranks": args.ranks,
        "prompt_tokens": args.prompt_tokens,
        "prefill_step_size": step_size,
        "max_tokens": args.max_tokens,
        "single": single,
        "pipeline": pipeline,
        "prefill_speedup": single["prefill_s"] / pipeline["prefill_s"],
        "decode_ratio": pipeline["decode_tokens_per_s"] / single["decode_tokens_per_s"],
        "same_tokens": single["tokens"] == pipeline["tokens"],
    }
    if args.json:
        print(json.dumps(report))
    else:
        Console().print(_table(report, args.png))
    return 0


def _run_side(ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "pipemlx.cli.bench_rank", json.dumps(spec)]
    results = launch(ranks, command, timeout=LAUNCH_TIMEOUT)
    lines = [line for line in results[0].stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise LaunchError("rank 0 printed no figures", results)
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures


def _table(report: dict[str, Any], png: str | None) -> Table:
    single, pipeline = report["single"], report["pipeline"]
    table = Table(
        title=(
            f"pipemlx bench: {model_name(Path(report['model']))}\n{report['prompt_tokens']}-token prompt "
            f"prefill step {report['prefill_step_size']}, {report['max_tokens']} tokens decoded"
        ),
        title_justify="left",
    )
    for name in ("", "1 process", f"pipemlx, {report['ranks']} ranks", "speed ratio"):
        table.add_column(name, justify="right" if name else "left")
    table.add_row(
        "prefill",
        f"{single['prefill_s']:.3f} s",
        f"{pipeline['prefill_s']:.3f} s",
        f"{report['prefill_speedup']:.2f}x",
    )
    table.add_row(
        "prefill tokens/s",
        f"{single['prefill_tokens_per_s']:,.0f}",
        f"{pipeline['prefill_tokens_per_s']:,.0f}",
        f"{pipeline['prefill_tokens_per_s'] / single['prefill_tokens_per_s']:.2f}x",
    )
    table.add_row(
        "decode tokens/s",
        f"{single['decode_tokens_per_s']:,.1f}",
        f"{pipeline['decode_tokens_per_s']:,.1f}",
        f"{report['decode_ratio']:.2f}x",
    )
    table.add_row("same tokens", "", "", "yes" if report["same_tokens"] else "NO")
    if png:
        table.caption = f"prefill timeline written to {png}"
    return table


def draw_timeline(trace_dir: Path, output: Path, label: str) -> Path:
    """Draw the pipeline's per-rank traces in ``trace_dir`` as a PNG (:func:`pipemlx.observe.timeline.plot_timeline`)."""
    merged = merge_traces(find_rank_traces(trace_dir), trace_dir / "trace.json")
    return plot_timeline([(label, read_spans(merged))], output)
