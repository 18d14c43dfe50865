"""``pipemlx split MODEL --ranks N --memory 24GB,16GB,8GB [--context 32768]``: a layer split that fits.

MODEL is a model folder or a Hugging Face repo id, sized from its index and safetensors
headers (read with HTTP range requests; :mod:`pipemlx.models.hub`) without downloading the weights.
Without ``--context`` the split weighs parameter bytes only; with it, each
rank's memory is its weights, its layers' KV cache at that context and one
prefill chunk's peak (:mod:`pipemlx.schedule.memory_model`, ``docs/planning.md``),
and the table shows the headroom and the longest context the split holds.
``pipemlx plan`` is accepted as an alias (a *plan* elsewhere is the prefill
schedule, :mod:`pipemlx.schedule.plan`; a *split* is how many layers each rank holds).
"""

from __future__ import annotations

import argparse
import re
import sys

from ..models.hub import locate_model, memory_model_of, model_bytes_of
from ..models.loading import head_of_folder
from ..models.sharding import AUTO_PLANNED_STEP
from ..schedule.memory_model import Settings, format_context_plan, plan_balanced, plan_context
from ..schedule.memory_split import (
    MemoryPlan,
    MemoryPlanError,
    ModelBytes,
    format_plan,
    format_size,
    memory_plan,
    plan_split,
    resolve_budgets,
)
from ..schedule.split import resolve_split
from .common import DefaultsFormatter, add_head_flag, add_renamed_flags

EXIT_DOES_NOT_FIT = 2
EXIT_USAGE = 2


def step_tokens(text: str) -> int | str:
    """argparse type: ``auto`` or a number of tokens as :func:`context_tokens` reads it (``--prefill-step-size``)."""
    return "auto" if text == "auto" else context_tokens(text)


def context_tokens(text: str) -> int:
    """argparse type: a token count, ``32768`` or ``32k`` (x1024)."""
    match = re.fullmatch(r"\s*(-?[0-9]+)\s*([kK]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a number of tokens like 32768 or 32k, got {text!r}")
    value = int(match.group(1)) * (1024 if match.group(2) else 1)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return value


def _numbers(text: str | None, kind: type[int] | type[float], what: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def main(argv: list[str], prog: str = "pipemlx split") -> int:
    """``pipemlx split MODEL [--ranks N] [--memory ...] [--context N] ...``: print the split as a table.

    ``argv`` holds the arguments after ``split``; ``prog`` names the command in
    messages (``pipemlx plan`` when called by the alias). Returns 0, or 2
    (with one line on stderr) for bad arguments and for budgets that cannot
    hold the model: that line names the rank, what it needs and has, and the
    longest context that would fit.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsFormatter,
        description="Split an mlx-lm model directory's layers over ranks from its safetensors headers, "
        "its config and each rank's memory (and speed).",
    )
    parser.add_argument(
        "model_dir",
        metavar="MODEL",
        help="mlx-lm model directory (config.json, model*.safetensors) or Hugging Face repo id "
        "(sized from its index and safetensors headers; the weights are not downloaded)",
    )
    parser.add_argument("--ranks", type=int, help="number of ranks (default: the number of --memory budgets)")
    parser.add_argument(
        "--memory",
        help="per-rank memory budgets, comma separated (24GB,16GB,8GB), or one for every rank; "
        "omitted: equal memory, balance bytes",
    )
    parser.add_argument(
        "--context", type=context_tokens, help="tokens each request holds (32768 or 32k): count the KV cache"
    )
    parser.add_argument(
        "--prefill-step-size",
        type=step_tokens,
        default="auto",
        metavar="{auto,N}",
        help=f"prefill chunk in tokens (512 or 1k) counted in the peak; auto is counted as {AUTO_PLANNED_STEP}",
    )
    add_renamed_flags(parser, ["--step-size"])
    parser.add_argument("--kv-bits", type=int, help="quantized KV cache bits (mlx-lm's kv_bits; default: none)")
    parser.add_argument("--kv-group-size", type=int, default=64, help="quantized KV group size (default 64)")
    parser.add_argument(
        "--quantized-kv-start", type=int, default=5000, help="position from which the KV cache is quantized"
    )
    parser.add_argument("--split", help="layers per rank (6,2): show that split instead of planning one")
    parser.add_argument("--speeds", help="per-rank speeds (3,1): a balanced split, layers in proportion")
    add_head_flag(parser)
    parser.add_argument(
        "--fused-attention",
        action="store_true",
        help="attention runs fused (MLX on Metal): no score matrix in the chunk peak",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return _run(args, prog)
    except MemoryPlanError as exc:
        print(f"{prog}: does not fit: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except (ValueError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace, prog: str) -> int:
    budgets_text: list[str] | None = None if args.memory is None else [m for m in args.memory.split(",") if m.strip()]
    split = _numbers(args.split, int, "--split")
    speeds = _numbers(args.speeds, float, "--speeds")
    ranks: int | None = args.ranks
    for given in (split, speeds, budgets_text if budgets_text and len(budgets_text) > 1 else None):
        if ranks is None and given is not None:
            ranks = len(given)
    if ranks is None:
        raise ValueError("give --ranks, or --memory / --split / --speeds with one entry per rank")
    if ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {ranks}")
    if budgets_text is not None and len(budgets_text) == 1:
        budgets_text = budgets_text * ranks
    if split is not None and speeds is not None:
        raise ValueError("give --split or --speeds, not both")
    budgets = resolve_budgets(budgets_text, ranks)
    if args.context is None:
        if args.kv_bits is not None or args.head != "auto" or args.fused_attention:
            raise ValueError("--kv-bits, --head and --fused-attention need --context")
        if split is None and speeds is None:
            print(format_plan(plan_split(model_bytes_of(args.model_dir), ranks, budgets)))
            return 0
    model = memory_model_of(args.model_dir)
    if args.context is None:  # a given or balanced split, parameters only
        layers = len(model.bytes.layers)
        given = resolve_split([int(s) for s in split], layers, ranks) if split is not None else None
        chosen_split = given or plan_balanced(model, ranks, speeds or [1.0] * ranks, budgets)
        print(format_plan(parameter_plan(model.bytes, chosen_split, budgets)))
        return 0
    settings = Settings(
        args.context or 1,
        AUTO_PLANNED_STEP if args.prefill_step_size == "auto" else args.prefill_step_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        head=head_of_folder(args.head, locate_model(args.model_dir).root, ranks),  # "auto" as load_sharded decides
        fused_attention=args.fused_attention,
    )
    chosen: tuple[int, ...] | None = None
    if split is not None:
        chosen = resolve_split([int(s) for s in split], len(model.bytes.layers), ranks)
    elif speeds is not None:
        chosen = plan_balanced(model, ranks, speeds, budgets, settings if args.context else None)
    plan = plan_context(model, ranks, settings, budgets, chosen)
    print(format_context_plan(plan))
    return 0


def parameter_plan(model: ModelBytes, split: tuple[int, ...], budgets: tuple[int, ...] | None) -> MemoryPlan:
    """The parameter-only table of a given split; :class:`MemoryPlanError` when a rank exceeds its budget."""
    plan = memory_plan(model, split, budgets)
    for rank in plan.ranks:
        if rank.budget is not None and rank.total > rank.budget:
            raise MemoryPlanError(
                f"rank {rank.rank} needs {format_size(rank.total)} of parameters but has {format_size(rank.budget)}; "
                f"split {list(split)}"
            )
    return plan
