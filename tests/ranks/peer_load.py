"""Rank program: load_sharded a model folder that only rank 0 has; the others read their tensors from it.

Spec: {"cwds": [...], "caches": [...], "model": "model", "prompt": [ids], "step", "max_tokens",
"chunk"?: bytes per request, "die_after"?: ranges rank 0 serves before it dies, "loads"?: times to load,
"head"?: load_sharded's head (default "all"; "split": decoded by pipemlx.generate_step)}
Each rank works in its own folder (``cwds[rank]``; only rank 0's holds ``model``) with its own pipemlx cache
(``caches[rank]``), as separate hosts would. It prints one JSON line: the split, the greedy tokens, and the
complete weight folders in its cache. With ``die_after``, rank 0 serves that many ranges (slowly) and then
exits at once, mid-transfer; every other rank prints its error on stderr and exits with status 3.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.models import peer, weights
from pipemlx.runtime.stage import stage_of


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    group = init_group()
    rank = group.rank()
    os.chdir(spec["cwds"][rank])
    os.environ["PIPEMLX_CACHE_DIR"] = spec["caches"][rank]
    if spec.get("chunk"):
        weights.CHUNK_BYTES = int(spec["chunk"])
    if spec.get("die_after") is not None:
        peer.RESUME_WAIT_S = 0.01  # the reconnections to the dead holder, without the waits between them
    if spec.get("die_after") is not None and rank == 0:
        answer = peer.PeerServer._answer  # pyright: ignore[reportPrivateUsage]
        served = [0]

        def dying(self: peer.PeerServer, request: dict[str, Any], files: Any) -> bytes | tuple[str, int, int]:
            if request.get("op") == "range":
                served[0] += 1
                if served[0] > spec["die_after"]:
                    os._exit(9)  # the holder dies mid-transfer
                time.sleep(0.2)
            return answer(self, request, files)

        peer.PeerServer._answer = dying  # type: ignore[method-assign]
    for _ in range(spec.get("loads", 1)):  # a second load in the same run finds its weight folder: fetches nothing
        try:
            model, _ = pipemlx.load_sharded(
                spec["model"], group, lend="none", timeout=spec.get("timeout", 30.0), head=spec.get("head", "all")
            )
        except Exception as exc:
            print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
    prompt = mx.array(spec["prompt"], dtype=mx.int32)
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=spec["step"])
    steps = generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=spec["max_tokens"])  # mlx-lm's own
    tokens = [int(t) for t, _ in steps]
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    folders = sorted(
        p.name for p in (Path(spec["caches"][rank]) / "weights").glob("*") if (p / weights.DONE_FILE).is_file()
    )
    report = {"rank": rank, "split": list(stage_of(model).info.split), "tokens": tokens, "folders": folders}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
