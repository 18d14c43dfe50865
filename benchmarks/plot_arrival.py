"""Draw docs/images/arrival.png: the time between tokens of 4 decoding requests as a long prompt arrives.

    python benchmarks/concurrent_requests.py --skip-table --arrival-tokens 4096 --chunks 32,64 \\
        --json benchmarks/results/arrival.json
    python benchmarks/plot_arrival.py benchmarks/results/arrival.json

One line per prefill_chunk_tokens: every step's time (the 4 requests get one token each per step) against
the time since the prompt arrived; the last 32 steps before it arrived are drawn at negative times, the
arrived request's first token ends each line. The dashed lines are twice the undisturbed p95 (issue 15's
target for the others' p95 while the prompt is prefilled). Needs matplotlib.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "images" / "arrival.png"


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    runs = json.loads(Path(sys.argv[1]).read_text())["arrival"]["runs"]
    fig, ax = plt.subplots(figsize=(10, 4))
    for run, color in zip(runs, ["#3b7dd8", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]):
        before = [g * 1000 for g in run["gaps_before"]]
        during = [g * 1000 for g in run["gaps_during"]]
        x_before = [-t for t in itertools.accumulate(reversed(run["gaps_before"]))][::-1]
        x_during = list(itertools.accumulate(run["gaps_during"]))
        label = (
            f"{run.get('chunking', 'fixed')} chunk {run['chunk']}: p95 {run['p95_during'] / run['p95_before']:.1f}x, "
            f"first token {run['ttft']:.1f} s = {run['ttft'] / run['solo']:.2f}x solo"
        )
        ax.plot(x_before + x_during, before + during, color=color, linewidth=0.9, label=label)
        ax.axhline(2000 * run["p95_before"], color=color, linestyle="--", linewidth=0.8)
        ax.axvline(run["ttft"], color=color, linestyle=":", linewidth=0.8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("seconds since the 4096-token prompt arrived")
    ax.set_ylabel("time between tokens (ms)")
    ax.set_title("4 requests decoding through pipemlx.BatchGenerator (S=2) while a long prompt is prefilled")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
