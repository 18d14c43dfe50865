"""The ``pipemlx`` command: ``generate``, ``bench`` and ``plan``.

``pipemlx generate`` prefills a prompt across ranks and streams the decoded
text; ``pipemlx bench`` compares one process with a 2-rank pipeline;
``pipemlx plan`` proposes a layer split from each rank's memory. Without
``--model`` they use the demo model shipped in :mod:`pipemlx.demo_model`.

Where the ranks come from (``generate``):

- ``--ranks N`` (the default, N = 2): N local processes, started with
  :func:`pipemlx.launch.launch`; rank 0's output is this command's output.
- under ``mlx.launch`` or ``mpirun`` (``MLX_RANK`` or ``OMPI_COMM_WORLD_RANK`` set):
  this process is one rank of the surrounding group.
- ``--hostfile FILE``: MLX's ring hostfile (a JSON list with one list of
  ``"ip:port"`` per rank); run the same command on every host, and each takes
  the rank whose address is its own (``--rank`` when that is ambiguous).

Exit status: 0 on success, 1 when a rank or the pipeline failed, 2 for bad
input (named in one line on stderr, without a traceback), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from ..demo import MODEL_DIR

RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")
DEFAULT_RANKS = 2
LAUNCH_TIMEOUT = 7 * 24 * 3600.0
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UserError(Exception):
    """Bad input: reported as ``pipemlx <command>: error: <message>`` with exit status 2."""


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def layer_counts(text: str) -> list[int]:
    """argparse type: layers per rank, comma-separated (``6,2``)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layers per rank like 6,2, got {text!r}") from None


def positive_float(text: str) -> float:
    """argparse type: a number greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def in_launched_rank() -> bool:
    """True when a launcher (pipemlx's, ``mlx.launch``, ``mpirun``) started this process as a rank."""
    return any(name in os.environ for name in RANK_VARIABLES)


def model_layers(model_dir: Path) -> int | None:
    """Check that ``model_dir`` looks like an mlx-lm model folder; return its decoder layer count if known."""
    if not model_dir.exists():
        raise UserError(f"model folder {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise UserError(f"{str(model_dir)!r} is not a folder; --model takes an mlx-lm model folder")
    config_path = model_dir / "config.json"
    try:
        config: Any = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{str(model_dir)!r} has no config.json; it is not an mlx-lm model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {config_path}: {exc}") from None
    if not any(model_dir.glob("model*.safetensors")):
        raise UserError(f"{str(model_dir)!r} has no model*.safetensors weights")
    if not isinstance(config, dict):
        raise UserError(f"{config_path} does not hold a JSON object")
    layers = config.get("num_hidden_layers")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    text_config = config.get("text_config")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    if layers is None and isinstance(text_config, dict):
        layers = text_config.get("num_hidden_layers")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    return layers if isinstance(layers, int) else None


def model_name(model_dir: Path) -> str:
    """``the demo model`` for the shipped one, else the folder as given."""
    return "the demo model" if Path(model_dir).resolve() == MODEL_DIR.resolve() else str(model_dir)


def check_ranks(ranks: int, model_dir: Path, split: list[int] | None = None) -> None:
    """Every rank needs at least one layer of the model; an explicit ``split`` must fit model and ranks."""
    from ..schedule.split import resolve_split

    layers = model_layers(model_dir)
    if layers is not None and ranks > layers:
        raise UserError(
            f"more ranks than layers: {ranks} ranks cannot share the {layers} layers of {model_name(model_dir)} "
            "(every rank needs at least one)"
        )
    if split is not None:
        if layers is None:
            raise UserError(f"--split needs the model's layer count, which {model_dir}/config.json does not give")
        try:
            resolve_split(split, layers, ranks)
        except ValueError as exc:
            raise UserError(f"--split: {exc}") from None


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from ``--prompt``, ``--prompt-file`` or the demo prompt."""
    if args.prompt is not None:
        text: str = args.prompt
    elif args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read prompt file {args.prompt_file!r}: {exc}") from None
    else:
        from ..demo import default_prompt

        text = default_prompt()
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def hostfile_rank(path: str, rank: int | None) -> int:
    """Check MLX's ring hostfile at ``path``; return this host's rank in it (``rank`` if given)."""
    try:
        entries: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read hostfile {path!r}: {exc}") from None
    if not _is_hostfile(entries):
        raise UserError(
            f"hostfile {path!r} must be a JSON list with one list of \"ip:port\" strings per rank, "
            'like [["10.0.0.1:5000"], ["10.0.0.2:5000"]]'
        )
    hosts = cast("list[list[str]]", entries)
    if rank is not None:
        if not 0 <= rank < len(hosts):
            raise UserError(f"--rank {rank} is not a rank of {path!r}, which has {len(hosts)} ranks")
        return rank
    local = [r for r, addresses in enumerate(hosts) if any(_is_local(a.rsplit(":", 1)[0]) for a in addresses)]
    if len(local) == 1:
        return local[0]
    if not local:
        raise UserError(f"no address in {path!r} belongs to this host; pass --rank R to choose this process's rank")
    raise UserError(f"ranks {local} of {path!r} all have addresses of this host; pass --rank R to choose one")


def _is_hostfile(entries: Any) -> bool:
    """A non-empty list of non-empty lists of ``"host:port"`` strings."""
    if not isinstance(entries, list) or not entries:
        return False
    for entry in cast("list[Any]", entries):
        if not isinstance(entry, list) or not entry:
            return False
        if not all(isinstance(a, str) and ":" in a for a in cast("list[Any]", entry)):
            return False
    return True


def _is_local(host: str) -> bool:
    """Whether this machine has the address ``host`` (can bind to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
        return True
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The ``pipemlx`` argument parser."""
    parser = argparse.ArgumentParser(prog="pipemlx", description="Pipeline-parallel prefill for mlx-lm models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser(
        "generate",
        help="prefill a prompt across ranks with a progress bar, then stream the generated text",
        description="Prefill a prompt across ranks, then stream the generated text and print a summary.",
    )
    _add_model_args(generate)
    where = generate.add_mutually_exclusive_group()
    where.add_argument("--ranks", type=positive_int, help=f"local ranks to start (default {DEFAULT_RANKS})")
    where.add_argument("--hostfile", help="MLX ring hostfile: run the same command on every host")
    generate.add_argument("--split", type=layer_counts, help="layers per rank, like 6,2 (default: even)")
    generate.add_argument("--rank", type=int, help="with --hostfile: this process's rank (default: found by address)")
    prompt = generate.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: the opening of Pride and Prejudice)")
    prompt.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    generate.add_argument("--max-tokens", type=positive_int, default=100, help="tokens to generate (default 100)")
    generate.add_argument(
        "--temp", type=float, default=0.7, help="sampling temperature (default 0.7; 0 for greedy decoding)"
    )
    generate.add_argument("--seed", type=int, default=0, help="sampling seed, the same on every rank (default 0)")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of the text and tables")

    bench = commands.add_parser(
        "bench",
        help="one process against a 2-rank pipeline on the same model and prompt",
        description="Time prefill and decode in one process and in a pipeline, and print the ratios.",
    )
    _add_model_args(bench)
    bench.add_argument("--ranks", type=positive_int, default=2, help="pipeline ranks (default 2)")
    bench.add_argument("--prompt-tokens", type=positive_int, default=2048, help="prompt length (default 2048)")
    bench.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to decode (default 64)")
    bench.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    bench.add_argument("--png", help="also write the pipeline's prefill timeline to this PNG (needs matplotlib)")

    commands.add_parser(
        "plan",
        help="propose a layer split from each rank's memory (pipemlx plan MODEL_DIR --ranks N --memory ...)",
        add_help=False,
    )
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="mlx-lm model folder (default: the demo model)")
    parser.add_argument(
        "--step-size",
        type=positive_int,
        help="prefill chunk in tokens (default 512, smaller for short prompts: at least 4 chunks per rank)",
    )
    parser.add_argument("--timeout", type=positive_float, default=120.0, help="seconds any pipeline wait may take")


def run_plan(argv: Sequence[str]) -> int:
    """``pipemlx plan``: handed to :func:`pipemlx.memory_split.plan_main` when this build has it."""
    try:
        from ..schedule.memory_split import plan_main  # pyright: ignore[reportMissingImports, reportUnknownVariableType]
    except ModuleNotFoundError as exc:
        if exc.name != "pipemlx.schedule.memory_split":
            raise
        print("pipemlx plan: error: not available in this build (pipemlx.memory_split is missing)", file=sys.stderr)
        return EXIT_USAGE
    return int(plan_main(list(argv)))  # pyright: ignore[reportUnknownArgumentType]


def run_generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Check the input, then run as a rank here or start the local ranks."""
    from ..launch import LaunchError, launch

    prompt = read_prompt(args)
    if args.rank is not None and args.hostfile is None:
        raise UserError("--rank only goes with --hostfile")
    if in_launched_rank() or args.hostfile is not None or (args.ranks or DEFAULT_RANKS) == 1:
        if args.hostfile is not None:
            rank = hostfile_rank(args.hostfile, args.rank)
            os.environ.update({"MLX_HOSTFILE": args.hostfile, "MLX_RANK": str(rank), "PIPEMLX_BACKEND": "ring"})
        from .generate import generate_rank

        return generate_rank(args, prompt, expected_ranks=args.ranks, check=check_ranks)
    ranks: int = args.ranks or DEFAULT_RANKS
    check_ranks(ranks, args.model, args.split)
    command = [sys.executable, "-m", "pipemlx", *argv]
    try:
        launch(ranks, command, timeout=LAUNCH_TIMEOUT, passthrough_rank=0)
    except LaunchError as exc:
        print(f"pipemlx generate: {str(exc).splitlines()[0]}", file=sys.stderr)
        for result in exc.results[1:]:
            if result.stderr.strip():
                tail = "\n".join(result.stderr.strip().splitlines()[-8:])
                print(f"--- rank {result.rank} (status {result.returncode}):\n{tail}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipemlx`` command; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["plan"]:
        return run_plan(arguments[1:])
    args = build_parser().parse_args(arguments)
    try:
        if args.command == "generate":
            return run_generate(args, arguments)
        from .bench import run_bench

        return run_bench(args, check=check_ranks)
    except UserError as exc:
        print(f"pipemlx {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"pipemlx {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
