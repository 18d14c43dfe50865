"""Benchmark rank program: greedy decode tokens/s with and without speculation, on the demo model.

Spec: {"mode": "single" | "pipemlx" | "batch", "draft": folder, "prompts": {name: text}, "tokens", "repeats",
"k", "lookup", "pin" (default true: each process on its own core, rank r on the r-th allowed one),
"batch": [text, ...]}. "single": mlx-lm's generate_step and speculative_generate_step (the same draft) on one
process; "pipemlx": pipemlx.generate_step on the sharded model, plain, with the draft and with prompt lookup, each
with speculation="serial" and "pipelined", and with num_draft_tokens="auto" and speculation="auto". Prints one JSON line: per prompt and contender, the
decode tokens/s of each repeat (first token to last) and the share of guesses confirmed. The repeats
run round-robin over the contenders. "batch": pipemlx.BatchGenerator on the sharded model, the "batch" prompts all
inserted at once, without guesses and with prompt lookup (k guesses a pass, and "auto"): aggregate decode tokens/s
from the first token to the last, each request's tokens, and the share of guesses confirmed.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step, speculative_generate_step

import pipemlx
from pipemlx.demo import MODEL_DIR
from pipemlx.launch import init_group
from pipemlx.runtime.batch.speculate import StepCosts


def timed(tokens: Iterable[Any], count: int) -> tuple[float, list[int]]:
    """Tokens/s from the first token to the ``count``-th, and the tokens."""
    out: list[int] = []
    start = 0.0
    for item in tokens:
        out.append(int(item[0]))
        if len(out) == 1:
            start = time.perf_counter()
        if len(out) == count:
            break
    return (len(out) - 1) / (time.perf_counter() - start), out


def pin(rank: int) -> None:
    """This process on one core (rank ``r``: the ``r``-th allowed), as the other benchmarks' baselines."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def batched(
    model: Any, prompts: list[list[int]], count: int, lookup: int | None, k: int | str, draft: Any = None
) -> dict[str, Any]:
    """One batch of ``prompts`` decoded together (``count`` tokens each): aggregate tokens/s, tokens, guesses, the
    decode ticks (those that returned tokens) and, with ``"auto"``, how many steps chose each count. ``draft``:
    the draft model's guesses instead of prompt lookup's."""
    generator = pipemlx.BatchGenerator(
        model, max_tokens=count, logprobs=False, prompt_lookup=lookup, num_draft_tokens=k, draft_model=draft
    )
    uids = generator.insert(prompts)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    start, produced, ticks = 0.0, 0, 0
    while len(generator):
        responses = generator.next()
        ticks += bool(responses)
        for response in responses:
            tokens[response.uid].append(response.token)
            produced += 1
            if produced == 1:
                start = time.perf_counter()
    proposed, confirmed = generator.guesses
    speculation = generator._speculation  # pyright: ignore[reportPrivateUsage]
    return {
        "tok_s": (produced - 1) / (time.perf_counter() - start),
        "tokens": [tokens[u] for u in uids],
        "accepted": f"{confirmed / proposed:.2f}" if proposed else "",
        "guesses": [proposed, confirmed],
        "ticks": ticks,
        "chosen": {} if speculation is None or not speculation.auto else dict(sorted(speculation.chosen.items())),
        "costs": {} if speculation is None or not speculation.auto else step_costs(speculation.costs),
    }


def step_costs(costs: StepCosts) -> dict[int, float]:
    """``"auto"``'s measured cost of a step by width, in plain steps (the median of its latest timings)."""
    return {w: round(statistics.median(r), 2) for w, r in sorted(costs.ratios.items())}


def continued(model: Any, prompts: list[list[int]], count: int) -> list[list[int]]:
    """Each prompt, then what the model says after it (``count`` greedy tokens, mlx-lm on the whole model): the
    demo model, decoding greedily, soon repeats itself ("I am sure, I am sure, ..."), so that prompt lookup's
    guesses from its own text hold more often than on a passage it was shown again (which it rarely copies)."""
    return [
        prompt + [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=count)] for prompt in prompts
    ]


def run_batch(spec: dict[str, Any]) -> None:
    """``"batch"`` mode: the same batch without guesses, with prompt lookup and with the draft (k guesses and
    ``"auto"``), round-robin over the repeats."""
    group = init_group()
    if spec.get("pin", True):
        pin(group.rank())
    model, tokenizer = pipemlx.load_sharded(MODEL_DIR, group)
    prompts = [list(tokenizer.encode(text)) for text in spec["batch"]]
    whole, _ = mlx_lm.load(str(MODEL_DIR))
    workloads = {
        "repeated passages": prompts,
        "the model's own text": continued(whole, [p[:300] for p in prompts], 200),
    }
    del whole
    draft, _ = mlx_lm.load(spec["draft"])
    contenders: dict[str, tuple[int | None, int | str, Any]] = {
        "batch": (None, spec["k"], None),
        f"batch lookup k={spec['k']}": (spec["lookup"], spec["k"], None),
        "batch lookup auto": (spec["lookup"], "auto", None),
        f"batch draft k={spec['k']}": (None, spec["k"], draft),
        "batch draft auto": (None, "auto", draft),
    }
    report: dict[str, Any] = {"rank": group.rank()}
    for workload, batch in workloads.items():
        rows: dict[str, Any] = {label: {"tok_s": []} for label in contenders}
        for _ in range(spec["repeats"]):
            for label, (lookup, k, guesser) in contenders.items():
                run = batched(model, batch, spec["tokens"], lookup, k, guesser)
                rows[label]["tok_s"].append(run.pop("tok_s"))
                rows[label].update(run)
        report[f"{len(batch)} requests, {workload}"] = rows
    print(json.dumps(report), flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["mode"] == "batch":
        run_batch(spec)
        return
    count, k = spec["tokens"], spec["k"]
    draft, _ = mlx_lm.load(spec["draft"])
    contenders: dict[str, Callable[[mx.array], Any]] = {}
    rank = 0
    if spec["mode"] == "single":
        if spec.get("pin", True):  # one core, as each rank has
            pin(0)
        model, tokenizer = mlx_lm.load(str(MODEL_DIR))
        contenders["mlx-lm"] = lambda p: generate_step(p, model, max_tokens=count)
        contenders["mlx-lm draft"] = lambda p: speculative_generate_step(
            p, model, draft, num_draft_tokens=k, max_tokens=count
        )
    else:
        group = init_group()
        rank = group.rank()
        if spec.get("pin", True):
            pin(rank)
        model, tokenizer = pipemlx.load_sharded(MODEL_DIR, group)  # the default head ("auto": split here)
        whole, _ = pipemlx.load_sharded(MODEL_DIR, group, head="all")  # pipelined passes need the whole head
        contenders["pipemlx"] = lambda p: pipemlx.generate_step(p, model, max_tokens=count)
        contenders["pipemlx head=all"] = lambda p: pipemlx.generate_step(p, whole, max_tokens=count)
        for mode, held in (("serial", model), ("pipelined", whole)):  # one pass at a time, or one every tick
            contenders[f"pipemlx draft {mode}"] = lambda p, mode=mode, held=held: pipemlx.generate_step(
                p, held, max_tokens=count, draft_model=draft, num_draft_tokens=k, speculation=mode
            )
            contenders[f"pipemlx lookup {mode}"] = lambda p, mode=mode, held=held: pipemlx.generate_step(
                p, held, max_tokens=count, prompt_lookup=spec["lookup"], num_draft_tokens=k, speculation=mode
            )
        for label, held in (("", model), (" head=all", whole)):
            contenders[f"pipemlx draft auto{label}"] = lambda p, held=held: pipemlx.generate_step(
                p, held, max_tokens=count, draft_model=draft, num_draft_tokens="auto", speculation="auto"
            )
    report: dict[str, Any] = {"rank": rank}
    for name, text in spec["prompts"].items():
        prompt = mx.array(tokenizer.encode(text), dtype=mx.int32)
        rows: dict[str, Any] = {label: {"tok_s": [], "tokens": [], "accepted": ""} for label in contenders}
        # Round-robin: each repeat runs every contender once, so a slow spell of a noisy machine slows them alike.
        for _ in range(spec["repeats"]):
            for label, start in contenders.items():
                stream = start(prompt)
                rate, tokens = timed(stream, count)
                stream.close()
                rows[label]["tok_s"].append(rate)
                rows[label]["tokens"] = tokens
                guesses = getattr(stream, "guesses", None)
                if guesses is not None and guesses[0]:
                    rows[label]["accepted"] = f"{guesses[1] / guesses[0]:.2f}"
        report[name] = rows
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
