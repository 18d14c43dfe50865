"""Rank program: a pipemlx.BatchGenerator driven one command at a time over stdin (tests/live_group.py).

Spec: {"timeout", "step" (prefill_step_size, and the solo runs' prefill step), "chunk" (prefill_chunk_tokens)}.
Commands, one JSON line each; every answer is one JSON line:
  {"op": "insert", "M", "seed", "max_tokens"}  -> {"uid", "solo"}: one prompt (as "requests" with one entry)
  {"op": "insert", "requests": [{"M", "seed", "max_tokens", "stop_at"?, "processor"?, "after"?}, ...]}
      -> {"uids", "solo": [[...], ...], "finish": [...], "held": [...]} or {"error"}: several prompts in one insert.
      Each request's solo run is single-process mlx-lm's greedy generate_step on the whole model, with the same
      logits processors ("processor": "penalty" = repetition penalty 1.5, "bias" = a logit bias), of its whole
      history: with "after": U, the tokens the cache handed back for request U holds, then the new prompt
      (inserted with that cache and all_tokens). "stop_at": k: the request stops at the token its solo run
      generates k-th (a stop sequence of that one token): its solo run is cut after the first such token
      (finish "stop"). "M": 0 is an empty prompt (a bad request: every rank raises ValueError, nothing changes).
  {"op": "step"}                               -> {"responses": [[uid, token, finish_reason], ...],
                                                   "active", "queued", "prefilled": {uid: positions},
                                                   "armed": this rank's fault still pending, "handed": {uid: n}}
                                                  (a finished request's cache is kept for "after"; n: the
                                                  positions it holds)
  {"op": "remove", "uids", "return_caches"?}   -> {"left", "returned": {uid: positions or None}}
  {"op": "reset", "budget_positions"?, "decode_groups"?} -> {"left": 0, "bytes_per_position", "budget"}: faults disarmed
                                                  first, every request removed, handed caches dropped, then a new
                                                  generator (a collective), every time: memory_budget = this many
                                                  cached positions of this rank's layers (None: no budget), and
                                                  decode_groups as given (default 1). Nothing
                                                  of what came before is left (uids start at 0 again): what follows
                                                  depends only on the commands sent after it.
  {"op": "status"}                             -> {"len", "active", "queued"}
  {"op": "arm", "rank", "what": "decode" | "chunk"} -> {}: on that rank, the last local layer raises
                                                  on its next decode (one position) or chunk pass
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.batch.memory import cache_bytes_per_position
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


class InjectedModelError(RuntimeError):
    pass


def prompt_of(length: int, seed: int) -> list[int]:
    return mx.random.randint(0, 256, (length,), key=mx.random.key(seed * 1000 + length)).tolist()  # pyright: ignore[reportReturnType]


def processors_of(name: str | None) -> list[Any] | None:
    if name is None:
        return None
    if name == "penalty":
        return make_logits_processors(repetition_penalty=1.5, repetition_context_size=8)
    return make_logits_processors(logit_bias={7: 4.0, 99: 3.0})


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


class Server:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.group = init_group()
        self.rank = self.group.rank()
        config = tiny_config("llama")
        self.model = pipemlx.shard_model(build_model(config), self.group)
        self.reference = build_model(config)
        self.armed = arm_faults(self.model, self.rank)
        self.draft = build_model(config)  # the speculating runs' draft: the model less its last layer (about half
        self.draft.model.layers = self.draft.model.layers[:-1]  # its greedy guesses hold)
        self.engine = self.new_engine(None)
        self.handed: dict[int, tuple[list[Any], list[int]]] = {}  # uid -> (cache, the tokens it holds)

    def new_engine(self, budget: int | None, groups: int = 1, guessing: str | None = None) -> pipemlx.BatchGenerator:
        """A new generator; ``guessing``: ``"lookup"`` (prompt lookup, 2 guesses a step) or ``"draft"`` (the draft
        model, 3 guesses a step), else none."""
        spec = self.spec
        speculation: dict[str, Any] = {}
        if guessing == "lookup":
            speculation = {"prompt_lookup": 2, "num_draft_tokens": 2}
        elif guessing == "draft":
            speculation = {"draft_model": self.draft, "num_draft_tokens": 3}
        return pipemlx.BatchGenerator(
            self.model,
            prefill_step_size=spec["step"],
            prefill_chunk_tokens=spec["chunk"],
            timeout=spec["timeout"],
            memory_budget=budget,
            decode_groups=groups,
            **speculation,
        )

    def solo(self, tokens: list[int], limit: int, processor: str | None, stop_at: int | None) -> dict[str, Any]:
        steps = generate_step(
            mx.array(tokens),
            self.reference,
            prefill_step_size=self.spec["step"],
            max_tokens=limit,
            logits_processors=processors_of(processor),
        )
        solo = [int(t) for t, _ in steps]
        if stop_at is None or stop_at >= len(solo):
            return {"solo": solo, "finish": "length", "stop": None}
        stop = solo[stop_at]
        return {"solo": solo[: solo.index(stop) + 1], "finish": "stop", "stop": stop}

    def insert(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        prompts, limits, caches, befores, processors, stops, solos = [], [], [], [], [], [], []
        for r in requests:
            prompt = prompt_of(r["M"], r["seed"])
            cache, before = self.handed.get(r["after"], (None, [])) if r.get("after") is not None else (None, [])
            if prompt:
                solo = self.solo([*before, *prompt], r["max_tokens"], r.get("processor"), r.get("stop_at"))
            else:  # an empty prompt: refused at insert
                solo = {"solo": [], "finish": None, "stop": None}
            prompts.append(prompt)
            limits.append(r["max_tokens"])
            caches.append(cache)
            befores.append(before)
            processors.append(processors_of(r.get("processor")))
            stops.append(None if solo["stop"] is None else [[solo["stop"]]])
            solos.append(solo)
        try:
            uids = self.engine.insert(
                prompts,
                max_tokens=limits,
                caches=caches,
                all_tokens=befores,
                logits_processors=processors,
                stop_sequences=stops,
            )
        except ValueError as exc:
            return {"error": f"ValueError: {exc}"}
        for r in requests:
            if r.get("after") is not None:
                self.handed.pop(r["after"], None)  # the generator took the cache over
        return {
            "uids": uids,
            "solo": [s["solo"] for s in solos],
            "finish": [s["finish"] for s in solos],
            "held": [len(b) for b in befores],
        }

    def step(self) -> dict[str, Any]:
        responses = self.engine.next()
        handed: dict[str, int] = {}
        for r in responses:
            if r.finish_reason in ("length", "stop"):
                assert r.prompt_cache is not None and r.all_tokens is not None, r
                self.handed[r.uid] = (r.prompt_cache, list(r.all_tokens))
                handed[str(r.uid)] = len(r.all_tokens)
        engine = self.engine
        return {
            "responses": [[r.uid, r.token, r.finish_reason] for r in responses],
            "active": engine.active_uids,
            "queued": engine.queued_uids,
            "prefilled": {str(u): engine.prefilled(u) for u in engine.queued_uids},
            "armed": self.armed["what"] is not None,
            "handed": handed,
            "error": None if engine.last_error is None else str(engine.last_error),
            "groups_in_flight": engine._group_state.in_flight(),  # pyright: ignore[reportPrivateUsage]
        }

    def remove(self, uids: list[int], return_caches: bool) -> dict[str, Any]:
        returned = self.engine.remove(uids, return_prompt_caches=return_caches)
        shown: dict[str, int | None] = {}
        for uid, (cache, tokens) in returned.items():
            shown[str(uid)] = None if cache is None else len(tokens)
            if cache is not None:
                self.handed[uid] = (cache, list(tokens))
        return {"left": len(self.engine), "returned": shown}

    def reset(self, positions: int | None, groups: int = 1, guessing: str | None = None) -> dict[str, Any]:
        # Disarm first: a fault an earlier run armed and never fired would fire in the budget's measuring pass below
        # (a one-token pass of the local layers) and end this rank.
        self.armed["what"] = None
        self.handed.clear()
        self.engine.remove([*self.engine.active_uids, *self.engine.queued_uids])
        left = len(self.engine)
        self.engine.close()
        # A new generator every time, budget or not: its uids, plan and batch rows start afresh, so a run's answers
        # depend only on its own commands (the stateful test replays and shrinks runs on the same ranks).
        budget = None if positions is None else positions * cache_bytes_per_position(self.model, stage_of(self.model))
        self.engine = self.new_engine(budget, groups, guessing)
        admission = self.engine.admission
        return {
            "left": left,
            "bytes_per_position": None if admission is None else list(admission.bytes_per_position),
            "budget": None if admission is None else list(admission.budget),
        }

    def answer(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "insert":
            if "requests" in command:
                return self.insert(command["requests"])
            one = self.insert([{k: command[k] for k in ("M", "seed", "max_tokens")}])
            return one if "error" in one else {"uid": one["uids"][0], "solo": one["solo"][0]}
        if op == "step":
            return self.step()
        if op == "remove":
            return self.remove(command["uids"], command.get("return_caches", False))
        if op == "reset":
            return self.reset(command.get("budget_positions"), command.get("decode_groups", 1), command.get("guessing"))
        if op == "status":
            engine = self.engine
            return {"len": len(engine), "active": engine.active_uids, "queued": engine.queued_uids}
        if op == "arm":
            if command["rank"] == self.rank:
                self.armed["what"] = command["what"]
            return {}
        raise ValueError(f"unknown command {command}")


def main() -> None:
    server = Server(json.loads(sys.argv[1]))
    for line in sys.stdin:
        answer = {"rank": server.rank, **server.answer(json.loads(line))}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
