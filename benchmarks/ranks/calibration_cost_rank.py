"""Benchmark rank program: shard_model, then two prefills with the defaults; prints the seconds of each.

Spec: {"config", "M"}. With an empty calibration cache the first ``shard_model`` (``lend="auto"``) and the first
``prefill_step_size="auto"`` prefill calibrate; with a warm one they read the cache. Prints one JSON line:
{"rank", "shard_s", "first_prefill_s", "second_prefill_s"}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.launch import init_group
from pipemlx.testing import build_model


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    group = init_group()
    start = time.perf_counter()
    model = pipemlx.shard_model(build_model(spec["config"], seed=0), group)
    sharded = time.perf_counter()
    prompt = mx.random.randint(0, spec["config"]["vocab_size"], (spec["M"],), key=mx.random.key(1)).astype(mx.int32)
    pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model))
    first = time.perf_counter()
    pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model))
    second = time.perf_counter()
    times = {"shard_s": sharded - start, "first_prefill_s": first - sharded, "second_prefill_s": second - first}
    print(json.dumps({"rank": group.rank(), **times}), flush=True)


if __name__ == "__main__":
    main()
