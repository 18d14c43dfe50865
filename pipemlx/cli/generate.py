"""``pipemlx generate``, one rank's side: load, shard, prefill with a progress bar, stream, summarise."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer  # pyright: ignore[reportUnknownVariableType]
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ..errors import PipelineError
from ..launch import init_group
from ..models.hub import locate_model
from ..models.loading import load_draft, load_sharded
from ..models.peer import Sharing, share_model
from ..observe.metrics import decode_tokens_per_s, prefill_tokens_per_s
from ..runtime.generate import stream_generate
from ..runtime.prefill import pipeline_prefill
from ..runtime.stage import stage_of
from .common import check_ranks, model_name
from .parity import prompt_tokens

PROMPT_TAIL_CHARS = 300
MB = float(1 << 20)


@dataclass(frozen=True)
class RankFigures:
    """What one rank reports for the summary."""

    rank: int
    layer_start: int
    layer_stop: int
    peak_memory_mb: float
    load_s: float = 0.0  # loading and sharding the model on this rank (lend="auto" and the split included)
    calibration_s: float = 0.0  # timing costs and agreeing on them on this rank (stage.calibration_s)


class TokenRate(ProgressColumn):
    """Tokens per second since the bar started."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        rate = task.completed / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="progress.data.speed")


def generate_rank(
    args: argparse.Namespace,
    prompt_text: str,
    *,
    expected_ranks: int | None,
) -> int:
    """Run ``pipemlx generate`` as one rank of the group this process belongs to; returns the exit status."""
    group = init_group()
    rank, size = group.rank(), group.size()
    err = Console(stderr=True, quiet=rank != 0 or args.json or not args.verbose)
    if expected_ranks is not None and expected_ranks != size:
        if rank == 0:
            print(f"pipemlx generate: error: --ranks {expected_ranks} but the group has {size} ranks", file=sys.stderr)
        return 2
    # Who has the model (one all-gather): a rank without it reads it from one that has it, which serves it
    # until the run ends (pipemlx/models/peer.py).
    with share_model(group, args.model, None, args.timeout) as sharing:
        if sharing.peer is None:
            check_ranks(size, args.model, args.split)
        try:
            return _generate(args, prompt_text, group, err, sharing)
        except PipelineError as exc:
            print(f"pipemlx generate: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1


def _generate(
    args: argparse.Namespace, prompt_text: str, group: mx.distributed.Group, err: Console, sharing: Sharing
) -> int:
    rank, size = group.rank(), group.size()
    tokenizer_config = {"trust_remote_code": True} if args.trust_remote_code else None
    try:  # the tokenizer first: the prompt's real length is the context the model is sharded for (lend=auto)
        # a repo: its metadata fetched; from a peer: its config and tokenizer files
        root = sharing.peer.metadata_root() if sharing.peer else locate_model(args.model, rank=rank).root
        tokenizer: Any = load_tokenizer(root, tokenizer_config)
    except (ValueError, OSError) as exc:
        print(f"pipemlx generate: error: cannot load the tokenizer in {args.model}: {exc}", file=sys.stderr)
        return 2
    try:  # as mlx_lm.generate builds it: the chat template by default
        prompt = mx.array(prompt_tokens(tokenizer, prompt_text, args), dtype=mx.int32)
    except Exception as exc:  # a template that refuses the messages: the same on every rank
        print(f"pipemlx generate: error: the chat template cannot render the prompt: {exc}", file=sys.stderr)
        return 2
    if prompt.size == 0:  # every rank encodes the same text: every rank stops here, before anything is sent
        print(f"pipemlx generate: error: the prompt {prompt_text!r} encodes to no tokens", file=sys.stderr)
        return 2
    loading = time.perf_counter()
    try:  # mlx-lm's own loader, lazily: this rank reads only the weights it keeps
        model, tokenizer = load_sharded(
            args.model,
            group,
            split=args.split,
            timeout=args.timeout,
            allow_unregistered=args.allow_unregistered,
            context=prompt.size + args.max_tokens if args.max_tokens >= 0 else None,
            lend=args.lend,
            head=args.head,
            adapter_path=args.adapter_path,
            tokenizer_config=tokenizer_config,
            sharing=sharing,
        )
    except (ValueError, OSError) as exc:
        print(f"pipemlx generate: error: cannot load the model in {args.model}: {exc}", file=sys.stderr)
        return 2
    try:  # speculative decoding: the draft is whole on every rank (mlx-lm's loader, a folder or a repo id)
        draft = None if args.draft_model is None else load_draft(args.draft_model)
    except Exception as exc:  # a missing folder, a repo the Hub lacks, weights mlx-lm refuses: one line on every rank
        print(f"pipemlx generate: error: cannot load the draft model {args.draft_model}: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - loading
    stage = stage_of(model)
    step_size: int | str = args.prefill_step_size
    name = model_name(args.model)
    err.print(
        f"[bold]pipemlx[/bold]: {name}, {stage.info.total_layers} layers on {size} rank{'s' if size > 1 else ''} "
        f"(split {list(stage.info.split)}); prompt {prompt.size} tokens, prefill step {step_size}",
        highlight=False,
        soft_wrap=True,
    )

    cache = make_prompt_cache(model)
    progress = Progress(
        TextColumn("[bold]prefill"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TokenRate(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=err,
    )
    task = progress.add_task("prefill", total=max(prompt.size - 1, 1))

    def on_progress(processed: int, total: int) -> None:
        progress.update(task, completed=processed)

    start = time.perf_counter()
    with progress:
        step = pipeline_prefill(
            model,
            prompt,
            cache,
            prefill_step_size=args.prefill_step_size,
            prompt_progress_callback=on_progress,
            timeout=args.timeout,
        )
    prefill_s = time.perf_counter() - start

    for eos in args.extra_eos_token:
        tokenizer.add_eos_token(eos)
    err.print(Text(_prompt_tail(prompt_text), style="dim"), end="")
    if args.seed is not None:
        mx.random.seed(args.seed)
    tokens: list[int] = []
    pieces: list[str] = []
    generated, first_token, last_token, confirmed = 0, 0.0, 0.0, 0
    responses = stream_generate(
        model,
        tokenizer,
        prompt[-1:],
        max_tokens=args.max_tokens,
        prompt_cache=cache,
        sampler=_sampler(args, tokenizer),
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        prefill_step_size=step,
        draft_model=draft,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup=args.prompt_lookup,
        logprobs=False,  # never read here: with --head split, greedy steps gather no logits
    )
    for response in responses:
        if response.finish_reason != "stop":
            tokens.append(response.token)
        confirmed += int(response.from_draft)
        pieces.append(response.text)
        last_token = time.perf_counter()
        generated += 1
        if generated == 1:
            first_token = last_token
        if rank == 0 and not args.json and args.verbose:
            sys.stdout.write(response.text)
            sys.stdout.flush()
    figures = _gather_figures(group, stage.info.layers, load_s, stage.calibration_s)
    if rank != 0:
        return 0
    prefill_tps = prefill_tokens_per_s(prompt.size, prefill_s)
    decode_tps = decode_tokens_per_s(generated, last_token - first_token)
    if args.json:
        report = {
            "ranks": size,
            "split": list(stage.info.split),
            "lend_mlp": stage.info.lending.mlp,
            "lend_heads": stage.info.lending.heads,
            "prompt_tokens": prompt.size,
            "prefill_step_size": step_size,
            "largest_chunk": step,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens_per_s": decode_tps,
            "confirmed_guesses": confirmed,
            "proposed_guesses": responses.guesses[0],
            "tokens": tokens,
            "text": "".join(pieces),
            "per_rank": [f.__dict__ for f in figures],
        }
        print(json.dumps(report), flush=True)
        return 0
    if not args.verbose:  # mlx-lm's --verbose false: the text alone
        print("".join(pieces), flush=True)
        return 0
    sys.stdout.write("\n")
    sys.stdout.flush()
    speculating = draft is not None or args.prompt_lookup is not None
    guessed = (confirmed, *responses.guesses) if speculating else None
    err.print(_summary(prompt.size, step, prefill_s, prefill_tps, len(tokens), decode_tps, figures, guessed))
    return 0


def _sampler(args: argparse.Namespace, tokenizer: Any) -> Any:
    """mlx_lm.generate's sampler (``None`` when greedy: the ranks then share the head's work)."""
    if args.temp <= 0:
        return None
    return make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def _prompt_tail(text: str) -> str:
    """The end of the prompt, shown before the generated text: whole lines, about ``PROMPT_TAIL_CHARS``."""
    if len(text) <= PROMPT_TAIL_CHARS:
        return text
    tail = text[-PROMPT_TAIL_CHARS:]
    if "\n" not in tail[:-1]:
        return "…" + tail
    return "…\n" + tail[tail.find("\n") + 1 :].lstrip("\n")


def _gather_figures(
    group: mx.distributed.Group, layers: range, load_s: float, calibration_s: float
) -> list[RankFigures]:
    """Every rank's layers, peak memory, load and calibration seconds, by rank (a small all-gather)."""
    mine = mx.array([layers.start, layers.stop, mx.get_peak_memory() / MB, load_s, calibration_s], dtype=mx.float32)
    gathered: list[float] = mx.distributed.all_gather(mine, group=group).tolist()  # pyright: ignore[reportAssignmentType]
    n = mine.size
    return [
        RankFigures(
            r,
            int(gathered[n * r]),
            int(gathered[n * r + 1]),
            round(gathered[n * r + 2], 1),
            round(gathered[n * r + 3], 3),
            round(gathered[n * r + 4], 3),
        )
        for r in range(group.size())
    ]


def _summary(
    prompt_tokens: int,
    step_size: int,
    prefill_s: float,
    prefill_tps: float,
    generated: int,
    decode_tps: float,
    figures: list[RankFigures],
    guesses: tuple[int, int, int] | None = None,
) -> Table:
    """The closing table; ``guesses``: speculative decoding's tokens that were confirmed guesses, and the tokens
    guessed and accepted (the acceptance rate)."""
    table = Table(title="pipemlx generate", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompt tokens", f"{prompt_tokens} (chunks of up to {step_size})")
    table.add_row("prefill", f"{prefill_s:.2f} s, {prefill_tps:,.0f} tokens/s")
    table.add_row("decode", f"{generated} tokens, {decode_tps:,.0f} tokens/s")
    if guesses is not None:
        confirmed, proposed, accepted = guesses
        share = confirmed / generated if generated else 0.0
        rate = f"{accepted / proposed:.0%}" if proposed else "none guessed"
        table.add_row(
            "guesses",
            f"{confirmed} of the {generated} tokens were confirmed guesses ({share:.0%}); "
            f"acceptance {accepted} of {proposed} guessed tokens ({rate})",
        )
    for f in figures:
        table.add_row(
            f"rank {f.rank}",
            f"layers {f.layer_start}-{f.layer_stop - 1}, peak memory {f.peak_memory_mb:,.1f} MB, "
            f"load {f.load_s:.1f} s, calibration {f.calibration_s:.2f} s",
        )
    return table
