"""Rank program: pipemlx.BatchGenerator (continuous batching) against solo single-device mlx-lm runs.

Spec: {"arch", "requests": [{"M", "max_tokens", "insert_at"}, ...], "remove": [{"index", "at"}, ...], "steps",
"step_size", "chunk" (prefill_chunk_tokens),
"kill": {"rank", "at"} | null, "timeout", "stop_at": [request, k] | null, "prefixes": {request: P},
"memory_budget": bytes, "follow_up": {"of", "M", "max_tokens"}, "chunking": "fixed" | "equal-cost",
"costs": [chunk_s, token_s, attention_s] | null}. Step s inserts every request with insert_at == s, removes request
`remove.index` before step `remove.at` (with `remove.resume`, asking for its caches back and inserting the
rest of its prompt and answer on them at once, to go on where it stopped), then calls next(). Reports each request's batched tokens, its solo
greedy tokens (mlx-lm generate_step on the whole model, one process), every step's active rows (and the
batch caches' rows, dead ones included) and the positions of each finished request's prompt_cache. With
"stop_at", the k-th solo token of that request is the generator's stop token. With
"prefixes", request i's first P tokens are prefilled (pipemlx.pipeline_prefill) into a cache of its own
before it is inserted, and only the rest of its prompt is inserted, with that cache. With
"kill", rank `kill.rank` calls os._exit(3) before step `kill.at`; the survivors report their error. With
"stall" ({"rank", "at", "seconds"}), that rank stays alive but silent for `seconds` before step `at`, then
exits with status 3. With "follow_up", when request `of` finishes ("length") its returned prompt_cache (the
whole conversation, as mlx-lm's) is inserted at once with M new tokens: the next turn of a conversation, compared with a
solo run of prompt + answer + new tokens. With "costs", the group's cost model is set to those layer costs
before the generator is made (instead of calibrating), so equal-cost chunk sizes are known in advance.
With "default_processors" (mlx-lm make_logits_processors keyword arguments), the generator's default logits
processors; with "processors" ({request: kwargs | null}), a request's own (null: none; a request not named
gets the default); the solo runs then use the same processors. "all_tokens": {request: n} gives that
request's processors its first n prompt tokens as `all_tokens`, with only the rest of the prompt inserted,
on a cache holding those n (as "prefixes" does). "generator": more keyword arguments of the generator
(prefill_batch_size, ...); "segments": {request: [cut, ...]} inserts that request with insert_segments, its
prompt cut at those positions. "always_guess" (with "generator": {"prompt_lookup": ...}): every greedy row
guesses its next tokens as zeros in every tick (they fail: each decode step feeds several positions a row), and
a failed run's report says whether its last tick carried guesses ("guessing"). "boundary_inserts": [[M, max_tokens], ...], after the steps, inserts each such
request alone and removes it at once (nothing is sent): the report's "boundary_inserts" says "queued" or the error. The report's "prefilling" is, per step, how many requests were started and not
yet decoding after it.

Or {"parity": true, "step_size", "chunk"}: mlx-lm's BatchGenerator API on a sharded model (run_parity).

Or {"engine": true, "arch"}: an engine's loop written once for mlx-lm's BatchGenerator, run on pipemlx's and on
mlx-lm's in each rank's process, then mlx-lm's batch_generate() on both (run_engine).

Or {"scenarios": {name: spec, ...}}: several such specs (none with "kill" or "stall") one after the other on
one group, each with its own sharded model and generator, reported as {"rank", "scenarios": {name: report}};
one launch instead of one per spec saves every rank's start-up. Solo runs are computed once per
(architecture, prompt, max_tokens, step) and shared by the scenarios that ask for the same one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import StopSequences, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.batch.speculate import StepCosts
from pipemlx.runtime.caches import cache_offset, trim_to
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.costmodel import CostModel, LayerCosts
from pipemlx.testing import build_model, tiny_config, write_tokenizer


def prompt_of(length: int) -> list[int]:
    return mx.random.randint(0, 256, (length,), key=mx.random.key(length)).tolist()  # pyright: ignore[reportReturnType]


def processors_of(kwargs: dict[str, Any] | None) -> list[Any] | None:
    """mlx-lm's logits processors from make_logits_processors keyword arguments (a logit_bias's keys as strings)."""
    if not kwargs:
        return None
    given = dict(kwargs)
    if "logit_bias" in given:
        given["logit_bias"] = {int(k): v for k, v in given["logit_bias"].items()}
    return make_logits_processors(**given)


def reused_cache(model: Any, prompt: list[int], length: int | None, step_size: int) -> list[Any] | None:
    """A cache holding the first ``length`` positions of ``prompt`` (None for no prefix)."""
    if not length:
        return None
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, mx.array(prompt[: length + 1]), cache, prefill_step_size=step_size)
    return cache


class Solo:
    """Greedy single-device mlx-lm runs (generate_step on the whole model), each computed once."""

    def __init__(self) -> None:
        self.references: dict[str, Any] = {}
        self.runs: dict[tuple[str, tuple[int, ...], int, int, str], list[int]] = {}

    def __call__(
        self, arch: str, prompt: list[int], max_tokens: int, step_size: int, processors: dict[str, Any] | None = None
    ) -> list[int]:
        key = (arch, tuple(prompt), max_tokens, step_size, json.dumps(processors, sort_keys=True))
        if key not in self.runs:
            if arch not in self.references:
                self.references[arch] = build_model(tiny_config(arch))
            steps = generate_step(
                mx.array(prompt),
                self.references[arch],
                prefill_step_size=step_size,
                max_tokens=max_tokens,
                logits_processors=processors_of(processors),
            )
            self.runs[key] = [int(t) for t, _ in steps]
        return self.runs[key]


def run(spec: dict[str, Any], group: Any, solo_run: Solo) -> dict[str, Any]:
    """One scenario; a report, or {"error", "message", "waited"} when the group failed (kill, stall)."""
    rank = group.rank()
    arch = spec.get("arch", "llama")
    # head="all" unless the scenario says: greedy ticks share the whole head (tests/test_vocab_split.py: split)
    model = pipemlx.shard_model(build_model(tiny_config(arch)), group, **{"head": "all", **spec.get("shard", {})})
    requests = spec["requests"]
    prompts = [prompt_of(r["M"]) for r in requests]
    default_processors: dict[str, Any] | None = spec.get("default_processors")
    own_processors: dict[str, Any] = spec.get("processors", {})
    wanted = [own_processors.get(str(i), default_processors) for i in range(len(requests))]
    solo = [solo_run(arch, p, r["max_tokens"], spec["step_size"], w) for p, r, w in zip(prompts, requests, wanted)]
    costs = spec.get("costs")
    if costs is not None:
        stage = stage_of(model)
        stage.cost_model = CostModel(
            LayerCosts(*costs), layers=stage.info.split, hidden_size=stage.info.hidden_size or 1
        )
    stop_at = spec.get("stop_at")  # [request, k] or [request, k, n]: its k-th solo token (ending n of them) stops
    stops: list[Any] = []
    if stop_at:
        request, k, n = (*stop_at, 1) if len(stop_at) == 2 else stop_at
        stops = [solo[request][k]] if n == 1 else [solo[request][k - n + 1 : k + 1]]
    engine = pipemlx.BatchGenerator(
        model,
        prefill_step_size=spec["step_size"],
        prefill_chunk_tokens=spec.get("chunk", 64),
        timeout=spec.get("timeout"),
        stop_tokens=stops,
        memory_budget=spec.get("memory_budget"),
        prefill_chunking=spec.get("chunking", "fixed"),
        logits_processors=processors_of(default_processors),
        **spec.get("generator", {}),
    )
    if spec.get("always_guess"):  # every decode step a pass with guesses (a rank killed mid-pass)
        engine._speculation.proposer = AlwaysGuess()  # pyright: ignore
    cuts: dict[str, list[int]] = spec.get("segments", {})
    seen_before: dict[str, int] = spec.get("all_tokens", {})
    prefixes: dict[str, int] = {**spec.get("prefixes", {}), **seen_before}
    uid_of: dict[int, int] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    finish: dict[int, str | None] = {}
    rows: list[int] = []
    handed_back: dict[int, int] = {}  # request -> positions of the prompt_cache its final response carried
    batch_rows: list[int] = []  # per step: the batch caches' rows after it, finished rows not yet filtered out included
    first: dict[int, int] = {}  # request -> the step of its first token
    partial: list[int] = []  # per step: queued requests partly prefilled after it
    prefilled: dict[int, list[int]] = {}  # request -> positions every rank had prefilled, after each step
    prefilling: list[int] = []  # per step: requests started and not yet decoding after it
    kill = spec.get("kill")
    follow = spec.get("follow_up")  # {"of": request, "M": new tokens, "max_tokens"}: a next turn on its cache
    follow_prompt = prompt_of(follow["M"]) if follow is not None else []
    kept: dict[str, int] = {}
    resumed: dict[int, dict[str, Any]] = {}  # request -> what remove(return_prompt_caches=True) handed back
    error: dict[str, Any] | None = None
    in_flight: dict[str, bool] = {}  # removed request -> its group's step was under way on some rank
    most_groups = 0  # the most decode groups in flight after a step (0: the serial batch throughout)
    for step in range(spec["steps"]):
        arriving = [i for i, r in enumerate(requests) if r["insert_at"] == step and str(i) not in cuts]
        segmented = [i for i, r in enumerate(requests) if r["insert_at"] == step and str(i) in cuts]
        if arriving:
            caches = [reused_cache(model, prompts[i], prefixes.get(str(i)), spec["step_size"]) for i in arriving]
            chosen = None
            if own_processors:
                chosen = [
                    processors_of(own_processors[str(i)]) if str(i) in own_processors else engine.logits_processors
                    for i in arriving
                ]
            uids = engine.insert(
                [prompts[i][prefixes.get(str(i), 0) :] for i in arriving],
                [requests[i]["max_tokens"] for i in arriving],
                caches=caches,
                logits_processors=chosen,
                all_tokens=[prompts[i][: seen_before[str(i)]] if str(i) in seen_before else None for i in arriving]
                if seen_before
                else None,
            )
            uid_of.update(zip(uids, arriving))
        for i in segmented:
            ends = [0, *cuts[str(i)], len(prompts[i])]
            (uid,) = engine.insert_segments(
                [[prompts[i][a:b] for a, b in zip(ends, ends[1:])]], [requests[i]["max_tokens"]]
            )
            uid_of[uid] = i
        for removal in spec["remove"]:
            if removal["at"] == step:
                index = removal["index"]
                resume = removal.get("resume", False)
                for uid in (u for u, i in uid_of.items() if i == index):  # its decode group's step under way?
                    place = engine._row_of(engine._requests[uid]) if uid in engine._requests else None  # pyright: ignore[reportPrivateUsage]
                    state = engine._group_state  # pyright: ignore[reportPrivateUsage]
                    in_flight[str(index)] = place is not None and state.position(place[0]) is not None
                handed = engine.remove([u for u, i in uid_of.items() if i == index], return_prompt_caches=resume)
                for cache, held in handed.values():
                    whole = prompts[index] + tokens[index]
                    resumed[index] = {
                        "positions": None if cache is None else cache_offset(cache),
                        "held": len(held),
                        "matches": whole[: len(held)] == held,
                        "generated": len(tokens[index]),
                    }
                    if cache is not None:  # go on from the handed-back cache: the rest equals the solo run
                        left = requests[index]["max_tokens"] - len(tokens[index])
                        rest = whole[len(held) :]
                        if not rest:  # it holds every token returned (as mlx-lm's): feed the last one again
                            assert trim_to(cache, len(held) - 1)
                            rest = whole[-1:]
                        (uid,) = engine.insert([rest], [left], caches=[cache])
                        uid_of[uid] = index
        if kill is not None and kill["rank"] == rank and kill["at"] == step:
            os._exit(3)
        stall = spec.get("stall")
        if stall is not None and stall["rank"] == rank and stall["at"] == step:
            time.sleep(stall["seconds"])
            os._exit(3)
        try:
            started = time.time()
            responses = engine.next()
        except pipemlx.PipelineError as exc:
            error = {"error": type(exc).__name__, "message": str(exc), "waited": time.time() - started}
            error["guessing"] = any(engine._guesses)  # pyright: ignore[reportPrivateUsage]
            break
        rows.append(len(responses))
        groups = engine._group_state  # pyright: ignore[reportPrivateUsage]
        most_groups = max(most_groups, 0 if groups.serial else len(groups.groups))
        batch_rows.append(sum(len(g) for g in engine._groups.values()))  # pyright: ignore[reportPrivateUsage]  # dead rows included
        partial.append(sum(1 for u in engine.queued_uids if engine.prefilled(u) > 0))
        prefilling.append(len(engine._plan.prefilling))  # pyright: ignore[reportPrivateUsage]
        for u in engine.queued_uids:
            prefilled.setdefault(uid_of[u], []).append(engine.prefilled(u))
        if engine.last_error is not None and "model_error" not in spec:
            raise engine.last_error
        for response in responses:
            first.setdefault(uid_of[response.uid], step)
            tokens[uid_of[response.uid]].append(response.token)
            if response.finish_reason is not None:
                finish[uid_of[response.uid]] = response.finish_reason
            if response.prompt_cache is not None:
                handed_back[uid_of[response.uid]] = cache_offset(response.prompt_cache)
            if follow is not None and uid_of[response.uid] == follow["of"] and response.finish_reason == "length":
                # The next turn: new tokens on the returned cache (it holds the whole answer, as mlx-lm's).
                assert response.prompt_cache is not None
                kept["positions"] = cache_offset(response.prompt_cache)
                (uid,) = engine.insert([follow_prompt], [follow["max_tokens"]], caches=[response.prompt_cache])
                uid_of[uid] = len(requests)
                tokens[len(requests)] = []
    if error is not None:
        return {"rank": rank, **error}
    too_big = None
    if engine.admission is not None:
        try:
            engine.insert([[1] * 4000])
        except ValueError as exc:
            too_big = str(exc)
    tried: list[str] = []  # "boundary_inserts": [[M, max_tokens], ...] each inserted alone: "queued" or the error
    for length, most in spec.get("boundary_inserts", []):
        try:
            engine.remove(engine.insert([prompt_of(length)], [most]))  # queued and dropped: nothing is sent
            tried.append("queued")
        except ValueError as exc:
            tried.append(str(exc))
    report = {
        "rank": rank,
        "admission": None if engine.admission is None else list(engine.admission.bytes_per_position),
        "too_big": too_big,
        "boundary_inserts": tried,
        "tokens": [tokens[i] for i in range(len(requests))],
        "solo": solo,
        "finish": [finish.get(i) for i in range(len(requests))],
        "rows": rows,
        "batch_rows": batch_rows,
        "handed_back": [handed_back.get(i) for i in range(len(requests) + (follow is not None))],
        "partial": partial,
        "prefilling": prefilling,
        "prefilled": {str(i): p for i, p in prefilled.items()},
        "left": len(engine),
        "shared_head_ticks": engine.shared_head_ticks,
        "most_groups": most_groups,
        "in_flight": in_flight,
        "group_switches": list(engine.group_switches),  # decode_groups="auto": splits, merges; and the ticks it timed
        "group_timings": {
            f"{'groups' if grouped else 'one'} {rows}": samples
            for (grouped, rows), samples in engine._timings.samples.items()  # pyright: ignore[reportPrivateUsage]
        },
        "first": [first.get(i) for i in range(len(requests))],
        "stops": stops,
        "resumed": {str(i): r for i, r in resumed.items()},
        "unprocessed": [
            solo_run(arch, p, r["max_tokens"], spec["step_size"]) if w else None
            for p, r, w in zip(prompts, requests, wanted)
        ],
    }
    if follow is not None:
        whole = prompts[follow["of"]] + tokens[follow["of"]] + follow_prompt
        report["follow_up"] = {
            "tokens": tokens.get(len(requests), []),
            "solo": solo_run(arch, whole, follow["max_tokens"], spec["step_size"]),
            "positions": kept.get("positions"),
            "finish": finish.get(len(requests)),
        }
    return report


def run_parity(spec: dict[str, Any], group: Any, solo_run: Solo) -> dict[str, Any]:
    """mlx-lm's BatchGenerator API: insert's argument order and per-request stop sequences, completion_batch_size,
    logprobs, all_tokens, extract_cache, next_generated, stats, prompt_cache_nbytes and close.

    Requests A, B, C, D (all inserted at once, at most 2 at a time): A overrides the generator's stop token with
    none, B stops at a token of its own (ids), C at a two-token sequence of its own (an mlx-lm StopSequences),
    D keeps the generator's. B's cache is extracted mid-decode (it goes on). Then E is inserted, prefilled one
    tick and closed; F, inserted after, runs alone.
    """
    step = spec["step_size"]
    model = pipemlx.shard_model(build_model(tiny_config("llama")), group)
    lengths, limits = [9, 17, 12, 5], [8, 10, 7, 6]
    prompts = [prompt_of(m) for m in lengths]
    solo = [solo_run("llama", p, n, step) for p, n in zip(prompts, limits)]
    default = [solo[0][2]]
    own: list[Any] = [[], [solo[1][4]], StopSequences([solo[2][2:4]]), None]
    engine = pipemlx.BatchGenerator(
        model, prefill_step_size=step, prefill_chunk_tokens=spec["chunk"], stop_tokens=default, completion_batch_size=2
    )
    last = group.rank() == group.size() - 1
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    finish: dict[int, str | None] = {}
    held_ok: dict[int, bool] = {}
    logprobs: list[list[float]] = []
    busy: list[int] = []  # per call: requests decoding or being prefilled
    extracted: dict[str, Any] = {}
    with engine.stats() as stats:
        uids = engine.insert(prompts, limits, None, None, None, None, own)  # mlx-lm's positional order
        index = {u: i for i, u in enumerate(uids)}
        calls = 0
        while len(engine):
            responses = engine.next_generated()
            calls += 1
            busy.append(len(engine.active_uids) + sum(1 for u in engine.queued_uids if engine.prefilled(u) > 0))
            for r in responses:
                i = index[r.uid]
                tokens[i].append(r.token)
                if i == 0 and len(logprobs) < 3:
                    logprobs.append([] if r.logprobs is None else r.logprobs.tolist())  # pyright: ignore[reportArgumentType]
                if r.finish_reason is not None:
                    finish[i] = r.finish_reason
                    held_ok[i] = r.all_tokens == prompts[i] + tokens[i]
            if len(tokens[1]) == 3 and not extracted:
                ((cache, held),) = engine.extract_cache([uids[1]]).values()
                extracted = {
                    "positions": None if cache is None else cache_offset(cache),
                    "held": held == prompts[1] + tokens[1],
                    "count": len(held),
                }
    solo_logprobs = [
        lp.tolist()
        for _, lp in generate_step(
            mx.array(prompts[0]), solo_run.references["llama"], prefill_step_size=step, max_tokens=3
        )
    ]
    late = [prompt_of(m) for m in (30, 11)]
    engine.insert([late[0]], [4])
    engine.next()
    holding = engine.prompt_cache_nbytes
    engine.close()
    after_close = (len(engine), engine.prompt_cache_nbytes)
    engine.insert([late[1]], [5])
    alone: list[int] = []
    while len(engine):
        alone += [r.token for r in engine.next()]
    return {
        "rank": group.rank(),
        "last": last,
        "tokens": [tokens[i] for i in range(4)],
        "solo": solo,
        "default": default,
        "own": [None if o is None else (o if isinstance(o, list) else solo[2][2:4]) for o in own],
        "finish": [finish.get(i) for i in range(4)],
        "held_ok": [held_ok.get(i) for i in range(4)],
        "busy": busy,
        "calls": calls,
        "logprobs_gap": max(
            (max(abs(a - b) for a, b in zip(mine, theirs)) for mine, theirs in zip(logprobs, solo_logprobs) if mine),
            default=None,
        ),
        "logprobs_given": [bool(lp) for lp in logprobs],
        "extracted": extracted,
        "stats": {
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "generation_steps": stats.generation_steps,
            "times": [stats.prompt_time, stats.decode_time, stats.wall_time],
        },
        "holding": holding,
        "after_close": list(after_close),
        "alone": alone,
        "alone_solo": solo_run("llama", late[1], 5, step),
    }


class Seen:
    """Records what one request's logits processor and sampler are called with (per call: a row's token history,
    its first logits or log-probabilities, the token drawn). The sampler takes the second likeliest token, so a
    request whose own sampler is ignored shows (greedy takes the likeliest)."""

    def __init__(self) -> None:
        self.histories: list[list[int]] = []
        self.logits: list[list[float]] = []
        self.draws: list[list[float]] = []

    def processor(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.histories.append([int(t) for t in tokens.tolist()])  # pyright: ignore[reportUnknownVariableType, reportGeneralTypeIssues]
        self.logits.append(logits[0, :4].astype(mx.float32).tolist())  # pyright: ignore[reportArgumentType]
        return logits

    def sampler(self, logprobs: mx.array) -> mx.array:
        drawn = mx.argsort(logprobs, axis=-1)[:, -2]
        for row, token in zip(logprobs.tolist(), drawn.tolist()):  # pyright: ignore[reportArgumentType, reportCallIssue]
            self.draws.append([*row[:4], float(token)])
        return drawn


class WordTokenizer:
    """What mlx-lm's batch_generate reads of a tokenizer: end-of-sequence ids and ``decode``."""

    def __init__(self, eos: list[int]) -> None:
        self.eos_token_ids = eos

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def word_tokenizer() -> Any:
    """mlx-lm's tokenizer wrapper over a word-level tokenizer of the tiny models' 256 ids (written to a temporary
    directory once per call)."""
    import tempfile

    from mlx_lm.utils import load_tokenizer  # pyright: ignore[reportUnknownVariableType]

    with tempfile.TemporaryDirectory() as root:
        write_tokenizer(root, 256)
        return load_tokenizer(Path(root))  # pyright: ignore[reportUnknownVariableType]


def run_engine(spec: dict[str, Any], group: Any, solo_run: Solo) -> dict[str, Any]:
    """An engine's code written once for mlx-lm, run on pipemlx's BatchGenerator (sharded) and on mlx-lm's (the
    whole model, this process): per-request samplers, processors and stop sequences, each call's responses, the
    logprobs, ``max_kv_size`` and the caches handed back; then mlx-lm's own ``batch_generate`` on both.

    Reports, per engine ("pipemlx", "mlx"): the tokens, reasons and logprobs of the sampled token per request, each
    request's processor and sampler inputs, the uids each next_generated() call returned, the handed-back caches'
    classes and offsets; and batch_generate's token ids, logprobs and cache offsets.
    """
    mlx_generate: Any = sys.modules["mlx_lm.generate"]  # (the package's ``generate`` is the function)

    config = tiny_config(spec.get("arch", "llama"))
    sharded = pipemlx.shard_model(build_model(config), group)
    whole = build_model(config)
    prompts = [prompt_of(m) for m in (9, 21, 14)]
    solo = solo_run(spec.get("arch", "llama"), prompts[2], 8, 8)
    stop = solo[1:3]  # request 2 (greedy) stops at its 3rd token, completing this two-token sequence

    def engine(make: Any, max_kv_size: int | None) -> dict[str, Any]:
        seen = [Seen() for _ in prompts]
        generator = make(max_tokens=7, max_kv_size=max_kv_size)
        uids = generator.insert(
            prompts,
            [6, 7, 8],
            samplers=[None, seen[1].sampler, None],
            logits_processors=[[s.processor] for s in seen],
            stop_sequences=[StopSequences([]), StopSequences([]), StopSequences([stop])],
        )
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        logprobs: dict[int, list[float]] = {u: [] for u in uids}
        finished: dict[int, Any] = {}
        handed: dict[int, Any] = {}
        calls: list[list[int]] = []
        most_groups = 0  # pipemlx's: the most decode groups in flight after a call
        while responses := generator.next_generated():
            calls.append(sorted(r.uid for r in responses))
            state = getattr(generator, "_group_state", None)
            most_groups = max(most_groups, 0 if state is None or state.serial else len(state.groups))
            for r in responses:
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs[r.token].item())
                if r.finish_reason is not None:
                    handed[r.uid] = (r.prompt_cache, r.all_tokens)
                    finished[r.uid] = [
                        r.finish_reason,
                        [type(c).__name__ for c in r.prompt_cache],
                        [int(c.offset) for c in r.prompt_cache],
                        len(r.all_tokens),
                        r.all_tokens == prompts[uids.index(r.uid)] + tokens[r.uid],
                    ]
        # The next turns, on the caches the finished responses handed back (all at once, as an engine would).
        turns = generator.insert(
            [[5, 6, 7], [8], [9, 10]],
            [5, 4, 5],
            caches=[handed[u][0] for u in uids],
            all_tokens=[handed[u][1] for u in uids],
            logits_processors=[[s.processor] for s in seen],
        )
        following: dict[int, list[Any]] = {u: [] for u in turns}
        while responses := generator.next_generated():
            for r in responses:
                following[r.uid].append([r.token, r.logprobs[r.token].item()])
        generator.close()
        compiled = getattr(generator, "compiled_decode", None)  # pipemlx's, compiled_decode=True
        return {
            "compiled": None if compiled is None else [compiled.steps, compiled.traces, len(compiled.shapes)],
            "tokens": [tokens[u] for u in uids],
            "logprobs": [logprobs[u] for u in uids],
            "finished": [finished[u] for u in uids],
            "following": [following[u] for u in turns],
            "calls": calls,
            "most_groups": most_groups,
            "histories": [s.histories for s in seen],
            "logits": [s.logits for s in seen],
            "draws": [s.draws for s in seen],
        }

    report: dict[str, Any] = {"rank": group.rank()}
    for size in (None, spec.get("max_kv_size", 32)):
        name = f"max_kv_size={size}"
        report[name] = {
            "pipemlx": engine(lambda **kw: pipemlx.BatchGenerator(sharded, prefill_step_size=8, **kw), size),
            "mlx": engine(lambda **kw: mlx_generate.BatchGenerator(whole, prefill_step_size=8, **kw), size),
        }
        if spec.get("decode_groups"):  # the same engine loop with decode groups in flight, against the same mlx-lm run
            grouped = lambda **kw: pipemlx.BatchGenerator(  # noqa: E731
                sharded, prefill_step_size=8, decode_groups=spec["decode_groups"], **kw
            )
            report[f"groups {name}"] = {"pipemlx": engine(grouped, size), "mlx": report[name]["mlx"]}
        # The same loop with each rank's layers' decode step compiled; with max_kv_size (rotating caches: every step
        # eager) in a group of one only, where it costs no launch's time.
        if spec.get("compiled_decode") and (size is None or group.size() == 1):
            compiled = lambda **kw: pipemlx.BatchGenerator(  # noqa: E731
                sharded, prefill_step_size=8, compiled_decode=True, **kw
            )
            report[f"compiled {name}"] = {"pipemlx": engine(compiled, size), "mlx": report[name]["mlx"]}
            if spec.get("decode_groups") and size is None:  # compiled with decode groups in flight too
                both = lambda **kw: pipemlx.BatchGenerator(  # noqa: E731
                    sharded, prefill_step_size=8, compiled_decode=True, decode_groups=spec["decode_groups"], **kw
                )
                report[f"compiled groups {name}"] = {"pipemlx": engine(both, size), "mlx": report[name]["mlx"]}
    tokenizer = WordTokenizer(stop[-1:])
    sampled = {"sampler": Seen().sampler}  # a sampler: every rank holds the logprobs it was given

    def batch(model: Any) -> dict[str, Any]:
        result = mlx_generate.batch_generate(
            model,
            tokenizer,
            prompts,
            max_tokens=[6, 7, 8],
            return_token_ids=True,
            return_logprobs=True,
            return_prompt_caches=True,
            max_kv_size=32,
            prefill_step_size=8,
            **sampled,
        )
        return {
            "texts": result.texts,
            "token_ids": result.token_ids,
            "logprobs": result.logprobs,
            "caches": [[int(c.offset) for c in cache] for cache in result.caches or []],
            "generation_tokens": result.stats.generation_tokens,
        }

    # A processor that raises on rank 0 only, at its 3rd call: the tick's decode fails on every rank alike ("error"
    # for every row it sampled, one tick later: told in the next tick's header), and the generator serves the next
    # request; once with one group, once more with decode groups in flight (each request its own group).
    def raising_run(groups: int) -> dict[str, Any]:
        calls = {"n": 0}

        def raising(tokens: mx.array, logits: mx.array) -> mx.array:
            calls["n"] += 1
            if group.rank() == 0 and calls["n"] == 3:
                raise ValueError("the processor raised on rank 0")
            return logits

        generator = pipemlx.BatchGenerator(sharded, prefill_step_size=8, decode_groups=groups)
        generator.insert(prompts[:2], [6, 6], logits_processors=[[raising], None])
        responses: list[list[Any]] = []
        # Every collective of these ticks (processors: the last rank's logits travel) is counted, per tick.
        all_gather, gathers = mx.distributed.all_gather, [0]

        def counted(*args: Any, **kwargs: Any) -> Any:
            gathers[-1] += 1
            return all_gather(*args, **kwargs)

        mx.distributed.all_gather = counted
        try:
            while True:
                answered = generator.next()
                gathers.append(0)
                if not answered and not generator.active_uids and not generator.queued_uids:
                    break
                responses += [[r.uid, r.token, r.finish_reason] for r in answered]
        finally:
            mx.distributed.all_gather = all_gather
        (uid,) = generator.insert([prompts[2]], [4])
        after = [r.token for _ in range(12) for r in generator.next() if r.uid == uid]
        return {
            "responses": responses,
            "after": after,
            "solo": solo_run(spec.get("arch", "llama"), prompts[2], 4, 8),
            "error": repr(generator.last_error),
            "gathers": [g for g in gathers if g],  # the ticks that ran
        }

    report["raising"] = raising_run(1)
    if spec.get("decode_groups"):
        report["raising groups"] = raising_run(spec["decode_groups"])

    def continued(step: Any, model: Any) -> dict[str, Any]:
        """generate_step four times on one prompt_cache (a conversation's turns, the third stopped by its consumer
        after 3 tokens): tokens, logprobs, the cache's positions after each turn, what the processor and sampler
        saw."""
        seen = Seen()
        cache = make_prompt_cache(model)
        turns: list[Any] = []
        for prompt, stop_after in ((prompts[1], None), ([5, 6, 7], None), ([11, 12], 3), ([13], None)):
            steps = step(
                mx.array(prompt),
                model,
                prompt_cache=cache,
                max_tokens=5,
                sampler=seen.sampler,
                logits_processors=[seen.processor],
            )
            got: list[Any] = []
            for t, lp in steps:  # a consumer that stops early (stream_generate at an end of sequence) too
                got.append([int(t), lp[int(t)].item()])
                if len(got) == stop_after:
                    break
            steps.close()
            turns.append(got)
            turns.append(int(cache[0].offset))
        return {"turns": turns, "histories": seen.histories, "draws": seen.draws}

    def outgrowing(make: Any) -> dict[str, Any]:
        """A lone request whose answer outgrows max_kv_size=16 (the batch caches rotate), sampled (the second
        likeliest token: logprobs on every rank); then two whose prompts alone outgrow it (40 and 23 tokens, the
        first prefilled past it in chunks of 8, mlx-lm's in its batch caches)."""
        generator = make(max_kv_size=16, sampler=Seen().sampler)
        (uid,) = generator.insert([prompt_of(12)], [20])
        got: list[Any] = []
        while responses := generator.next_generated():
            got += [[r.token, r.logprobs[r.token].item(), r.finish_reason] for r in responses if r.uid == uid]
        generator.close()
        generator = make(max_kv_size=16, sampler=Seen().sampler)
        uids = generator.insert([prompt_of(40), prompt_of(23)], [6, 5])
        long: dict[int, list[Any]] = {u: [] for u in uids}
        while responses := generator.next_generated():
            for r in responses:
                long[r.uid].append([r.token, r.logprobs[r.token].item()])
        generator.close()
        return {"got": got, "long": [long[u] for u in uids]}

    def bounded_step(step: Any, model: Any, length: int = 12, max_tokens: int = 20) -> list[Any]:
        """generate_step's tokens and logprobs, then the progress it reported (where its chunks ended)."""
        progress: list[int] = []
        steps = step(
            mx.array(prompt_of(length)),
            model,
            max_tokens=max_tokens,
            max_kv_size=16,
            sampler=Seen().sampler,
            prompt_progress_callback=lambda done, _: progress.append(done),
        )
        return [*([int(t), lp[int(t)].item()] for t, lp in steps), progress]

    def bounded_stream(stream: Any, model: Any) -> list[Any]:
        """stream_generate on a 30-token prompt with max_kv_size=16 (mlx-lm's default prefill_step_size)."""
        sampler = Seen().sampler
        responses = stream(model, word_tokenizer(), prompt_of(30), max_tokens=6, max_kv_size=16, sampler=sampler)
        return [[r.token, r.logprobs[r.token].item(), r.finish_reason] for r in responses]

    report["outgrow"] = {
        "pipemlx": outgrowing(lambda **kw: pipemlx.BatchGenerator(sharded, prefill_step_size=8, **kw)),
        "mlx": outgrowing(lambda **kw: mlx_generate.BatchGenerator(whole, prefill_step_size=8, **kw)),
        "pipemlx_step": bounded_step(pipemlx.generate_step, sharded),
        "mlx_step": bounded_step(generate_step, whole),
        # A prompt that rotates the caches keeping their first 4 positions while prefilled: mlx-lm's chunks decide
        # what each position attends to; "auto" takes them.
        "pipemlx_long_step": bounded_step(pipemlx.generate_step, sharded, 300, 6),
        "mlx_long_step": bounded_step(generate_step, whole, 300, 6),
        "pipemlx_stream": bounded_stream(pipemlx.stream_generate, sharded),
        "mlx_stream": bounded_stream(mlx_generate.stream_generate, whole),
    }
    report["generate_step"] = {
        "pipemlx": continued(pipemlx.generate_step, sharded),
        "mlx": continued(generate_step, whole),
    }
    report["batch_generate"] = {"mlx": batch(whole)}
    original = mlx_generate.BatchGenerator
    mlx_generate.BatchGenerator = pipemlx.BatchGenerator  # pyright: ignore[reportAttributeAccessIssue]
    try:
        report["batch_generate"]["pipemlx"] = batch(sharded)
    finally:
        mlx_generate.BatchGenerator = original
    return report


def keyed_sampler(seed: int, temperature: float = 0.8) -> Any:
    """A seeded sampler with a key of its own (as serve's batched requests have): one split per draw."""
    state = [mx.random.key(seed)]

    def sample(logprobs: mx.array) -> mx.array:
        pair = mx.random.split(state[0])
        state[0] = pair[0]
        return mx.random.categorical(logprobs * (1.0 / temperature), key=pair[1])

    return sample


class FixedCosts(StepCosts):
    """num_draft_tokens="auto"'s step costs, fixed: the counts it chooses then follow the rows' acceptance alone,
    the same in every run (the timings of a loaded test machine would choose differently from run to run)."""

    def observe(self, width: int, seconds: float) -> None:
        del width, seconds


class Oracle:
    """Guesses from the answers mlx-lm gave (a test's proposer, the same on every rank): mostly right, so that
    passes keep several guesses and a stop falls inside one; every third position's second guess is wrong."""

    def __init__(self, prompts: list[list[int]], answers: list[list[int]]) -> None:
        self.known = list(zip(prompts, answers))

    def propose(self, history: list[int], k: int, sampler: Any = None, greedy: int = 0) -> list[int]:
        for prompt, answer in self.known:
            if list(history[: len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                truth = list(answer[done : done + k])
                if len(history) % 3 == 0 and len(truth) > 1:
                    truth[1] = (truth[1] + 1) % 256
                return truth
        return []


class AlwaysGuess:
    """A proposer that guesses zeros for every row in every tick: each step with guesses feeds ``1 + k``
    positions a row (the guesses fail unless the model says 0)."""

    def propose(self, history: list[int], k: int, sampler: Any = None, greedy: int = 0) -> list[int]:
        return [0] * k


def half_draft(config: dict[str, Any]) -> Any:
    """A draft model for the batch's tests: the target's weights without its last layer, whose greedy guesses
    hold about half the time on the tiny llama (measured: 22 of 40 positions), so passes keep some guesses and
    reject others."""
    draft = build_model(config)
    draft.model.layers = draft.model.layers[:-1]
    return draft


def shared_guessing(
    sharded: Any,
    spec: dict[str, Any],
    prompts: list[list[int]],
    stops: list[list[list[int]]],
    unstopped: list[list[int]],
) -> dict[str, Any]:
    """Greedy requests without log-probabilities, guessing (the oracle's guesses) on a split head: every step
    with guesses gathers each rank's best logit of every position, never the whole logits. Reports each request's
    tokens, and the steps that shared the head with and without guesses."""
    limits = [16, 10, 14, 24]
    generator = pipemlx.BatchGenerator(
        sharded,
        prefill_step_size=8,
        prefill_chunk_tokens=8,
        logprobs=False,
        prompt_lookup=spec.get("lookup", 2),
        num_draft_tokens=spec.get("num_draft_tokens", 3),
    )
    generator._speculation.proposer = Oracle(prompts, unstopped)  # pyright: ignore
    uids = generator.insert(prompts, limits, stop_sequences=stops)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    for _ in range(200):
        if not len(generator):
            break
        for r in generator.next():
            tokens[r.uid].append(int(r.token))
    return {
        "tokens": [tokens[u] for u in uids],
        "shared_ticks": generator.shared_head_ticks,
        "shared_guess_ticks": generator._runner.shared_guess_ticks,  # pyright: ignore
        "guesses": list(generator.guesses),
    }


def run_speculative(spec: dict[str, Any], group: Any, solo_run: Solo) -> dict[str, Any]:
    """Prompt lookup in pipemlx's BatchGenerator against mlx-lm's one-process BatchGenerator without speculation.

    Requests: 0 greedy on a prompt repeating a passage (guesses); 1 greedy, ``draft`` False; 2 seeded sampled
    (its own key); 3 greedy, a stop token inside its answer (its 5th solo token), inserted at step 2; 4 greedy,
    removed (its caches handed back) once it returned 3 tokens. Prompts 0 and 4 hold what the model says after a
    passage, then the passage again, so that guesses hold. Reports per request the tokens and the
    logprobs of each token (``None`` where this rank holds none), mlx-lm's, the guesses proposed and confirmed,
    the widest step, and the handed-back cache's offset against the tokens it holds.
    """
    mlx_generate: Any = sys.modules["mlx_lm.generate"]
    arch = spec.get("arch", "llama")
    config = tiny_config(arch)
    sharded = pipemlx.shard_model(build_model(config), group, head=spec.get("head", "all"))
    whole = build_model(config)
    passage, other = prompt_of(11), prompt_of(9)
    echo = solo_run(arch, passage, 12, 8)  # what the model says after the passage: a later copy may say it again
    prompts = [passage + echo + passage, prompt_of(13), other * 2, passage * 2 + other[:3], other + echo + other]
    limits = [16, 10, 10, 14, 24]
    drafts = [True, False, True, True, True]

    def reference(stops: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        generator = mlx_generate.BatchGenerator(whole, prefill_step_size=8)
        uids = generator.insert(
            prompts,
            limits,
            samplers=[None, None, keyed_sampler(5), None, None],
            stop_sequences=[StopSequences(s) for s in stops],
        )
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        logprobs: dict[int, list[float]] = {u: [] for u in uids}
        while responses := generator.next_generated():
            for r in responses:
                tokens[r.uid].append(int(r.token))
                logprobs[r.uid].append(r.logprobs[r.token].item())
        generator.close()
        return [tokens[u] for u in uids], [logprobs[u] for u in uids]

    unstopped, _ = reference([[], [], [], [], []])
    # Request 0 stops at the sequence of its 4th to 6th tokens (the same token thrice: its 6th is a guess that holds,
    # in a pass that guessed further), request 3 at its 5th token.
    stops: list[list[list[int]]] = [[unstopped[0][3:6]], [], [], [[unstopped[3][4]]], []]
    want_tokens, want_logprobs = reference(stops)
    drafting = spec.get("draft", False)
    generator = pipemlx.BatchGenerator(
        sharded,
        prefill_step_size=8,
        prefill_chunk_tokens=8,
        prompt_lookup=None if drafting else spec.get("lookup", 2),
        draft_model=half_draft(config) if drafting else None,
        num_draft_tokens=spec.get("num_draft_tokens", 3),
        compiled_decode=spec.get("compiled_decode", False),
    )
    if spec.get("oracle"):  # guesses that mostly hold, from mlx-lm's answers without stops
        generator._speculation.proposer = Oracle(prompts, unstopped)  # pyright: ignore
    if spec.get("num_draft_tokens") == "auto":  # each position a tenth of a plain step, whatever this machine's
        costs = StepCosts.fixed({w: 1 + 0.1 * (w - 1) for w in range(2, 6)})
        generator._speculation.costs = FixedCosts(costs.plain, costs.plain_count, costs.ratios)  # pyright: ignore
    uids: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float | None]] = {}
    handed: list[Any] = []
    stopped_in_pass = 0  # finishing responses that came with earlier tokens of their request in the same tick
    step = 0
    while step == 0 or len(generator) or step <= 2:
        for i in [0, 1, 2, 4] if step == 0 else [3] if step == 2 else []:
            (uid,) = generator.insert(
                [prompts[i]],
                [limits[i]],
                samplers=[keyed_sampler(5) if i == 2 else None],
                stop_sequences=[stops[i]],
                draft=[drafts[i]],
            )
            uids[uid] = i
            tokens[i], logprobs[i] = [], []
        if 4 in tokens and len(tokens[4]) >= 3 and not handed:  # removed mid-run, its caches handed back
            removed = generator.remove([next(u for u, i in uids.items() if i == 4)], return_prompt_caches=True)
            for cache, held in removed.values():
                handed = [cache_offset(cache or []), held, list(tokens[4])]
        responses = generator.next()
        for r in responses:
            i = uids[r.uid]
            tokens[i].append(int(r.token))
            logprobs[i].append(None if r.logprobs is None else r.logprobs[r.token].item())
            if r.finish_reason == "stop" and sum(1 for o in responses if o.uid == r.uid) > 1:
                stopped_in_pass += 1
        step += 1
        if step > 200:
            raise RuntimeError("the generator never finished")
    proposed, confirmed = generator.guesses
    compiled = generator.compiled_decode
    admitted: list[int] = []  # a memory budget's bytes per position on this rank, without and with the draft
    if drafting:
        for draft in (None, half_draft(config)):
            budgeted = pipemlx.BatchGenerator(sharded, memory_budget="64MB", draft_model=draft)
            admitted.append(cast(Any, budgeted.admission).bytes_per_position[group.rank()])
            budgeted.close()
    shared: dict[str, Any] = {}
    if spec.get("head") == "split":  # greedy rows, no logprobs: steps with guesses share the split head
        picked = (0, 1, 3, 4)
        shared = shared_guessing(
            sharded, spec, [prompts[i] for i in picked], [stops[i] for i in picked], [unstopped[i] for i in picked]
        )
        shared["want"] = [want_tokens[i] for i in picked]
    return {
        "shared": shared,
        "rank": group.rank(),
        "compiled_steps": 0 if compiled is None else compiled.steps,
        "tokens": [tokens[i] for i in range(len(prompts))],
        "logprobs": [logprobs[i] for i in range(len(prompts))],
        "want_tokens": want_tokens,
        "want_logprobs": want_logprobs,
        "proposed": proposed,
        "confirmed": confirmed,
        "chosen": sorted(generator._speculation.chosen.items()),  # pyright: ignore
        "drafts_left": len(generator._speculation.drafts or ()),  # pyright: ignore
        "admitted": admitted,
        "ticks": step,
        "handed": handed,
        "removed_prompt": prompts[4],
        "stopped_in_pass": stopped_in_pass,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    solo_run = Solo()
    if "scenarios" in spec:
        reports: dict[str, dict[str, Any]] = {}
        for name, scenario in spec["scenarios"].items():
            runner = (
                run_parity
                if scenario.get("parity")
                else run_engine
                if scenario.get("engine")
                else run_speculative
                if scenario.get("speculate")
                else run
            )
            reports[name] = runner(scenario, group, solo_run)
            mx.synchronize()
            mx.eval(mx.distributed.all_sum(mx.array(1), group=group))  # every rank done before the next
        failed = {name: r for name, r in reports.items() if "error" in r}
        if failed:
            raise RuntimeError(f"scenarios failed: {failed}")
        print(json.dumps({"rank": group.rank(), "scenarios": reports}), flush=True)
        return
    report = run(spec, group, solo_run)
    print(json.dumps(report), flush=True)
    if "error" in report:
        os._exit(0)  # a communication may still be blocked inside MLX: leave without its teardown


if __name__ == "__main__":
    main()
