"""Do sends hold up the next chunk's compute? 8 MB activation messages (4096-d x 512 tokens, float32).

    python benchmarks/send_overlap.py

Runs a 2-rank pipemlx prefill of a 4096-d, 2-layer qwen2 with chunks of 512 tokens, traces it, and
prints per chunk: rank 0's compute, the time to issue its send (flush), the time rank 0 then waited
for that send to complete at the next agreement point, and rank 1's receive wait. A send that held
up compute would show as flush time or as compute stretched by the transfer; an 8 MB loopback
transfer is measured alone for scale.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, openblas_available, run_ranks

CONFIG: dict[str, Any] = {
    **BENCH_CONFIG,
    "hidden_size": 4096,
    "num_hidden_layers": 2,
    "intermediate_size": 1024,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 1000,
}


def spans(path: Path) -> list[dict[str, Any]]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "mode": "pipemlx",
            "M": 4 * 512 + 1,
            "step": 512,
            "repeats": 1,
            "decode_tokens": 0,
            "config": CONFIG,
            "trace_dir": tmp,
        }
        run_ranks(2, spec, openblas_available())
        rank0, rank1 = spans(Path(tmp) / "trace-rank0.json"), spans(Path(tmp) / "trace-rank1.json")
    message_mb = 512 * CONFIG["hidden_size"] * 4 / 2**20

    def by(events: list[dict[str, Any]], cat: str) -> list[float]:
        return [e["dur"] / 1000 for e in events if e["cat"] == cat]

    compute, flush, wait = by(rank0, "compute"), by(rank0, "send"), by(rank0, "wait")
    recv = by(rank1, "recv")
    print(f"activation message: {message_mb:.1f} MB per chunk")
    print(f"{'chunk':>5} {'r0 compute ms':>14} {'r0 send issue ms':>17} {'r0 send wait ms':>16} {'r1 recv ms':>11}")
    for k in range(len(compute)):
        print(
            f"{k:>5} {compute[k]:>14.1f} {flush[k] if k < len(flush) else 0:>17.2f} "
            f"{wait[k] if k < len(wait) else 0:>16.2f} {recv[k] if k < len(recv) else 0:>11.2f}"
        )
    print(
        f"sends issued in {max(flush):.2f} ms at most; waits for completion {max(wait):.2f} ms at most; "
        f"rank 0's compute per chunk {min(compute):.0f}-{max(compute):.0f} ms"
    )


if __name__ == "__main__":
    main()
