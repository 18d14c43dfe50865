"""The one-time cost of the calibration behind the defaults (``lend="auto"``, ``prefill_step_size="auto"``).

    python benchmarks/calibration_cost.py [--shape bench] [--prompt-tokens 2048] [--runs 2]

Two ranks (OpenBLAS preloaded, one core per rank). Each run starts two processes with an empty calibration
cache (``$PIPEMLX_CACHE_DIR`` in a temporary folder), then two more with the cache the first pair wrote: each
shards the model with the defaults and prefills the prompt twice. The calibration's cost is the cold start's
``shard_model`` and first prefill minus the warm start's. Run by hand on an otherwise idle machine.

Since issue #47 no request calibrates (the first plans with the untimed prior and refines it from its own
chunks): the difference is then the prior's plan against the refined one, plus the refinement's one all-gather,
and should be near zero (``benchmarks/first_run.py`` measures the same on realistic shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from common import HERE, SHAPES, bench_env, openblas_available

from pipemlx.launch import launch

PROGRAM = HERE / "ranks" / "calibration_cost_rank.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    spec = json.dumps({"config": SHAPES[args.shape], "M": args.prompt_tokens})
    print(f"shape {args.shape}, {args.prompt_tokens}-token prompt; seconds on rank 0")
    print(f"{'run':<5} {'start':<6} {'shard_model':>12} {'1st prefill':>12} {'2nd prefill':>12} {'calibration':>12}")
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="pipemlx-calibration-") as cache:
            env = {**bench_env(openblas_available()), "PIPEMLX_CACHE_DIR": cache}
            times = {}
            for start in ("cold", "warm"):
                results = launch(2, [sys.executable, str(PROGRAM), spec], timeout=1800, env=env)
                times[start] = json.loads(results[0].stdout.strip().splitlines()[-1])
            cold, warm = times["cold"], times["warm"]
            cost = cold["shard_s"] + cold["first_prefill_s"] - warm["shard_s"] - warm["first_prefill_s"]
            for start, t in times.items():
                extra = f"{cost:>12.2f}" if start == "cold" else ""
                row = f"{t['shard_s']:>12.2f} {t['first_prefill_s']:>12.2f} {t['second_prefill_s']:>12.2f}"
                print(f"{run:<5} {start:<6} {row}{extra}")


if __name__ == "__main__":
    main()
