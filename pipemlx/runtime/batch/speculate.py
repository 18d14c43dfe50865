"""Speculation in a :class:`~pipemlx.runtime.batch.BatchGenerator`: per-row prompt-lookup guesses, verified in the
batch's decode step.

Prompt lookup reads only the token history, which every rank holds alike, so every rank proposes the same guesses
for every row without a message: no rank runs a proposer the others wait for. In a tick with guesses, each live row
that guesses feeds its next token and its ``k_i`` guesses, the others their next token alone, right-padded to the
tick's widest row (the padding, after a row's real positions, is never attended to by them: the step is causal).
The last rank samples position 0 of every row as without guesses (the row's sampler and processors), and the greedy
rows' later positions by their argmax; a row keeps its guesses up to the first one its samples disagree with, then
its own next token (:func:`emitted`). Only rows that decode greedily with no logits processors guess, so a sampled
row's sampler sees exactly one call per token, as without speculation.

Every rank then cuts each row of its batch caches back to the positions the row kept (:func:`cut_rows`): the
rejected positions of a row become left padding, so the rows stay right-aligned at one shared position, as mlx-lm's
``BatchKVCache`` needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll  # pyright: ignore[reportUnknownVariableType]

from ..caches import cache_parts
from ..protocol import MAX_GUESSES
from ..sampling import Sampler
from ..speculative import PromptLookup
from .requests import BatchRequest

AUTO_GUESSES = 4
"""``num_draft_tokens="auto"``: the guesses a row proposes in a pass while its acceptance holds up."""
AUTO_TRIAL = 12
"""``"auto"``: a row's guesses are judged once it has proposed this many."""
AUTO_MIN_ACCEPTANCE = 0.25
"""``"auto"``: a row whose confirmed share of its guesses is below this stops guessing (see :class:`RowTally`)."""
AUTO_RETRY_EVERY = 32
"""``"auto"``: a row that stopped guessing guesses again (a new trial) after this many ticks without."""


@dataclass
class RowTally:
    """One request's guesses so far: proposed and confirmed, and the ticks since it stopped guessing (``"auto"``)."""

    proposed: int = 0
    confirmed: int = 0
    resting: int = 0  # ticks without guesses since "auto" turned the row's guesses off (0: guessing)
    recent: list[tuple[int, int]] = field(default_factory=list[tuple[int, int]])  # since the last judgement


class BatchSpeculation:
    """The generator's prompt-lookup setting and every request's tallies: which rows guess, and how many tokens.

    ``num_draft_tokens`` is the guesses per pass (an int), or ``"auto"``: :data:`AUTO_GUESSES` per pass, judged per
    row from its own tallies. Once a row has proposed :data:`AUTO_TRIAL` guesses since the last judgement, it stops
    guessing if fewer than :data:`AUTO_MIN_ACCEPTANCE` of them were confirmed (each guess that fails costs the
    batch's step a position for nothing), and after :data:`AUTO_RETRY_EVERY` ticks guesses again, judged afresh.
    Every decision is taken from the tokens every rank received, so every rank takes it alike.
    """

    def __init__(self, prompt_lookup: int, num_draft_tokens: int | Literal["auto"]) -> None:
        self.proposer = PromptLookup(prompt_lookup)
        self.auto = num_draft_tokens == "auto"
        self.count = AUTO_GUESSES if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.tallies: dict[int, RowTally] = {}  # by uid: the requests that may guess
        self.ended: dict[int, RowTally] = {}  # by uid: those that left since the last tick began (for their figures)
        self.proposed = 0  # every row's, for the counters
        self.confirmed = 0

    def enrol(self, uid: int) -> None:
        """A new request may guess."""
        self.tallies[uid] = RowTally()

    def forget(self, uids: set[int]) -> None:
        """Requests that left: their tallies are kept until the next tick begins (:meth:`of` reads them)."""
        for uid in uids:
            tally = self.tallies.pop(uid, None)
            if tally is not None:
                self.ended[uid] = tally

    def of(self, uid: int) -> tuple[int, int]:
        """``(proposed, confirmed)`` of a request that may guess, or that left since the last tick began."""
        tally = self.tallies.get(uid) or self.ended.get(uid)
        return (0, 0) if tally is None else (tally.proposed, tally.confirmed)

    def guesses(self, request: BatchRequest, default: Sampler | None) -> list[int]:
        """The guesses ``request``'s row feeds in the next step after its next token (none for a dead row, a row
        that samples or has processors, one in its closing step, one that opted out or rests)."""
        tally = self.tallies.get(request.uid)
        if tally is None or request.done or (request.sampler or default) is not None or request.processors:
            return []
        if request.decided is not None and request.decided.reason is not None:
            return []  # its closing step: it feeds its last token only
        if tally.resting:
            if tally.resting < AUTO_RETRY_EVERY:
                tally.resting += 1
                return []
            tally.resting = 0
            tally.recent = []
        k = self.count
        if request.max_tokens != -1:  # every guess may be kept, and the row's own token after them
            k = min(k, request.max_tokens - len(request.answer) - 1)
        if k <= 0:
            return []
        return self.proposer.propose(request.context, k)

    def record(self, uid: int, proposed: int, confirmed: int) -> None:
        """A row's pass: ``proposed`` guesses, ``confirmed`` of them held."""
        tally = self.tallies.get(uid)
        if tally is None or not proposed:
            return
        tally.proposed += proposed
        tally.confirmed += confirmed
        self.proposed += proposed
        self.confirmed += confirmed
        if not self.auto:
            return
        tally.recent.append((proposed, confirmed))
        tried = sum(p for p, _ in tally.recent)
        if tried >= AUTO_TRIAL:
            if sum(c for _, c in tally.recent) < AUTO_MIN_ACCEPTANCE * tried:
                tally.resting = 1
            tally.recent = []


def check_speculation(prompt_lookup: object, num_draft_tokens: object) -> None:
    """Raise ``ValueError`` naming the problem unless the generator's speculation settings are good ones (decided from
    the arguments alone, alike on every rank)."""
    if isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or prompt_lookup < 1:
        raise ValueError(f"prompt_lookup must be a positive int (the longest n-gram matched), got {prompt_lookup!r}")
    if num_draft_tokens != "auto" and (
        isinstance(num_draft_tokens, bool)
        or not isinstance(num_draft_tokens, int)
        or not 1 <= num_draft_tokens <= MAX_GUESSES
    ):
        raise ValueError(f"num_draft_tokens must be an int from 1 to {MAX_GUESSES} or 'auto', got {num_draft_tokens!r}")


def emitted(guesses: list[int], samples: list[int]) -> list[int]:
    """The tokens a row's pass yields: its guesses up to the first one its ``samples`` (one per position fed, the
    row's next token first) disagree with, then its own sample after them."""
    kept = 0
    while kept < len(guesses) and guesses[kept] == samples[kept]:
        kept += 1
    return samples[: kept + 1]


def padded_inputs(inputs: list[int], guesses: list[list[int]], pad: int = 0) -> tuple[list[list[int]], int]:
    """Each row's positions of a step with guesses: its next token, its guesses, ``pad`` up to the widest row;
    and that width."""
    width = 1 + max((len(g) for g in guesses), default=0)
    return [[t, *g, *([pad] * (width - 1 - len(g)))] for t, g in zip(inputs, guesses)], width


def speculable(cache: list[Any]) -> bool:
    """Whether a new request's per-layer ``cache`` batches into caches :func:`cut_rows` can cut back per row: plain
    ``KVCache`` layers (lent heads' ``CacheList`` parts included) only, never rotating, quantized or recurrent ones."""
    parts = cache_parts(cache)
    return bool(parts) and all(type(c) is KVCache for c in parts)


def cut_rows(batch_caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[i]`` positions from mlx-lm ``BatchKVCache`` layers, in place (lazily).

    The rows of a ``BatchKVCache`` end at one shared position (``_idx``; each row left-padded). The positions every
    row rejects are trimmed off the end; a row that rejects more is moved right by the difference (what it rejected
    moves past the end, where the next step overwrites it) and its left padding grows by as much, as mlx-lm's
    ``BatchKVCache.finalize`` turns right padding into left padding. Its keys keep the rotary positions they were
    computed at, and its offset (its own position) goes back by what it rejected. Raises ``TypeError`` for a layer
    of another kind (checked before anything changes).
    """
    parts = cache_parts(batch_caches)
    kinds = sorted({type(p).__name__ for p in parts if type(p) is not BatchKVCache})
    if kinds:
        raise TypeError(f"cannot cut rows of {kinds} back per row: batched speculation needs plain KV caches")
    if not rejected:
        return
    common = min(rejected)
    shifts = [r - common for r in rejected]
    for part in parts:
        if common:
            part.trim(common)
        if any(shifts) and part.keys is not None:
            shift = mx.array(shifts, dtype=mx.int32)
            part.keys = dynamic_roll(part.keys, shift[:, None], axis=2)
            part.values = dynamic_roll(part.values, shift[:, None], axis=2)
            part.left_padding = part.left_padding + shift
            part.offset = part.offset - shift


__all__ = [
    "AUTO_GUESSES",
    "MAX_GUESSES",
    "BatchSpeculation",
    "RowTally",
    "check_speculation",
    "cut_rows",
    "emitted",
    "padded_inputs",
    "speculable",
]
