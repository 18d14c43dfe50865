"""Decode benchmark: one greedy stream's tokens/s, one process against two pipelines at S=2, on two model shapes.

    python benchmarks/decode.py [--prompt-tokens 64] [--tokens 128] [--repeats 3] [--shapes light,bench]

For each shape (:data:`common.SHAPES`: ``light``, a head of 2% of the weights, as in the models people run, then
``bench``, the 32k-vocabulary head of 37% that the other benchmarks use), in one run:

- one process: mlx-lm's ``generate_step`` on the whole model;
- mlx-lm's native pipeline (``model.model.pipeline(group)``) under the same ``generate_step`` on 2 ranks;
- ``pipemlx.generate_step`` on 2 ranks (its defaults: greedy, the head shared where the model allows).

``--sampled`` decodes with mlx-lm's sampler (temperature 0.7, top-p 0.9) and a repetition penalty instead.

``--speculative`` measures speculative decoding instead (:mod:`speculative`, which also takes ``--k``,
``--lookup`` and ``--draft``): on the demo model with its draft, tokens/s of pipemlx at S=2 with and without
guesses (the draft, ``"auto"``, prompt lookup), of one-process mlx-lm with and without its
``speculative_generate_step``, and the share of guesses confirmed, on the demo prompt and on one that prompt
lookup suits.

Each contender runs ``--repeats`` times after a warm-up; the figure is the median of its repeats. OpenBLAS is
preloaded with one thread, every process on its own core (the launcher pins ranks); run it on an idle machine
(``chrt -f 50`` keeps other work off the cores while it runs). Also prints the TCP bytes pipemlx's ranks sent
per decoded token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import SHAPES, openblas_available, run_ranks, run_single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default="light,bench", help="comma-separated names from common.SHAPES")
    parser.add_argument(
        "--sampled", action="store_true", help="temperature 0.7, top-p 0.9 and a repetition penalty instead of greedy"
    )
    parser.add_argument("--speculative", action="store_true", help="speculative decoding instead (speculative.py)")
    parser.add_argument("--json", type=Path)
    args, rest = parser.parse_known_args()
    if args.speculative:  # speculative.py's own options pass through
        import speculative

        saved = ["--json", str(args.json)] if args.json else []
        sys.argv = [sys.argv[0], "--tokens", str(args.tokens), "--repeats", str(args.repeats), *saved, *rest]
        speculative.main()
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    openblas = openblas_available()
    print(
        f"prompt {args.prompt_tokens} tokens, {args.tokens} decoded, {'sampled' if args.sampled else 'greedy'}; OpenBLAS {'on' if openblas else 'off'}"
    )
    print(f"{'shape':<8} {'contender':<24} {'tokens/s':>9} {'vs one process':>15} {'bytes/token by rank':>21}")
    rows: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        spec: dict[str, Any] = {
            "M": args.prompt_tokens,
            "step": 256,
            "repeats": args.repeats,
            "decode_tokens": args.tokens,
            "config": SHAPES[name],
            "sampled": args.sampled,
        }
        single = statistics.median(run_single({**spec, "mode": "single"}, openblas)["decode_tok_s"])
        row: dict[str, Any] = {"shape": name, "one_process_tok_s": single}
        print(f"{name:<8} {'one process (mlx-lm)':<24} {single:>9.1f} {1.0:>15.2f}")
        for mode, label in (("native", "mlx-lm native pipeline"), ("pipemlx", "pipemlx.generate_step")):
            reports = run_ranks(2, {**spec, "mode": mode}, openblas)
            rate = statistics.median(reports[0]["decode_tok_s"])
            sent = [round(statistics.median(r["decode_bytes_per_token"])) for r in reports] if mode == "pipemlx" else []
            row[f"{mode}_tok_s"], row[f"{mode}_ratio"] = rate, rate / single
            print(f"{'':<8} {label:<24} {rate:>9.1f} {rate / single:>15.2f} {str(sent or ''):>21}")
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
