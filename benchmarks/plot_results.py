"""Draw docs/images/performance.png from benchmarks/results/{prefill_2048,sweep}.json (needs matplotlib).

python benchmarks/plot_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE.parent / "docs" / "images" / "performance.png"


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = json.loads((HERE / "results" / "prefill_2048.json").read_text())[0]
    sweep = json.loads((HERE / "results" / "sweep.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))

    labels = ["mlx-lm native", "pipemlx", "ideal S·n/(n+S-1)"]
    values = [reference["native_speedup"], reference["pipemlx_speedup"], reference["ideal_speedup"]]
    bars = left.bar(labels, values, color=["#999999", "#3b7dd8", "#dddddd"], edgecolor="black")
    for bar, value in zip(bars, values):
        left.text(bar.get_x() + bar.get_width() / 2, value + 0.02, f"{value:.2f}x", ha="center")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("prefill speed-up over one process")
    left.set_title(f"2 ranks, {reference['M']} tokens, step {reference['step']}")
    left.set_ylim(0, 2.1)

    steps = sorted({int(s) for row in sweep for s in row["pipemlx_s"]})
    for step in steps:
        xs = [row["M"] for row in sweep if str(step) in row["pipemlx_s"]]
        ys = [
            row["single_s"][str(step)] / row["pipemlx_s"][str(step)] for row in sweep if str(step) in row["pipemlx_s"]
        ]
        right.plot(xs, ys, marker="o", label=f"step {step}")
    right.set_xscale("log", base=2)
    right.set_xlabel("prompt tokens")
    right.set_ylabel("pipemlx speed-up over one process (same step)")
    right.set_title("where overlap pays (2 ranks)")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.legend(fontsize=8)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
