"""Speculative decoding benchmark: greedy decode tokens/s with and without guesses, S=2 and one process.

    python benchmarks/speculative.py [--tokens 128] [--repeats 3] [--k 3] [--lookup 3] [--batch 8] [--batch-only]
                                     [--no-pin]

On the demo model with its draft (pipemlx/demo/draft), two prompts: the demo's own (the draft guesses) and
one that prompt lookup suits (the start of a passage that the prompt already contains: the model continues
it). Contenders, each greedy, the tokens checked equal: mlx-lm's generate_step and its
speculative_generate_step with the same draft on one process; pipemlx.generate_step at S=2 plain, with the
draft and with prompt lookup (k guesses, each with speculation="serial": one pass through the ranks at a time,
and "pipelined": a pass started every tick), and with the draft, num_draft_tokens="auto" and speculation="auto".
Then (--batch N, 0: skip) N requests at once in pipemlx.BatchGenerator at S=2, on two workloads: "repeated
passages", each prompt a different passage of the book followed by its first 300 characters again (the demo model
rarely copies a passage it was shown: about a fifth of the guesses hold), and "the model's own text", each the
first 300 tokens of such a prompt and then the 200 tokens the model says after them (greedy, it soon repeats
itself: about two fifths hold; no prompt found makes the demo model copy more). Each with the batch without guesses,
with prompt lookup and with the draft (each with k guesses a pass and with num_draft_tokens="auto"): aggregate tokens/s, the guesses held of those fed, the decode ticks, each request's tokens
checked equal, and (auto) how many steps chose each count of guesses and the seconds it measured of a step by
width, in plain steps (--batch-only: this comparison alone). OpenBLAS
preloaded, one core per process (mlx-lm's one process too; --no-pin: unpinned); run by hand on an otherwise idle
machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from common import bench_env, openblas_available

from pipemlx.demo import DRAFT_DIR, MODEL_DIR, book_text
from pipemlx.launch import launch

HERE = Path(__file__).parent
PROGRAM = HERE / "ranks" / "speculative_rank.py"


def prompts() -> dict[str, str]:
    demo = (MODEL_DIR.parent / "prompt.txt").read_text()
    book = book_text()
    start = book.index("It is a truth universally acknowledged")
    passage = book[start : start + 1500]
    return {"demo prompt": demo, "repeated passage": passage + "\n\n" + passage[:300]}


def batch_prompts(count: int) -> list[str]:
    """``count`` prompts, each a different passage of the book and then its start again (prompt lookup suits it)."""
    book = book_text()
    start = book.index("It is a truth universally acknowledged")
    passages = [book[start + 2000 * i : start + 2000 * i + 1200] for i in range(count)]
    return [p + "\n\n" + p[:300] for p in passages]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=3, help="guesses per pass (num_draft_tokens)")
    parser.add_argument("--lookup", type=int, default=3, help="prompt lookup's longest n-gram")
    parser.add_argument("--draft", type=Path, default=DRAFT_DIR, help="the draft model folder (default: the demo's)")
    parser.add_argument("--batch", type=int, default=8, help="requests in the batched comparison (0: skip it)")
    parser.add_argument("--batch-only", action="store_true", help="only the batched comparison")
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    openblas = openblas_available()
    spec: dict[str, Any] = {
        "draft": str(args.draft),
        "prompts": prompts(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "k": args.k,
        "lookup": args.lookup,
        "pin": not args.no_pin,
        "batch": batch_prompts(args.batch),
    }
    if args.batch_only:
        spec["prompts"] = {}
        runs = []
    else:
        runs = [launch(1, [*command(spec, "single")], timeout=1800, env=bench_env(openblas))[0]]
        runs.append(launch(2, [*command(spec, "pipemlx")], timeout=1800, env=bench_env(openblas))[0])
    if args.batch:
        runs.append(launch(2, [*command(spec, "batch")], timeout=3600, env=bench_env(openblas))[0])
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    pinning = "unpinned" if args.no_pin else "one core per process"
    print(
        f"greedy, {args.tokens} tokens, k={args.k}, lookup n={args.lookup}; OpenBLAS {'on' if openblas else 'off'}; "
        + pinning
    )
    table: dict[str, Any] = {}
    for name in spec["prompts"]:
        rows = {**reports[0][name], **reports[1][name]}
        base = statistics.median(rows["pipemlx"]["tok_s"])
        single = statistics.median(rows["mlx-lm"]["tok_s"])
        print(f"\n{name}")
        print(f"{'contender':<26} {'tokens/s':>9} {'vs pipemlx':>11} {'vs mlx-lm':>10} {'accepted':>9}  same tokens")
        for label, row in rows.items():
            rate = statistics.median(row["tok_s"])
            same = row["tokens"] == rows["mlx-lm"]["tokens"]
            print(f"{label:<26} {rate:>9.1f} {rate / base:>11.2f} {rate / single:>10.2f} {row['accepted']:>9}  {same}")
        table[name] = {label: {**row, "median": statistics.median(row["tok_s"])} for label, row in rows.items()}
    if args.batch:
        for name, rows in reports[-1].items():
            if name == "rank":
                continue
            base = statistics.median(rows["batch"]["tok_s"])
            print(f"\n{name} at once (BatchGenerator, S=2), aggregate decode")
            print(
                f"{'contender':<26} {'tokens/s':>9} {'vs batch':>9} {'accepted':>9} {'held/guessed':>13} {'ticks':>6}"
                "  same tokens  steps by guesses, step seconds by width in plain steps (auto)"
            )
            for label, row in rows.items():
                rate = statistics.median(row["tok_s"])
                same = row["tokens"] == rows["batch"]["tokens"]
                held = f"{row['guesses'][1]}/{row['guesses'][0]}"
                print(
                    f"{label:<26} {rate:>9.1f} {rate / base:>9.2f} {row['accepted']:>9} {held:>13} {row['ticks']:>6}"
                    f"  {str(same):<11}  {row['chosen'] or ''} {row['costs'] or ''}"
                )
            table[name] = {label: {**row, "median": statistics.median(row["tok_s"])} for label, row in rows.items()}
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))


def command(spec: dict[str, Any], mode: str) -> list[str]:
    import sys

    return [sys.executable, str(PROGRAM), json.dumps({**spec, "mode": mode})]


if __name__ == "__main__":
    main()
