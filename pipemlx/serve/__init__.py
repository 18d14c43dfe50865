"""``pipemlx serve``: an OpenAI-compatible HTTP server over a pipeline of ranks, built on pipemlx's public API.

Every rank loads its share of the model (:func:`pipemlx.load_sharded`), warms
the pipeline up and greets the others (:class:`.engines.Rank`); then rank 0
serves HTTP (:mod:`.app`) over the request queue (:mod:`.front`) and leads the
serving loop (:mod:`.loop`), which every other rank follows, each driving one
scheduler (:mod:`.engines`). Requests reuse the KV caches of earlier ones
(:mod:`.prefix_cache`). The OpenAI wire format is in :mod:`.openai_api`.

With ``--recover`` (:func:`run_front`) HTTP and the requests' state live in a
front process that is not a rank (:mod:`.recovery`); it starts the ranks,
rank 0 serves the requests it is sent over a local link (:mod:`.link`,
:mod:`.worker`), and after a fault the front restarts the ranks and resumes
every request.

Needs the ``serve`` extra (``pip install 'pipemlx[serve]'``: Starlette,
uvicorn and prometheus_client) on rank 0; :func:`missing_packages` says what is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from pathlib import Path
from types import FrameType
from typing import Any, cast

from ..errors import PipelineError
from ..launch import init_group
from ..models.hub import locate_model
from ..models.loading import load_draft, load_sharded
from ..models.sharding import LendSpec
from .engines import Rank, Scheduler, make_scheduler
from .front import Front, ServeSettings, log
from .link import FRONT_ADDRESS_VARIABLE, Link
from .loop import Leader, LocalRequests, follow
from .worker import JOIN_VARIABLE, LinkRequests

SERVE_PACKAGES = ("starlette", "uvicorn", "prometheus_client")
CONNECT_EVERY_S = 1.0
"""Seconds between rank 0's attempts to reach a front that is not answering (``--worker``)."""
HANDSHAKE_WAIT_S = 2.0
"""The longest one attempt to reach the front may take (less with a short ``--timeout``)."""
INSTALL_HINT = "pip install 'pipemlx[serve]'  (or: pip install starlette uvicorn prometheus_client)"

__all__ = [
    "INSTALL_HINT",
    "FrontOptions",
    "RankOptions",
    "ServeSettings",
    "missing_packages",
    "model_context",
    "run_front",
    "run_rank",
]


def missing_packages() -> list[str]:
    """The packages of the ``serve`` extra that cannot be imported here."""
    return [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]


def model_context(model_dir: Path) -> int | None:
    """The model's ``max_position_embeddings`` (from ``config.json``, or its ``text_config``), if it says."""
    try:
        config: Any = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    top = cast(dict[str, Any], config)
    text_config = top.get("text_config")
    for where in (top, cast(dict[str, Any], text_config) if isinstance(text_config, dict) else {}):
        value = where.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class RankOptions:
    """What one rank needs to start serving."""

    model_dir: Path
    settings: ServeSettings
    host: str = "127.0.0.1"
    port: int = 8080
    split: list[int] | None = None
    expected_ranks: int | None = None
    allow_unregistered: bool = False
    lend: LendSpec = "auto"
    cors_origins: tuple[str, ...] = ()
    """Origins (``"*"``: any) whose pages may call the HTTP API from a browser; none by default."""


def run_rank(options: RankOptions) -> int:
    """Serve as one rank of the group this process belongs to; returns the exit status (or exits after a fault)."""
    joined = _join(options) if os.environ.get(JOIN_VARIABLE) is not None else None
    group = init_group()
    rank, size = group.rank(), group.size()
    settings = options.settings
    if options.expected_ranks is not None and options.expected_ranks != size:
        if rank == 0:
            print(
                f"pipemlx serve: error: --ranks {options.expected_ranks} but the group has {size} ranks",
                file=sys.stderr,
            )
        return 2
    front_address = os.environ.get(FRONT_ADDRESS_VARIABLE)  # a front process serves HTTP (--recover)
    if rank == 0 and front_address is None and missing_packages():
        print(f"pipemlx serve: error: rank 0 needs the serve extra: {INSTALL_HINT}", file=sys.stderr)
        os._exit(2)  # the other ranks notice the lost peer and exit
    try:
        model, tokenizer = load_sharded(
            options.model_dir,
            group,
            split=options.split,
            timeout=settings.timeout,
            allow_unregistered=options.allow_unregistered,
            context=settings.context,
            lend=options.lend,
        )
    except (ValueError, OSError) as exc:
        print(f"pipemlx serve: error: cannot load the model in {options.model_dir}: {exc}", file=sys.stderr)
        os._exit(2)
    except PipelineError as exc:  # an architecture it refuses, a group that fails while sharding: as generate says it
        print(f"pipemlx serve: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
    try:  # speculative decoding: the draft is whole on every rank (mlx-lm's loader, a folder or a repo id)
        draft = None if settings.draft_model is None else load_draft(settings.draft_model)
    except Exception as exc:  # a folder without a model, a repo the Hub lacks: one line on every rank
        print(f"pipemlx serve: error: cannot load the draft model {settings.draft_model}: {exc}", file=sys.stderr)
        os._exit(2)
    engine = Rank(model, tokenizer, group, settings, draft)
    try:
        engine.start()
    except PipelineError as exc:
        print(
            f"pipemlx serve: rank {rank}: the pipeline failed at start-up: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        os._exit(1)
    try:
        scheduler = make_scheduler(engine)
    except TypeError as exc:  # the same model on every rank: every rank says so and exits
        print(f"pipemlx serve: error: --max-concurrency {settings.max_concurrency}: {exc}", file=sys.stderr)
        os._exit(2)
    except PipelineError as exc:  # a peer lost or stalled while the batch scheduler calibrated
        print(
            f"pipemlx serve: rank {rank}: the pipeline failed at start-up: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        os._exit(1)  # after a lost or stalled peer, MLX's teardown can block or abort
    if rank != 0:
        return _follow(engine, scheduler)
    if joined is not None:  # across hosts: the link rank 0 joined the front over
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when the group stops
        return Leader(engine, scheduler, LinkRequests(engine, joined)).serve()
    if front_address is not None:
        return _work(engine, scheduler, front_address)
    return _lead(engine, scheduler, options)


def _join(options: RankOptions) -> Link | None:
    """A ``--worker``: join the front, then form the group it assigns (the hosts, this worker's rank among them, the
    split) from a hostfile of those hosts; rank 0 keeps the link, every other rank closes it."""
    from ..launch import available_memory
    from .link import key_from_environment
    from .worker import join_front

    address = os.environ[FRONT_ADDRESS_VARIABLE]
    attempt_s = min(HANDSHAKE_WAIT_S, options.settings.timeout / 4)
    entry = int(os.environ[JOIN_VARIABLE])
    assignment = join_front(address, key_from_environment() or "", entry, available_memory(), attempt_s)
    hostfile = Path(tempfile.gettempdir()) / f"pipemlx-serve-worker-{entry}-{os.getuid()}.json"  # assigned hosts
    hostfile.write_text(json.dumps(assignment.hosts), encoding="utf-8")
    os.environ.update({"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(assignment.rank)})
    if assignment.split is not None:
        options.split = assignment.split
    print(
        f"pipemlx serve: worker {entry}: forming a group of {len(assignment.hosts)} as rank {assignment.rank}"
        + (f", split {assignment.split}" if assignment.split is not None else ""),
        file=sys.stderr,
        flush=True,
    )
    if assignment.rank == 0:
        return assignment.link
    assignment.link.close()
    return None


def _work(engine: Rank, scheduler: Scheduler, front_address: str) -> int:
    """Rank 0 under a front process: connect to it, greet it, serve what it sends.

    Until the front answers (it may be down, restarting, or across a cut network) rank 0 tries again every
    :data:`CONNECT_EVERY_S` seconds and keeps the other ranks waiting with idle broadcasts, so a group that is
    up stays up; a lost or stalled peer meanwhile ends the worker (its supervisor starts it again)."""
    from .broadcast import IDLE
    from .link import connect, key_from_environment

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when the group stops
    key = key_from_environment() or ""
    timeout = engine.settings.timeout
    attempt_s = min(HANDSHAKE_WAIT_S, timeout / 4)  # each attempt ends well before the followers' wait does
    said = False
    while True:
        started = time.monotonic()
        try:
            link = connect(front_address, key, timeout=attempt_s)
            break
        except (OSError, EOFError, ValueError, AuthenticationError) as exc:  # AuthenticationError: a wrong key
            if not said:
                print(
                    f"pipemlx serve: rank 0: cannot reach the front at {front_address} ({type(exc).__name__}: "
                    f"{exc}); trying again every {CONNECT_EVERY_S:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
        try:
            engine.exchange({"op": IDLE, "pause_ms": int(CONNECT_EVERY_S * 1000)}, timeout, "waiting for the front")
        except PipelineError as exc:
            print(f"pipemlx serve: rank 0: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(1)  # after a lost or stalled peer, MLX's teardown can block
        time.sleep(max(0.0, CONNECT_EVERY_S - (time.monotonic() - started)))
    if said:
        print(f"pipemlx serve: rank 0: connected to the front at {front_address}", file=sys.stderr, flush=True)
    return Leader(engine, scheduler, LinkRequests(engine, link)).serve()


def _follow(engine: Rank, scheduler: Scheduler) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    try:
        return follow(engine, scheduler)
    except BaseException as exc:  # a lost or stalled peer, ranks out of step: the group cannot go on
        print(f"pipemlx serve: rank {engine.rank}: exiting: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # after a lost or stalled peer, MLX's teardown can block


def _lead(engine: Rank, scheduler: Scheduler, options: RankOptions) -> int:
    from .app import Api, HttpThread  # Starlette and uvicorn: rank 0 only

    settings = options.settings
    split = list(engine.stage.info.split)
    front = Front(settings, split, engine.prefix, engine.slots)
    leader = Leader(engine, scheduler, LocalRequests(front, engine.tokenizer, settings.parent_pid))
    context = settings.context if settings.context is not None else model_context(options.model_dir)
    api = Api(front, engine.tokenizer, settings, context)
    http = HttpThread(api.app(cors_origins=options.cors_origins), options.host, options.port, settings)
    if not http.start():
        print(f"pipemlx serve: error: cannot listen on {options.host}:{options.port}: {http.failure}", file=sys.stderr)
        front.stopping.set()
        leader.serve()  # tells the other ranks to stop
        return 2

    def stop(signum: int, frame: FrameType | None) -> None:
        if front.stopping.is_set():  # a second signal: no more waiting
            log(f"{signal.Signals(signum).name} again: exiting now")
            os._exit(130)
        log(
            f"{signal.Signals(signum).name}: new requests get 503; the running ones get {settings.grace:g} s "
            "(--grace) to finish, then every rank stops"
        )
        front.request_stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    ranks = ", ".join(f"rank {r} layers {sum(split[:r])}-{sum(split[: r + 1]) - 1}" for r in range(len(split)))
    log(
        f"{settings.model_id}: {sum(split)} layers on {len(split)} rank{'s' if len(split) > 1 else ''} "
        f"({ranks}); prefix cache {settings.prefix_cache_mb:g} MB ({engine.prefix.budget_tokens} tokens); "
        f"context {context or 'unlimited'}; queue {settings.max_queue}"
        + (f"; up to {settings.max_concurrency} requests batched" if settings.max_concurrency > 1 else "")
        + (f"; speculative decoding: {settings.speculation}" if settings.speculation else "")
    )
    log(f"listening on http://{options.host}:{options.port} (OpenAI API under /v1, status at /health)")
    status = leader.serve()  # a lost or stalled rank: 503 for --fault-grace seconds, then the process exits
    http.stop()
    log("stopped")
    return status


@dataclass
class FrontOptions:
    """What the front process of ``pipemlx serve --recover`` needs: HTTP, the model's tokenizer, the ranks."""

    model_dir: Path  # a folder, or a Hub repo id (the front fetches its tokenizer files, the ranks their weights)
    settings: ServeSettings
    ranks: int
    command: list[str]
    host: str = "127.0.0.1"
    port: int = 8080
    cors_origins: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict[str, str])
    recover_timeout: float = 60.0
    max_restarts: int = 5
    restart_window: float = 600.0
    listen: tuple[str, int] | None = None
    """Across hosts: the address rank 0 of the workers connects to (the front then starts no ranks)."""
    key: str | None = None
    """Across hosts: the link's shared key (``PIPEMLX_SERVE_FRONT_KEY``)."""
    allow_shrink: bool = False
    """Fewer ranks after a fault (``--allow-shrink``): local ranks, one fewer after a rank was killed in several
    faults in a row; across hosts, the hosts that came back when the others stay gone for ``shrink_after`` s."""
    shrink_after: float = 20.0
    hosts: list[list[str]] = field(default_factory=list[list[str]])
    """Across hosts: the hostfile's entries (the front tells each joining worker which of them form the group)."""


def front_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer as every rank loads it (mlx-lm's ``load_tokenizer``): the front tokenizes and
    detokenizes, and joins no group."""
    from mlx_lm.utils import load_tokenizer  # pyright: ignore[reportUnknownVariableType]

    try:
        config: Any = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    eos = cast(dict[str, Any], config).get("eos_token_id") if isinstance(config, dict) else None
    return load_tokenizer(model_dir, None, eos_token_ids=eos)


def run_front(options: FrontOptions) -> int:
    """Serve HTTP in this process and run the ranks as workers, restarting them after a fault (``--recover``)."""
    from .app import Api, HttpThread
    from .recovery import GroupFront, RecoverOptions, stop_handler

    settings = options.settings
    try:  # a Hub repo id: its config and tokenizer files fetched (or found in the cache), as every rank does
        model_dir = locate_model(options.model_dir).root
        tokenizer = front_tokenizer(model_dir)
    except (OSError, ValueError) as exc:  # ModelNotFoundError (one line) too
        print(f"pipemlx serve: error: cannot load the tokenizer of {options.model_dir}: {exc}", file=sys.stderr)
        return 2
    front = Front(settings, [0] * options.ranks)
    context = settings.context if settings.context is not None else model_context(model_dir)
    api = Api(front, tokenizer, settings, context)
    recover = RecoverOptions(
        options.ranks,
        options.command,
        env=options.env,
        recover_timeout=options.recover_timeout,
        max_restarts=options.max_restarts,
        restart_window=options.restart_window,
        listen=options.listen,
        key=options.key,
        allow_shrink=options.allow_shrink,
        shrink_after=options.shrink_after,
        hosts=options.hosts,
        model=model_dir,
    )
    try:
        group = GroupFront(front, tokenizer, recover)
    except OSError as exc:
        where = "" if options.listen is None else f" {options.listen[0]}:{options.listen[1]} (--front-listen)"
        print(f"pipemlx serve: error: cannot listen on{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    http = HttpThread(api.app(cors_origins=options.cors_origins), options.host, options.port, settings)
    if not http.start():
        print(f"pipemlx serve: error: cannot listen on {options.host}:{options.port}: {http.failure}", file=sys.stderr)
        group.close()
        return 2
    handler = stop_handler(front, group)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    bounds = (
        f"--recover-timeout {options.recover_timeout:g} s, --max-restarts {options.max_restarts} in "
        f"{options.restart_window:g} s"
    )
    if options.listen is None:
        log(
            f"{settings.model_id}: the front serves http://{options.host}:{options.port} and runs {options.ranks} "
            f"ranks, restarting them after a fault ({bounds})"
        )
    else:
        host, port = options.listen
        log(
            f"{settings.model_id}: the front serves http://{options.host}:{options.port} and waits for rank 0 of "
            f"{options.ranks} workers on {host}:{port}; after a fault their supervisors restart them ({bounds})"
        )
    status = group.run()
    http.stop()
    log("stopped")
    return status
