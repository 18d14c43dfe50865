"""Serving through HTTP: pipemlx serve at S=2 against mlx-lm's own server, same model, same prompt, one run each.

For each server it sends one long prompt as a streamed ``/v1/completions``
request (greedy) and measures, at the client, the time to the first token and
the decode speed (tokens after the first, over the time from the first to the
last). Then a second turn (the first turn's prompt and answer plus a few new
tokens) measures the time to first token that the prefix cache saves:
pipemlx serve with its prefix cache and with ``--prompt-cache-bytes 0``.

Servers: ``pipemlx serve --ranks 2`` (one request at a time, and with
``--decode-concurrency 4``: the same request through the batch scheduler; both
behind the front process, the default, and once with ``--no-recover``, rank 0
serving HTTP itself);
``mlx_lm.server`` (one process); and
``mlx_lm.server --pipeline`` on 2 local ranks (mlx-lm's own pipeline, for the
models that have one: qwen2 does) when it runs here.

The default model is the benchmarks' reference setup (a 512-d, 8-layer qwen2
with random weights and the demo model's byte-level tokenizer), written once to
``benchmarks/results/serve-model``; ``--model DIR`` takes any mlx-lm folder.
The prompt is *Pride and Prejudice* cut to ``--prompt-tokens`` tokens (or
``--prompt-file``).
OpenBLAS is preloaded in every server process when it is installed.

Concurrency: ``pipemlx serve`` with ``--decode-concurrency 1`` (one request at a
time) and ``--decode-concurrency 4`` (continuous batching), each sent 4 and then 8
clients at once (``--clients``), each a different short greedy prompt streaming
``--concurrent-tokens`` tokens; the figure is the aggregate decode speed, all
the clients' completion tokens over the wall time from the first request sent to
the last token received. Then ``--decode-concurrency 8`` once per ``--decode-groups`` value (1 and auto)
against ``mlx_lm.server --decode-concurrency 8``, one process pinned to one core (a core stands for a
machine; the ranks are pinned one core each by the launcher).

Usage: python benchmarks/serve.py [--prompt-tokens 2048] [--max-tokens 64] [--json OUT]
       python benchmarks/serve.py --skip long-prompt   # only the concurrency figure
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from common import BENCH_CONFIG, HERE, bench_env, openblas_available

from pipemlx.demo import MODEL_DIR, book_text
from pipemlx.launch import free_ports, write_hostfile

RESULTS = HERE / "results"
READY_TIMEOUT = 300.0


@dataclass
class Figures:
    server: str
    prompt_tokens: int
    ttft_s: float
    decode_tokens: int
    decode_tokens_per_s: float
    turn2_ttft_s: float | None = None
    turn2_cached_tokens: int | None = None


@dataclass
class Concurrency:
    server: str
    clients: int
    tokens_each: int
    completion_tokens: int
    wall_s: float
    aggregate_tokens_per_s: float


class Server:
    """Server processes (one per rank) on a free port; rank 0's HTTP is at ``url``."""

    def __init__(self, name: str, commands: list[list[str]], port: int, envs: list[dict[str, str]]) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.TemporaryDirectory(prefix="pipemlx-bench-serve-")
        self.logs: list[IO[bytes]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for i, (command, env) in enumerate(zip(commands, envs)):
            log = open(Path(self._dir.name) / f"{i}.log", "w+b")  # noqa: SIM115 (closed in stop())
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=log, start_new_session=True)
            )

    def log_tail(self) -> str:
        parts = []
        for i, log in enumerate(self.logs):
            log.flush()
            log.seek(0)
            parts.append(f"--- process {i}:\n" + log.read().decode(errors="replace")[-2000:])
        return "\n".join(parts)

    def wait_ready(self, path: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} was not ready after {READY_TIMEOUT:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in self.logs:
            log.close()
        self._dir.cleanup()


def stream(url: str, prompt: str, max_tokens: int) -> tuple[float, int, float, str, int | None]:
    """One greedy streamed completion: (ttft_s, tokens, decode tokens/s, text, cached prompt tokens if told)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces: list[str] = []
    times: list[float] = []
    cached: int | None = None
    generated: int | None = None
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage")
            if usage:
                generated = usage.get("completion_tokens")
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in event.get("choices", []):
                if choice.get("text"):
                    pieces.append(choice["text"])
                    times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{url}: no text came back")
    ttft = times[0] - start
    tokens = generated or len(times)  # a piece of text per token, unless the server tells the count
    decode = (tokens - 1) / (times[-1] - times[0]) if tokens > 1 and times[-1] > times[0] else 0.0
    return ttft, tokens, decode, "".join(pieces), cached


def measure(server: Server, name: str, prompt: str, prompt_tokens: int, args: argparse.Namespace) -> Figures:
    stream(server.url, "It is a truth universally acknowledged", 4)  # warm-up, not timed
    ttft, tokens, decode, text, _ = stream(server.url, prompt, args.max_tokens)
    figures = Figures(name, prompt_tokens, round(ttft, 3), tokens, round(decode, 1))
    if args.turn2:
        turn2 = f"{prompt}{text}\n\n{args.turn2_text}"
        ttft2, _, _, _, cached = stream(server.url, turn2, 8)
        figures.turn2_ttft_s, figures.turn2_cached_tokens = round(ttft2, 3), cached
    print(f"  {name}: {figures}", file=sys.stderr, flush=True)
    return figures


def pipemlx_server(model: Path, env: dict[str, str], extra: list[str]) -> Server:
    port = free_ports(1)[0]
    command = [sys.executable, "-m", "pipemlx", "serve", "--ranks", "2", "--model", str(model), "--port", str(port)]
    command += ["--max-tokens", "4096", *extra]
    return Server("pipemlx serve", [command], port, [env])


def mlx_lm_server(model: Path, env: dict[str, str], ranks: int, pinned: bool = False) -> Server:
    """mlx-lm's server; ``pinned``: one process on one core (the first this process may use), batching up to 8
    requests (``--decode-concurrency 8``), the baseline of ``pipemlx serve --decode-concurrency 8`` at S=2."""
    port = free_ports(1)[0]
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)]
    if pinned:
        core = min(os.sched_getaffinity(0))
        command = ["taskset", "-c", str(core), *command, "--decode-concurrency", "8"]
    if ranks == 1:
        return Server("mlx_lm.server", [command], port, [env])
    directory = Path(tempfile.mkdtemp(prefix="pipemlx-bench-ring-"))
    hostfile = write_hostfile([f"127.0.0.1:{p}" for p in free_ports(ranks)], directory)
    envs = [{**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(ranks)]
    return Server("mlx_lm.server --pipeline", [[*command, "--pipeline"]] * ranks, port, envs)


def bench_model() -> Path:
    """The reference qwen2 as an mlx-lm folder (random weights, the demo model's tokenizer), made once."""
    root = RESULTS / "serve-model"
    if not (root / "model.safetensors").exists():
        from pipemlx.testing import build_model, save_model_dir

        save_model_dir(build_model(dict(BENCH_CONFIG), seed=0), BENCH_CONFIG, root)
        # A byte-level BPE that transformers reads whatever the model type (ids < 1024 of the 32000 rows).
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(MODEL_DIR / name, root / name)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", type=Path, help="mlx-lm model folder (default: the reference qwen2)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens in the long prompt (2048)")
    parser.add_argument("--prompt-file", type=Path, help="use this text as the long prompt instead")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to decode (64)")
    parser.add_argument("--turn2-tokens", type=int, default=64, help="new tokens in the second turn (64)")
    parser.add_argument("--no-turn2", dest="turn2", action="store_false", help="skip the second-turn measurement")
    parser.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["batched", "no-front", "mlx-lm", "mlx-lm-pipeline", "long-prompt", "concurrency"],
    )
    parser.add_argument(
        "--clients", type=lambda t: [int(c) for c in t.split(",")], default=[1, 4, 8], help="concurrent clients (1,4,8)"
    )
    parser.add_argument("--concurrent-tokens", type=int, default=64, help="tokens per concurrent client (64)")
    parser.add_argument(
        "--decode-groups",
        type=lambda t: t.split(","),
        default=["1", "auto"],
        help="pipemlx serve --decode-concurrency 8 once per --decode-groups value (1,auto), against mlx_lm.server "
        "--decode-concurrency 8 on one core",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    model = args.model or bench_model()
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    text = args.prompt_file.read_text(encoding="utf-8") if args.prompt_file else book_text()[2000:]
    prompt = tokenizer.decode(tokenizer.encode(text)[: args.prompt_tokens])
    prompt_tokens = len(tokenizer.encode(prompt))
    args.turn2_text = tokenizer.decode(tokenizer.encode(book_text()[200000:])[: args.turn2_tokens])
    openblas = not args.no_openblas and openblas_available()
    env = bench_env(openblas)
    print(f"model {model}, OpenBLAS {'on' if openblas else 'off'}, {os.cpu_count()} cores", file=sys.stderr)

    runners: list[tuple[str, Callable[[], Server]]] = []
    if "long-prompt" not in args.skip:
        runners.append(("pipemlx serve S=2", lambda: pipemlx_server(model, env, [])))
        runners.append(
            (
                "pipemlx serve S=2, --prompt-cache-bytes 0",
                lambda: pipemlx_server(model, env, ["--prompt-cache-bytes", "0"]),
            )
        )
        if "no-front" not in args.skip:  # rank 0 serving HTTP itself: what the front's extra hop costs
            runners.append(("pipemlx serve S=2, --no-recover", lambda: pipemlx_server(model, env, ["--no-recover"])))
        if "batched" not in args.skip:
            batched = ["--decode-concurrency", "4"]
            runners.append(("pipemlx serve S=2, --decode-concurrency 4", lambda: pipemlx_server(model, env, batched)))
        if "mlx-lm" not in args.skip:
            runners.append(("mlx_lm.server (1 process)", lambda: mlx_lm_server(model, env, 1)))
        if "mlx-lm-pipeline" not in args.skip:
            runners.append(("mlx_lm.server --pipeline S=2", lambda: mlx_lm_server(model, env, 2)))
    results: list[Figures] = []
    failures: dict[str, str] = {}
    for name, start in runners:  # one server at a time: they would share the cores
        server: Server | None = None
        try:
            server = start()
            server.wait_ready("/health")
            results.append(measure(server, name, prompt, prompt_tokens, args))
        except Exception as exc:  # a server that cannot run here is reported, not fatal
            failures[name] = f"{type(exc).__name__}: {str(exc)[:1500]}"
            print(f"  {name}: failed: {failures[name]}", file=sys.stderr)
        finally:
            if server is not None:
                server.stop()
    concurrency: list[Concurrency] = []
    if "concurrency" not in args.skip:
        concurrency = measure_concurrency(model, env, tokenizer, args, failures)
    print_table(results, failures, args)
    print_concurrency(concurrency)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "results": [asdict(r) for r in results],
            "concurrency": [asdict(c) for c in concurrency],
            "failures": failures,
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def concurrent_prompts(tokenizer: Any, count: int) -> list[str]:
    """``count`` different short prompts (about 16 tokens each) cut from the book."""
    text = book_text()[50000:]
    ids = tokenizer.encode(text)
    return [tokenizer.decode(ids[i * 97 : i * 97 + 16]) for i in range(count)]


def run_clients(url: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    """Send every prompt at once (streamed, greedy); return all completion tokens and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: stream(url, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    return sum(tokens for _, tokens, _, _, _ in answers), wall


def measure_concurrency(
    model: Path, env: dict[str, str], tokenizer: Any, args: argparse.Namespace, failures: dict[str, str]
) -> list[Concurrency]:
    figures: list[Concurrency] = []
    setups = [(1, []), (4, [])] + ([] if "no-front" in args.skip else [(4, ["--no-recover"])])
    setups += [(8, ["--decode-groups", groups]) for groups in args.decode_groups]
    starts: list[tuple[str, Callable[[], Server]]] = [
        (
            " ".join([f"pipemlx serve S=2 --decode-concurrency {n}", *extra]),
            lambda n=n, extra=extra: pipemlx_server(
                model, env, ["--decode-concurrency", str(n), "--max-queue", "64", *extra]
            ),
        )
        for n, extra in setups
    ]
    if "mlx-lm" not in args.skip:  # one process on one core, as a machine of its own, batching 8 at once
        starts.append(("mlx_lm.server --decode-concurrency 8", lambda: mlx_lm_server(model, env, 1, pinned=True)))
    for name, start in starts:
        server: Server | None = None
        try:
            server = start()
            server.wait_ready("/health")
            stream(server.url, "It is a truth universally acknowledged", 4)  # warm-up, not timed
            for clients in args.clients:
                tokens, wall = run_clients(server.url, concurrent_prompts(tokenizer, clients), args.concurrent_tokens)
                figure = Concurrency(
                    name, clients, args.concurrent_tokens, tokens, round(wall, 3), round(tokens / wall, 1)
                )
                print(f"  {figure}", file=sys.stderr, flush=True)
                figures.append(figure)
        except Exception as exc:  # reported, not fatal
            failures[name] = f"{type(exc).__name__}: {str(exc)[:1500]}"
            print(f"  {name}: failed: {failures[name]}", file=sys.stderr)
        finally:
            if server is not None:
                server.stop()
    return figures


def print_concurrency(figures: list[Concurrency]) -> None:
    if not figures:
        return
    print("\nconcurrent clients: short prompts, greedy; aggregate = completion tokens / wall time")
    print(
        f"{'server':52} {'clients':>7} {'tokens':>7} {'wall s':>8} {'aggregate tok/s':>16} {'vs N=1':>7} {'vs mlx-lm':>9}"
    )
    base = {f.clients: f.aggregate_tokens_per_s for f in figures if f.server.endswith("concurrency 1")}
    mlx = {f.clients: f.aggregate_tokens_per_s for f in figures if f.server.startswith("mlx_lm")}
    for f in figures:
        ratio = f.aggregate_tokens_per_s / base[f.clients] if base.get(f.clients) else float("nan")
        versus = f.aggregate_tokens_per_s / mlx[f.clients] if mlx.get(f.clients) else float("nan")
        print(
            f"{f.server:52} {f.clients:7d} {f.completion_tokens:7d} {f.wall_s:8.2f} "
            f"{f.aggregate_tokens_per_s:16.1f} {ratio:6.2f}x {versus:8.2f}x"
        )


def print_table(results: list[Figures], failures: dict[str, str], args: argparse.Namespace) -> None:
    if not results and not failures:
        return
    print(f"\nlong prompt: {results[0].prompt_tokens if results else '?'} tokens, {args.max_tokens} decoded, greedy")
    print(f"{'server':38} {'TTFT s':>8} {'decode tok/s':>13} {'turn-2 TTFT s':>14} {'turn-2 cached':>14}")
    for r in results:
        turn2 = f"{r.turn2_ttft_s:.3f}" if r.turn2_ttft_s is not None else "-"
        cached = str(r.turn2_cached_tokens) if r.turn2_cached_tokens is not None else "-"
        print(f"{r.server:38} {r.ttft_s:8.3f} {r.decode_tokens_per_s:13.1f} {turn2:>14} {cached:>14}")
    for name, why in failures.items():
        print(f"{name}: did not run: {why.splitlines()[0]}")


if __name__ == "__main__":
    raise SystemExit(main())
