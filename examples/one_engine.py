"""One engine, written once against mlx-lm's API, run on one machine or across several unchanged.

The engine below (``engine``) only calls ``pipemlx.stream_generate`` and
``pipemlx.BatchGenerator`` with mlx-lm's arguments: a sampler, logits
processors (a repetition penalty, and one that counts its calls), ``logprobs``,
per-request processors and stop sequences. On a model loaded with
``mlx_lm.load`` (one machine) those are mlx-lm's own functions; on a model
loaded with ``pipemlx.load_sharded`` on every rank they run the pipeline, and
every rank gets mlx-lm's tokens, text and logprobs, its processors and sampler
called as mlx-lm calls them (each rank seeds its random generator alike). The
only line that differs is how the model is loaded (``load``).

One machine:              python examples/one_engine.py
The same on 2 local ranks: python examples/one_engine.py --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import pipemlx
from pipemlx.demo import MODEL_DIR
from pipemlx.launch import init_group, relaunch_as_ranks

PROMPTS = [
    "It is a truth universally acknowledged, that",
    '"My dear Mr. Bennet," said his lady to him one day,',
    "Elizabeth walked on, and",
]


def load(path: str) -> tuple[Any, Any, int]:
    """The model and tokenizer, and this process's rank: the only place that knows whether there are ranks."""
    if "MLX_RANK" not in os.environ:
        model, tokenizer = mlx_load(path)[:2]
        return model, tokenizer, 0
    group = init_group()
    model, tokenizer = pipemlx.load_sharded(path, group)  # only this rank's layers are read
    return model, tokenizer, group.rank()


def engine(model: Any, tokenizer: Any) -> dict[str, Any]:
    """An engine's request handling, as it would be written for mlx-lm alone."""
    calls = {"processor": 0}

    def counting(tokens: mx.array, logits: mx.array) -> mx.array:
        calls["processor"] += 1
        return logits

    mx.random.seed(7)  # every process alike: a sampler then draws alike everywhere
    streamed = list(
        pipemlx.stream_generate(
            model,
            tokenizer,
            PROMPTS[0],
            max_tokens=20,
            sampler=make_sampler(0.8, top_p=0.95),
            logits_processors=[*make_logits_processors(repetition_penalty=1.2), counting],
        )
    )
    chat = {
        "text": "".join(r.text for r in streamed),
        "tokens": [r.token for r in streamed],
        "logprobs": [round(float(r.logprobs[r.token]), 4) for r in streamed],
        "finish_reason": streamed[-1].finish_reason,
        "processor_calls": calls["processor"],
    }

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    generator = pipemlx.BatchGenerator(model, max_tokens=12)
    eos = [[t] for t in tokenizer.eos_token_ids]
    full_stop = tokenizer.encode(".", add_special_tokens=False)
    uids = generator.insert(
        prompts,
        [12, 10, 8],
        logits_processors=[make_logits_processors(repetition_penalty=1.3), None, [counting]],
        stop_sequences=[StopSequences(eos), StopSequences([full_stop, *eos]), StopSequences(eos)],
    )
    answers: dict[int, list[int]] = {uid: [] for uid in uids}
    reasons: dict[int, str] = {}
    while responses := generator.next_generated():
        for r in responses:
            answers[r.uid].append(r.token)
            if r.finish_reason is not None:
                reasons[r.uid] = r.finish_reason
    generator.close()
    batch = [{"text": tokenizer.decode(answers[u]), "tokens": answers[u], "finish_reason": reasons[u]} for u in uids]
    return {"chat": chat, "batch": batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, help="start this many local ranks (none: one process, mlx-lm alone)")
    parser.add_argument("--model", default=str(MODEL_DIR), help="mlx-lm model folder (default: the demo model)")
    parser.add_argument("--json", action="store_true", help="each process prints one JSON line (for tests)")
    args = parser.parse_args()
    if args.ranks and "MLX_RANK" not in os.environ:
        return relaunch_as_ranks(args.ranks)
    model, tokenizer, rank = load(args.model)
    report = engine(model, tokenizer)
    if args.json:
        print(json.dumps({"rank": rank, **report}), flush=True)
    elif rank == 0:
        print(report["chat"]["text"])
        for answer in report["batch"]:
            print(f"[{answer['finish_reason']}] {answer['text']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
