"""``pipemlx bench``: one process against a pipeline of S ranks, on the same model and prompt.

Both sides run as fresh processes started by :func:`pipemlx.launch.launch`
(the single side as one rank holding the whole model, running plain mlx-lm
``generate_step``), each after a short warm-up. Prefill time is the time to the
first token, decode speed is tokens/s after it; the prompt is seeded random
token ids, so both sides see the same prompt and should give the same tokens.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load
from rich.console import Console
from rich.table import Table

from . import UserError, model_name
from .generate import default_step_size
from ..launch import LaunchError, init_group, launch
from ..models.loading import load_sharded
from ..runtime.prefill import pipeline_prefill
from ..observe.timeline import plot_timeline
from ..observe.trace import find_rank_traces, merge_traces, read_spans

LAUNCH_TIMEOUT = 24 * 3600.0
WARMUP_TOKENS = 3


def run_bench(args: argparse.Namespace, *, check: Callable[[int, Path], None]) -> int:
    """Run both sides, print the table (or JSON), optionally draw the timeline; returns the exit status."""
    check(args.ranks, args.model)
    if args.png is not None:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise UserError("--png needs matplotlib: pip install matplotlib") from None
    step_size: int = args.step_size or default_step_size(args.prompt_tokens, args.ranks)
    spec: dict[str, Any] = {
        "model": str(args.model),
        "prompt_tokens": args.prompt_tokens,
        "step_size": step_size,
        "max_tokens": args.max_tokens,
        "timeout": args.timeout,
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
        "step_size": step_size,
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
    command = [sys.executable, "-m", "pipemlx.cli.bench", json.dumps(spec)]
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
            f"in chunks of {report['step_size']}, {report['max_tokens']} tokens decoded"
        ),
        title_justify="left",
    )
    for name in ("", "1 process", f"pipemlx, {report['ranks']} ranks", "speed ratio"):
        table.add_column(name, justify="right" if name else "left")
    table.add_row(
        "prefill (time to first token)",
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
    """Draw the pipeline's per-rank traces in ``trace_dir`` as a PNG (:func:`pipemlx.timeline.plot_timeline`)."""
    merged = merge_traces(find_rank_traces(trace_dir), trace_dir / "trace.json")
    return plot_timeline([(label, read_spans(merged))], output)


def _timed_tokens(tokens: Iterator[tuple[Any, Any]], start: float) -> tuple[list[int], float, float]:
    """Run a token generator: the tokens, seconds to the first one, and seconds after it."""
    out: list[int] = []
    first = start
    for i, (token, _) in enumerate(tokens):
        if i == 0:
            first = time.perf_counter()
        out.append(int(token))
    end = time.perf_counter()
    mx.synchronize(generation_stream)
    return out, first - start, end - first


def _measure(model: nn.Module, prompt: mx.array, spec: dict[str, Any], pipelined: bool, trace: str | None) -> dict[str, Any]:
    step, max_tokens = spec["step_size"], spec["max_tokens"]
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    if pipelined:
        pipeline_prefill(model, prompt, cache, step_size=step, timeout=spec["timeout"], trace_dir=trace)
        generator = generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=max_tokens)
    else:
        generator = generate_step(prompt, model, prompt_cache=cache, prefill_step_size=step, max_tokens=max_tokens)
    tokens, prefill_s, decode_s = _timed_tokens(generator, start)
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prompt.size / prefill_s,
        "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
        "tokens": tokens,
    }


def bench_rank(spec: dict[str, Any]) -> None:
    """One rank of one side of the benchmark; rank 0 prints its figures as a JSON line."""
    pipelined = spec["mode"] == "pipeline"
    group = init_group() if pipelined else None
    if group is not None:
        model, _ = load_sharded(spec["model"], group, timeout=spec["timeout"])
    else:
        loaded: Any = load(spec["model"])
        model = loaded[0]
    vocab = int(getattr(model, "args").vocab_size)
    prompt = mx.random.randint(0, vocab, (spec["prompt_tokens"],), key=mx.random.key(0)).astype(mx.int32)
    warmup = {**spec, "max_tokens": WARMUP_TOKENS}
    _measure(model, prompt[: min(prompt.size, 2 * spec["step_size"] + 1)], warmup, pipelined, None)
    figures = _measure(model, prompt, spec, pipelined, spec.get("trace_dir"))
    if group is not None:
        mx.eval(mx.distributed.all_sum(mx.array(1), group=group))  # pyright: ignore[reportUnknownMemberType]  # all done before any exits
    if group is None or group.rank() == 0:
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    bench_rank(json.loads(sys.argv[1]))
