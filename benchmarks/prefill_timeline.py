"""Draw the prefill before and after prefill_step_size="auto" cuts its ends: docs/images/prefill_before_after.png.

    python benchmarks/prefill_timeline.py [--tokens 2048] [--step 256] [-o docs/images/prefill_before_after.png]

Two traced pipemlx prefills of the benchmark model at S=2 (OpenBLAS preloaded, one core per process),
each the last of three in its launch: chunks of ``--step`` tokens as mlx-lm cuts them (what mlx-lm's
native pipeline also runs), and ``prefill_step_size="auto"``. The PNG shows both timelines on one time axis
(needs matplotlib); the seconds printed are the traced prefills'.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, openblas_available, run_ranks

from pipemlx.observe.timeline import plot_timeline
from pipemlx.observe.trace import find_rank_traces, merge_traces, read_spans

OUT = Path(__file__).resolve().parents[1] / "docs" / "images" / "prefill_before_after.png"


def traced(num_tokens: int, step: Any, directory: Path) -> tuple[Path, float, list[int]]:
    """Run one launch (a warm-up, then two prefills, the last traced); the merged trace, its seconds, the cut."""
    spec: dict[str, Any] = {
        "mode": "pipemlx",
        "M": num_tokens,
        "step": step,
        "repeats": 2,
        "decode_tokens": 0,
        "config": BENCH_CONFIG,
        "trace_dir": str(directory),
    }
    reports = run_ranks(2, spec, openblas_available())
    seconds = max(r["prefill_s"][-1] for r in reports)
    merged = merge_traces(find_rank_traces(directory), directory / "trace.json")
    return merged, seconds, reports[0].get("chunks") or []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--step", type=int, default=256)
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before, before_s, _ = traced(args.tokens, args.step, Path(tmp) / "uniform")
        after, after_s, chunks = traced(args.tokens, "auto", Path(tmp) / "auto")
        cut = ",".join(map(str, chunks))
        print(f"uniform {args.step}: {before_s:.2f} s; auto ({cut}): {after_s:.2f} s")
        panels = [
            (f"chunks of {args.step} ({before_s:.2f} s)", read_spans(before)),
            (f'prefill_step_size="auto" ({after_s:.2f} s)', read_spans(after)),
        ]
        title = f"pipemlx prefill, {args.tokens} tokens, 2 ranks"
        print(plot_timeline(panels, args.output, title=title))


if __name__ == "__main__":
    main()
