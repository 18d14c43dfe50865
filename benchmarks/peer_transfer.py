"""Weights from a peer against a plain copy over the same link (issue 50's goal: >= 80% of the copy's rate).

Writes a safetensors file of ``--mb`` MB of tensors, then, over loopback (or ``--host``, an address of this
machine another host reaches), times in turns, ``--rounds`` times each: (1) fetching every tensor from a
``PeerServer`` into a rank's weight folder (a fresh cache each round), as a rank without the model does, and
(2) a plain copy of the same file's bytes over one TCP connection into a file, at its fastest: the sender hands
the file to the kernel (``sendfile``), the receiver receives into one reused buffer and writes it out, and both
end with the file synced, as the fetch does (no checks, no headers). Each sender is a process of its own, as the
holder is. Each end is pinned to a core of its own (the senders to the first allowed core, the receiver to the
second; a core stands for a machine), unless ``--no-pin``. Prints each round's rates, each side's CPU seconds and
the seconds the receiver's closing ``fsync`` waited (on a busy machine the rates mean nothing, the CPU seconds and
the ``fsync`` wait a little more), and the ratio of the medians.
Run it on an idle machine.

    python benchmarks/peer_transfer.py --mb 512
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx

from pipemlx.models.peer import PeerServer, PeerSource, fingerprint
from pipemlx.models.weights import FolderSource, TensorPart, _Writeback, fetch_rank_folder  # pyright: ignore[reportPrivateUsage]
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE


def make_model(root: Path, megabytes: int) -> None:
    root.mkdir(parents=True)
    rows = 4096
    count = max(1, megabytes * 2**20 // (rows * 1024 * 2))
    tensors = {f"model.layers.{i}.mlp.weight": mx.zeros((rows, 1024), dtype=mx.bfloat16) + i for i in range(count)}
    mx.save_safetensors(str(root / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (root / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": %d}' % count)


def pin(core: int | None) -> None:
    """This process on ``core`` alone (``None``: left as it is)."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def serve_peer(root: str, host: str, addresses: Queue[Any], stop: Event, core: int | None) -> None:
    """The holder, in a process of its own as a rank is: serves ``root`` until ``stop``; reports bytes sent."""
    pin(core)
    with PeerServer(FolderSource(Path(root)), host, b"k" * 32) as server:
        cpu = sum(os.times()[:2])
        addresses.put(server.address)
        stop.wait()
        addresses.put((server.served, sum(os.times()[:2]) - cpu))


def send_plain(path: str, host: str, addresses: Queue[Any], core: int | None) -> None:
    """The plain copy's sender, in a process of its own: hands the file to the kernel on one connection."""
    pin(core)
    with socket.create_server((host, 0)) as listener:
        cpu = sum(os.times()[:2])
        addresses.put(listener.getsockname()[:2])
        conn, _ = listener.accept()
        with conn, open(path, "rb") as f:
            conn.sendfile(f)
    addresses.put(sum(os.times()[:2]) - cpu)


class Timing:
    """The seconds of one contender: the whole receive, its closing ``fsync``, each side's CPU."""

    def __init__(self) -> None:
        self.took = self.fsync = self.cpu = self.sender_cpu = 0.0
        self._fsync = os.fsync  # the real one (the fetch's is patched to this method)

    def fsync_timed(self, fd: int) -> None:
        began = time.perf_counter()
        self._fsync(fd)
        self.fsync += time.perf_counter() - began

    def line(self) -> str:
        return f"fsync {self.fsync:.2f} s, CPU receiver {self.cpu:.2f} s, sender {self.sender_cpu:.2f} s"


def peer_rate(root: Path, host: str, cache: Path, core: int | None) -> tuple[int, Timing]:
    os.environ[CACHE_DIR_VARIABLE] = str(cache)
    held = FolderSource(root)
    parts = tuple(TensorPart(n) for n in sorted(held.headers()))
    context = multiprocessing.get_context("spawn")
    addresses: Queue[Any] = context.Queue()
    stop = context.Event()
    holder = context.Process(target=serve_peer, args=(str(root), host, addresses, stop, core))
    holder.start()
    address = addresses.get(timeout=60)
    peer = PeerSource(str(root), tuple(address), b"k" * 32, fingerprint(held), 0)
    peer.metadata_root()  # headers and config first: not counted
    timing = Timing()
    began, cpu = time.perf_counter(), time.process_time()
    with mock.patch.object(os, "fsync", timing.fsync_timed):
        fetch_rank_folder(peer, parts)
    timing.took, timing.cpu = time.perf_counter() - began, time.process_time() - cpu
    peer.close()
    stop.set()
    served, timing.sender_cpu = addresses.get(timeout=60)
    holder.join()
    return int(served), timing


def copy_rate(path: Path, host: str, into: Path, core: int | None, writeback: bool = False) -> tuple[int, Timing]:
    """The plain copy; ``writeback``: it starts the disk write every 16 MiB as the fetch does (its fastest form on
    Linux: its closing ``fsync`` then waits only for the last part)."""
    context = multiprocessing.get_context("spawn")
    addresses: Queue[Any] = context.Queue()
    sender = context.Process(target=send_plain, args=(str(path), host, addresses, core))
    sender.start()
    address = addresses.get(timeout=60)
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    got = 0
    timing = Timing()
    began, cpu = time.perf_counter(), time.process_time()
    with socket.create_connection(tuple(address)) as conn, open(into, "wb", buffering=0) as out:
        started = _Writeback(out.fileno()) if writeback else None
        while n := conn.recv_into(view):
            out.write(view[:n])
            got += n
            if started is not None:
                started.wrote(n)
        timing.fsync_timed(out.fileno())
    timing.took, timing.cpu = time.perf_counter() - began, time.process_time() - cpu
    timing.sender_cpu = addresses.get(timeout=60)
    sender.join()
    into.unlink()
    return got, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="megabytes of tensors")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, in turns")
    parser.add_argument("--no-pin", action="store_true", help="leave both ends unpinned")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    sender: int | None = None
    if not args.no_pin and len(cores) >= 2:
        sender = cores[0]
        pin(cores[1])
    print(f"sender on core {sender}, receiver on core {cores[1]}" if sender is not None else "unpinned")
    peer_rates: list[float] = []
    copy_rates: list[float] = []
    overlapped_rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "model"
        make_model(root, args.mb)
        for round_ in range(args.rounds):
            sent, peer = peer_rate(root, args.host, Path(tmp) / f"cache{round_}", sender)
            shutil.rmtree(Path(tmp) / f"cache{round_}")
            copied, copy = copy_rate(root / "model.safetensors", args.host, Path(tmp) / "copy", sender)
            peer_rates.append(sent / 1e6 / peer.took)
            copy_rates.append(copied / 1e6 / copy.took)
            overlapped, overlap = copy_rate(
                root / "model.safetensors", args.host, Path(tmp) / "copy", sender, writeback=True
            )
            overlapped_rates.append(overlapped / 1e6 / overlap.took)
            print(
                f"round {round_ + 1}: peer {sent / 1e6:.1f} MB at {peer_rates[-1]:.0f} MB/s ({peer.line()}); ", end=""
            )
            print(f"plain copy {copied / 1e6:.1f} MB at {copy_rates[-1]:.0f} MB/s ({copy.line()}); ", end="")
            print(f"with the disk write started as it goes {overlapped_rates[-1]:.0f} MB/s ({overlap.line()})")
    peer_mb, copy_mb = statistics.median(peer_rates), statistics.median(copy_rates)
    overlapped_mb = statistics.median(overlapped_rates)
    print(
        f"medians: peer {peer_mb:.0f} MB/s, plain copy {copy_mb:.0f} MB/s, peer / copy: {peer_mb / copy_mb:.2f}; "
        f"copy with the write started as it goes {overlapped_mb:.0f} MB/s, peer / it: {peer_mb / overlapped_mb:.2f}"
    )


if __name__ == "__main__":
    main()
