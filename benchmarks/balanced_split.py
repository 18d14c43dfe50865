"""Balanced against even split on 2 ranks of unequal speed: the pipelined prefill of each.

    python benchmarks/balanced_split.py            # rank 0 with OpenBLAS, rank 1 with MLX's reference BLAS
    python benchmarks/balanced_split.py --json out.json

Rank 1 is the slow machine: it runs with the Linux MLX wheel's reference BLAS while rank 0 preloads
OpenBLAS (../shared/NOTES.md: tens of times faster matrix products, identical results), like an M1
beside an M4 Max. The even split gives each rank 4 of 8 layers, so the slow rank sets the pace;
``split="balanced"`` measures both ranks' speeds (``pipemlx.runtime.calibrate.measure_speeds``) and
gives the fast rank more layers. Prints both splits, the measured speeds, the prefill times (median
over repeats of the slower rank) and the ratio. Needs OpenBLAS (``apt-get install libopenblas0-pthread``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import OPENBLAS

from pipemlx.launch import launch

HERE = Path(__file__).parent
CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 1024,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}


def run(split: str, tokens: int, step: int, repeats: int) -> dict[str, Any]:
    spec = {"config": CONFIG, "M": tokens, "step": step, "repeats": repeats, "split": split}
    threads = ["env", "OPENBLAS_NUM_THREADS=1", "OMP_NUM_THREADS=1"]
    results = launch(
        2,
        [sys.executable, str(HERE / "ranks" / "balanced_rank.py"), json.dumps(spec)],
        timeout=1800,
        prefixes=[[*threads, f"LD_PRELOAD={OPENBLAS}"], threads],  # rank 0 fast, rank 1 slow
    )
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    per_repeat = [max(r["prefill_s"][i] for r in reports) for i in range(repeats)]
    return {"split": reports[0]["split"], "speeds": reports[0]["speeds"], "prefill_s": statistics.median(per_repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--step", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if not Path(OPENBLAS).exists():
        sys.exit(f"needs OpenBLAS at {OPENBLAS} (apt-get install libopenblas0-pthread)")
    even = run("even", args.tokens, args.step, args.repeats)
    balanced = run("balanced", args.tokens, args.step, args.repeats)
    speeds = balanced["speeds"]
    ratio = even["prefill_s"] / balanced["prefill_s"]
    print(
        f"{CONFIG['hidden_size']}-d {CONFIG['num_hidden_layers']}-layer qwen2, {args.tokens} tokens, step {args.step}"
    )
    print(f"measured speeds: rank 0 (OpenBLAS) {speeds[0]:.1f}/s, rank 1 (reference BLAS) {speeds[1]:.1f}/s")
    print(f"even     split {even['split']}: prefill {even['prefill_s']:.2f} s")
    print(f"balanced split {balanced['split']}: prefill {balanced['prefill_s']:.2f} s")
    print(f"balanced is {ratio:.2f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps({"even": even, "balanced": balanced, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
