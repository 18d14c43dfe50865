"""Draw docs/images/performance.png from the JSON files of benchmarks/prefill.py (needs matplotlib).

    python benchmarks/prefill.py --lengths 2048 --json benchmarks/results/prefill_2048.json
    python benchmarks/plot_results.py benchmarks/results/prefill_2048.json [more.json ...]

One panel per prompt length: every contender's speed-up over one process at one process's fastest step,
with the bound for perfect overlap drawn as a line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "docs" / "images" / "performance.png"
COLORS = {"one process": "#dddddd", "native": "#999999", "pipemlx": "#3b7dd8"}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables: list[tuple[int, list[dict[str, Any]], float]] = []
    for path in sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        tables += [(int(m), rows, float(data["bound"])) for m, rows in data["rows"].items()]
    if not tables:
        raise SystemExit(__doc__)
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.2), squeeze=False)
    for ax, (num_tokens, rows, bound) in zip(axes[0], tables):
        single = min(r["s"] for r in rows if r["who"] == "one process")
        labels = [f"{r['who']}\n{str(r['setting']).split(' (')[0]}" for r in rows]  # auto's cut is in the table
        values = [single / r["s"] for r in rows]
        bars = ax.bar(range(len(rows)), values, color=[COLORS[r["who"]] for r in rows], edgecolor="black")
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value + 0.02, f"{value:.2f}x", ha="center", fontsize=7)
        ax.axhline(bound, color="#d62728", linestyle="--", linewidth=1, label=f"perfect overlap {bound:.2f}x")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60, ha="right")
        ax.set_ylabel("prefill speed-up over one process")
        ax.set_title(f"{num_tokens} tokens, 2 ranks (best of each contender)")
        ax.set_ylim(0, max(bound, *values) * 1.15)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
