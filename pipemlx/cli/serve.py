"""``pipemlx serve``: the options, where the ranks come from, and the supervisor of local ranks.

``--ranks N`` (N >= 2, the default) makes this process a front that is no
rank (:mod:`pipemlx.serve.supervisor`): it serves HTTP, starts the N local ranks,
and restarts them after a fault, resuming every request. Across hosts the same
front waits on ``--front-listen`` for the ``--worker`` processes each host's
supervisor runs (``--recover --hostfile``).

Without a front (``--no-recover``, ``--ranks 1``, ``--hostfile`` without
``--recover``, under ``mlx.launch``/``mpirun``), rank 0 serves HTTP itself, as
in ``pipemlx generate`` this process supervises the local ranks or is one rank,
and a fault ends the server: rank 0 notices, answers 503 for a moment and exits
with one clear line, and then the supervisor ends the rest. Ctrl-C or SIGTERM
asks rank 0 to stop the group (every rank exits 0); what is still running
after :data:`pipemlx.launch.STOP_GRACE_S` seconds is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, cast

from ..demo import MODEL_DIR
from ..launch import STOP_GRACE_S, RankFile, kill_all, spawn_ranks
from ..models.hub import is_repo_id
from .common import (
    DEFAULT_TIMEOUT,
    DefaultsFormatter,
    UserError,
    add_head_flag,
    add_prefill_step_flag,
    add_renamed_flags,
    add_sharding_flags,
    add_speculation_flags,
    check_ranks,
    check_ranks_here,
    check_speculation,
    in_launched_rank,
    join_by_hostfile,
    layer_counts,
    positive_float,
    positive_int,
    read_hostfile,
)
from .parity import REFUSED_SERVE, SERVE_MAX_TOKENS, add_adapter_flag, add_refused, check_refused

if TYPE_CHECKING:
    from ..serve.settings import RankOptions, ServeSettings

DEFAULT_RANKS = 2
DEFAULT_PORT = 8080
FAULT_GRACE = 2.0  # seconds they get after rank 0 failed (a lost peer): a follower notices within about a second
MALLOC_ARENAS = "2"
"""glibc's ``MALLOC_ARENA_MAX`` for local ranks unless set: with its default (8 per core) rank 0's threads
(HTTP, the waits' helpers) left memory fragmented across arenas, its resident size creeping by about 4 MiB a
minute under load; with 2 it stayed flat (docs/serve.md, "Sustained load"). Other C libraries ignore it."""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:  # pyright: ignore[reportPrivateUsage]
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the pipeline (needs pip install 'pipemlx[serve]')",
        description="Serve the model over HTTP with OpenAI's API: a front process serves HTTP and restarts the ranks "
        "after a fault (--no-recover: rank 0 serves HTTP itself); rank 0 leads the pipeline, every other rank follows. "
        "Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health, "
        "GET /metrics.",
        formatter_class=DefaultsFormatter,
    )
    serve.add_argument(
        "--model",
        type=Path,
        default=MODEL_DIR,
        help="mlx-lm model folder or Hugging Face repo id (default: the demo model)",
    )
    serve.add_argument(
        "--model-name", help="the model id clients use (default: pipemlx-demo, the folder's name or the repo id)"
    )
    where = serve.add_mutually_exclusive_group()
    where.add_argument("--ranks", type=positive_int, help=f"local ranks to start (default {DEFAULT_RANKS})")
    where.add_argument("--hostfile", help="MLX ring hostfile: run the same command on every host")
    serve.add_argument("--rank", type=int, help="with --hostfile: this process's rank (default: found by address)")
    serve.add_argument("--split", type=layer_counts, help="layers per rank, like 6,2 (default: even)")
    add_sharding_flags(serve)
    add_head_flag(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PIPEMLX_API_KEY"),
        help="require 'Authorization: Bearer KEY' (several keys: comma-separated, each client's prompts cached "
        "apart; default: $PIPEMLX_API_KEY, else no key); prefer the variable or "
        "--api-key-file: a key on the command line is visible to every user of the machine (ps)",
    )
    serve.add_argument(
        "--api-key-file", type=Path, metavar="PATH",
        help="read the API key from the first line of PATH (instead of --api-key)",
    )  # fmt: skip
    serve.add_argument(
        "--allowed-origins",
        type=cors_origins,
        default=(),
        metavar="ORIGIN[,ORIGIN...]",
        help="let pages from these origins (like https://app.example.com, or * for any) call the API from a "
        "browser (default: none, no CORS headers; mlx_lm.server allows any: pipemlx does not unless told)",
    )
    serve.add_argument("--max-queue", type=positive_int, default=64, help="requests that may wait; more get 429")
    serve.add_argument(
        "--decode-concurrency",
        dest="max_concurrency",
        type=positive_int,
        default=1,
        metavar="N",
        help="requests decoded together in one batch; more wait in the queue (default 1: one at a time, which "
        "speculative decoding needs; mlx_lm.server's is 32)",
    )
    serve.add_argument(
        "--prefill-chunking",
        choices=("equal-cost", "fixed"),
        default="equal-cost",
        help="with --decode-concurrency above 1, a prompt prefilled while others decode comes in chunks that "
        "shrink as positions grow, each costing what the first does (equal-cost: the default; calibrates at "
        "start-up, once: the calibration cache), or in chunks of one size (fixed)",
    )
    serve.add_argument(
        "--decode-groups",
        type=decode_groups_arg,
        default="auto",
        help="with --decode-concurrency above 1: 'auto' (the default) cuts a batch of many rows (8 per group or "
        "more) into one group per rank, each rank computing another group's step at once, where the ticks it "
        "times show it faster (docs/batching.md); 1 decodes the "
        "batch as one group, every rank in turn; a number n >= 2: groups whenever n requests decode",
    )
    serve.add_argument(
        "--prompt-cache-bytes",
        type=size_in_bytes,
        default=1 << 30,
        metavar="SIZE",
        help="KV caches of recent requests kept for reuse, in bytes, or 500M, 2G (mlx_lm.server's sizes) "
        "(default 1073741824: 1 GiB; 0: off)",
    )
    add_prefill_step_flag(serve)
    add_renamed_flags(serve, ["--step-size", "--max-concurrency", "--prefix-cache", "--cors-origin"])
    add_server_flags(serve)
    add_adapter_flag(serve)
    serve.add_argument(
        "--max-tokens",
        type=positive_int,
        default=SERVE_MAX_TOKENS,
        help="tokens per answer when a request says none, as mlx_lm.server",
    )
    serve.add_argument(
        "--temp", type=float, default=0.0, help="temperature when a request says none (default 0: greedy)"
    )
    serve.add_argument(
        "--context",
        type=positive_int,
        help="most tokens (prompt + answer) a request holds, as load_sharded's context: longer requests are refused, "
        "and lend=auto plans for it (default: the model's max_position_embeddings)",
    )
    serve.add_argument(
        "--timeout", type=positive_float, default=DEFAULT_TIMEOUT, help="seconds any wait on another rank may take"
    )
    serve.add_argument(
        "--fault-grace", type=float, default=5.0, help="after a rank fails: seconds of 503 answers before exiting"
    )
    add_limit_flags(serve)
    add_speculation_flags(serve)
    add_recovery_flags(serve)


def add_recovery_flags(serve: argparse.ArgumentParser) -> None:
    """A front process apart from the ranks, which restarts them after a fault (docs/serve.md, "Recovery")."""
    recovery = serve.add_argument_group("recovery")
    recovery.add_argument(
        "--recover", action=argparse.BooleanOptionalAction, default=None,
        help="serve HTTP from a front process that is not a rank, which restarts the ranks when one dies or stalls "
        "and resumes every request where its client's stream stopped (default: on with --ranks N, N >= 2; with "
        "--hostfile it needs --front-listen). --no-recover: rank 0 serves HTTP itself, and a fault ends the server",
    )  # fmt: skip
    recovery.add_argument(
        "--recover-timeout", type=positive_float, default=60.0, metavar="S",
        help="with the front: seconds the ranks get to come back after a fault before the waiting clients get "
        "503 with Retry-After (default 60)",
    )  # fmt: skip
    recovery.add_argument(
        "--max-restarts", type=int, default=5, metavar="N",
        help="with the front: faults within --restart-window that are restarted; one more and the server stops "
        "restarting, says why and exits (default 5)",
    )  # fmt: skip
    recovery.add_argument(
        "--restart-window", type=positive_float, default=600.0, metavar="S",
        help="with the front: the window --max-restarts counts faults in, in seconds (default 600)",
    )  # fmt: skip
    recovery.add_argument(
        "--allow-shrink", action="store_true",
        help="with the front and 3 ranks or more: go on with fewer ranks (2 at least), the split planned again "
        "(--split dropped). Local ranks: when the same rank is killed (a signal: the OOM killer, kill -9) in 3 faults "
        "in a row, one fewer. Across hosts: when hosts have not come back --shrink-after seconds after a fault, those "
        "that did, if their memory holds the model; the group grows again when the others come back",
    )  # fmt: skip
    recovery.add_argument(
        "--shrink-after", type=positive_float, default=20.0, metavar="S",
        help="with --allow-shrink across hosts: seconds to wait for every host before going on without the missing "
        "ones (default 20)",
    )  # fmt: skip
    recovery.add_argument(
        "--front-listen", type=host_port, metavar="HOST:PORT",
        help="with --recover --hostfile: the address this front listens on for rank 0 of the workers (each host "
        "runs --worker under a supervisor); the front starts no ranks. Needs $PIPEMLX_SERVE_FRONT_KEY",
    )  # fmt: skip
    recovery.add_argument(
        "--worker", action="store_true",
        help="with --hostfile and --front: run this host's rank for a front started with --recover --front-listen; "
        "after a fault it exits for its supervisor (systemd, launchd, a shell loop) to start it again",
    )  # fmt: skip
    recovery.add_argument(
        "--front", type=host_port, metavar="HOST:PORT",
        help="with --worker: the front's --front-listen address (rank 0 connects to it, with the key in "
        "$PIPEMLX_SERVE_FRONT_KEY)",
    )  # fmt: skip


def host_port(text: str) -> str:
    """argparse type: ``HOST:PORT`` with a port in 1..65535."""
    from ..serve.link import parse_address

    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_limit_flags(serve: argparse.ArgumentParser) -> None:
    """What one client may make the server hold or do, and how it stops (docs/serve.md, "Limits and timeouts")."""
    limits = serve.add_argument_group("limits")
    limits.add_argument(
        "--max-body-bytes", type=positive_int, default=4 << 20, metavar="N",
        help="largest request body; a larger one gets 413 (default 4194304: 4 MiB)",
    )  # fmt: skip
    limits.add_argument(
        "--max-tokens-limit", type=positive_int, default=8192, metavar="N",
        help="most tokens one answer may ask for; more gets 400 (default 8192)",
    )  # fmt: skip
    limits.add_argument(
        "--max-streams", type=positive_int, default=64, metavar="N",
        help="streamed answers open at once; more get 429 with Retry-After (default 64)",
    )  # fmt: skip
    limits.add_argument(
        "--header-timeout", type=positive_float, default=10.0, metavar="S",
        help="seconds a connection may take to send a request's headers (after it opened, or after the previous "
        "answer ended) before it is closed (default 10)",
    )  # fmt: skip
    limits.add_argument(
        "--body-timeout", type=positive_float, default=30.0, metavar="S",
        help="seconds a request's body may take to arrive after its headers; then 408 (default 30)",
    )  # fmt: skip
    limits.add_argument(
        "--max-connections", type=positive_int, default=1024, metavar="N",
        help="open HTTP connections; one more is answered 503 and closed (default 1024)",
    )  # fmt: skip
    limits.add_argument(
        "--idle-timeout", type=positive_int, default=5, metavar="S",
        help="seconds a kept-alive connection may sit idle between requests (default 5)",
    )  # fmt: skip
    limits.add_argument(
        "--grace", type=float, default=30.0, metavar="S",
        help="on SIGTERM/Ctrl-C: seconds the running requests get to finish before every rank stops (default 30)",
    )  # fmt: skip
    limits.add_argument(
        "--metrics-public", action="store_true",
        help="serve /metrics without the API key (default: /metrics needs it when --api-key is set)",
    )  # fmt: skip
    limits.add_argument(
        "--no-cached-tokens", action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens as 0 (the count tells how much of a prompt some "
        "earlier request shared; see docs/serve.md, 'What clients share')",
    )  # fmt: skip


def decode_groups_arg(text: str) -> int | str:
    """``--decode-groups``: ``auto`` or a positive int."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive int, got {text!r}")
    return value


def cors_origins(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated origins (mlx_lm.server's ``--allowed-origins``), each :func:`cors_origin`."""
    return tuple(cors_origin(part.strip()) for part in text.split(",") if part.strip())


def size_in_bytes(text: str) -> int:
    """argparse type: bytes, or mlx_lm.server's sizes (``500M``, ``2G``, ``1.5GB``: powers of ten)."""
    units = {"": 1, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
    number = text.strip().rstrip("MGBmgb")
    unit = text.strip()[len(number) :].upper()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected bytes or a size like 500M or 2G, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more bytes, got {text!r}")
    return int(value)


def add_server_flags(serve: argparse.ArgumentParser) -> None:
    """mlx_lm.server's flags that pipemlx serve honours beyond those it shares with generate, and those it refuses."""
    server = serve.add_argument_group("as mlx_lm.server")
    server.add_argument("--top-p", type=float, default=1.0, help="top_p when a request says none")
    server.add_argument("--top-k", type=int, default=0, help="top_k when a request says none (0: off)")
    server.add_argument("--min-p", type=float, default=0.0, help="min_p when a request says none (0: off)")
    server.add_argument("--chat-template", default="", help="a chat template for the tokenizer (default: the model's)")
    server.add_argument(
        "--use-default-chat-template", action="store_true", help="the tokenizer's default template when it has none"
    )
    server.add_argument(
        "--chat-template-args", type=json_object, default={}, help="JSON of arguments for the chat template"
    )
    server.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run the model's code")
    server.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="WARNING and above: no line per request and no start-up lines, only warnings and errors",
    )
    server.add_argument(
        "--prompt-concurrency",
        type=positive_int,
        default=8,
        help="accepted as mlx_lm.server's; pipemlx prefills one chunk of one waiting prompt per batch step",
    )
    server.add_argument("--pipeline", action="store_true", help="accepted: pipemlx always pipelines")
    add_refused(serve, REFUSED_SERVE)


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object."""
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, like '{\"enable_thinking\": false}'")
    return cast(dict[str, Any], value)


def cors_origin(text: str) -> str:
    """argparse type: ``*`` or an origin as browsers send it: lower-case ``scheme://host[:port]``, nothing after."""
    if text == "*":
        return text
    try:
        parts = urllib.parse.urlsplit(text)
        _ = parts.port  # ValueError for a port out of range
        bare = bool(parts.hostname) and "@" not in parts.netloc and text == f"{parts.scheme}://{parts.netloc}"
    except ValueError:
        bare = False
    if not bare or text != text.lower():
        raise argparse.ArgumentTypeError(
            "expected * or an origin as browsers send it, like https://app.example.com or http://localhost:3000 "
            f"(lower case, no path, no trailing slash), got {text!r}"
        )
    return text


def model_id(args: argparse.Namespace) -> str:
    if args.model_name:
        return str(args.model_name)
    if is_repo_id(args.model):  # a Hub repo: its id, as mlx-lm's server names it
        return str(args.model)
    return "pipemlx-demo" if Path(args.model).resolve() == MODEL_DIR.resolve() else Path(args.model).resolve().name


def run_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Check the input, then serve as a rank here or start and supervise the local ranks."""
    from ..serve import INSTALL_HINT, missing_packages  # no MLX: the check runs before anything starts

    if args.worker:
        check_speculation(args)
        return _worker(args)  # rank 0 under a front serves no HTTP: no serve extra needed
    if args.front is not None:
        raise UserError("--front goes with --worker (the front's own address is --front-listen)")
    missing = missing_packages()
    if missing:
        raise UserError(f"needs the serve extra ({', '.join(missing)} missing): {INSTALL_HINT}")
    if args.recover is None:  # the front by default wherever this process starts the ranks itself
        args.recover = args.hostfile is None and not in_launched_rank() and (args.ranks or DEFAULT_RANKS) >= 2
    if args.allow_shrink and not args.recover:
        raise UserError("--allow-shrink needs the front (--ranks N without --no-recover)")
    if args.front_listen is not None and not (args.recover and args.hostfile is not None):
        raise UserError("--front-listen goes with --recover --hostfile (a front for workers on other hosts)")
    if args.rank is not None and args.hostfile is None:
        raise UserError("--rank only goes with --hostfile")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    check_refused(args, REFUSED_SERVE)
    if args.grace < 0:
        raise UserError(f"--grace must be 0 or more seconds, got {args.grace:g}")
    check_weights(Path(args.model))  # every rank checks: each one exits 2 with the same line
    check_speculation(args)
    if args.recover and not in_launched_rank():
        return _front(args, argv)
    if in_launched_rank() or args.hostfile is not None or (args.ranks or DEFAULT_RANKS) == 1:
        if args.hostfile is not None:
            check_ranks_here(len(read_hostfile(args.hostfile)), args.model, args.split)
            join_by_hostfile(args.hostfile, args.rank)
        return _as_rank(args)
    ranks: int = args.ranks or DEFAULT_RANKS
    check_ranks(ranks, args.model, args.split)
    _check_port(args.host, args.port)
    from ..serve.settings import rank_process

    command, env = rank_process(_rank_options(args, parent_pid=os.getpid()))
    return supervise(ranks, command, env, stop_grace=args.grace + STOP_GRACE_S)


def _shared_key(flag: str) -> str:
    """The front's key from the environment; :class:`UserError` naming ``flag`` when it is not set."""
    from ..serve.link import FRONT_KEY_VARIABLE, check_key, key_from_environment

    key = key_from_environment()
    if key is None:
        raise UserError(
            f"{flag} needs a shared key in ${FRONT_KEY_VARIABLE}, the same on the front and every worker "
            "(e.g. from: openssl rand -hex 32)"
        )
    try:
        check_key(key)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None
    return key


def _worker(args: argparse.Namespace) -> int:
    """``--worker``: this host's rank of a group whose rank 0 serves a front on another host (``--front``)."""
    from ..serve.link import FRONT_ADDRESS_VARIABLE, JOIN_VARIABLE

    if args.recover:  # asked for (None: not said)
        raise UserError("--worker runs a rank for a front; the front is its own command (--recover --front-listen)")
    if args.hostfile is None:
        raise UserError("--worker needs --hostfile: the group's ring hostfile, the same on every host")
    if args.front is None:
        raise UserError("--worker needs --front HOST:PORT: the address the front listens on (--front-listen)")
    _shared_key("--worker")
    check_weights(Path(args.model))
    check_ranks_here(len(read_hostfile(args.hostfile)), args.model, args.split)
    rank = join_by_hostfile(args.hostfile, args.rank)
    # the front says which group to form (without a lost host: --allow-shrink)
    os.environ.update({FRONT_ADDRESS_VARIABLE: args.front, JOIN_VARIABLE: str(rank)})
    return _as_rank(args)


def check_weights(model_dir: Path) -> None:
    """Raise :class:`UserError` for the weight files of a local model folder that cannot load: an index
    naming a missing shard, a truncated or corrupt safetensors file (``safetensors``' own header check,
    which reads no tensor)."""
    if not model_dir.is_dir():
        return  # no such folder (or a Hub repo id): check_ranks or the loader says what is wrong with it
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: Any = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({str(name) for name in cast(dict[str, Any], weight_map).values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index} is not a safetensors index: {type(exc).__name__}: {exc}") from None
        missing = [name for name in shards if not (model_dir / name).is_file()]
        if missing:
            raise UserError(f"{index.name} names weight files that are not in {model_dir}: {', '.join(missing)}")
    for path in sorted(model_dir.glob("*.safetensors")):
        _check_safetensors(path)


def _check_safetensors(path: Path) -> None:
    from safetensors import SafetensorError, safe_open  # mlx-lm's dependency; the header check reads no tensors

    try:
        with safe_open(str(path), framework="numpy") as weights:  # pyright: ignore[reportUnknownVariableType]
            weights.keys()  # pyright: ignore[reportUnknownMemberType]
    except (SafetensorError, OSError) as exc:
        raise UserError(f"the weight file {path} cannot be read (corrupt or incomplete download?): {exc}") from None


def _front(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``--recover``: this process is the front; it starts the local ranks and restarts them after a fault."""
    from ..serve import FrontOptions, run_front

    listen: tuple[str, int] | None = None
    key: str | None = None
    if args.hostfile is not None:  # across hosts: the workers come to this front
        if args.front_listen is None:
            raise UserError(
                "--recover --hostfile needs --front-listen HOST:PORT: where the workers' rank 0 reaches this front"
            )
        if args.rank is not None:
            raise UserError("--rank goes with --worker: the front is no rank")
        key = _shared_key("--front-listen")
        host, _, port = str(args.front_listen).rpartition(":")
        listen = (host.strip("[]"), int(port))
        ranks = len(read_hostfile(args.hostfile))
        if ranks < 2:
            raise UserError(f"--recover needs at least 2 ranks; {args.hostfile} lists {ranks}")
    else:
        ranks = args.ranks or DEFAULT_RANKS
        if ranks < 2:
            raise UserError("--recover needs at least 2 ranks (--ranks N)")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.allow_shrink and ranks < 3:
        raise UserError(f"--allow-shrink needs 3 ranks or more (a group shrinks to 2 ranks at least), got {ranks}")
    check_ranks(ranks, args.model, args.split)
    _check_port(args.host, args.port)
    if listen is not None:
        _check_port(*listen)
    options = FrontOptions(
        _rank_options(args),
        ranks,
        host=args.host,
        port=args.port,
        env={"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", MALLOC_ARENAS)},
        recover_timeout=args.recover_timeout,
        max_restarts=args.max_restarts,
        restart_window=args.restart_window,
        listen=listen,
        key=key,
        allow_shrink=args.allow_shrink,
        shrink_after=args.shrink_after,
        hosts=read_hostfile(str(args.hostfile)) if listen is not None else [],
    )
    return run_front(options)


def api_key(args: argparse.Namespace) -> str | None:
    """The API key: ``--api-key-file``'s first line, else ``--api-key`` (or ``$PIPEMLX_API_KEY``); None for none."""
    path: Path | None = args.api_key_file
    if path is None:
        return args.api_key or None
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"pipemlx serve: --api-key-file: cannot read {path}: {exc}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise SystemExit(f"pipemlx serve: --api-key-file: {path} holds no key on its first line")
    return key


def _settings(args: argparse.Namespace) -> ServeSettings:
    """The settings the command line sets, by who reads them."""
    from ..serve.requests import SamplingParams
    from ..serve.settings import EngineSettings, HttpLimits, ProcessControl, RequestDefaults, ServeSettings

    return ServeSettings(
        model_id=model_id(args),
        http=HttpLimits(
            api_key=api_key(args),
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            max_tokens_limit=args.max_tokens_limit,
            max_streams=args.max_streams,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            max_connections=args.max_connections,
            idle_timeout=args.idle_timeout,
            metrics_public=args.metrics_public,
            report_cached_tokens=not args.no_cached_tokens,
            cors_origins=tuple(args.allowed_origins),
        ),
        engine=EngineSettings(
            max_concurrency=args.max_concurrency,
            prefill_chunking=args.prefill_chunking,
            decode_groups=args.decode_groups,
            prefix_cache_mb=args.prompt_cache_bytes / float(1 << 20),
            prefill_step_size=args.prefill_step_size,
            timeout=args.timeout,
            context=args.context,
            draft_model=args.draft_model,
            num_draft_tokens=args.num_draft_tokens,
            prompt_lookup=args.prompt_lookup,
        ),
        defaults=RequestDefaults(
            max_tokens=args.max_tokens,
            sampling=SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p),
            chat_template=args.chat_template,
            chat_template_args=json.dumps(args.chat_template_args),
            use_default_chat_template=args.use_default_chat_template,
        ),
        process=ProcessControl(grace=args.grace, fault_grace=max(0.0, args.fault_grace), log_level=args.log_level),
    )


def _rank_options(args: argparse.Namespace, parent_pid: int | None = None) -> RankOptions:
    """What each rank serves with; ``parent_pid``: the process that starts the ranks (rank 0 stops when it is
    gone)."""
    from ..serve.settings import RankOptions

    settings = _settings(args)
    if parent_pid is not None:
        settings = replace(settings, process=replace(settings.process, parent_pid=parent_pid))
    expected = args.ranks if args.ranks is not None and in_launched_rank() else None
    return RankOptions(
        Path(args.model),
        settings,
        host=args.host,
        port=args.port,
        split=args.split,
        expected_ranks=expected,
        allow_unregistered=args.allow_unregistered,
        lend=args.lend,
        head=args.head,
        trust_remote_code=args.trust_remote_code,
        adapter_path=args.adapter_path,
    )


def _as_rank(args: argparse.Namespace) -> int:
    from ..serve import run_rank  # MLX and mlx-lm: imported only where a rank runs

    return run_rank(_rank_options(args))


def _check_port(host: str, port: int) -> None:
    """Fail early, before any rank starts, when the address cannot be listened on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def supervise(
    num_ranks: int, command: list[str], env: dict[str, str] | None = None, stop_grace: float = STOP_GRACE_S
) -> int:
    """Start ``num_ranks`` local ranks of ``command`` (with ``env`` added) and wait for them; returns rank 0's exit
    status.

    Rank 0's output is this process's. When rank 0 exits or is asked to stop, the others get
    ``stop_grace`` seconds to follow (``--grace`` plus :data:`~pipemlx.launch.STOP_GRACE_S`), then are killed;
    a follower's stderr tail is shown when it failed. Ctrl-C / SIGTERM forward SIGTERM to rank 0.
    """
    with tempfile.TemporaryDirectory(prefix="pipemlx-serve-") as tmp:
        directory = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[IO[bytes] | None] = []
        stopping: list[float] = []

        def forward(signum: int, frame: FrameType | None) -> None:
            if stopping:  # a second Ctrl-C: no more waiting
                raise KeyboardInterrupt
            stopping.append(time.monotonic())
            if procs and procs[0].poll() is None:
                procs[0].send_signal(signal.SIGTERM)

        def outputs(rank: int) -> tuple[RankFile, RankFile]:
            """Rank 0 writes to this terminal; the others' stdout is dropped and their stderr kept for the end."""
            err = None if rank == 0 else open(directory / f"rank{rank}.err", "w+b")
            logs.append(err)
            return (None if rank == 0 else subprocess.DEVNULL), err

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            env = {**(env or {}), "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", MALLOC_ARENAS)}
            spawn_ranks(command, num_ranks, directory=directory, env=env, outputs=outputs, on_start=procs.append)
            return _wait(procs, logs, stopping, stop_grace)
        except KeyboardInterrupt:
            print("pipemlx serve: interrupted", file=sys.stderr)
            return 130
        finally:
            kill_all(procs)
            for f in logs:
                if f is not None:
                    f.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


def _wait(
    procs: list[subprocess.Popen[bytes]], logs: list[IO[bytes] | None], stopping: list[float], stop_grace: float
) -> int:
    leader_done: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if codes[0] is not None and leader_done is None:
            leader_done = time.monotonic()
        if all(c is not None for c in codes):
            break
        started = leader_done if leader_done is not None else (stopping[0] if stopping else None)
        grace = FAULT_GRACE if codes[0] not in (None, 0) else stop_grace
        if started is not None and time.monotonic() - started > grace:
            break
        time.sleep(0.1)
    for rank, proc in enumerate(procs[1:], start=1):
        code = proc.poll()
        f = logs[rank]
        if code not in (0, None) and f is not None and procs[0].poll() not in (1, 2):
            f.seek(0)
            tail = "\n".join(f.read().decode(errors="replace").strip().splitlines()[-8:])
            print(f"--- rank {rank} (status {code}):\n{tail}", file=sys.stderr)
    code = procs[0].poll()
    return 1 if code is None else (code if code >= 0 else 128 - code)
