"""What serving through the front costs: ``pipemlx serve --ranks 2`` (the front, the default) against
``--no-recover`` (rank 0 serves HTTP itself), same model, alternating in one run.

Each round starts one server of each kind in turn (the order alternates between
rounds) and measures, at the client: one streamed greedy request of
``--prompt-tokens`` tokens decoding ``--max-tokens`` (time to first token, decode
tokens/s), then ``--clients`` short greedy streams at once with
``--decode-concurrency 4`` servers (aggregate tokens/s). The figures are the
medians over the rounds, and each contender's ratio to ``--no-recover``.

Usage: python benchmarks/serve_front.py [--rounds 3] [--prompt-tokens 512] [--max-tokens 128] [--clients 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import bench_env, openblas_available
from serve import Server, bench_model, concurrent_prompts, pipemlx_server, run_clients, stream

from pipemlx.demo import book_text

CONTENDERS = {"front (default)": [], "--no-recover": ["--no-recover"]}


def one_round(model: object, env: dict[str, str], name: str, prompt: str, args: argparse.Namespace) -> dict[str, float]:
    extra = CONTENDERS[name]
    figures: dict[str, float] = {}
    server: Server | None = None
    try:
        server = pipemlx_server(model, env, [*extra])  # pyright: ignore[reportArgumentType]
        server.wait_ready("/health")
        stream(server.url, "It is a truth universally acknowledged", 4)  # warm-up, not timed
        ttft, _, decode_tps, _, _ = stream(server.url, prompt, args.max_tokens)
        figures["ttft_s"], figures["decode_tok_s"] = ttft, decode_tps
    finally:
        if server is not None:
            server.stop()
    server = None
    try:
        server = pipemlx_server(model, env, ["--decode-concurrency", "4", "--max-queue", "64", *extra])  # pyright: ignore[reportArgumentType]
        server.wait_ready("/health")
        stream(server.url, "It is a truth universally acknowledged", 4)
        tokens, wall = run_clients(server.url, args.prompts, args.concurrent_tokens)
        figures["batch_tok_s"] = tokens / wall
    finally:
        if server is not None:
            server.stop()
    print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), file=sys.stderr, flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--concurrent-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model = bench_model()
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompt = tokenizer.decode(tokenizer.encode(book_text()[2000:])[: args.prompt_tokens])
    args.prompts = concurrent_prompts(tokenizer, args.clients)
    openblas = openblas_available()
    env = bench_env(openblas)
    print(f"model {model}, OpenBLAS {'on' if openblas else 'off'}", file=sys.stderr)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    names = list(CONTENDERS)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rounds[name].append(one_round(model, env, name, prompt, args))
    base = {k: statistics.median(f[k] for f in rounds["--no-recover"]) for k in rounds["--no-recover"][0]}
    print(f"\n{args.rounds} rounds, medians; prompt {args.prompt_tokens} tokens, {args.max_tokens} decoded; "
          f"{args.clients} clients x {args.concurrent_tokens} tokens at --decode-concurrency 4")  # fmt: skip
    print(f"{'server':<18} {'TTFT s':>8} {'decode tok/s':>13} {'batch tok/s':>12}  vs --no-recover (decode, batch)")
    for name, figures in rounds.items():
        med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
        print(
            f"{name:<18} {med['ttft_s']:8.3f} {med['decode_tok_s']:13.1f} {med['batch_tok_s']:12.1f}  "
            f"{med['decode_tok_s'] / base['decode_tok_s']:.2f}x, {med['batch_tok_s'] / base['batch_tok_s']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
