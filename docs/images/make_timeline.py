"""Make docs/images/timeline.png: a measured 2-rank prefill next to the cost model's prediction.

Runs tests/ranks/timed_prefill.py on 2 local ranks: before each of two traced pipelined prefills,
both ranks time the whole model in one process (the single-process calibration of
tests/test_costmodel.py, made under the same machine load). The faster run is drawn above the
prediction from the layer costs fitted to the calibration made right before it.
Needs matplotlib (pip install 'pipemlx[plot]').

Usage: python docs/images/make_timeline.py [OUT.png]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from pipemlx.schedule.costmodel import CostModel, cache_only_share, fit_layer_costs, predict
from pipemlx.launch import launch
from pipemlx.schedule.plan import Chunk
from pipemlx.observe.timeline import plot_timeline, simulated_trace, write_trace
from pipemlx.observe.trace import find_rank_traces, merge_traces, read_spans

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_key_value_heads": 2}
M, STEP = 769, 96


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images" / "timeline.png"
    work = Path(tempfile.mkdtemp(prefix="pipemlx-timeline-"))
    spec = {"arch": "llama", "config": CONFIG, "seed": 0, "M": M, "step": STEP, "trace_dir": str(work),
            "repeats": 2, "calibrate": True, "pin": True}  # fmt: skip
    results = launch(2, [sys.executable, str(ROOT / "tests" / "ranks" / "timed_prefill.py"), json.dumps(spec)], timeout=600)
    reports = [json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1]) for r in results]
    run = min(range(2), key=lambda i: max(r["prefill_s"][i] for r in reports))
    chunks = [Chunk(i, a, b) for i, (a, b) in enumerate(reports[0]["calibration_chunks"])]
    timings = [sum(r["calibrations"][run][i] for r in reports) / 2 for i in range(len(chunks))]
    share = cache_only_share(256, 2 * 64, 512)
    collective = max(r["collective_s"][run] for r in reports)
    costs = CostModel(
        fit_layer_costs(list(zip(chunks, timings)), CONFIG["num_hidden_layers"], share),
        tuple(reports[0]["split"]),
        CONFIG["hidden_size"],
        latency_s=collective,
        collective_s=collective,
        last_layer_share=share,
    )
    prediction = predict(M, STEP, costs)
    measured = merge_traces(find_rank_traces(work / f"run{run}"), work / "measured.json")
    predicted = write_trace(simulated_trace(prediction.result), work / "predicted.json")
    plot_timeline(
        [
            ("measured: 2 ranks, one process (one core) each", read_spans(measured)),
            ("predicted by pipemlx.costmodel, calibrated on one process holding all 4 layers", read_spans(predicted)),
        ],
        out,
        title=f"pipemlx prefill of a {M}-token prompt in chunks of {STEP}: 4-layer llama (hidden 256), 2 ranks",
    )
    print(f"wrote {out}; traces in {work}; predicted {prediction.prefill_s:.3f} s, bubble {prediction.bubble_fraction:.2f}")


if __name__ == "__main__":
    main()
