"""Benchmark rank program: where each rank's time goes in a pass of speculative decoding, on the demo model.

Spec: {"draft": folder, "prompt": text, "tokens", "repeats", "lookup", "pin" (default true: rank r on the r-th
allowed core), "sync" (see :func:`instrument`)}. Runs pipemlx.generate_step greedily on the sharded demo model: plain decode, a serial pass with
the draft (k=2 and k=3), a pipelined pass with the draft (k=3, the whole head on the last rank) and prompt lookup
in serial passes (k=3); a warm-up run of each, then ``repeats`` runs round-robin. Nothing in pipemlx changes: the
runtime's functions are wrapped from here (as ranks/decode_phases_rank.py does) and each wrapped call's own time,
less that of the wrapped calls inside it, goes to its phase: the proposer's ``propose`` (the draft's or prompt
lookup's guesses), ``DecodeRun._build`` and ``DecodeRun._compute_pass`` (building the graph), ``SendQueue.flush``
(issuing a pipelined pass's send, ``mx.async_eval``), each ``wait_for`` of pipemlx.runtime.decode named by what
it waits for, the split head's ``VocabShard.logits`` / ``embed`` and ``shared_head``, the message row
(``gather``), ``trim_to`` (cutting the caches back) and the rest of ``DecodeRun._step`` / ``_tick`` (Python);
"between passes" is the rest of the run (yielding each token, the generator's bookkeeping). Prints one JSON line:
{"rank", contender: {"ms": {phase: total}, "passes", "tokens", "seconds", "proposed", "confirmed"}}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx_lm

import pipemlx
from pipemlx.demo import MODEL_DIR
from pipemlx.launch import init_group
from pipemlx.runtime import decode as decode_module
from pipemlx.runtime import sampling as sampling_module
from pipemlx.runtime import send_queue as send_queue_module
from pipemlx.runtime import speculative as speculative_module
from pipemlx.runtime import stage as stage_module

# What a decode wait waits for, from its description (the first marker found names it; order matters).
WAITS = (
    ("receiving pipelined", "wait: hidden states from the previous rank"),
    ("computing tick", "wait: own layers (last rank: and verify)"),
    ("computing token", "wait: own part (recv + layers + send; last: verify)"),
    ("sending on", "wait: the send to the next rank"),
    ("output head", "wait: shared head (all-gather)"),
    ("logits", "wait: split head's logits (all-gather)"),
    ("embedding token", "wait: split head's embedding (all-gather)"),
    (" in decode step", "wait: agreement (the pass's all-gather)"),
    (" in pipelined tick", "wait: agreement (the pass's all-gather)"),
)
PYTHON = "python (rest of the pass)"
AHEAD = "python (proposing ahead)"
AFTER = "python (proposing after the verification)"


class Profile:
    """Exclusive time per phase: each wrapped call's own time, less the wrapped calls inside it (one thread)."""

    def __init__(self) -> None:
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []  # [label, start of its current own segment]
        self.on = False
        self.passes = 0

    def enter(self, label: str) -> None:
        now = time.perf_counter()
        if self.stack:
            self.totals[self.stack[-1][0]] += now - self.stack[-1][1]
        self.stack.append([label, now])

    def leave(self) -> None:
        now = time.perf_counter()
        label, start = self.stack.pop()
        self.totals[label] += now - start
        if self.stack:
            self.stack[-1][1] = now

    def wrap(self, function: Callable[..., Any], label: Callable[..., str] | str, counts: bool = False) -> Any:
        """``function`` timed under ``label`` (or ``label(*args)``) while ``on``; ``counts``: one pass a call."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return function(*args, **kwargs)
            self.passes += counts
            self.enter(label if isinstance(label, str) else label(*args, **kwargs))
            try:
                return function(*args, **kwargs)
            finally:
                self.leave()

        return timed


def wait_label(arrays: Any, timeout: Any, describe: Callable[[], str]) -> str:
    what = describe()
    return next((name for marker, name in WAITS if marker in what), "wait: " + what)


def instrument(profile: Profile, sync: bool) -> None:
    """Wrap the runtime's functions (module and class attributes) so that ``profile`` times them. ``sync``: each
    receive of the previous rank's hidden states is evaluated as soon as it is built, apart, so that a serial pass's
    wait for its own part holds its layers (and send) only; this changes the schedule (the last rank's draft
    proposes its guesses made ahead only after the receive)."""
    if sync:
        receive = stage_module.PipelineStage.receive

        def received(self: Any, like: mx.array) -> mx.array:
            array = receive(self, like)
            if profile.on:
                profile.enter("wait: hidden states from the previous rank")
                try:
                    mx.eval(array)  # pyright: ignore[reportUnknownMemberType]
                finally:
                    profile.leave()
            return array

        stage_module.PipelineStage.receive = received  # pyright: ignore[reportAttributeAccessIssue]
    run = decode_module.DecodeRun
    wrapped = profile.wrap(decode_module.wait_for, wait_label)
    decode_module.wait_for = wrapped  # pyright: ignore[reportAttributeAccessIssue]
    sampling_module.wait_for = wrapped  # pyright: ignore[reportAttributeAccessIssue]
    run._step = profile.wrap(run._step, PYTHON, counts=True)  # pyright: ignore[reportPrivateUsage]
    run._tick = profile.wrap(run._tick, PYTHON, counts=True)  # pyright: ignore[reportPrivateUsage]
    run._build = profile.wrap(run._build, "building the graph")  # pyright: ignore[reportPrivateUsage]
    run._compute_pass = profile.wrap(run._compute_pass, "building the graph")  # pyright: ignore[reportPrivateUsage]
    decode_module.trim_to = profile.wrap(decode_module.trim_to, "cutting the caches back")  # pyright: ignore[reportAttributeAccessIssue]
    decode_module.gather = profile.wrap(decode_module.gather, "the pass's message row")  # pyright: ignore[reportAttributeAccessIssue]
    decode_module.shared_head = profile.wrap(decode_module.shared_head, "shared head")  # pyright: ignore[reportAttributeAccessIssue]
    shard = sampling_module.VocabShard
    shard.logits = profile.wrap(shard.logits, "split head (logits)")  # pyright: ignore[reportAttributeAccessIssue]
    shard.embed = profile.wrap(shard.embed, "split head (embedding)")  # pyright: ignore[reportAttributeAccessIssue]
    queue = send_queue_module.SendQueue
    queue.flush = profile.wrap(queue.flush, "issuing the send (async_eval)")  # pyright: ignore[reportAttributeAccessIssue]
    # Which proposals: a serial pass's last rank proposes ahead (while the ranks before it compute) and, when
    # those guesses turn out wrong, again after its verification; a pipelined pass's rank 0 before its layers.
    speculation = decode_module.Speculation
    speculation.ahead = profile.wrap(speculation.ahead, AHEAD)  # pyright: ignore[reportAttributeAccessIssue]
    speculation.following = profile.wrap(speculation.following, AFTER)  # pyright: ignore[reportAttributeAccessIssue]
    draft, lookup = speculative_module.DraftModel, speculative_module.PromptLookup
    draft.propose = profile.wrap(draft.propose, lambda *_, **__: proposals(profile, "the draft"))  # pyright: ignore[reportAttributeAccessIssue]
    lookup.propose = profile.wrap(lookup.propose, lambda *_, **__: proposals(profile, "prompt lookup"))  # pyright: ignore[reportAttributeAccessIssue]


def proposals(profile: Profile, proposer: str) -> str:
    """The label of a proposer's call: which proposals, from the wrapped call it is made in."""
    within = profile.stack[-1][0] if profile.stack else ""
    when = {AHEAD: "ahead", AFTER: "after the verification"}.get(within, "before the pass")
    return f"{proposer}'s proposals ({when})"


def pin(rank: int) -> None:
    """This process on one core (rank ``r``: the ``r``-th allowed), as benchmarks/ranks/speculative_rank.py."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    profile = Profile()
    instrument(profile, bool(spec.get("sync")))
    group = init_group()
    rank = group.rank()
    if spec.get("pin", True):
        pin(rank)
    count, lookup = spec["tokens"], spec["lookup"]
    draft = mlx_lm.load(spec["draft"])[0]
    model, tokenizer = pipemlx.load_sharded(MODEL_DIR, group)  # the default head ("auto": split here)
    whole, _ = pipemlx.load_sharded(MODEL_DIR, group, head="all")  # pipelined passes need the whole head
    contenders: dict[str, Callable[[mx.array], Any]] = {
        "plain": lambda p: pipemlx.generate_step(p, model, max_tokens=count),
        "draft serial k=2": lambda p: pipemlx.generate_step(
            p, model, max_tokens=count, draft_model=draft, num_draft_tokens=2, speculation="serial"
        ),
        "draft serial k=3": lambda p: pipemlx.generate_step(
            p, model, max_tokens=count, draft_model=draft, num_draft_tokens=3, speculation="serial"
        ),
        "draft pipelined k=3": lambda p: pipemlx.generate_step(
            p, whole, max_tokens=count, draft_model=draft, num_draft_tokens=3, speculation="pipelined"
        ),
        "lookup serial k=3": lambda p: pipemlx.generate_step(
            p, model, max_tokens=count, prompt_lookup=lookup, num_draft_tokens=3, speculation="serial"
        ),
    }
    prompt = mx.array(tokenizer.encode(spec["prompt"]), dtype=mx.int32)
    report: dict[str, Any] = {"rank": rank}
    ms: dict[str, defaultdict[str, float]] = {label: defaultdict(float) for label in contenders}
    counts: dict[str, dict[str, float]] = {label: defaultdict(float) for label in contenders}
    for repeat in range(spec["repeats"] + 1):  # the first round warms up
        for label, start in contenders.items():
            stream = start(prompt)
            first = next(stream)  # the prompt's prefill and first token: not a pass of decoding
            del first
            profile.totals.clear()
            profile.passes = 0
            profile.on = repeat > 0
            began = time.perf_counter()
            tokens = 1 + sum(1 for _ in stream)
            seconds = time.perf_counter() - began
            profile.on = False
            if repeat == 0:
                continue
            for phase, value in profile.totals.items():
                ms[label][phase] += value * 1e3
            ms[label]["between passes"] += (seconds - sum(profile.totals.values())) * 1e3
            row = counts[label]
            row["passes"] += profile.passes
            row["tokens"] += tokens - 1
            row["seconds"] += seconds
            guesses: tuple[int, int] = getattr(stream, "guesses", None) or (0, 0)
            row["proposed"] += guesses[0]
            row["confirmed"] += guesses[1]
    for label in contenders:
        report[label] = {"ms": ms[label], **counts[label]}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
