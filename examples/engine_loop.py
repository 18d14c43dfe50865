"""pipemlx inside an engine's request loop: progress, agreed cancellation, decode with pipemlx.stream_generate.

Every rank runs the same loop over the same requests (an engine would
broadcast each incoming request from rank 0). For each request the prompt is
prefilled across the ranks with a progress callback; the second request's
client "hangs up" halfway through its prefill, which only the last rank
notices: its ``should_cancel`` says yes, and at the next agreement point *all*
ranks stop and raise ``PrefillCancelled`` with the same ``processed`` count and
nothing left queued. The loop drops that request and serves the next one.
Completed prefills are decoded with ``pipemlx.stream_generate`` (mlx-lm's
arguments and ``GenerationResponse`` objects, every rank agreeing on each token).

Run it on 2 local ranks:   python examples/engine_loop.py --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.demo import MODEL_DIR, default_prompt
from pipemlx.launch import init_group, relaunch_as_ranks


@dataclass
class Request:
    id: str
    prompt: str
    max_tokens: int
    hang_up_at: float | None = None  # fraction of the prefill after which the client goes away


def requests() -> list[Request]:
    opening = default_prompt()
    return [
        Request("a", opening, max_tokens=24),
        Request("b", opening + "\n\nChapter 2\n\n", max_tokens=24, hang_up_at=0.5),
        Request("c", '"My dear Mr. Bennet," said his lady to him one day, "have you heard', max_tokens=24),
    ]


def serve(model: Any, tokenizer: Any, group: mx.distributed.Group, step_size: int, quiet: bool) -> list[dict[str, Any]]:
    rank, last = group.rank(), group.size() - 1
    say = (lambda *a, **k: None) if quiet or rank != 0 else print
    outcomes: list[dict[str, Any]] = []
    for request in requests():
        prompt = mx.array(tokenizer.encode(request.prompt), dtype=mx.int32)
        progress: list[int] = []

        def on_progress(processed: int, total: int) -> None:
            progress.append(processed)
            say(f"\r[{request.id}] prefill {processed}/{total - 1}", end="", flush=True)

        def should_cancel() -> bool:
            # The client's connection lives on the last rank, so only it sees the hang-up.
            done = progress[-1] if progress else 0
            hung_up = request.hang_up_at is not None and done >= request.hang_up_at * (prompt.size - 1)
            return rank == last and hung_up

        cache = make_prompt_cache(model)
        outcome: dict[str, Any] = {"id": request.id, "prompt_tokens": prompt.size}
        try:
            pipemlx.pipeline_prefill(
                model,
                prompt,
                cache,
                prefill_step_size=step_size,
                prompt_progress_callback=on_progress,
                should_cancel=should_cancel,
            )
        except pipemlx.PrefillCancelled as stop:
            # Every rank lands here at the same agreement point; the group is ready for the next request.
            say(
                f"\n[{request.id}] cancelled by rank(s) {stop.cancelling_ranks} after {stop.processed} "
                f"positions (cache trimmed: {stop.cache_trimmed})"
            )
            outcome.update(
                status="cancelled",
                processed=stop.processed,
                cache_trimmed=stop.cache_trimmed,
                cache_offsets=sorted({c.offset for c in cache}),
                cancelling_ranks=stop.cancelling_ranks,
            )
            outcomes.append(outcome)
            continue
        say(f"\n[{request.id}] ", end="")
        tokens: list[int] = []
        for response in pipemlx.stream_generate(
            model, tokenizer, prompt[-1:], max_tokens=request.max_tokens, prompt_cache=cache
        ):
            if response.finish_reason != "stop":
                tokens.append(response.token)
            say(response.text, end="", flush=True)
        say("")
        outcome.update(status="done", tokens=tokens, progress=progress)
        outcomes.append(outcome)
    return outcomes


def run_rank(args: argparse.Namespace) -> None:
    group = init_group()
    model, tokenizer = pipemlx.load_sharded(args.model, group)  # only this rank's weights are read
    outcomes = serve(model, tokenizer, group, args.prefill_step_size, quiet=args.json)
    if args.json:
        print(
            json.dumps({"rank": group.rank(), "prefill_step_size": args.prefill_step_size, "requests": outcomes}),
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, help="start this many local ranks")
    parser.add_argument("--model", default=str(MODEL_DIR), help="mlx-lm model folder (default: the demo model)")
    parser.add_argument("--prefill-step-size", type=int, default=16, help="prefill chunk in tokens")
    parser.add_argument("--json", action="store_true", help="each rank prints one JSON line (for tests)")
    args = parser.parse_args()
    if args.ranks and "MLX_RANK" not in os.environ:
        return relaunch_as_ranks(args.ranks)
    run_rank(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
