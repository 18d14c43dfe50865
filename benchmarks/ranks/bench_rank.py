"""Benchmark rank program: time prefill (and decode) for one mode.

Spec: {"mode": "single" | "native" | "pipemlx", "M", "step", "repeats", "decode_tokens", "pin", "config",
       "agree_every"?, "warmup"? (default true: one untimed run first; pipemlx "auto" calibrates in it),
       "lend_mlp"?, "lend_heads"? (pipemlx: shard_model(lend="mlp" or lend=K or "auto"; whole layers without them)}
  single   one process holding all layers, mlx-lm generate_step's own chunked prefill
  native   mlx-lm's own pipeline (model.model.pipeline(group)), generate_step's prefill (prefill only)
  pipemlx  pipemlx.shard_model + pipeline_prefill, then pipemlx.generate_step(prompt[-1:]) to decode
Prefill time and decode tokens/s are pipemlx.observe.metrics' (prefill: from the call until the cache holds
the M-1 prompt positions, i.e. the progress callback reports (M-1, M), the same point for every mode).
Prints one JSON line: per-repeat prefill seconds, decode tokens/s, and the prefill's bytes sent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.observe.metrics import PrefillClock, decode_tokens_per_s
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.autostep import choose_chunks
from pipemlx.testing import build_model


def tcp_bytes_sent() -> int:
    """Bytes this process has sent over TCP so far (``ss -tinp``: bytes_sent of its sockets)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if "users:(" in line:
            mine = f"pid={os.getpid()}," in line
        match = re.search(r"bytes_sent:(\d+)", line)
        if mine and match:
            total += int(match.group(1))
    return total


def pin(rank: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def time_generate_step(model: Any, prompt: mx.array, step: int, decode_tokens: int) -> tuple[float, float]:
    """Prefill seconds (until the (M-1, M) report) and decode tokens/s of mlx-lm's generate_step.

    Prefill alone (``decode_tokens=0``) runs it with ``max_tokens=0``: it then evaluates the first token
    and issues nothing more, so no step is left in flight when it returns (with mlx-lm's native pipeline,
    a step in flight holds collectives the next run's would interleave with).
    """
    clock = PrefillClock(time.perf_counter())
    tokens = 0
    decode_start = decode_end = 0.0
    max_tokens = decode_tokens + 1 if decode_tokens else 0
    for _ in generate_step(
        prompt, model, prefill_step_size=step, max_tokens=max_tokens, prompt_progress_callback=clock
    ):
        tokens += 1
        decode_end = time.perf_counter()
        if tokens == 1:
            decode_start = decode_end
    return clock.seconds, decode_tokens_per_s(tokens, decode_end - decode_start)


STEPS_USED: list[int] = []


def time_pipemlx(
    model: Any,
    prompt: mx.array,
    step: Any,
    decode_tokens: int,
    trace_dir: str | None,
    agree_every: int | None,
    head_on_last: bool = False,
) -> tuple[float, float, float]:
    """Prefill seconds, decode tokens/s (pipemlx.generate_step), and TCP bytes this rank sent per decode pass.

    ``head_on_last``: decode with an argmax sampler (the same tokens), which keeps the output head on the last
    rank instead of sharing it among the ranks (what greedy decoding without a sampler does).
    """
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    used = pipemlx.pipeline_prefill(
        model, prompt, cache, prefill_step_size=step, trace_dir=trace_dir, agree_every=agree_every
    )
    prefill_s = time.perf_counter() - start
    STEPS_USED.append(used)
    rate, per_token = 0.0, 0.0
    if decode_tokens:
        sent_before = tcp_bytes_sent()
        tokens = 0
        decode_start = decode_end = 0.0
        sampler = (lambda logprobs: mx.argmax(logprobs, axis=-1)) if head_on_last else None
        for _ in pipemlx.generate_step(
            prompt[-1:], model, prompt_cache=cache, max_tokens=decode_tokens + 1, sampler=sampler
        ):
            tokens += 1
            decode_end = time.perf_counter()
            if tokens == 1:
                decode_start = decode_end
        rate = decode_tokens_per_s(tokens, decode_end - decode_start)
        # decode_tokens + 2 forward passes: the prompt's last token, one per yielded token after the first,
        # and the pass of the last token (mlx-lm runs it too); nothing is left in flight.
        per_token = (tcp_bytes_sent() - sent_before) / (decode_tokens + 2)
    return prefill_s, rate, per_token


def auto_chunks(model: Any, spec: dict[str, Any]) -> list[int]:
    """The cut ``prefill_step_size="auto"`` took for this prompt (the same pure choice pipeline_prefill makes)."""
    if spec["mode"] != "pipemlx" or spec["step"] != "auto":
        return []
    return list(choose_chunks(spec["M"], stage_of(model).cost_model))


def main() -> None:
    spec = json.loads(sys.argv[1])
    mode = spec["mode"]
    group = init_group() if mode != "single" else None
    rank = group.rank() if group is not None else 0
    if spec.get("pin", True):
        pin(rank)
    model = build_model(spec["config"], seed=0)
    if mode == "native":
        if spec["decode_tokens"]:  # its generate_step leaves a step with collectives in flight after decoding
            raise SystemExit("native mode times prefill only (decode_tokens must be 0)")
        model.model.pipeline(group)
        mx.eval(model.parameters())
    elif mode == "pipemlx":
        assert group is not None
        heads = spec.get("lend_heads", 0)
        lend: Any = (heads or "mlp") if spec.get("lend_mlp") else "none"  # whole layers unless asked
        pipemlx.shard_model(model, group, timeout=600, lend=lend, context=spec["M"])  # lend="auto": for this prompt
    prompt = mx.random.randint(0, spec["config"]["vocab_size"], (spec["M"],), key=mx.random.key(1)).astype(mx.int32)
    prefill: list[float] = []
    decode: list[float] = []
    sent: list[float] = []
    warmup = 1 if spec.get("warmup", True) else 0
    if mode == "pipemlx" and spec["step"] == "auto" and not warmup:  # calibrate outside the timed runs
        pipemlx.pipeline_prefill(model, prompt[:64], make_prompt_cache(model), prefill_step_size="auto")
    for i in range(spec["repeats"] + warmup):  # the first run warms up
        if mode == "pipemlx":  # its handshake lines the ranks up; nothing to synchronize by hand
            trace = spec.get("trace_dir") if i == spec["repeats"] + warmup - 1 else None
            p, d, b = time_pipemlx(
                model,
                prompt,
                spec["step"],
                spec["decode_tokens"],
                trace,
                spec.get("agree_every"),
                spec.get("head_on_last", False),
            )
        else:
            p, d = time_generate_step(model, prompt, spec["step"], spec["decode_tokens"])
            b = 0.0
        if i >= warmup:
            prefill.append(p)
            decode.append(d)
            sent.append(b)
    print(
        json.dumps(
            {
                "rank": rank,
                "mode": mode,
                "lent_heads": stage_of(model).info.lending.heads if mode == "pipemlx" else 0,
                "prefill_s": prefill,
                "decode_tok_s": decode,
                "decode_bytes_per_token": sent,
                "steps": STEPS_USED,
                "chunks": auto_chunks(model, spec),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
