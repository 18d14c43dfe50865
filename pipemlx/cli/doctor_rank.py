"""One rank of ``pipemlx doctor``: join the group (bounded), share facts, measure links, run the demo end to end.

Each step is bounded: joining by ``--join-timeout`` (on expiry the rank probes its ring neighbours'
addresses with a plain TCP connect and names the link that does not answer), every later wait by
``--timeout``. Rank 0 prints the report (a table and a verdict line, or ``--json``); every rank exits
0 when the verdict is OK and 1 otherwise, with its own one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED = 0, 1
JOINED_VARIABLE = "PIPEMLX_DOCTOR_JOINED"
"""A file the rank writes once it has joined the group (set by the supervising process)."""
VERSION_VARIABLE = "PIPEMLX_DOCTOR_VERSION"
"""Overrides the pipemlx version this rank reports (to simulate a host running another version)."""
DOCTOR_PROMPT_TOKENS = 96
DOCTOR_DECODE_TOKENS = 8


def versions() -> dict[str, str]:
    import mlx.core as mx
    import mlx_lm

    import pipemlx

    return {
        "mlx": str(getattr(mx, "__version__", "?")),
        "mlx-lm": str(getattr(mlx_lm, "__version__", "?")),
        "pipemlx": os.environ.get(VERSION_VARIABLE) or pipemlx.__version__,
        "python": platform.python_version(),
    }


def ring_addresses() -> list[str]:
    """The ring hostfile's first address per rank (empty when there is none)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return []
    try:
        entries: Any = json.loads(Path(path).read_text())
        return [str(e[0]) for e in entries]
    except (OSError, ValueError, IndexError, TypeError):
        return []


def probe(address: str, timeout: float = 1.0) -> str:
    """``"ok"`` when a TCP connection to ``host:port`` opens, else why not."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return "ok"
    except TimeoutError:
        return "no answer (timed out)"
    except OSError as exc:
        return exc.strerror or str(exc)


def join() -> Any:
    """Join the group, then tell the supervising process (:func:`pipemlx.cli.doctor.supervise`) so.

    MLX's ring backend holds the interpreter while it connects, so no thread
    of this process could bound the join: the supervisor, a separate process,
    does, and names the link that does not answer when it expires.
    """
    from ..launch import init_group

    try:
        group = init_group()
    except RuntimeError as exc:
        print(f"pipemlx doctor: rank {os.environ.get('MLX_RANK', '?')}: joining failed: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_FAILED)
    marker = os.environ.get(JOINED_VARIABLE)
    if marker:
        Path(marker).write_text(str(group.rank()))
    return group


class DoctorFailure(Exception):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def format_bytes(n: float) -> str:
    from ..schedule.memory_split import format_size

    return format_size(int(n))


def run_rank(args: argparse.Namespace) -> int:
    """The doctor's work on this rank; returns the exit status."""
    try:
        report: dict[str, Any] = check(args)
    except DoctorFailure as exc:
        report = {
            "ok": False,
            "problems": exc.problems,
            "rank": int(os.environ.get("MLX_RANK", "0")),
        }
    rank = report.get("rank", 0)
    if rank == 0 or not report.get("joined", False):
        print(json.dumps(report) if args.json else render(report), flush=True)
    if not report["ok"]:
        print(f"pipemlx doctor: rank {rank}: {report['problems'][0]}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_OK if report["ok"] else EXIT_FAILED)  # MLX's teardown can block after a failed peer


def check(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from ..launch import available_memory
    from ..runtime.links import gather_facts, measure_links

    group = join()
    rank, size = group.rank(), group.size()
    problems: list[str] = []
    backend = os.environ.get("PIPEMLX_BACKEND", "any")
    addresses = ring_addresses()
    facts: dict[str, Any] = {
        "rank": rank,
        "host": socket.gethostname(),
        "address": addresses[rank] if rank < len(addresses) else "",
        "backend": backend,
        "available": available_memory(),
        "model": model_here(args.model),
        **versions(),
    }
    report: dict[str, Any] = {"rank": rank, "size": size, "joined": True, "backend": backend}
    try:
        ranks = gather_facts(group, facts, args.timeout)
    except Exception as exc:
        raise DoctorFailure([f"rank {rank}: the first collective failed: {exc}"]) from exc
    report["ranks"] = ranks
    for key in ("mlx", "mlx-lm", "pipemlx"):
        values = [r[key] for r in ranks]
        if len(set(values)) > 1:
            common = max(values, key=lambda v: (values.count(v), v == values[0]))  # a tie: rank 0's
            odd = [r for r in ranks if r[key] != common]
            problems.extend(
                f"version mismatch: rank {r['rank']} ({r['host']} {r['address']}) runs {key} {r[key]}, "
                f"the others {common}"
                for r in odd
            )
    try:
        links = measure_links(group, args.timeout)
        report["links"] = [
            {"ranks": [x.source, x.target], "latency_ms": 1e3 * x.latency_s, "bandwidth": x.bandwidth_bytes_s}
            for x in links
        ]
    except Exception as exc:
        raise DoctorFailure([*problems, f"{type(exc).__name__}: {exc}"]) from exc
    plan = planned_memory(args, size)
    report["memory"] = plan
    if plan is not None:
        for r, need in enumerate(plan["needs"]):
            if need > ranks[r]["available"]:
                problems.append(
                    f"memory: rank {r} ({ranks[r]['host']}) needs {format_bytes(need)} for its layers at "
                    f"{plan['context']} tokens but has {format_bytes(ranks[r]['available'])} available"
                )
    try:
        report["e2e"] = end_to_end(args, group)
    except Exception as exc:
        problems.append(f"end-to-end prefill + decode failed on rank {rank}: {type(exc).__name__}: {exc}")
        report["e2e"] = None
    if report["e2e"] is not None:
        with mx.stream(mx.new_thread_unsafe_stream(mx.default_device())):
            fingerprint = mx.array([sum((i + 1) * t for i, t in enumerate(report["e2e"]["tokens"]))], dtype=mx.int32)
            gathered = mx.distributed.all_gather(fingerprint, group=group)
        from ..runtime.waits import wait_for

        wait_for(gathered, args.timeout, lambda: f"rank {rank}/{size} comparing the tokens")
        fingerprints: list[int] = gathered.tolist()  # pyright: ignore[reportAssignmentType]
        if len(set(fingerprints)) > 1:
            problems.append("end-to-end: the ranks decoded different tokens")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def model_here(model: Any) -> str:
    """``"has it"`` when this machine has the model (a folder, or every weight file in the Hub cache), else
    ``"fetches"``: its ranks read their tensors from a rank that has it, or from the Hub."""
    from ..models.hub import cached_snapshot

    return "has it" if cached_snapshot(model) is not None else "fetches"


def planned_memory(args: argparse.Namespace, size: int) -> dict[str, Any] | None:
    from ..models.hub import memory_model_of
    from ..schedule.memory_model import Settings, plan_context

    try:
        model = memory_model_of(args.model)
        context = min(args.context or model.max_context or 4096, model.max_context or 1 << 24)
        plan = plan_context(model, size, Settings(context, 512), split=args.split)
    except (OSError, ValueError):
        return None
    return {"context": context, "split": list(plan.split), "needs": [r.total for r in plan.ranks]}


def end_to_end(args: argparse.Namespace, group: Any) -> dict[str, Any]:
    """The model (default: the demo) loaded on every rank, a prompt prefilled across the ranks and decoded."""
    import mlx.core as mx

    import pipemlx

    from ..runtime.stage import stage_of

    model, _ = pipemlx.load_sharded(
        args.model, group, split=args.split, timeout=args.timeout, allow_unregistered=args.allow_unregistered
    )
    vocab = int(getattr(getattr(model, "args"), "vocab_size", 256))
    prompt = mx.arange(DOCTOR_PROMPT_TOKENS, dtype=mx.int32) % vocab
    started = time.perf_counter()
    first: list[float] = []
    tokens: list[int] = []
    for token, _ in pipemlx.generate_step(  # logprobs unread: a split head (the default) gathers no logits
        prompt, model, max_tokens=DOCTOR_DECODE_TOKENS, prefill_step_size=16, timeout=args.timeout, logprobs=False
    ):
        if not first:
            first.append(time.perf_counter())
        tokens.append(int(token))
    ended = time.perf_counter()
    stage = stage_of(model)
    return {
        "prompt_tokens": DOCTOR_PROMPT_TOKENS,
        "tokens": tokens,
        "prefill_s": first[0] - started,
        "decode_tok_s": (len(tokens) - 1) / max(ended - first[0], 1e-9),
        "split": list(stage.info.split),
    }


def render(report: dict[str, Any]) -> str:
    """The report as a table and a verdict line."""
    lines: list[str] = []
    ranks: list[dict[str, Any]] = report.get("ranks", [])
    if ranks:
        memory = report.get("memory")
        lines.append(f"pipemlx doctor: {len(ranks)} ranks, backend {report.get('backend')}")
        header = ("rank", "host", "address", "mlx", "mlx-lm", "pipemlx", "model", "available", "needs")
        rows: list[tuple[str, ...]] = [header]
        for r in ranks:
            need = memory["needs"][r["rank"]] if memory else None
            rows.append(
                (
                    str(r["rank"]),
                    r["host"],
                    r["address"] or "-",
                    r["mlx"],
                    r["mlx-lm"],
                    r["pipemlx"],
                    str(r.get("model", "-")),
                    format_bytes(r["available"]),
                    "-" if need is None else format_bytes(need),
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        if memory:
            lines.append(f"needs: the model's split {memory['split']} at {memory['context']} tokens (pipemlx split)")
    for link in report.get("links", []):
        a, b = link["ranks"]
        lines.append(
            f"link rank {a} <-> rank {b}: latency {link['latency_ms']:.3f} ms, "
            f"bandwidth {format_bytes(link['bandwidth'])}/s"
        )
    e2e = report.get("e2e")
    if e2e:
        lines.append(
            f"end to end: split {e2e['split']}, {e2e['prompt_tokens']} prompt tokens prefilled in "
            f"{e2e['prefill_s']:.2f} s, {len(e2e['tokens'])} tokens decoded at {e2e['decode_tok_s']:.0f} tokens/s"
        )
    problems: list[str] = report.get("problems", [])
    lines += [f"problem: {p}" for p in problems]
    if report.get("ok"):
        lines.append(f"verdict: OK: {len(ranks)} ranks, {len(report.get('links', []))} links, end to end works")
    else:
        lines.append(f"verdict: FAIL: {problems[0] if problems else 'see above'}")
    return "\n".join(lines)
