"""``pipemlx serve``: an OpenAI-compatible HTTP server over a pipeline of ranks, built on pipemlx's public API.

A request's way, in one shape (:class:`.requests.Request`): the HTTP side
(:mod:`.app`, the OpenAI wire format in :mod:`.openai_api`) checks it and
queues it in the book (:mod:`.book`), which owns every running request's
answer. Every rank loads its share of the model (:func:`pipemlx.load_sharded`),
warms the pipeline up and greets the others (:class:`.rank.Rank`); rank 0 leads
the serving loop (:mod:`.loop`), taking requests from the book (in its own
process, or over the front's link: :mod:`.sources`), and every other rank
follows it; each drives one scheduler (:mod:`.schedulers`). Requests reuse the
KV caches of earlier ones (:mod:`.prefix_cache`). Settings, by who reads them:
:mod:`.settings`.

With the front (the default with ``--ranks N``, :func:`run_front`) HTTP and the
book live in a process that is not a rank: its supervisor (:mod:`.supervisor`)
starts the ranks and restarts them after a fault, and its relay (:mod:`.relay`)
hands the requests to rank 0 over a link (:mod:`.link`) and resumes them on
the new group.

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
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from ..errors import PipelineError
from ..launch import init_group
from ..models.hub import locate_model
from ..models.loading import load_draft, load_sharded, load_tokenizer_of, model_context
from .book import Book, configure_logging, log
from .link import CONNECT_EVERY_S, FRONT_ADDRESS_VARIABLE, JOIN_VARIABLE, Link
from .loop import Leader, follow
from .rank import Rank
from .schedulers import Scheduler, make_scheduler
from .settings import RankOptions, ServeSettings
from .sources import LinkRequests, LocalRequests
from .supervisor import FrontOptions

SERVE_PACKAGES = ("starlette", "uvicorn", "prometheus_client")
HANDSHAKE_WAIT_S = 2.0
"""The longest one attempt to reach the front may take (less with a short ``--timeout``)."""
INSTALL_HINT = "pip install 'pipemlx[serve]'  (or: pip install starlette uvicorn prometheus_client)"

__all__ = [
    "INSTALL_HINT",
    "FrontOptions",
    "RankOptions",
    "ServeSettings",
    "missing_packages",
    "run_front",
    "run_rank",
]


def missing_packages() -> list[str]:
    """The packages of the ``serve`` extra that cannot be imported here."""
    return [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]


def run_rank(options: RankOptions) -> int:
    """Serve as one rank of the group this process belongs to; returns the exit status (or exits after a fault)."""
    configure_logging(options.settings.process.log_level)
    joined: Link | None = None
    if os.environ.get(JOIN_VARIABLE) is not None:
        joined, options = _join(options)
    group = init_group()
    rank, size = group.rank(), group.size()
    settings = options.settings
    engine = settings.engine
    if options.expected_ranks is not None and options.expected_ranks != size:
        if rank == 0:
            print(
                f"pipemlx serve: error: --ranks {options.expected_ranks} but the group has {size} ranks",
                file=sys.stderr,
            )
        return 2
    front_address = os.environ.get(FRONT_ADDRESS_VARIABLE)  # a front process serves HTTP (--recover)
    if rank == 0 and front_address is None and missing_packages():
        _exit(2, f"error: rank 0 needs the serve extra: {INSTALL_HINT}")  # the other ranks notice the lost peer
    try:
        model, tokenizer = load_sharded(
            options.model_dir,
            group,
            split=options.split,
            timeout=engine.timeout,
            allow_unregistered=options.allow_unregistered,
            context=engine.context,
            lend=options.lend,
            head=options.head,
            trust_remote_code=options.trust_remote_code,
            adapter_path=options.adapter_path,
        )
    except (ValueError, OSError) as exc:
        _exit(2, f"error: cannot load the model in {options.model_dir}: {exc}")
    except PipelineError as exc:  # an architecture it refuses, a group that fails while sharding: as generate says it
        _exit(1, f"rank {rank}: {type(exc).__name__}: {exc}")
    try:  # speculative decoding: the draft is whole on every rank (mlx-lm's loader, a folder or a repo id)
        draft = None if engine.draft_model is None else load_draft(engine.draft_model)
    except Exception as exc:  # a folder without a model, a repo the Hub lacks: one line on every rank
        _exit(2, f"error: cannot load the draft model {engine.draft_model}: {exc}")
    here = Rank(model, tokenizer, group, engine, draft)
    try:
        here.start()
        scheduler = make_scheduler(here)
    except TypeError as exc:  # the same model on every rank: every rank says so and exits
        _exit(2, f"error: --decode-concurrency {engine.max_concurrency}: {exc}")
    except PipelineError as exc:  # a peer lost or stalled while warming up or while the batch scheduler calibrated
        _exit(1, f"rank {rank}: the pipeline failed at start-up: {type(exc).__name__}: {exc}")
    if rank != 0:
        return _follow(here, scheduler)
    if joined is not None:  # across hosts: the link rank 0 joined the front over
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when the group stops
        return Leader(here, scheduler, LinkRequests(here, joined)).serve()
    if front_address is not None:
        return _work(here, scheduler, front_address)
    return _lead(here, scheduler, options)


def _exit(status: int, line: str) -> NoReturn:
    """Say ``line`` and exit now: after a lost or stalled peer, MLX's teardown can block or abort."""
    print(f"pipemlx serve: {line}", file=sys.stderr, flush=True)
    os._exit(status)


def _join(options: RankOptions) -> tuple[Link | None, RankOptions]:
    """A ``--worker``: join the front, then form the group it assigns (the hosts, this worker's rank among them, the
    split) from a hostfile of those hosts; rank 0 keeps the link, every other rank closes it. The options with the
    assigned split."""
    from ..launch import available_memory
    from .link import check_key, join_front, key_from_environment

    address = os.environ[FRONT_ADDRESS_VARIABLE]
    attempt_s = min(HANDSHAKE_WAIT_S, options.settings.engine.timeout / 4)
    entry = int(os.environ[JOIN_VARIABLE])
    key = key_from_environment() or ""
    try:
        check_key(key)
    except ValueError as exc:
        _exit(2, f"worker {entry}: {exc}")
    assignment = join_front(address, key, entry, available_memory(), attempt_s)
    # The assigned hosts, at a path no other user can guess or reach (mkstemp: random name, mode 0600).
    fd, name = tempfile.mkstemp(prefix=f"pipemlx-serve-worker-{entry}-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(json.dumps(assignment.hosts))
    hostfile = Path(name)
    os.environ.update({"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(assignment.rank)})
    if assignment.split is not None:
        options = replace(options, split=assignment.split)
    print(
        f"pipemlx serve: worker {entry}: forming a group of {len(assignment.hosts)} as rank {assignment.rank}"
        + (f", split {assignment.split}" if assignment.split is not None else ""),
        file=sys.stderr,
        flush=True,
    )
    if assignment.rank == 0:
        return assignment.link, options
    assignment.link.close()
    return None, options


def _work(engine: Rank, scheduler: Scheduler, front_address: str) -> int:
    """Rank 0 under a front process: connect to it, greet it, serve what it sends.

    Until the front answers rank 0 keeps the other ranks waiting with idle broadcasts, so a group that is up
    stays up; a lost or stalled peer meanwhile ends the worker (its supervisor starts it again)."""
    from .broadcast import IDLE
    from .link import connect_retrying, key_from_environment

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when the group stops
    timeout = engine.settings.timeout

    def keep_the_group() -> None:
        try:
            engine.exchange({"op": IDLE, "pause_ms": int(CONNECT_EVERY_S * 1000)}, timeout, "waiting for the front")
        except PipelineError as exc:
            _exit(1, f"rank 0: {type(exc).__name__}: {exc}")

    # Each attempt ends well before the followers' wait does.
    attempt_s = min(HANDSHAKE_WAIT_S, timeout / 4)
    link = connect_retrying(front_address, key_from_environment() or "", attempt_s, "rank 0", keep_the_group)
    return Leader(engine, scheduler, LinkRequests(engine, link)).serve()


def _follow(engine: Rank, scheduler: Scheduler) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    try:
        return follow(engine, scheduler)
    except BaseException as exc:  # a lost or stalled peer, ranks out of step: the group cannot go on
        _exit(1, f"rank {engine.rank}: exiting: {type(exc).__name__}: {exc}")


def _lead(rank: Rank, scheduler: Scheduler, options: RankOptions) -> int:
    """Rank 0 serving HTTP itself: the book in this process, the HTTP thread, the loop."""
    from .app import Api, HttpThread  # Starlette and uvicorn: rank 0 only

    settings = options.settings
    book = Book(settings, rank.tokenizer, list(rank.stage.info.split), rank.prefix, rank.slots)
    leader = Leader(rank, scheduler, LocalRequests(book, settings.process.parent_pid))
    context = settings.engine.context if settings.engine.context is not None else model_context(options.model_dir)
    api = Api(book, rank.tokenizer, settings, context)
    http = HttpThread(api.app(), options.host, options.port, settings.http)
    if not http.start():
        print(f"pipemlx serve: error: cannot listen on {options.host}:{options.port}: {http.failure}", file=sys.stderr)
        book.stopping.set()
        leader.serve()  # tells the other ranks to stop
        return 2
    book.stop_on_signals()
    book.log_start()
    log(f"listening on http://{options.host}:{options.port} (OpenAI API under /v1, status at /health)")
    status = leader.serve()  # a lost or stalled rank: 503 for --fault-grace seconds, then the process exits
    http.stop()
    log("stopped")
    return status


def run_front(options: FrontOptions) -> int:
    """Serve HTTP in this process and run the ranks as workers, restarting them after a fault (``--recover``)."""
    from .app import Api, HttpThread
    from .supervisor import Supervisor

    settings = options.rank.settings
    configure_logging(settings.process.log_level)
    try:  # a Hub repo id: its config and tokenizer files fetched (or found in the cache), as every rank does
        model_dir = locate_model(options.rank.model_dir).root
        tokenizer = load_tokenizer_of(model_dir, options.rank.trust_remote_code)
    except (OSError, ValueError) as exc:  # ModelNotFoundError (one line) too
        print(f"pipemlx serve: error: cannot load the tokenizer of {options.rank.model_dir}: {exc}", file=sys.stderr)
        return 2
    book = Book(settings, tokenizer, [0] * options.ranks)
    context = settings.engine.context if settings.engine.context is not None else model_context(model_dir)
    api = Api(book, tokenizer, settings, context)
    try:
        supervisor = Supervisor(book, replace(options, model=model_dir))
    except OSError as exc:
        where = "" if options.listen is None else f" {options.listen[0]}:{options.listen[1]} (--front-listen)"
        print(f"pipemlx serve: error: cannot listen on{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    http = HttpThread(api.app(), options.host, options.port, settings.http)
    if not http.start():
        print(f"pipemlx serve: error: cannot listen on {options.host}:{options.port}: {http.failure}", file=sys.stderr)
        supervisor.close()
        return 2
    book.stop_on_signals(supervisor.kill)
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
    status = supervisor.run()
    http.stop()
    log("stopped")
    return status
