"""Benchmark rank program: where each rank's time goes in batch ticks, with an arrival or in steady decode.

Spec: {"config", "lend_mlp"?, "mode": "arrival" (the default) or "steady", ...}.

``"arrival"`` ({"R", "M" (the decoding requests' prompts), "arrival_tokens", "chunk", "chunking"}): R requests
decode; after 10 undisturbed ticks, 10 more are timed; then an ``arrival_tokens`` prompt is inserted and every
tick until its first token is timed. Each phase of ``pipemlx.runtime.batch.tick.TickRunner.run`` that blocks
(handing a graph to MLX, or the tick's all-gather) is timed by wrapping ``TickRunner._issue`` and
``batch_tick.wait_for``; the rest of a tick is Python (planning, building graphs, bookkeeping). Prints one JSON
line: {"rank", "ticks", "ttft", "undisturbed_ms": [...], "per_tick_ms": {phase: ms}, "python_ms"}.

``"steady"`` ({"requests": [R, ...], "groups": [decode_groups, ...], "compiled"?: [compiled_decode, ...], "M", "warmup", "ticks", "sync"?, "logprobs"?
(the generator's, default true), "head"? (shard_model's, default "auto"), "probe"? (steps: then
:func:`compile_probe` for each R and R/S rows, after the runs, in "probe")}): for each
R and each ``decode_groups`` value, a new generator decodes R requests (no arrival: every prompt prefilled,
every row decoding, groups formed), ``warmup`` ticks untimed, then ``ticks`` ticks each timed phase by phase
(:class:`Phases`): building the model's graph (the inner model's ``__call__``: the layers' graph, Python),
building the samples' graph, handing each graph to MLX (``mx.async_eval`` through ``waits.issue``, named by what
it hands: the decode step, a received group's step or chunk, a receive), each blocking wait (``waits.wait_for``
in any pipemlx module, named by what it waits for: the tick's all-gather, the shared or split head's), and
"python", the rest of the tick (planning, bookkeeping, the helper threads). It counts per tick the collectives
(``mx.distributed.all_gather``/``all_sum``/...), the point-to-point messages (``send``, ``recv``, ``recv_like``),
and the syncs (``mx.eval``, ``mx.async_eval``), and the tokens the tick returned. MLX computes on its own
thread while Python goes on, so a rank's layers' compute hides in those waits; with ``"sync": true`` every
hand-off is followed by ``mx.synchronize()`` and that wait is timed on its own ("compute after ..."): the
layers' compute (with, on a rank after the first, the wait for its input), at the price of the overlap the
tick relies on (the tick is then slower than without). Prints one JSON line: {"rank", "runs": [{"R",
"groups", "ticks", "tokens_per_tick", "tick_ms", "per_tick_ms": {phase: ms}, "counts": {what: per tick},
"python_ms"}]}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

import mlx.core as mx

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.batch import tick as batch_tick
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model

PHASES = {
    "running the decode step": "decode",
    "computing the chunk it received": "held chunk",
    "computing its new chunk": "new chunk",
    "sending its chunk": "send",
}

COLLECTIVES = ("all_gather", "all_sum", "all_max", "all_min", "sum_scatter")
MESSAGES = ("send", "recv", "recv_like")


class Phases:
    """Wraps, in this process only, the functions a tick blocks in or builds graphs in, and adds up their time
    and calls while :attr:`on` (the inner spans of a wrapped call that calls another are counted once, in the
    outermost: graph building that evaluates counts as graph building)."""

    def __init__(self, model: Any, sync: bool) -> None:
        self.on = False
        self.sync = sync
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: defaultdict[str, int] = defaultdict(int)
        self._depth = 0
        self._patch_waits()
        self._patch_counts()
        inner = type(model.model)
        call = inner.__call__
        self._timed(inner, "__call__", call, lambda *_: "graph: layers")
        sample = pipemlx.BatchGenerator._sample  # pyright: ignore[reportPrivateUsage]
        self._timed(pipemlx.BatchGenerator, "_sample", sample, lambda *_: "graph: sampling")

    def _timed(self, owner: Any, name: str, function: Any, label: Any) -> None:
        phases = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not phases.on or phases._depth:
                return function(*args, **kwargs)
            phases._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phases.seconds[label(*args, **kwargs)] += time.perf_counter() - start
                phases._depth -= 1

        setattr(owner, name, timed)

    def _patch_waits(self) -> None:
        """Every pipemlx module's ``issue`` and ``wait_for`` (each module imported the names itself)."""
        from pipemlx.runtime import waits

        def what(describe: Any) -> str:
            text = describe()
            return next((name for marker, name in PHASES.items() if marker in text), _short(text))

        issue, wait_for = waits.issue, waits.wait_for
        phases = self

        def timed_issue(arrays: Any, timeout: float | None, describe: Any) -> None:
            if not phases.on or phases._depth:
                return issue(arrays, timeout, describe)
            start = time.perf_counter()
            issue(arrays, timeout, describe)
            label = what(describe)
            phases.seconds[f"issue: {label}"] += time.perf_counter() - start
            if phases.sync:
                start = time.perf_counter()
                mx.synchronize()
                phases.seconds[f"compute after: {label}"] += time.perf_counter() - start

        def timed_wait(arrays: Any, timeout: float | None, describe: Any) -> None:
            if not phases.on or phases._depth:
                return wait_for(arrays, timeout, describe)
            start = time.perf_counter()
            wait_for(arrays, timeout, describe)
            phases.seconds[f"wait: {what(describe)}"] += time.perf_counter() - start

        for module in [m for n, m in sys.modules.items() if n.startswith("pipemlx") and m is not None]:
            if getattr(module, "issue", None) is issue:
                module.issue = timed_issue  # pyright: ignore[reportAttributeAccessIssue]
            if getattr(module, "wait_for", None) is wait_for:
                module.wait_for = timed_wait  # pyright: ignore[reportAttributeAccessIssue]

    def _patch_counts(self) -> None:
        phases = self

        def counted(owner: Any, name: str, kind: str) -> None:
            function = getattr(owner, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if phases.on:
                    phases.counts[kind] += 1
                return function(*args, **kwargs)

            setattr(owner, name, wrapper)

        for name in COLLECTIVES:
            counted(mx.distributed, name, f"collective {name}")
        for name in MESSAGES:
            counted(mx.distributed, name, f"message {name}")
        counted(mx, "eval", "sync mx.eval")
        counted(mx, "async_eval", "sync mx.async_eval")

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


def _short(text: str) -> str:
    """A wait's description without the rank and tick (``rank 0/2 (layers ...) in batch tick 12 ...``)."""
    if text.endswith("rows)"):  # TickRunner.run's wait for the tick's all-gather (the rest of the compute too)
        return "the tick's all-gather"
    words = [w for w in text.split() if not w[:1].isdigit() and "/" not in w and not w.startswith("(")]
    kept = [w for w in words if w not in ("rank", "layers", "of", "in", "batch", "tick", "rows)", "tick's")]
    return " ".join(kept[:6])


def steady(spec: dict[str, Any], model: Any, rank: int) -> dict[str, Any]:
    """Every R and decode_groups of ``spec``: the per-tick breakdown of steady batched decode (see the module)."""
    phases = Phases(model, bool(spec.get("sync")))
    vocab = spec["config"]["vocab_size"]
    runs: list[dict[str, Any]] = []
    for requests in spec["requests"]:
        prompts = [
            mx.random.randint(0, vocab, (spec["M"],), key=mx.random.key(100 + i)).tolist() for i in range(requests)
        ]
        for groups, compiled in [(g, c) for g in spec["groups"] for c in spec.get("compiled", [False])]:
            engine = pipemlx.BatchGenerator(
                model,
                max_tokens=-1,
                prefill_step_size=256,
                decode_groups=groups,
                timeout=300.0,
                logprobs=spec.get("logprobs", True),
                compiled_decode=compiled,
            )
            uids = engine.insert(prompts)  # pyright: ignore[reportArgumentType]
            while len(engine.active_uids) < len(uids):
                engine.next()
            for _ in range(spec["warmup"]):
                engine.next()
            phases.reset()
            decode = engine.compiled_decode
            compiled_before = 0 if decode is None else decode.steps
            tokens = 0
            start = time.perf_counter()
            phases.on = True
            for _ in range(spec["ticks"]):
                tokens += len(engine.next())
            phases.on = False
            seconds = time.perf_counter() - start
            splits, merges = engine.group_switches  # the whole run's, warm-up included
            costs = engine.group_costs()  # decode_groups="auto": measured seconds per token, per way and rows
            engine.remove(uids)
            engine.close()
            ticks = spec["ticks"]
            per_tick = {p: round(1000 * s / ticks, 2) for p, s in sorted(phases.seconds.items())}
            runs.append(
                {
                    "R": requests,
                    "groups": groups,
                    "compiled": compiled,
                    # timed ticks whose decode step ran compiled on this rank, and the traces made in the whole run
                    "compiled_steps": 0 if decode is None else decode.steps - compiled_before,
                    "traces": 0 if decode is None else decode.traces,
                    "ticks": ticks,
                    "tokens_per_tick": tokens / ticks,
                    "tick_ms": round(1000 * seconds / ticks, 2),
                    "per_tick_ms": per_tick,
                    "counts": {k: round(v / ticks, 2) for k, v in sorted(phases.counts.items())},
                    "python_ms": round(1000 * (seconds - sum(phases.seconds.values())) / ticks, 2),
                    "splits": splits,
                    "merges": merges,
                    "group_costs_ms": {k: round(1000 * v, 3) for k, v in costs.items()},
                }
            )
    return {"rank": rank, "runs": runs}


def compile_probe(config: dict[str, Any], layers: int, rows: int, context: int, steps: int) -> dict[str, float]:
    """What compiling this rank's decode forward could save: ms per step of ``layers`` decoder layers of
    ``config`` (random weights) over ``rows`` rows at ``context`` positions, eager over mlx-lm's ``KVCache`` (the
    graph built every step, the keys growing) and ``mx.compile``d over ``pipemlx.runtime.draft_step``'s
    ``FixedKVCache`` (room fixed, offset an array, positions past it masked: one trace), each the best of 3
    rounds of ``steps`` steps, evaluated every step. Every row at the same offset, as a batch of prompts of
    the same length (a batch of mlx-lm's ``BatchKVCache`` adds left padding, not more work)."""
    from mlx_lm.models.cache import KVCache

    from pipemlx.runtime.draft_step import FixedKVCache

    blocks = build_model({**config, "num_hidden_layers": layers}, seed=1).model.layers
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dims = config.get("head_dim") or config["hidden_size"] // heads
    start = mx.random.normal((rows, 1, config["hidden_size"]), key=mx.random.key(3))
    keys = [mx.random.normal((rows, kv_heads, context, dims), key=mx.random.key(10 + i)) for i in range(layers)]
    values = [mx.random.normal((rows, kv_heads, context, dims), key=mx.random.key(50 + i)) for i in range(layers)]

    first: dict[str, mx.array] = {}  # each forward's first step: they must agree, or the times mean nothing

    def eager() -> float:
        caches = [KVCache() for _ in blocks]
        for cache, k, v in zip(caches, keys, values):
            cache.update_and_fetch(k, v)
        mx.eval([c.state for c in caches])
        begin = time.perf_counter()
        for _ in range(steps):
            h = start
            for block, cache in zip(blocks, caches):
                h = block(h, None, cache)
            mx.eval(h)
            first.setdefault("eager", h)
        return (time.perf_counter() - begin) / steps

    fixed = [FixedKVCache() for _ in blocks]

    def forward(h: mx.array, offset: mx.array, *arrays: mx.array) -> list[mx.array]:
        for i, (block, cache) in enumerate(zip(blocks, fixed)):
            cache.keys, cache.values, cache.offset = arrays[2 * i], arrays[2 * i + 1], offset
            cache.room = arrays[2 * i].shape[2]
            h = block(h, cache.make_mask(1), cache)
        return [h, *(a for c in fixed for a in (c.keys, c.values) if a is not None)]

    compiled = mx.compile(forward)

    def traced() -> float:
        room = context + steps
        arrays: list[mx.array] = []
        for k, v in zip(keys, values):
            pad = mx.zeros((rows, kv_heads, room - context, dims), dtype=k.dtype)
            arrays += [mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)]
        offset = mx.array(context, dtype=mx.int32)
        mx.eval(arrays)
        begin = time.perf_counter()
        for _ in range(steps):
            h, *arrays = compiled(start, offset, *arrays)
            offset = offset + 1
            mx.eval(h, arrays)
            first.setdefault("compiled", h)
        return (time.perf_counter() - begin) / steps

    traced()  # the trace
    times = {
        "eager_ms": round(1000 * min(eager() for _ in range(3)), 2),
        "compiled_ms": round(1000 * min(traced() for _ in range(3)), 2),
    }
    want, got = first["eager"], first["compiled"]
    scale = max(1.0, float(mx.max(mx.abs(want)).item()))
    return {**times, "relative_difference": float(mx.max(mx.abs(want - got)).item()) / scale}


def arrival(spec: dict[str, Any], model: Any, rank: int) -> dict[str, Any]:
    """Where each rank's time goes in the ticks of an arrival (see the module)."""
    marks: list[tuple[str, float]] = []
    issue, wait_for = batch_tick.TickRunner._issue, batch_tick.wait_for  # pyright: ignore[reportPrivateUsage]

    def timed_issue(self: Any, arrays: Any, tick: int | None, what: str) -> None:
        start = time.perf_counter()
        issue(self, arrays, tick, what)
        marks.append((PHASES.get(what, "receive"), time.perf_counter() - start))

    def timed_wait(arrays: Any, timeout: float | None, describe: Any) -> None:
        start = time.perf_counter()
        wait_for(arrays, timeout, describe)
        marks.append(("all-gather", time.perf_counter() - start))

    batch_tick.TickRunner._issue = timed_issue  # pyright: ignore[reportPrivateUsage]
    batch_tick.wait_for = timed_wait
    vocab = spec["config"]["vocab_size"]
    prompts = [mx.random.randint(0, vocab, (spec["M"],), key=mx.random.key(100 + i)).tolist() for i in range(spec["R"])]
    long_prompt = mx.random.randint(0, vocab, (spec["arrival_tokens"],), key=mx.random.key(7)).tolist()
    engine = pipemlx.BatchGenerator(
        model,
        max_tokens=-1,
        prefill_step_size=256,
        prefill_chunk_tokens=spec["chunk"],
        prefill_chunking=spec["chunking"],
        timeout=120.0,
    )
    decoding = engine.insert(prompts)  # pyright: ignore[reportArgumentType]
    while len(engine.active_uids) < len(decoding):
        engine.next()
    for _ in range(10):
        engine.next()
    undisturbed: list[float] = []
    for _ in range(10):
        start = time.perf_counter()
        engine.next()
        undisturbed.append(time.perf_counter() - start)
    marks.clear()
    (uid,) = engine.insert([long_prompt], max_tokens=2)  # pyright: ignore[reportArgumentType]
    start = time.perf_counter()
    ticks = 0
    while True:
        ticks += 1
        if any(r.uid == uid for r in engine.next()):
            break
    ttft = time.perf_counter() - start
    engine.remove([*decoding, uid])
    totals: dict[str, float] = defaultdict(float)
    for phase, seconds in marks:
        totals[phase] += seconds
    return {
        "rank": rank,
        "ticks": ticks,
        "ttft": ttft,
        "undisturbed_ms": [round(1000 * s, 1) for s in undisturbed],
        "per_tick_ms": {phase: round(1000 * s / ticks, 1) for phase, s in totals.items()},
        "python_ms": round(1000 * (ttft - sum(totals.values())) / ticks, 1),
    }


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    group = init_group()
    rank = group.rank()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    model = pipemlx.shard_model(
        build_model(spec["config"], seed=0),
        group,
        lend="mlp" if spec.get("lend_mlp") else "none",
        head=spec.get("head", "auto"),
    )
    run = steady if spec.get("mode") == "steady" else arrival
    report = run(spec, model, rank)
    if spec.get("probe"):
        layers = len(stage_of(model).info.layers)
        context = spec["M"] + spec["warmup"] + spec["ticks"]
        sizes = sorted({n for r in spec["requests"] for n in (r, max(1, r // group.size()))})
        report["probe"] = {
            "layers": layers,
            "context": context,
            "rows": {str(n): compile_probe(spec["config"], layers, n, context, spec["probe"]) for n in sizes},
        }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
