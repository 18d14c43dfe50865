"""``pipemlx doctor [--hostfile FILE | --ranks N]``: check a cluster before trusting it with a model.

Per rank and per link it checks: mlx / mlx-lm / pipemlx versions (they must match), the backend, each
neighbour link's latency and bandwidth (bounded), the memory each rank has against what the model's
split needs, and a real pipelined prefill + decode of the demo model (or ``--model``) with a timeout.
It ends with a verdict line and exit status 0 (OK) or 1, naming the host or link at fault; 2 for bad
input. The ranks come from where ``pipemlx generate``'s do; their work is in :mod:`.doctor_rank`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..launch import LaunchError, launch
from .common import UserError, check_ranks, in_launched_rank, join_by_hostfile

DEFAULT_RANKS = 2
EXIT_FAILED = 1
CHILD_VARIABLE = "PIPEMLX_DOCTOR_CHILD"
POLL_S = 0.05


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:  # pyright: ignore[reportPrivateUsage]
    from pathlib import Path

    from ..demo import MODEL_DIR
    from .common import DEFAULT_TIMEOUT, DefaultsFormatter, add_sharding_flags, layer_counts, positive_float

    doctor = commands.add_parser(
        "doctor",
        help="check every rank and link: versions, backend, latency and bandwidth, memory, a real prefill + decode",
        description="Check a group of ranks before trusting it with a model; ends with a verdict and exit 0/1.",
        formatter_class=DefaultsFormatter,
    )
    where = doctor.add_mutually_exclusive_group()
    where.add_argument("--ranks", type=int, help=f"local ranks to start (default {DEFAULT_RANKS})")
    where.add_argument("--hostfile", help="MLX ring hostfile: run the same command on every host")
    doctor.add_argument("--rank", type=int, help="with --hostfile: this process's rank (default: found by address)")
    doctor.add_argument(
        "--model",
        type=Path,
        default=MODEL_DIR,
        help="model folder or Hugging Face repo id for the end-to-end run (default: demo)",
    )
    doctor.add_argument("--split", type=layer_counts, help="layers per rank, like 6,2 (default: even)")
    doctor.add_argument(
        "--context",
        type=int,
        help="most tokens (prompt + answer) a request holds, as load_sharded's context: what the memory check "
        "plans for (default: the model's max_position_embeddings)",
    )
    doctor.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT, help="seconds any wait may take")
    doctor.add_argument(
        "--join-timeout", type=positive_float, default=30.0, help="seconds to wait for every rank to join"
    )
    doctor.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    add_sharding_flags(doctor, ["--allow-unregistered"])  # for --model: the end-to-end run loads it


def run_doctor(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run as one rank here, or start the local ranks."""
    if args.rank is not None and args.hostfile is None:
        raise UserError("--rank only goes with --hostfile")
    if args.ranks is not None and args.ranks < 2:
        raise UserError(f"--ranks must be at least 2 (a doctor checks links), got {args.ranks}")
    if os.environ.get(CHILD_VARIABLE) == "1":
        from .doctor_rank import run_rank  # MLX and mlx-lm: imported only where a rank runs

        return run_rank(args)
    if in_launched_rank() or args.hostfile is not None:
        if args.hostfile is not None:
            join_by_hostfile(args.hostfile, args.rank)
        return supervise(args, argv)
    ranks: int = args.ranks or DEFAULT_RANKS
    check_ranks(ranks, args.model, args.split)
    command = [sys.executable, "-m", "pipemlx", *argv]
    deadline = args.join_timeout + 10 * args.timeout + 60
    try:
        results = launch(ranks, command, timeout=deadline, passthrough_rank=0, fail_fast=False)
    except LaunchError as exc:  # the deadline passed
        print(f"pipemlx doctor: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILED
    failed = [r for r in results if r.returncode != 0]
    for result in failed[1:] if failed and failed[0].rank == 0 else failed:
        tail = "\n".join(result.stderr.strip().splitlines()[-3:])
        print(f"--- rank {result.rank} (status {result.returncode}): {tail}", file=sys.stderr)
    return EXIT_FAILED if failed else 0


def supervise(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run this rank's checks in a child process and bound it: joining by ``--join-timeout``, the rest too.

    When the child has not joined the group in time (MLX's ring backend holds
    its process while it connects, so only another process can give up on
    it), it is killed, the ring neighbours' addresses are probed with a plain
    TCP connect, and the failure is reported naming the link that does not
    answer. Returns the exit status: the child's, or 1.
    """
    from .doctor_rank import JOINED_VARIABLE, render

    rank = int(os.environ.get("MLX_RANK", "0"))
    with tempfile.TemporaryDirectory(prefix="pipemlx-doctor-") as tmp:
        marker = Path(tmp) / "joined"
        env = {**os.environ, CHILD_VARIABLE: "1", JOINED_VARIABLE: str(marker)}
        child = subprocess.Popen([sys.executable, "-m", "pipemlx", *argv], env=env)
        try:
            start = time.monotonic()
            while child.poll() is None and not marker.exists() and time.monotonic() - start < args.join_timeout:
                time.sleep(POLL_S)
            if not marker.exists():
                status = child.poll()
                links = probe_neighbours(rank)  # while this rank's own listener still runs
                if status is None:
                    child.kill()
                    child.wait()
                how = f"within {args.join_timeout:g} s" if status is None else f"(it ended with status {status})"
                problems = [*links, f"rank {rank} could not join the group {how}"]
                report = {"ok": False, "rank": rank, "problems": problems}
                print(json.dumps(report) if args.json else render(report), flush=True)
                print(f"pipemlx doctor: rank {rank}: {'; '.join(problems)}", file=sys.stderr, flush=True)
                return EXIT_FAILED
            try:
                return child.wait(timeout=10 * args.timeout + 60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                print(f"pipemlx doctor: rank {rank}: no verdict within {10 * args.timeout + 60:g} s", file=sys.stderr)
                return EXIT_FAILED
        finally:
            if child.poll() is None:
                child.kill()


def probe_neighbours(rank: int) -> list[str]:
    """Problems with this rank's ring neighbours' addresses: a plain TCP connect to each.

    A refused connection means the network path works (the host answered)
    but no rank listens there (not started, or given up already): that peer,
    not the link, is named. A connect that times out or finds no route names
    the link.
    """
    from .doctor_rank import probe, ring_addresses

    addresses = ring_addresses()
    if len(addresses) < 2:
        return []
    size = len(addresses)
    links: list[str] = []
    peers: list[str] = []
    for peer in sorted({(rank + 1) % size, (rank - 1) % size} - {rank}):
        answer = probe(addresses[peer])
        if answer == "ok":
            continue
        where = f"rank {rank} ({addresses[rank]}) -> rank {peer} ({addresses[peer]})"
        if "refused" in answer.lower():
            peers.append(f"rank {peer} ({addresses[peer]}) is reachable but no rank listens there: {where}")
        else:
            links.append(f"link {where}: {answer}")
    return links or peers  # with a link down, a peer that gave up waiting is no news
