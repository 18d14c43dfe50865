"""``pipemlx split MODEL_DIR --ranks N --memory 24GB,16GB,8GB``: a layer split that fits each rank's memory.

``pipemlx plan`` is accepted as an alias for now (the command's old name;
"plan" now means the prefill schedule, :mod:`pipemlx.schedule.plan`).
"""

from __future__ import annotations

import argparse
import sys

from ..models.safetensors import model_bytes_from_dir
from ..schedule.memory_split import MemoryPlanError, format_plan, plan_split, resolve_budgets


def main(argv: list[str], prog: str = "pipemlx split") -> int:
    """``pipemlx split MODEL_DIR [--ranks N] [--memory 24GB,16GB,8GB]``: print the split as a table.

    ``argv`` holds the arguments after ``split``; ``prog`` names the command in
    messages (``pipemlx plan`` when called by its old name). Returns 0, 1 when
    the model does not fit, 2 for bad arguments (with a message on stderr).
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Split an mlx-lm model directory's layers over ranks from its safetensors headers "
        "and each rank's memory.",
    )
    parser.add_argument("model_dir", help="mlx-lm model directory (config.json, model*.safetensors)")
    parser.add_argument("--ranks", type=int, help="number of ranks (default: the number of --memory budgets)")
    parser.add_argument(
        "--memory",
        help="per-rank memory budgets, comma separated (24GB,16GB,8GB), or one for every rank; "
        "omitted: equal memory, balance bytes",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        budgets_text: list[str] | None = (
            None if args.memory is None else [m for m in args.memory.split(",") if m.strip()]
        )
        ranks: int | None = args.ranks
        if ranks is None:
            if budgets_text is None:
                raise ValueError("give --ranks, --memory with one budget per rank, or both")
            ranks = len(budgets_text)
        if budgets_text is not None and len(budgets_text) == 1:
            budgets_text = budgets_text * ranks
        budgets = resolve_budgets(budgets_text, ranks)
        model = model_bytes_from_dir(args.model_dir)
        plan = plan_split(model, ranks, budgets)
    except MemoryPlanError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0
