"""Rank program: rank 0 queues two sends in a send_mode block; rank 1 receives them with plain MLX."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def main() -> None:
    group = init_group()
    # Whole layers: rank 1 receives with plain MLX, messages of the hidden size (no lent heads' outputs).
    model = pipemlx.shard_model(build_model(tiny_config("llama")), group, lend="none")
    report: dict[str, object] = {"rank": group.rank()}
    if group.rank() == 0:
        cache = make_prompt_cache(model)
        with pipemlx.send_mode(model, "queue") as queue, stage_of(model).executing_plan():
            outs = [model.model(mx.array([[1, 2, 3]]), cache=cache), model.model(mx.array([[4, 5, 6]]), cache=cache)]
            report["queued_inside"] = len(queue)
            sent = [p.array for p in queue.pending]
            mx.eval(sent)
            report["sent"] = [a.sum().item() for a in sent]
        del outs
        stage = stage_of(model)
        report["queued_after"] = len(stage.send_queue)
        report["in_flight_after"] = len(stage.send_queue.in_flight())
        report["mode_after"] = stage.mode
    else:
        like = mx.zeros((1, 3, 64))
        received = [mx.distributed.recv_like(like, 0, group=group) for _ in range(2)]
        mx.eval(received)
        report["received"] = [a.sum().item() for a in received]
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
