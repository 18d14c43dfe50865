"""The ``pipemlx`` command: ``generate``, ``serve``, ``bench``, ``split`` (alias ``plan``) and ``doctor``.

One module per command (what they share is in :mod:`.common`); this module
holds the parser and the dispatcher. Without ``--model`` the commands use the
demo model shipped in :mod:`pipemlx.demo`. Two tools have a command line of
their own: ``python -m pipemlx.cli.timeline`` and ``python -m pipemlx.cli.costmodel``.

Where the ranks come from (``generate``, ``serve``):

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
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .._version import __version__
from ..demo import MODEL_DIR
from ..launch import LaunchError, launch
from . import doctor as doctor_command
from . import serve as serve_command
from . import split as split_command
from .common import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TIMEOUT,
    DefaultsFormatter,
    UserError,
    add_head_flag,
    add_prefill_step_flag,
    add_renamed_flags,
    add_sharding_flags,
    add_speculation_flags,
    check_ranks,
    check_speculation,
    in_launched_rank,
    join_by_hostfile,
    layer_counts,
    positive_float,
    positive_int,
    read_prompt,
    token_limit,
)
from .parity import (
    GENERATE_MAX_TOKENS,
    REFUSED_GENERATE,
    add_adapter_flag,
    add_generate_flags,
    check_refused,
    template_config,
)

DEFAULT_RANKS = 2
LAUNCH_TIMEOUT = 7 * 24 * 3600.0
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    """The ``pipemlx`` argument parser."""
    parser = argparse.ArgumentParser(prog="pipemlx", description="Pipeline-parallel prefill for mlx-lm models.")
    parser.add_argument("--version", action="version", version=f"pipemlx {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser(
        "generate",
        help="prefill a prompt across ranks with a progress bar, then stream the generated text",
        description="Prefill a prompt across ranks, then stream the generated text and print a summary.",
        formatter_class=DefaultsFormatter,
    )
    _add_model_args(generate)
    where = generate.add_mutually_exclusive_group()
    where.add_argument("--ranks", type=positive_int, help=f"local ranks to start (default {DEFAULT_RANKS})")
    where.add_argument("--hostfile", help="MLX ring hostfile: run the same command on every host")
    generate.add_argument("--split", type=layer_counts, help="layers per rank, like 6,2 (default: even)")
    generate.add_argument("--rank", type=int, help="with --hostfile: this process's rank (default: found by address)")
    prompt = generate.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt", "-p", help="prompt text; - reads standard input (default: the opening of Pride and Prejudice)"
    )
    prompt.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    generate.add_argument(
        "--max-tokens",
        "-m",
        type=token_limit,
        default=GENERATE_MAX_TOKENS,
        help="the most tokens to generate (-1: no limit), as mlx_lm.generate",
    )
    generate.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (0: greedy decoding, as mlx-lm)"
    )
    generate.add_argument("--seed", type=int, help="sampling seed (default: none, as mlx-lm)")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of the text and tables")
    add_sharding_flags(generate)
    add_head_flag(generate)
    add_speculation_flags(generate)
    add_generate_flags(generate)
    add_adapter_flag(generate)

    serve_command.add_parser(commands)

    bench = commands.add_parser(
        "bench",
        help="one process against a 2-rank pipeline on the same model and prompt",
        description="Time prefill and decode in one process (mlx-lm, at --prefill-step-size, or at mlx-lm's default "
        "step with auto) and in a pipeline, and print the ratios.",
        formatter_class=DefaultsFormatter,
    )
    _add_model_args(bench)
    bench.add_argument("--ranks", type=positive_int, default=2, help="pipeline ranks")
    bench.add_argument("--prompt-tokens", type=positive_int, default=2048, help="prompt length")
    bench.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="tokens to decode")
    bench.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    bench.add_argument("--png", help="also write the pipeline's prefill timeline to this PNG (needs matplotlib)")
    add_sharding_flags(bench)

    doctor_command.add_parser(commands)

    commands.add_parser(
        "split",
        aliases=["plan"],
        help="propose a layer split from each rank's memory (pipemlx split MODEL_DIR --ranks N --memory ...); "
        "plan: an alias",
        add_help=False,
    )
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=MODEL_DIR,
        help="mlx-lm model folder or Hugging Face repo id (default: the demo model)",
    )
    add_prefill_step_flag(parser)
    add_renamed_flags(parser, ["--step-size"])
    parser.add_argument(
        "--timeout", type=positive_float, default=DEFAULT_TIMEOUT, help="seconds any pipeline wait may take"
    )


def run_generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Check the input, then run as a rank here or start the local ranks."""
    check_refused(args, REFUSED_GENERATE)
    template_config(args.chat_template_config)
    prompt = read_prompt(args)
    if args.rank is not None and args.hostfile is None:
        raise UserError("--rank only goes with --hostfile")
    check_speculation(args)  # every rank checks: each one exits 2 with the same line
    if in_launched_rank() or args.hostfile is not None or (args.ranks or DEFAULT_RANKS) == 1:
        if args.hostfile is not None:
            join_by_hostfile(args.hostfile, args.rank)
        from .generate import generate_rank  # MLX and mlx-lm: imported only where a rank runs

        return generate_rank(args, prompt, expected_ranks=args.ranks)
    ranks: int = args.ranks or DEFAULT_RANKS
    check_ranks(ranks, args.model, args.split)
    with tempfile.TemporaryDirectory(prefix="pipemlx-generate-") as tmp:
        if args.prompt == "-":  # read here, once: the ranks get it in a file
            argv = _prompt_from_file(argv, prompt, Path(tmp) / "prompt.txt")
        return _launch(ranks, [sys.executable, "-m", "pipemlx", *argv])


def _prompt_from_file(argv: Sequence[str], prompt: str, path: Path) -> list[str]:
    """``argv`` with ``--prompt -`` (standard input) replaced by ``--prompt-file`` holding ``prompt``."""
    path.write_text(prompt, encoding="utf-8")
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--prompt", "-p"):
            skip = True
        elif arg not in ("--prompt=-", "-p-"):
            out.append(arg)
    return [*out, "--prompt-file", str(path)]


def _launch(ranks: int, command: list[str]) -> int:
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


def run() -> NoReturn:
    """The ``pipemlx`` program: :func:`main`, then exit. After a failure (status 1: a lost or stalled peer among
    them) the process exits at once, as MLX's teardown of a broken group can abort it or block."""
    code = main()
    if code == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipemlx`` command; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] in (["split"], ["plan"]):
        return split_command.main(arguments[1:], prog=f"pipemlx {arguments[0]}")
    args = build_parser().parse_args(arguments)
    try:
        if args.command == "generate":
            return run_generate(args, arguments)
        if args.command == "serve":
            return serve_command.run_serve(args, arguments)
        if args.command == "doctor":
            return doctor_command.run_doctor(args, arguments)
        from .bench import run_bench  # MLX and mlx-lm: imported only when benchmarking

        return run_bench(args)
    except UserError as exc:
        print(f"pipemlx {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"pipemlx {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
