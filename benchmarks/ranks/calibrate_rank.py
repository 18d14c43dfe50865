"""Benchmark rank program: calibrate the group's cost model as prefill_step_size="auto" does; print it (rank 0's line).

Spec: {"config", "lend_mlp"?}. Prints the CostModel's fields as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import pipemlx
from pipemlx.launch import init_group
from pipemlx.runtime.calibrate import calibrated
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[group.rank() % len(cores)]})
    model = pipemlx.shard_model(
        build_model(spec["config"], seed=0), group, lend="mlp" if spec.get("lend_mlp") else "none"
    )
    print(json.dumps(asdict(calibrated(model, stage_of(model), 120.0))), flush=True)


if __name__ == "__main__":
    main()
