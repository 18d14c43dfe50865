"""Speculative decoding through the server: decode tokens/s of greedy answers with and without guesses.

    python benchmarks/serve_speculative.py [--proposer draft|lookup] [--num-draft-tokens 3] [--requests 12]
                                           [--concurrency 1]

Starts `pipemlx serve --ranks 2` on the demo model with its draft model (`--proposer draft`) or with
`--prompt-lookup 3` (`--proposer lookup`, on a prompt that repeats the start of a passage it contains), and
sends `--requests` completions of `--max-tokens` greedy tokens, alternating `"draft": true` and `false`, so
that both see the same machine load; prints each request's figures from `/health` (decode tokens/s, guessed
and accepted tokens) and the median of each kind, with the load average. The prompt is cached after the
first request, so the figures are decode speed. ``--concurrency N`` (above 1): the server batches N requests
(``--decode-concurrency N``) and each round sends N requests at once, all with guesses or all without (rounds
alternating, after one uncounted round that prefills the prompts); a round's figure is its completion tokens over
its wall time (the batch's aggregate rate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from pipemlx.demo import DRAFT_DIR, book_text
from pipemlx.launch import free_ports

OPENING = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def prompt_for(proposer: str) -> str:
    if proposer == "draft":
        return OPENING
    book = book_text()
    start = book.index(OPENING[:38])
    passage = book[start : start + 1500]
    return passage + "\n\n" + passage[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--proposer", choices=("draft", "lookup"), default="draft")
    parser.add_argument("--num-draft-tokens", default="3", help="a count or auto")
    parser.add_argument("--requests", type=int, default=12, help="half with guesses, half without")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1, help="requests batched at once (rounds of this many)")
    args = parser.parse_args()
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    guessing = ["--draft-model", str(DRAFT_DIR)] if args.proposer == "draft" else ["--prompt-lookup", "3"]
    command = [sys.executable, "-m", "pipemlx", "serve", "--ranks", "2", "--port", str(port), *guessing]
    server = subprocess.Popen(
        [*command, "--num-draft-tokens", args.num_draft_tokens, "--decode-concurrency", str(args.concurrency)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        rates: dict[bool, list[float]] = {True: [], False: []}
        body: dict[str, Any] = {"prompt": prompt_for(args.proposer), "max_tokens": args.max_tokens, "temperature": 0}
        if args.concurrency > 1:
            rounds(url, body, args, rates)
        for i in range(args.requests if args.concurrency == 1 else 0):
            draft = i % 2 == 0
            httpx.post(url + "/v1/completions", json={**body, "draft": draft}, timeout=600).raise_for_status()
            record = httpx.get(url + "/health", timeout=10).json()["recent"][-1]
            rates[draft].append(record["decode_tokens_per_s"])
            print(
                f"draft {str(draft).lower():5} {record['completion_tokens']} tokens, "
                f"{record['decode_tokens_per_s']:6.1f} tokens/s, accepted {record['draft_accepted_tokens']} "
                f"of {record['draft_proposed_tokens']} guessed",
                flush=True,
            )
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"{args.proposer}, --num-draft-tokens {args.num_draft_tokens}: median {statistics.median(rates[True]):.1f} "
            f"tokens/s with guesses, {statistics.median(rates[False]):.1f} without (load average {load})"
        )
    finally:
        server.terminate()
        server.wait(60)


def rounds(url: str, body: dict[str, Any], args: argparse.Namespace, rates: dict[bool, list[float]]) -> None:
    """``--concurrency N``: rounds of N requests sent at once (each its own prompt: the book's chapter number
    before it), all with guesses or all without, alternating; each round's aggregate tokens/s."""
    from concurrent.futures import ThreadPoolExecutor

    def post(i: int, draft: bool) -> int:
        answer = httpx.post(
            url + "/v1/completions",
            json={**body, "prompt": f"Chapter {i + 1}. {body['prompt']}", "draft": draft},
            timeout=600,
        )
        answer.raise_for_status()
        return int(answer.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(args.concurrency) as pool:  # a round first, not counted: it prefills the prompts
        list(pool.map(lambda i: post(i, False), range(args.concurrency)))
    for r in range(max(2, args.requests // args.concurrency)):
        draft = r % 2 == 0
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(lambda i: post(i, draft), range(args.concurrency)))
        rate = tokens / (time.perf_counter() - start)
        rates[draft].append(rate)
        print(f"round {r}: draft {str(draft).lower():5} {tokens} tokens, {rate:6.1f} tokens/s at once", flush=True)


if __name__ == "__main__":
    main()
