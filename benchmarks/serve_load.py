"""Sustained load on ``pipemlx serve``: N streaming clients for a fixed time, some hanging up part-way.

Each client sends streamed ``/v1/completions`` requests (greedy, a prompt cut
from the book at a random place, ``--max-tokens`` tokens) one after another until
the time is up; a ``--hang-up`` fraction of them closes the connection after
0 to 3 chunks. Reported: requests served (finished), hung up, refused with 429
(the queue's or the stream cap's answer: expected under load), errors (any
other status, an ``error`` event, a broken stream: must be 0), time to first
token and inter-token latency at the client (p50, p99), and rank 0's resident
memory (``/proc``, Linux) after a warm-up under the same load, every 10 s, and at the end.

Usage:
    python benchmarks/serve_load.py [--clients 8] [--seconds 60] [--warm-up 20] [--hang-up 0.25] [--decode-concurrency 4]
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --api-key KEY   # a server already running

Without ``--url`` it starts ``pipemlx serve --ranks 2`` on the demo model (OpenBLAS
preloaded when installed) and stops it at the end. Its prefix cache is small (``--prompt-cache-bytes 1M``):
full after the warm-up, so that memory growth during the run means a leak, not the cache filling
(at the default 1024 MB the cache grows by every request's tokens, by design). ``drive`` is what the test
suite's short version (``tests/test_serve_limits.py``) runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
RETRY_S = 0.2  # a client refused with 429 tries again after this long
WORDS = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families"
).split()


@dataclass
class LoadReport:
    """What one load run measured (latencies in seconds, memory in MiB)."""

    clients: int
    seconds: float
    served: int = 0
    hung_up: int = 0
    refused_429: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list[str])
    ttft: list[float] = field(default_factory=list[float])
    inter_token: list[float] = field(default_factory=list[float])
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None
    rss_every_10s_mib: list[float] = field(default_factory=list[float])

    def summary(self) -> dict[str, Any]:
        """The figures, with p50/p99 instead of the samples."""
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft", "inter_token")}
        for name, samples in (("ttft", self.ttft), ("inter_token", self.inter_token)):
            out[f"{name}_p50_s"] = percentile(samples, 50)
            out[f"{name}_p99_s"] = percentile(samples, 99)
        if self.rss_start_mib and self.rss_end_mib:
            out["rss_growth"] = round(self.rss_end_mib / self.rss_start_mib - 1.0, 4)
        return out


def percentile(samples: list[float], p: float) -> float | None:
    if not samples:
        return None
    if len(samples) == 1:
        return round(samples[0], 4)
    return round(statistics.quantiles(samples, n=100, method="inclusive")[int(p) - 1], 4)


def rss_mib(pid: int) -> float | None:
    """Resident memory of ``pid`` in MiB (Linux ``/proc``), None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def prompt(rng: random.Random) -> str:
    start = rng.randrange(len(WORDS) - 8)
    return " ".join(WORDS[start : start + rng.randint(4, 12)])


async def one_request(
    client: httpx.AsyncClient, url: str, report: LoadReport, rng: random.Random, max_tokens: int, hang_up: float
) -> None:
    """One streamed request; hangs up after 0-3 chunks with probability ``hang_up``."""
    body = {"prompt": prompt(rng), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    leave_after = rng.randint(0, 3) if rng.random() < hang_up else None
    sent = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code == 429:
                report.refused_429 += 1
                await asyncio.sleep(RETRY_S)  # not Retry-After's whole second: keep the pressure on
                return
            if response.status_code != 200:
                _error(report, f"status {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    report.served += 1
                    return
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    _error(report, str(event["error"])[:200])
                    return
                now = time.perf_counter()
                if event["choices"] and event["choices"][0]["text"]:
                    if last is None:
                        report.ttft.append(now - sent)
                    else:
                        report.inter_token.append(now - last)
                    last = now
                chunks += 1
                if leave_after is not None and chunks > leave_after:
                    report.hung_up += 1
                    return  # leaving the block closes the connection mid-stream
            _error(report, "the stream ended without [DONE]")
    except httpx.HTTPError as exc:
        _error(report, f"{type(exc).__name__}: {exc}")


def _error(report: LoadReport, what: str) -> None:
    report.errors += 1
    if len(report.error_samples) < 5:
        report.error_samples.append(what)


async def _drive(
    url: str, headers: dict[str, str], clients: int, seconds: float, hang_up: float, max_tokens: int, seed: int,
    rank0_pid: int | None = None,
) -> LoadReport:  # fmt: skip
    report = LoadReport(clients=clients, seconds=seconds)
    deadline = time.monotonic() + seconds

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(headers=headers, timeout=120.0) as client:
            while time.monotonic() < deadline:
                await one_request(client, url, report, rng, max_tokens, hang_up)

    async def sample_memory() -> None:
        while rank0_pid is not None and time.monotonic() < deadline:
            await asyncio.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
            rss = rss_mib(rank0_pid)
            if rss is not None:
                report.rss_every_10s_mib.append(round(rss, 1))

    await asyncio.gather(sample_memory(), *(client_loop(i) for i in range(clients)))
    return report


def drive(
    url: str,
    headers: dict[str, str],
    *,
    clients: int = 8,
    seconds: float = 60.0,
    hang_up: float = 0.25,
    max_tokens: int = 32,
    rank0_pid: int | None = None,
    seed: int = 0,
    warm_up: float = 5.0,
) -> LoadReport:
    """Warm up (the same load for ``warm_up`` seconds: the allocator's and the prefix cache's sizes settle),
    read rank 0's memory, run the load for ``seconds``, read it again."""
    asyncio.run(_drive(url, headers, clients, warm_up, hang_up, max_tokens, seed + 1))
    start = rss_mib(rank0_pid) if rank0_pid else None
    report = asyncio.run(_drive(url, headers, clients, seconds, hang_up, max_tokens, seed, rank0_pid))
    report.rss_start_mib = start
    report.rss_end_mib = rss_mib(rank0_pid) if rank0_pid else None
    return report


def wait_idle(url: str, headers: dict[str, str], timeout: float = 60.0) -> dict[str, Any]:
    """``/health``'s detail once nothing runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        health: dict[str, Any] = httpx.get(url + "/health", headers=headers, timeout=10.0).json()
        if not health["running"] and health["queue"]["waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not go idle: {health}")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start pipemlx serve --ranks 2 here)")
    parser.add_argument("--api-key", default="load-test-key")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warm-up", type=float, default=20.0, help="seconds of the same load before measuring")
    parser.add_argument("--hang-up", type=float, default=0.25, help="fraction of requests that hang up early")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--decode-concurrency", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=4, help="small, so that the 429 path is exercised")
    parser.add_argument(
        "--prefix-cache", default="1", metavar="MB",
        help="the server's prefix cache (default 1 MB: full after the warm-up, so that growth means a leak)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    server: subprocess.Popen[bytes] | None = None
    url = args.url
    if url is None:
        server, url = _start(args)
    try:
        health = wait_idle(url, headers, 300.0)
        pid = int(health["rank_status"][0]["pid"])
        report = drive(
            url, headers, clients=args.clients, seconds=args.seconds, hang_up=args.hang_up,
            max_tokens=args.max_tokens, rank0_pid=pid, warm_up=args.warm_up,
        )  # fmt: skip
        health = wait_idle(url, headers)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    summary = {**report.summary(), "server_counts": health["requests"]}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if report.errors == 0 else 1


def _start(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    sys.path.insert(0, str(HERE))
    from common import bench_env  # noqa: PLC0415 (the benchmarks' folder is not a package)

    from pipemlx.launch import free_ports

    port = free_ports(1)[0]
    command = [
        sys.executable, "-m", "pipemlx", "serve", "--ranks", "2", "--port", str(port), "--api-key", args.api_key,
        "--decode-concurrency", str(args.decode_concurrency), "--max-queue", str(args.max_queue), "--grace", "5", "--prompt-cache-bytes", f"{args.prefix_cache}M",
    ]  # fmt: skip
    server = subprocess.Popen(command, env={**os.environ, **bench_env(True)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300.0
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("pipemlx serve did not get ready")


if __name__ == "__main__":
    sys.exit(main())
