"""Prefill benchmark: one process vs mlx-lm's native pipeline vs pipemlx at S=2, each at its own best setting.

    python benchmarks/prefill.py                                  # 2048 and 8192 tokens, the table below
    python benchmarks/prefill.py --lengths 2048 --rounds 3 --json out.json
    python benchmarks/prefill.py --lengths 8192 --rounds 1 --single-steps 256,512 --pipeline-steps 128,256

For every prompt length, in one run: one process at steps 256, 512 and 2048; mlx-lm's native pipeline
(``model.model.pipeline(group)``) at steps 128, 256 and 512; pipemlx at the same fixed steps and with
``prefill_step_size="auto"``, then with ``lend_mlp`` (the cut between the halves of rank 0's last layer, whose
feed-forward half runs on rank 1) and with ``lend_heads=K`` (``--lend-heads``, default 2 of the model's 4
key-value heads, or ``auto``: the count ``shard_model`` predicts fastest for the prompt; several, comma-separated:
that layer's attention split between the ranks too) at the first fixed step and auto. The contenders take turns: each round launches every contender once (one warm-up
prefill, then ``--repeats`` timed ones), so a disturbance of the shared machine falls on all of them
rather than on one; a time is the best over all rounds and repeats of the slowest rank's prefill, as
``pipemlx.observe.metrics`` defines it (the JSON also holds the medians). The table gives each contender's
time, its speed-up over one process at one process's fastest step, over native at native's fastest step,
and as a fraction of the bound for perfect overlap: one process's best time divided by the share of the
work the busiest rank holds (the last layer counted at the share a prefill computes of it, see
``pipemlx.schedule.costmodel``), i.e. no bubble, no communication and no slowdown from two processes
sharing the machine, for whole layers per rank: ``lend_mlp`` moves the cut inside a layer, so it may pass
that bound. The 512-d 8-layer qwen2 with random weights (``--shape``: another of common.SHAPES; a model
without mlx-lm's native pipeline leaves native out), one core per process, OpenBLAS
preloaded (../shared/NOTES.md); run by hand on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import SHAPES, describe_cut, openblas_available, run_ranks, run_single

from pipemlx.runtime.calibrate import last_layer_share
from pipemlx.schedule.split import even_split
from pipemlx.testing import build_model

LEND = "lend_mlp"
"""A pipemlx setting: ``shard_model(..., lend_mlp=True)``, the cut between the halves of rank 0's last layer."""
LEND_HEADS = "lend_heads="
"""A pipemlx setting: ``shard_model(..., lend_mlp=True, lend_heads=K)``, the attention's heads split too."""
SINGLE_STEPS = (256, 512, 2048)
PIPELINE_STEPS = (128, 256, 512)


def overlap_bound(ranks: int, config: dict[str, Any]) -> float:
    """Speed-up with perfect overlap: all the work over the busiest rank's share of it."""
    layers = even_split(config["num_hidden_layers"], ranks)
    share = last_layer_share(build_model(dict(config)))
    work = [float(n) for n in layers]
    work[-1] -= 1.0 - share
    return sum(work) / max(work)


def slowest_rank(reports: list[dict[str, Any]]) -> list[float]:
    """A repeat ends when its slowest rank ends: one time per repeat."""
    return [max(r["prefill_s"][i] for r in reports) for i in range(len(reports[0]["prefill_s"]))]


def contenders(
    num_tokens: int,
    single_steps: list[int],
    pipeline_steps: list[int],
    lend_heads: Sequence[str] = ("2",),
    native: bool = True,
) -> list[tuple[str, Any]]:
    """``(who, setting)`` pairs measured for a prompt of ``num_tokens``; ``lend_heads``: counts or ``auto``;
    ``native``: whether the model has mlx-lm's own pipeline (``model.model.pipeline``)."""
    lent = [LEND] + [f"{LEND_HEADS}{k}" for k in lend_heads if k != "0"]
    return (
        [("one process", s) for s in single_steps if s < num_tokens]
        + [("native", s) for s in pipeline_steps if native]
        + [("pipemlx", s) for s in pipeline_steps]
        + [("pipemlx", "auto")]
        + [("pipemlx", f"{s}, {how}") for how in lent for s in [*pipeline_steps[:1], "auto"]]
    )


def run_contender(who: str, setting: Any, base: dict[str, Any], openblas: bool) -> tuple[list[float], Any]:
    """One launch of one contender: its prefill times (slowest rank, per repeat) and the cut it used."""
    if who == "one process":
        report = run_single({**base, "mode": "single", "step": setting}, openblas)
        return report["prefill_s"], setting
    lend = isinstance(setting, str) and "," in setting
    step: Any = setting.split(",")[0] if lend else setting
    step = int(step) if isinstance(step, str) and step.isdigit() else step
    given = setting.split(LEND_HEADS)[1] if lend and LEND_HEADS in setting else "0"
    heads: Any = given if given == "auto" else int(given)
    mode = "native" if who == "native" else "pipemlx"
    reports = run_ranks(2, {**base, "mode": mode, "step": step, "lend_mlp": lend, "lend_heads": heads}, openblas)
    cut = describe_cut(reports[0].get("chunks") or [])
    if heads == "auto":  # the count the ranks chose
        cut = f"{reports[0]['lent_heads']} heads" + (f", {cut}" if cut else "")
    return slowest_rank(reports), cut


def measure(
    num_tokens: int,
    rounds: int,
    repeats: int,
    openblas: bool,
    single_steps: list[int],
    pipeline_steps: list[int],
    warmup: bool = True,
    lend_heads: Sequence[str] = ("2",),
    config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per contender and setting, all measured in this call, the contenders taking turns."""
    base: dict[str, Any] = {
        "M": num_tokens,
        "repeats": repeats,
        "decode_tokens": 0,
        "config": config or SHAPES["bench"],
        "warmup": warmup,
    }
    native = hasattr(build_model(dict(base["config"])).model, "pipeline")
    entries = contenders(num_tokens, single_steps, pipeline_steps, lend_heads, native)
    samples: dict[int, list[float]] = {i: [] for i in range(len(entries))}
    used: dict[int, Any] = {}
    for _ in range(rounds):
        for i, (who, setting) in enumerate(entries):
            times, used[i] = run_contender(who, setting, base, openblas)
            samples[i].extend(times)
    rows: list[dict[str, Any]] = []
    for i, (who, setting) in enumerate(entries):
        label = f"{setting} ({used[i]})" if "auto" in str(setting) else setting
        rows.append(
            {
                "who": who,
                "setting": label,
                "s": min(samples[i]),
                "median_s": statistics.median(samples[i]),
                "samples": samples[i],
            }
        )
    return rows


def print_table(num_tokens: int, rows: list[dict[str, Any]], bound: float) -> None:
    single = min(r["s"] for r in rows if r["who"] == "one process")
    native = min((r["s"] for r in rows if r["who"] == "native"), default=float("nan"))  # nan: no native pipeline
    best = {
        who: min((r for r in rows if r["who"] == who), key=lambda r: r["s"])
        for who in ("one process", "native")
        if any(r["who"] == who for r in rows)
    }
    print(f"\n{num_tokens} tokens, S=2; bound for perfect overlap {bound:.2f}x")
    print(f"{'contender':<12} {'setting':>22} {'seconds':>8} {'vs one process':>15} {'vs native':>10} {'of bound':>9}")
    for r in rows:
        mark = " *" if r is best.get(r["who"]) else ""
        speedup = single / r["s"]
        print(
            f"{r['who']:<12} {str(r['setting']):>22} {r['s']:>8.2f} {speedup:>14.2f}x {native / r['s']:>9.2f}x "
            f"{speedup / bound:>8.0%}{mark}"
        )
    print("(* the contender's fastest setting; ratios against one process's and native's fastest; best of all rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,8192", help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every contender")
    parser.add_argument("--repeats", type=int, default=1, help="timed prefills per launch, after a warm-up")
    parser.add_argument(
        "--no-warmup", action="store_true", help="time every prefill (long prompts, where a warm-up changes little)"
    )
    parser.add_argument("--single-steps", default=",".join(map(str, SINGLE_STEPS)))
    parser.add_argument("--pipeline-steps", default=",".join(map(str, PIPELINE_STEPS)))
    parser.add_argument(
        "--lend-heads", default="2", help="key-value heads lent, comma-separated counts or auto (0: no lend_heads rows)"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench", help="the model (common.SHAPES)")
    parser.add_argument("--no-openblas", action="store_true")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    openblas = not args.no_openblas and openblas_available()
    config = SHAPES[args.shape]
    bound = overlap_bound(2, config)
    print(
        f"OpenBLAS preload: {'on' if openblas else 'off'}; model {args.shape}: {config['hidden_size']}-d, "
        f"{config['num_hidden_layers']} layers ({config['model_type']}); {args.rounds} round(s) of "
        f"{args.repeats} timed prefill(s) per contender"
    )
    results: dict[int, list[dict[str, Any]]] = {}
    for num_tokens in (int(v) for v in args.lengths.split(",")):
        single = [int(v) for v in args.single_steps.split(",")]
        pipeline = [int(v) for v in args.pipeline_steps.split(",")]
        results[num_tokens] = measure(
            num_tokens,
            args.rounds,
            args.repeats,
            openblas,
            single,
            pipeline,
            warmup=not args.no_warmup,
            lend_heads=args.lend_heads.split(","),
            config=config,
        )
        print_table(num_tokens, results[num_tokens], bound)
    if args.json:
        args.json.write_text(json.dumps({"bound": bound, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
