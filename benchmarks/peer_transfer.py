"""Weights from a peer against a plain copy over the same link (issue 50's goal: >= 80% of the copy's rate).

Writes a safetensors file of ``--mb`` MB of tensors, then, over loopback (or ``--host``, an address of this
machine another host reaches), times (1) fetching every tensor from a ``PeerServer`` into a rank's weight
folder, as a rank without the model does, and (2) a plain copy of the same file's bytes over one TCP
connection into a file (read, send, receive, write: no checks). Prints both rates and their ratio. Run it on
an idle machine; on a shared one the timings mean nothing.

    python benchmarks/peer_transfer.py --mb 512
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from pipemlx.models.peer import PeerServer, PeerSource, fingerprint
from pipemlx.models.weights import FolderSource, TensorPart, fetch_rank_folder
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE


def make_model(root: Path, megabytes: int) -> None:
    root.mkdir(parents=True)
    rows = 4096
    count = max(1, megabytes * 2**20 // (rows * 1024 * 2))
    tensors = {f"model.layers.{i}.mlp.weight": mx.zeros((rows, 1024), dtype=mx.bfloat16) + i for i in range(count)}
    mx.save_safetensors(str(root / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (root / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": %d}' % count)


def peer_rate(root: Path, host: str) -> tuple[int, float]:
    held = FolderSource(root)
    parts = tuple(TensorPart(n) for n in sorted(held.headers()))
    with PeerServer(held, host, b"k" * 32) as server:
        peer = PeerSource(str(root), server.address, server.token, fingerprint(held), 0)
        peer.metadata_root()  # headers and config first: not counted
        began = time.perf_counter()
        fetch_rank_folder(peer, parts)
        took = time.perf_counter() - began
        peer.close()
        return server.served, took


def copy_rate(path: Path, host: str, into: Path) -> tuple[int, float]:
    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with conn, open(path, "rb") as f:
            while piece := f.read(16 << 20):
                conn.sendall(piece)

    threading.Thread(target=send, daemon=True).start()
    began = time.perf_counter()
    got = 0
    with socket.create_connection((host, port)) as conn, open(into, "wb") as out:
        while piece := conn.recv(1 << 20):
            out.write(piece)
            got += len(piece)
        out.flush()
        os.fsync(out.fileno())
    took = time.perf_counter() - began
    listener.close()
    return got, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="megabytes of tensors")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[CACHE_DIR_VARIABLE] = str(Path(tmp) / "cache")
        root = Path(tmp) / "model"
        make_model(root, args.mb)
        sent, peer_s = peer_rate(root, args.host)
        copied, copy_s = copy_rate(root / "model.safetensors", args.host, Path(tmp) / "copy")
    peer_mb, copy_mb = sent / 1e6 / peer_s, copied / 1e6 / copy_s
    print(f"peer: {sent / 1e6:.1f} MB in {peer_s:.2f} s ({peer_mb:.0f} MB/s)")
    print(f"plain copy: {copied / 1e6:.1f} MB in {copy_s:.2f} s ({copy_mb:.0f} MB/s)")
    print(f"peer / copy: {peer_mb / copy_mb:.2f}")


if __name__ == "__main__":
    main()
