"""Rank program: a pipemlx.BatchGenerator driven one command at a time over stdin (tests/live_group.py).

Spec: {"timeout", "step" (prefill_step_size, and the solo runs' prefill step), "chunk" (prefill_chunk_tokens)}.
Commands, one JSON line each; every answer is one JSON line:
  {"op": "insert", "M", "seed", "max_tokens"}  -> {"uid", "solo"}: the solo greedy tokens of that prompt
                                                  (mlx-lm generate_step on the whole model, one process)
  {"op": "step"}                               -> {"responses": [[uid, token, finish_reason], ...],
                                                   "active", "queued", "prefilled": {uid: positions}}
  {"op": "remove", "uids"}                     -> {"left"}
  {"op": "reset"}                              -> {"left": 0}: every request removed
  {"op": "arm", "rank", "what": "decode" | "chunk"} -> {}: on that rank, the last local layer raises
                                                  on its next decode (one position) or chunk pass
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model, tiny_config


class InjectedModelError(RuntimeError):
    pass


def prompt_of(length: int, seed: int) -> list[int]:
    return mx.random.randint(0, 256, (length,), key=mx.random.key(seed * 1000 + length)).tolist()  # pyright: ignore[reportReturnType]


def arm_faults(model: Any, rank: int) -> dict[str, str | None]:
    """Wrap the last local layer: it raises once on the armed kind of pass."""
    armed: dict[str, str | None] = {"what": None}
    layer = model.layers[-1]
    original = type(layer).__call__

    def call(this: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        kind = "decode" if x.shape[1] == 1 else "chunk"
        if armed["what"] == kind:
            armed["what"] = None
            raise InjectedModelError(f"injected {kind} error on rank {rank}")
        return original(this, x, *args, **kwargs)

    layer.__class__ = type(type(layer).__name__, (type(layer),), {"__call__": call})
    return armed


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    rank = group.rank()
    config = tiny_config("llama")
    model = pipemlx.shard_model(build_model(config), group)
    reference = build_model(config)
    armed = arm_faults(model, rank)
    engine = pipemlx.BatchGenerator(
        model, prefill_step_size=spec["step"], prefill_chunk_tokens=spec["chunk"], timeout=spec["timeout"]
    )
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        answer: dict[str, Any] = {"rank": rank}
        if op == "insert":
            prompt = prompt_of(command["M"], command["seed"])
            limit = command["max_tokens"]
            solo = generate_step(mx.array(prompt), reference, prefill_step_size=spec["step"], max_tokens=limit)
            (uid,) = engine.insert([prompt], max_tokens=limit)
            answer |= {"uid": uid, "solo": [int(t) for t, _ in solo]}
        elif op == "step":
            responses = engine.next()
            answer |= {
                "responses": [[r.uid, r.token, r.finish_reason] for r in responses],
                "active": engine.active_uids,
                "queued": engine.queued_uids,
                "prefilled": {str(u): engine.prefilled(u) for u in engine.queued_uids},
                "error": None if engine.last_error is None else str(engine.last_error),
            }
        elif op in ("remove", "reset"):
            engine.remove(command["uids"] if op == "remove" else [*engine.active_uids, *engine.queued_uids])
            answer |= {"left": len(engine)}
        elif op == "arm":
            if command["rank"] == rank:
                armed["what"] = command["what"]
        else:
            raise ValueError(f"unknown command {command}")
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
