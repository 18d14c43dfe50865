"""The cost model's prediction against three traced 2-rank prefills (moved out of the test suite: a timing check).

    python benchmarks/cost_model_accuracy.py            # prints the figures, exits 1 outside the tolerances
    python benchmarks/cost_model_accuracy.py --json out.json

A 4-layer, 256-wide llama, a 385-token prompt in 8 chunks of 48: about 1 s per prefill on one core. The ranks
run ``tests/ranks/timed_prefill.py``. Run it on an otherwise idle machine: the tolerances below are loose
because a loaded machine slows a computing rank by amounts no calibration run sees.

Right before each pipelined run, both ranks time the whole model (all 4 layers, one process, no
communication) on chunks of 24, 48 and 72 tokens covering the prompt, and an all_gather like an
agreement point; both ranks do it at once, so the machine is loaded as in the run. Three checks:

- replay (each run, factor 1.25): the plan simulated with the run's own measured compute spans
  predicts the run's makespan. This is the schedule and communication part of the model
  (overlap, dependencies, agreement points); measured 0.97-1.03 on an idle machine, 0.97-1.08
  under load averages of 6-11.
- bubble (median over runs, within 0.1): the bubble fraction predicted from the calibration
  matches the trace's (1 - compute time / (2 x makespan)). About 0.3 here, because the even
  split is not even in a prefill: the last layer only fills its cache (1/9 of a layer's work
  in this model) so rank 1 idles; a model without that term predicts 0.14 and fails.
  Measured differences: 0.00-0.10.
- time (median over runs of measured / predicted, factor 1.5): a sanity bound on the calibrated
  prediction, which knows nothing of CPU contention. On the project's shared 2-core machine
  other jobs take CPU at random moments, and MLX's ring backend busy-polls while a rank waits
  (measured: 86% of a core inside an all_gather, 47% inside a recv), so an oversubscribed
  machine slows a computing rank by amounts no calibration run sees: single runs gave 0.92 to
  0.97 on an idle machine but 0.75 to 1.64 at load averages of 10-11 (medians of three
  0.86-1.12).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipemlx.launch import launch
from pipemlx.observe.trace import Span, find_rank_traces, read_spans
from pipemlx.schedule.costmodel import CostModel, cache_only_share, fit_layer_costs, predict
from pipemlx.schedule.plan import Action, Chunk, build_plans
from pipemlx.schedule.simulate import simulate

RANK_PROGRAM = Path(__file__).resolve().parent.parent / "tests" / "ranks" / "timed_prefill.py"
MEASURED: dict[str, Any] = {
    "arch": "llama",
    "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_key_value_heads": 2},
    "seed": 0,
    "M": 385,
    "step": 48,
    "repeats": 3,
    "calibrate": True,
    "pin": True,
}
# hidden 256, 2 key-value heads of 64, MLP 512: the last layer's k and v are 1/9 of its matmuls
LAST_LAYER_SHARE = cache_only_share(256, 2 * 64, 512)
REPLAY_TOLERANCE = 1.25  # measured / replayed makespan, each run
CALIBRATED_TOLERANCE = 1.5  # median over runs of measured / predicted prefill time
BUBBLE_TOLERANCE = 0.1  # median over runs of |measured - predicted bubble fraction|


class MeasuredComputes:
    """Durations that replay a traced run: each rank's measured compute spans, fixed communication costs."""

    def __init__(self, spans: list[Span], collective_s: float) -> None:
        self.seconds = {(s.rank, s.chunk): s.dur_us / 1e6 for s in spans if s.kind == "compute"}
        self.collective_s = collective_s

    def compute(self, rank: int, chunk: Chunk) -> float:
        return self.seconds[(rank, chunk.index)]

    def transfer(self, source: int, dest: int, shape: tuple[int, int]) -> float:
        return self.collective_s

    def collective(self, action: Action) -> float:
        return self.collective_s


def measure(trace_dir: Path) -> dict[str, Any]:
    """Run the three traced prefills; return each run's figures and the checks' outcomes."""
    spec: dict[str, Any] = {**MEASURED, "trace_dir": str(trace_dir)}
    results = launch(2, [sys.executable, str(RANK_PROGRAM), json.dumps(spec)], timeout=240)
    reports = [json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1]) for r in results]
    layers, plans = MEASURED["config"]["num_hidden_layers"], build_plans(spec["M"], spec["step"], 2)
    chunks = [Chunk(i, a, b) for i, (a, b) in enumerate(reports[0]["calibration_chunks"])]
    ratios: list[float] = []
    records: list[dict[str, Any]] = []
    for run in range(spec["repeats"]):
        timings = [sum(r["calibrations"][run][i] for r in reports) / 2 for i in range(len(chunks))]
        collective = max(r["collective_s"][run] for r in reports)
        costs = CostModel(
            fit_layer_costs(list(zip(chunks, timings)), layers, LAST_LAYER_SHARE),
            tuple(reports[0]["split"]),
            reports[0]["hidden_size"],
            latency_s=collective,
            collective_s=collective,
            last_layer_share=LAST_LAYER_SHARE,
        )
        predicted = predict(spec["M"], spec["step"], costs)
        serial = predict(spec["M"], spec["step"], costs.with_ranks(1))
        measured = max(r["prefill_s"][run] for r in reports)
        spans = [s for p in find_rank_traces(trace_dir / f"run{run}") for s in read_spans(p)]
        makespan = (max(s.end_us for s in spans) - min(s.start_us for s in spans)) / 1e6
        replayed = simulate(
            plans, capacity=None, await_sends=True, durations=MeasuredComputes(spans, collective)
        ).raise_for_failure()
        busy = sum(s.dur_us for s in spans if s.kind == "compute") / 1e6
        ratios.append(measured / predicted.prefill_s)
        records.append({
            "measured_s": round(measured, 4),
            "predicted_s": round(predicted.prefill_s, 4),
            "ratio": round(ratios[-1], 3),
            "replay_ratio": round(makespan / replayed.makespan, 3),
            "serial_predicted_s": round(serial.prefill_s, 4),
            "predicts_overlap": serial.prefill_s > 1.25 * predicted.prefill_s,
            "predicted_bubble": round(predicted.bubble_fraction, 3),
            "measured_bubble": round(1 - busy / (2 * makespan), 3),
            "collective_ms": round(collective * 1e3, 3),
        })  # fmt: skip
    bubble_gap = statistics.median(abs(r["measured_bubble"] - r["predicted_bubble"]) for r in records)
    checks = {
        "overlap predicted": all(r["predicts_overlap"] for r in records),
        f"replay within {REPLAY_TOLERANCE}x": all(
            1 / REPLAY_TOLERANCE <= r["replay_ratio"] <= REPLAY_TOLERANCE for r in records
        ),
        f"bubble within {BUBBLE_TOLERANCE}": bubble_gap <= BUBBLE_TOLERANCE,
        f"time within {CALIBRATED_TOLERANCE}x": 1 / CALIBRATED_TOLERANCE
        <= statistics.median(ratios)
        <= CALIBRATED_TOLERANCE,
    }
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"load_average": load, "runs": records, "median_ratio": statistics.median(ratios), "checks": checks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipemlx-costmodel-") as directory:
        result = measure(Path(directory))
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    failed = [name for name, ok in result["checks"].items() if not ok]
    print("cost model accuracy: " + ("OK" if not failed else "FAIL: " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
