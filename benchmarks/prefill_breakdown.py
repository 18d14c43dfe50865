"""Where a default prefill's time goes at S=2, against half of one process's: the gap to the two-rank limit.

    python benchmarks/prefill_breakdown.py [--lengths 2048,8192] [--shape bench] [--json OUT]

For each prompt length: one process at its fastest step (``--single-steps``, best of ``--repeats``), and
pipemlx with its defaults (``prefill_step_size="auto"``, ``lend="auto"``) traced (the last of ``--repeats``
prefills after a warm-up). The limit for two ranks is half the one process's time; the traced prefill's gap
to it is cut into four parts, on the busier rank ``b`` (the one with more compute):

- **compute inflation**: the pipeline's compute over both ranks less the one process's (smaller chunks,
  the lent heads' extra work, two processes' kernels), halved;
- **imbalance**: rank ``b``'s compute less half the pipeline's compute;
- **fill and drain**: rank ``b`` idle before its first chunk and after its last;
- **in between**: rank ``b``'s other time between its first and last chunk (waiting for the other rank's
  hidden states, sends, agreements, Python between spans).

The four add up to the traced prefill less half the one process's (the traced prefill is one run; the
one process's the best of its repeats).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import SHAPES, openblas_available, run_ranks, run_single

from pipemlx.observe.trace import Span, find_rank_traces, merge_traces, read_spans


def one_process(num_tokens: int, config: dict[str, Any], steps: list[int], repeats: int) -> tuple[float, int]:
    """The fastest one-process prefill over ``steps``: (seconds, step)."""
    best: tuple[float, int] | None = None
    for step in steps:
        spec = {"mode": "single", "M": num_tokens, "step": step, "repeats": repeats, "decode_tokens": 0}
        seconds = min(run_single({**spec, "config": config}, openblas_available())["prefill_s"])
        print(f"  one process, step {step}: {seconds:.3f} s", file=sys.stderr, flush=True)
        if best is None or seconds < best[0]:
            best = (seconds, step)
    assert best is not None
    return best


def traced_defaults(num_tokens: int, config: dict[str, Any], repeats: int, folder: Path) -> tuple[float, list[Span], dict[str, Any]]:  # fmt: skip
    """pipemlx's defaults at S=2, the last prefill traced: (its seconds, its spans, rank 0's report)."""
    spec = {
        "mode": "pipemlx", "M": num_tokens, "step": "auto", "lend_mlp": True, "lend_heads": "auto",
        "repeats": repeats, "decode_tokens": 0, "config": config, "trace_dir": str(folder),
    }  # fmt: skip
    reports = run_ranks(2, spec, openblas_available())
    seconds = max(r["prefill_s"][-1] for r in reports)
    merged = merge_traces(find_rank_traces(folder), folder / "trace.json")
    return seconds, read_spans(merged), reports[0]


def breakdown(spans: list[Span], single_s: float) -> dict[str, Any]:
    """The gap of the traced prefill to ``single_s / 2``, cut as the module says (seconds)."""
    start = min(s.end_us for s in spans if s.kind == "handshake")  # the ranks leave the handshake together
    end = max(s.end_us for s in spans)
    total = (end - start) / 1e6
    ranks: dict[int, dict[str, float]] = {}
    for rank in sorted({s.rank for s in spans}):
        computes = sorted((s for s in spans if s.rank == rank and s.kind == "compute"), key=lambda s: s.start_us)
        compute = sum(s.dur_us for s in computes) / 1e6
        first, last = computes[0].start_us, computes[-1].end_us
        kinds: dict[str, float] = {}
        for s in spans:
            if s.rank == rank and s.kind != "compute" and first <= s.start_us < last:
                kinds[s.kind] = kinds.get(s.kind, 0.0) + s.dur_us / 1e6
        ranks[rank] = {
            "compute_s": compute,
            "chunks": len(computes),
            "fill_s": (first - start) / 1e6,
            "drain_s": (end - last) / 1e6,
            "between_s": (last - first) / 1e6 - compute,
            **{f"{k}_s": v for k, v in sorted(kinds.items())},
        }
    pipeline_compute = sum(r["compute_s"] for r in ranks.values())
    busy = max(ranks, key=lambda r: ranks[r]["compute_s"])
    b = ranks[busy]
    parts = {
        "compute inflation": (pipeline_compute - single_s) / 2,
        "imbalance": b["compute_s"] - pipeline_compute / 2,
        "fill and drain": b["fill_s"] + b["drain_s"],
        "in between": b["between_s"],
    }
    return {"traced_s": total, "limit_s": single_s / 2, "busier_rank": busy, "parts": parts, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--single-steps", default="256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = SHAPES[args.shape]
    results: dict[str, Any] = {}
    for num_tokens in [int(n) for n in args.lengths.split(",")]:
        single_s, single_step = one_process(num_tokens, config, [int(s) for s in args.single_steps.split(",")], args.repeats)  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            seconds, spans, report = traced_defaults(num_tokens, config, args.repeats, Path(tmp))
        result = breakdown(spans, single_s)
        result.update(single_s=single_s, single_step=single_step, prefill_s=seconds, lent_heads=report["lent_heads"],
                      chunks=report["chunks"])  # fmt: skip
        results[str(num_tokens)] = result
        gap = result["traced_s"] - result["limit_s"]
        print(f"\n{num_tokens} tokens, shape {args.shape}: one process {single_s:.3f} s (step {single_step}); pipemlx "
              f"defaults {seconds:.3f} s ({single_s / seconds:.2f}x; traced {result['traced_s']:.3f} s, lent heads "
              f"{report['lent_heads']}, {len(report['chunks'])} chunks); limit {result['limit_s']:.3f} s (2.00x), "
              f"gap {gap:.3f} s")  # fmt: skip
        for name, part in result["parts"].items():
            print(f"  {name:<18} {part:7.3f} s  {part / gap:6.1%} of the gap  {part / result['traced_s']:6.1%} of the prefill")  # fmt: skip
        for rank, figures in result["ranks"].items():
            print(f"  rank {rank}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
