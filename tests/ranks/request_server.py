"""Rank program for tests/live_group.py: serve request commands on a sharded model and on a reference.

Each rank holds the sharded model (its pipeline cache) and a one-process
reference model with the same weights (its own cache), and applies every
command to both, so the test compares the pipeline with mlx-lm on a model
holding the same cache history. Commands (one JSON object per stdin line):

  {"op": "request", "M", "seed", "step", "max_tokens", "temp", "reuse", "trim_to",
   "stop": {"rank", "after", "how"}, "cancel_prefill": {"rank", "at"},
   "cancel_decode": {"rank", "after"}, "raise_progress": {"rank", "at"}, "model_error": {"rank", "chunk"},
   "decode_error": {"rank", "token"}, "processor_error": {"rank", "at"}, "penalty", "draft"}  (a fault's "rank" may be "all": every rank)
      pipemlx.generate_step on the pipeline; ``reuse`` keeps the cache of the previous requests (trimmed to
      ``trim_to`` positions when given), otherwise both caches start empty. ``stop.how`` is "break", "close",
      "raise" (the consumer's own exception) or "abandon" (the generator is dropped without being closed and
      the rank goes straight on to the request in ``then``, which every rank runs next). Answers tokens, progress calls, outcome, cache offset and
      the reference's tokens and offset. ``draft``: speculate, the reference model (whole) guessing. ``penalty``: a repetition penalty plus a logits processor that
      records the token history and logits it is given (answered as ``histories``, ``seen`` / ``ref_...``); with ``temp``
      a sampler that records what it is given and draws (``draws``). ``processor_error``: that processor raises
      ValueError at its ``at``-th call on that rank (the reference's does not).
  {"op": "plain", "M", "seed", "step", "take"}
      mlx-lm's own generate_step on the sharded model, consumed for ``take`` tokens, nothing synchronized.
  {"op": "second_model", "M", "seed", "step", "take", "max_tokens"}
      "plain" (mlx-lm leaves a step in flight), then pipemlx.generate_step on a second sharded model (other
      weights, the same group), against mlx-lm on that model's reference.
End of input: the program simply ends (no barrier, no synchronize).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


class InjectedModelError(RuntimeError):
    pass


class Recorder:
    """A logits processor that keeps every token history and the first logits it is shown; :meth:`sampler` wraps a
    sampler to keep the first log-probabilities each call is shown and the tokens it draws."""

    def __init__(self, raise_at: int = 0) -> None:
        self.histories: list[list[int]] = []
        self.logits: list[list[float]] = []
        self.draws: list[tuple[list[float], list[int]]] = []
        self.raise_at = raise_at  # the call that raises (0: none)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if len(self.histories) + 1 == self.raise_at:
            raise ValueError("the logits processor raised")
        self.histories.append([int(t) for t in tokens.tolist()])  # type: ignore[union-attr]
        self.logits.append(logits[0, :6].astype(mx.float32).tolist())  # type: ignore[arg-type]
        return logits

    def sampler(self, inner: Any) -> Any:
        def sample(logprobs: mx.array) -> mx.array:
            drawn = inner(logprobs)
            self.draws.append((logprobs[:, :6].reshape(-1).astype(mx.float32).tolist(), drawn.reshape(-1).tolist()))
            return drawn

        return sample


def processors(command: dict[str, Any], raise_at: int = 0) -> tuple[list[Any] | None, Recorder]:
    recorder = Recorder(raise_at)
    if command.get("penalty") is None:
        return None, recorder
    return [*make_logits_processors(repetition_penalty=command["penalty"]), recorder], recorder


def prompt_of(length: int, seed: int, vocab: int) -> mx.array:
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(seed)).astype(mx.int32)


class Server:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.group = init_group()
        self.rank = self.group.rank()
        self.config = tiny_config(spec.get("arch", "llama"))
        self.reference = build_model(self.config, seed=spec.get("seed", 0))
        # head="all": the scenario checks that greedy steps share the whole head (a split one, the default, gathers
        # the logits while logprobs are yielded: tests/test_vocab_split.py).
        self.model = pipemlx.shard_model(
            build_model(self.config, seed=spec.get("seed", 0)),
            self.group,
            timeout=spec.get("timeout", 30.0),
            head=spec.get("head", "all"),
        )
        self.cache: list[Any] = make_prompt_cache(self.model)
        self.ref_cache: list[Any] = make_prompt_cache(self.reference)
        self.abandoned: list[Any] = []
        self.second: tuple[Any, Any] | None = None  # (sharded, reference) of a second model, built on first use
        self.error_chunk: int | None = None
        self.error_token: int | None = None
        self._wrap_first_layer()

    def _wrap_first_layer(self) -> None:
        """Make the last local layer raise on the n-th prefill chunk when asked (a bug in layer code)."""
        layer = self.model.layers[-1]
        original = type(layer).__call__
        server = self
        calls = {"n": 0}

        def call(this: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
            armed = server.error_chunk if x.shape[1] > 1 else server.error_token
            if armed is not None:
                if calls["n"] == armed:
                    server.error_chunk = server.error_token = None
                    calls["n"] = 0
                    raise InjectedModelError(f"injected model error on rank {server.rank}")
                calls["n"] += 1
            return original(this, x, *args, **kwargs)

        layer.__class__ = type(type(layer).__name__, (type(layer),), {"__call__": call})

    def mine(self, command: dict[str, Any], key: str) -> dict[str, Any] | None:
        entry = command.get(key)
        return entry if entry is not None and entry["rank"] in (self.rank, "all") else None

    def request(self, command: dict[str, Any]) -> dict[str, Any]:
        if not command.get("reuse"):
            self.cache, self.ref_cache = make_prompt_cache(self.model), make_prompt_cache(self.reference)
        elif command.get("trim_to") is not None:
            for cache in (self.cache, self.ref_cache):
                trim_prompt_cache(cache, max(0, cache[0].offset - command["trim_to"]))
        prefix = self.cache[0].offset
        prompt = prompt_of(command["M"], command["seed"], self.config["vocab_size"])
        temp = command.get("temp", 0.0)
        stop, cancel_prefill = self.mine(command, "stop"), self.mine(command, "cancel_prefill")
        cancel_decode, raise_progress = self.mine(command, "cancel_decode"), self.mine(command, "raise_progress")
        model_error = self.mine(command, "model_error")
        self.error_chunk = model_error["chunk"] if model_error else None
        decode_error = self.mine(command, "decode_error")
        self.error_token = decode_error["token"] if decode_error else None
        progress: list[list[int]] = []
        polls = {"prefill": 0, "tokens": 0}
        tokens: list[int] = []
        prefilled = {"done": False}

        def on_progress(done: int, total: int) -> None:
            progress.append([done, total])
            if raise_progress and len(progress) == raise_progress["at"]:
                raise ValueError(f"progress callback raised on rank {self.rank}")
            if done >= total - 1:
                prefilled["done"] = True

        def should_cancel() -> bool:
            if not prefilled["done"]:
                polls["prefill"] += 1
                return bool(cancel_prefill) and polls["prefill"] == cancel_prefill["at"]
            return bool(cancel_decode) and len(tokens) >= cancel_decode["after"]

        outcome: dict[str, Any] = {"outcome": "done"}
        mx.random.seed(command["seed"])
        processor_error = self.mine(command, "processor_error")
        logits_processors, recorder = processors(command, processor_error["at"] if processor_error else 0)
        generator = pipemlx.generate_step(
            prompt,
            self.model,
            prompt_cache=self.cache,
            max_tokens=command["max_tokens"],
            sampler=recorder.sampler(make_sampler(temp)) if temp else None,  # None: greedy, the head shared
            logits_processors=logits_processors,
            prefill_step_size=command["step"],
            prompt_progress_callback=on_progress,
            should_cancel=should_cancel,
            draft_model=self.reference if command.get("draft") else None,
        )
        try:
            for token, _ in generator:
                tokens.append(token)
                if stop and len(tokens) == stop["after"]:
                    if stop["how"] == "raise":
                        raise KeyError("consumer raised")
                    if stop["how"] == "close":
                        generator.close()
                    if stop["how"] == "abandon":
                        self.abandoned.append(generator)
                    break
        except pipemlx.PrefillCancelled as exc:
            outcome = {"outcome": "cancelled", "processed": exc.processed, "prefix": exc.prefix}
        except (ValueError, InjectedModelError, KeyError) as exc:
            frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
            outcome = {
                "outcome": type(exc).__name__,
                "in_prefill": bool({"pipeline_prefill", "prefill_before_decode"} & set(frames)),
            }
        if not (stop and stop["how"] == "abandon"):
            generator.close()  # a generator left by ``break`` closes here, running the agreed stop
        last = generator.stop  # why it ended (None while an abandoned one waits for the next command)
        outcome["last_stop"] = None if last is None else [last.reason, last.tokens, list(last.ranks)]
        answer = {"rank": self.rank, "tokens": tokens, "progress": progress, "prefix": prefix, **outcome}
        answer["shared_head"] = generator.shared_head
        del generator
        answer.update(histories=recorder.histories, seen=recorder.logits, draws=recorder.draws)
        if stop and stop["how"] == "abandon":
            answer["offset"] = None  # the agreed stop runs when the next command settles the stage
        else:
            answer["offset"] = self.cache[0].offset
        # With guesses (greedy), a pass's tokens are decided together: a consumer's stop ends the request after them.
        taken = last.tokens if command.get("draft") and last is not None else len(tokens)
        answer.update(self.replay(prompt, command, outcome, taken, temp))
        if "then" in command:  # the abandoning rank goes straight on; the others finish first, then follow
            answer["then"] = self.request(command["then"])
        return answer

    def replay(
        self, prompt: mx.array, command: dict[str, Any], outcome: dict[str, Any], taken: int, temp: float
    ) -> dict[str, Any]:
        """The reference: mlx-lm on one process, from the same cache history, consumed as the pipeline was."""
        prefill_stopped = outcome["outcome"] == "cancelled" or outcome.get("in_prefill", False)
        if prefill_stopped:
            # Every rank stopped in the prefill: its cache keeps the prefix plus the agreed positions.
            processed = self.cache[0].offset - self.ref_cache[0].offset
            step = command["step"]
            for start in range(0, processed, step):
                self.reference(prompt[None, start : min(start + step, processed)], cache=self.ref_cache)
                mx.eval([c.state for c in self.ref_cache])
            return {"ref_tokens": [], "ref_offset": self.ref_cache[0].offset}
        mx.random.seed(command["seed"])
        ref_tokens: list[int] = []
        logits_processors, recorder = processors(command)
        if taken > 0:
            for token, _ in mlx_generate_step(
                prompt,
                self.reference,
                prompt_cache=self.ref_cache,
                max_tokens=command["max_tokens"],
                sampler=recorder.sampler(make_sampler(temp)) if temp else None,
                logits_processors=logits_processors,
                prefill_step_size=command["step"],
            ):
                ref_tokens.append(token)
                if len(ref_tokens) == taken:
                    break
        else:  # the pipeline stopped before its first token: only the prompt went through
            for token, _ in mlx_generate_step(
                prompt, self.reference, prompt_cache=self.ref_cache, max_tokens=0, prefill_step_size=command["step"]
            ):
                ref_tokens.append(token)
        mx.eval([c.state for c in self.ref_cache])
        undone = self.ref_cache[0].offset - self.cache[0].offset
        if outcome.get("last_stop") and outcome["last_stop"][0] == "failed" and undone > 0:
            trim_prompt_cache(self.ref_cache, undone)  # pipemlx undoes a decode step the model failed in
        return {
            "ref_tokens": ref_tokens,
            "ref_offset": self.ref_cache[0].offset,
            "ref_histories": recorder.histories,
            "ref_seen": recorder.logits,
            "ref_draws": recorder.draws,
        }

    def plain(self, command: dict[str, Any]) -> dict[str, Any]:
        self.cache, self.ref_cache = make_prompt_cache(self.model), make_prompt_cache(self.reference)
        prompt = prompt_of(command["M"], command["seed"], self.config["vocab_size"])
        got: list[list[int]] = [[], []]
        for i, (model, cache) in enumerate(((self.model, self.cache), (self.reference, self.ref_cache))):
            for token, _ in mlx_generate_step(prompt, model, prompt_cache=cache, prefill_step_size=command["step"]):
                got[i].append(token)
                if len(got[i]) == command["take"]:
                    break
        return {"rank": self.rank, "tokens": got[0], "ref_tokens": got[1], "outcome": "done"}

    def second_model(self, command: dict[str, Any]) -> dict[str, Any]:
        if self.second is None:
            timeout = stage_of(self.model).info.timeout
            sharded = pipemlx.shard_model(build_model(self.config, seed=97), self.group, timeout=timeout)
            self.second = (sharded, build_model(self.config, seed=97))
        model, reference = self.second
        prompt = prompt_of(command["M"], command["seed"], self.config["vocab_size"])
        take, limit, step = command["take"], command["max_tokens"], command["step"]
        self.cache, self.ref_cache = make_prompt_cache(self.model), make_prompt_cache(self.reference)
        steps = mlx_generate_step(prompt, self.model, prompt_cache=self.cache, prefill_step_size=step)
        tokens = [next(steps)[0] for _ in range(take)]
        del steps  # mlx-lm evaluated the next step asynchronously: it may still be on the wire
        tokens += [t for t, _ in pipemlx.generate_step(prompt, model, max_tokens=limit, prefill_step_size=step)]
        steps = mlx_generate_step(prompt, self.reference, prompt_cache=self.ref_cache, prefill_step_size=step)
        ref_tokens = [next(steps)[0] for _ in range(take)]
        ref_tokens += [t for t, _ in mlx_generate_step(prompt, reference, max_tokens=limit, prefill_step_size=step)]
        return {"rank": self.rank, "tokens": tokens, "ref_tokens": ref_tokens, "outcome": "done"}

    def fault(self, command: dict[str, Any]) -> None:
        """Decode with a fault on one rank ("die": os._exit(3), "stall": sleep) at token ``token``.

        The survivors answer the error they raised and how long after their
        last token it came, then leave with os._exit(0): after a lost peer or
        a timeout MLX's normal teardown can block.
        """
        fault = command["fault"]
        prompt = prompt_of(command["M"], command["seed"], self.config["vocab_size"])
        last = time.monotonic()
        answer: dict[str, Any] = {"rank": self.rank, "outcome": "done"}
        try:
            for n, _ in enumerate(pipemlx.generate_step(prompt, self.model, max_tokens=command["max_tokens"])):
                last = time.monotonic()
                if self.rank == fault["rank"] and n == fault["token"]:
                    if fault["kind"] == "die":
                        os._exit(3)
                    time.sleep(fault["seconds"])
                    os._exit(4)
        except pipemlx.PipelineError as exc:
            answer.update(outcome=type(exc).__name__, message=str(exc), after=time.monotonic() - last)
        print(json.dumps(answer), flush=True)
        os._exit(0)


def main() -> None:
    server = Server(json.loads(sys.argv[1]))
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "fault":
            server.fault(command)
        if command["op"] == "second_model":
            answer = server.second_model(command)
        else:
            answer = server.request(command) if command["op"] == "request" else server.plain(command)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
