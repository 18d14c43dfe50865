"""Decode benchmark: tokens/s of one process vs pipemlx at S=2, in one run.

    python benchmarks/decode.py [--prompt-tokens 64] [--tokens 128] [--repeats 3]

pipemlx decodes with pipemlx.generate_step: greedy, every rank applies its share of the output head to the
last rank's final hidden state, and each rank's best token travels with its word on whether to go on
(bounded waits, agreed stops); "head on the last rank" decodes with an argmax sampler (the same tokens),
which keeps the head on the last rank, as every decode did before the head was shared. Also prints the TCP
bytes each rank sent per decoded token (from `ss`). (mlx-lm's native pipeline is not timed here: its
generate_step leaves a decode step with collectives in flight, which every rank would have to drain and
line up by hand before the next run.)
OpenBLAS preloaded, one core per process; run by hand on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from common import BENCH_CONFIG, openblas_available, run_ranks, run_single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    openblas = openblas_available()
    spec: dict[str, Any] = {
        "M": args.prompt_tokens,
        "step": 256,
        "repeats": args.repeats,
        "decode_tokens": args.tokens,
        "config": BENCH_CONFIG,
    }
    single = statistics.median(run_single({**spec, "mode": "single"}, openblas)["decode_tok_s"])
    row: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "single_tok_s": single}
    print(f"prompt {args.prompt_tokens} tokens, {args.tokens} decoded; OpenBLAS {'on' if openblas else 'off'}")
    print(f"{'mode':<28} {'tokens/s':>9} {'vs one process':>15} {'bytes sent per token, by rank':>32}")
    print(f"{'one process':<28} {single:>9.1f} {1.0:>15.2f}")
    contenders = (
        ("pipemlx", "pipemlx.generate_step", False),
        ("pipemlx_head_on_last", "  head on the last rank", True),
    )
    for mode, label, head_on_last in contenders:
        reports = run_ranks(2, {**spec, "mode": "pipemlx", "head_on_last": head_on_last}, openblas)
        rate = statistics.median(reports[0]["decode_tok_s"])
        sent = [
            round(statistics.median(r["decode_bytes_per_token"])) if r["decode_bytes_per_token"][0] else "-"
            for r in reports
        ]
        row[f"{mode}_tok_s"], row[f"{mode}_ratio"], row[f"{mode}_bytes"] = rate, rate / single, sent
        print(f"{label:<28} {rate:>9.1f} {rate / single:>15.2f} {str(sent):>32}")
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
