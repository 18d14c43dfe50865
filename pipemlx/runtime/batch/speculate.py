"""Speculation in a :class:`~pipemlx.runtime.batch.BatchGenerator`: per-row guesses, by prompt lookup or a draft
model, verified in the batch's decode step.

Every rank proposes the same guesses for every row without a message: no rank runs a proposer the others wait for.
Prompt lookup reads only the token history, which every rank holds alike. A draft model is whole on every rank
(as ``generate_step``'s ``draft_model``): each rank keeps the guessing rows' draft caches batched (:mod:`.draft`),
reads each row's history into its row and draws every row's guesses greedily, one draft forward a step for all,
so every rank draws the same ones from the same weights; the guesses join
the tick's plan fingerprint, so ranks whose drafts disagree (another draft, another backend's rounding) fail the
tick's agreement with an error rather than decode apart. In a tick with guesses, each live row
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

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..caches import cache_parts
from ..protocol import MAX_GUESSES
from ..sampling import Sampler
from ..speculative import PromptLookup, Proposer, check_proposer
from .cut import common_cut, cut_rows
from .draft import BatchDraft
from .requests import BatchRequest

AUTO_GUESSES = 4
"""``num_draft_tokens="auto"``: the most guesses a row feeds in a step (each step's count is chosen, 0 to this)."""
AUTO_PRIOR = (1.0, 1.0)
"""``"auto"``: a new row's tally before it guessed, ``(held, failed)``: a guess holds with probability 1/2."""
AUTO_DECAY = 0.9
"""``"auto"``: each later pass of a row weighs its earlier passes' tally by this (recent passes count most)."""
AUTO_PRIOR_SLOPE = 1.0
"""``"auto"``: before a step with guesses was timed, each position a row adds costs this share of a plain step: a
whole one, so nothing guesses before a probe measured what a wider step costs (measured on the CPU backend: 2-2.7
plain steps for one or two guesses a row, so an optimistic prior paid for its first steps with guesses)."""
AUTO_PROBE_EVERY = 64
"""``"auto"``: after this many steps that chose no guesses while some row had guesses to feed, one guess is tried
(the rows' acceptance and the steps' cost measured afresh); each probe that guesses do not follow doubles the wait,
up to :data:`AUTO_PROBE_MOST`, and a step that chooses guesses on its own sets it back."""
AUTO_PROBE_MOST = 1024
"""``"auto"``: the longest wait between two probes (steps), where guesses keep losing."""
AUTO_COST_WEIGHT = 0.25
"""``"auto"``: the weight of a newly timed plain step in the running mean of a plain step's seconds."""
AUTO_WARMUP = 4
"""``"auto"``: plain steps timed before the first guess (the first steps after a prefill also evaluate the joins)."""
AUTO_SAMPLES = 5
"""``"auto"``: the latest timings of a width kept; its cost is their median (one slow step does not decide)."""


@dataclass
class RowTally:
    """One request's guesses so far: proposed and confirmed, and its decayed ``(held, failed)`` tally (``"auto"``:
    each pass adds its held guesses and, if one of its guesses failed, one failure)."""

    proposed: int = 0
    confirmed: int = 0
    held: float = AUTO_PRIOR[0]
    failed: float = AUTO_PRIOR[1]

    @property
    def acceptance(self) -> float:
        """The chance the row's next guess holds, given the ones before it held: held over held and failed (a
        geometric run of held guesses ended by a failure, the maximum-likelihood estimate, with the prior)."""
        return self.held / (self.held + self.failed)


@dataclass
class StepCosts:
    """What a decode step costs by width (1: no guesses), in plain steps, from steps every rank timed alike.

    Each rank times its ticks and reports the last one in the next tick's header; every rank takes the ranks'
    mean (:attr:`~pipemlx.runtime.batch.tick.TickOutcome.last_tick_us`), so every rank holds the same figures. Only ticks
    that computed no prefill chunk are counted (a chunk's work is no guess's cost). A plain step's seconds are a
    running mean; a wider step's are kept as its ratio to that mean when it ran (the batch's rows and context
    change a step's seconds, not much their ratio), the median of the latest :data:`AUTO_SAMPLES`."""

    plain: float | None = None  # a plain step's seconds, the running mean
    plain_count: int = 0  # plain steps timed
    ratios: dict[int, list[float]] = field(default_factory=dict[int, list[float]])  # by width: latest, in plain steps

    @classmethod
    def fixed(cls, ratios: dict[int, float]) -> StepCosts:
        """Costs known in advance (tests): ``ratios`` by width, in plain steps, a plain step 1 s."""
        return cls(1.0, AUTO_WARMUP, {w: [r] for w, r in ratios.items() if w > 1})

    def observe(self, width: int, seconds: float) -> None:
        """A step of ``width`` positions a row took ``seconds``."""
        if width == 1:
            known = self.plain
            self.plain = seconds if known is None else known + AUTO_COST_WEIGHT * (seconds - known)
            self.plain_count += 1
        elif self.plain:
            latest = self.ratios.setdefault(width, [])
            latest.append(seconds / self.plain)
            del latest[:-AUTO_SAMPLES]

    def estimate(self, width: int) -> float | None:
        """A step ``width`` positions wide, in plain steps: measured (the median of its latest), else on a line
        through the plain step and the nearest measured wider step (:data:`AUTO_PRIOR_SLOPE` a position where
        none was); ``None`` until :data:`AUTO_WARMUP` plain steps were timed."""
        if self.plain_count < AUTO_WARMUP:
            return None
        if width == 1:
            return 1.0
        if width in self.ratios:
            return statistics.median(self.ratios[width])
        wider = sorted((abs(w - width), w) for w in self.ratios)
        if not wider:
            return 1.0 + AUTO_PRIOR_SLOPE * (width - 1)
        w = wider[0][1]
        return 1.0 + max(0.0, statistics.median(self.ratios[w]) - 1.0) * (width - 1) / (w - 1)


def expected_tokens(acceptance: float, guesses: int) -> float:
    """The tokens a row's pass yields on average with ``guesses`` guesses, each holding with probability
    ``acceptance`` once the ones before it held: its own token, and each guess that holds."""
    return sum(acceptance**j for j in range(guesses + 1))


def choose_guesses(offers: list[tuple[float, int]], costs: StepCosts, most: int) -> int:
    """``"auto"``: the guesses per row (0 to ``most``) of the next step that give the most tokens per second.

    ``offers``: per live row, its acceptance and how many guesses it has to feed (0: none; such a row yields one
    token, whatever the step's width). Every row feeds as many of its guesses as the step's count allows, and the
    step costs what its width costs (:meth:`StepCosts.estimate`): the count maximises the rows' expected tokens
    (:func:`expected_tokens`) over that cost, the fewest guesses on a tie. A pure function of figures every rank
    holds alike, so every rank chooses alike. 0 before plain steps were timed.
    """
    if costs.estimate(1) is None:
        return 0
    best, best_rate = 0, float(len(offers))
    for k in range(1, most + 1):
        cost = costs.estimate(1 + k)
        if cost is None or cost <= 0:
            continue
        rate = sum(expected_tokens(p, min(k, m)) for p, m in offers) / cost
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class BatchSpeculation:
    """The generator's speculation setting and every request's tallies: which rows guess, and how many tokens.

    The guesses come from prompt lookup (``prompt_lookup``: the longest n-gram matched, one proposer every row
    shares) or from ``draft_model`` (:class:`~.draft.BatchDraft`: the guessing rows' draft caches batched, each
    row's following its history; a row joins on its first guess and leaves with its request).

    ``num_draft_tokens`` is the guesses per pass (an int), or ``"auto"``: each step's count (0 to
    :data:`AUTO_GUESSES`) is chosen by :func:`choose_guesses` from the rows' acceptance (:class:`RowTally`) and the
    measured seconds of steps by width (:class:`StepCosts`, whose ticks include the drafts' own time): a guess that
    fails costs the whole batch's step a position, so the count is the one that gives the most tokens per second,
    none where guesses lose. A draft row offers as many guesses as it has room for and draws only the chosen count
    (prompt lookup offers what it found). After :data:`AUTO_PROBE_EVERY` steps without guesses that some row could
    have fed, one guess is tried (then after twice as many while probes keep losing). Every decision is taken from
    the tokens and timings every rank received, so every rank takes it alike.
    """

    def __init__(
        self,
        prompt_lookup: int | None,
        num_draft_tokens: int | Literal["auto"],
        draft_model: nn.Module | None = None,
    ) -> None:
        self.proposer: Proposer | None = None if draft_model is not None else PromptLookup(prompt_lookup or 1)
        self.drafts = None if draft_model is None else BatchDraft(draft_model)  # the rows' draft caches
        self.auto = num_draft_tokens == "auto"
        self.count = AUTO_GUESSES if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.tallies: dict[int, RowTally] = {}  # by uid: the requests that may guess
        self.ended: dict[int, RowTally] = {}  # by uid: those that left since the last tick began (for their figures)
        self.proposed = 0  # every row's, for the counters
        self.confirmed = 0
        self.costs = StepCosts()
        self.idle = 0  # "auto": steps in a row that chose no guesses while some row had some to feed
        self.probe_every = AUTO_PROBE_EVERY  # "auto": the idle steps before the next probe
        self.chosen: dict[int, int] = {}  # "auto": how many steps chose each count (observability)
        self.caught_up = False  # the last plan's drafts read a history's backlog (a prompt): its tick is not timed
        self.retry = False  # "auto": so the next plan probes again (one guess), with the drafts then current

    def enrol(self, uid: int) -> None:
        """A new request may guess."""
        self.tallies[uid] = RowTally()

    def forget(self, uids: set[int]) -> None:
        """Requests that left: their tallies are kept until the next tick begins (:meth:`of` reads them)."""
        if self.drafts is not None:
            self.drafts.drop(set(uids))
        for uid in uids:
            tally = self.tallies.pop(uid, None)
            if tally is not None:
                self.ended[uid] = tally

    def of(self, uid: int) -> tuple[int, int]:
        """``(proposed, confirmed)`` of a request that may guess, or that left since the last tick began."""
        tally = self.tallies.get(uid) or self.ended.get(uid)
        return (0, 0) if tally is None else (tally.proposed, tally.confirmed)

    def room(self, request: BatchRequest, default: Sampler | None) -> int:
        """How many guesses ``request``'s row may feed in the next step after its next token, up to the count (none
        for a dead row, a row that samples or has processors, one in its closing step, one that opted out)."""
        tally = self.tallies.get(request.uid)
        if tally is None or request.done or (request.sampler or default) is not None or request.processors:
            return 0
        if request.decided is not None and request.decided.reason is not None:
            return 0  # its closing step: it feeds its last token only
        k = self.count
        if request.max_tokens != -1:  # every guess may be kept, and the row's own token after them
            k = min(k, request.max_tokens - len(request.answer) - 1)
        return max(k, 0)

    def guesses(self, request: BatchRequest, default: Sampler | None) -> list[int]:
        """The guesses ``request``'s row feeds in the next step by prompt lookup: up to its :meth:`room`."""
        k = self.room(request, default)
        return [] if k <= 0 or self.proposer is None else self.proposer.propose(request.context, k)

    def plan(self, requests: list[BatchRequest], default: Sampler | None) -> list[list[int]]:
        """Every row's guesses for the next step: :meth:`guesses`, up to the count ``"auto"`` chooses (a draft
        draws only that many; prompt lookup's are cut to it)."""
        drafting = self.proposer is None
        offered: list[list[int]] = []
        if drafting:  # a draft can always guess its room: choose first, then draw
            rooms = [self.room(r, default) for r in requests]
            offers = [(self.tallies[r.uid].acceptance if m else 0.0, m) for r, m in zip(requests, rooms, strict=True)]
            if not self.auto or not any(rooms):
                return self._draw(requests, rooms)
        else:
            offered = [self.guesses(r, default) for r in requests]
            if not self.auto or not any(offered):
                return offered
            offers = [
                (self.tallies[r.uid].acceptance if g else 0.0, len(g)) for r, g in zip(requests, offered, strict=True)
            ]
        k = choose_guesses(offers, self.costs, self.count)
        probe = False
        if k:  # chosen on its own: guesses pay, probe soon again once they stop paying
            self.probe_every = AUTO_PROBE_EVERY
        else:
            self.idle += 1
            if self.retry:  # the last probe's draft read a backlog (untimed): probe again at once, the draft current
                k, probe = 1, True
            elif self.idle >= self.probe_every:  # a probe; the next waits twice as long unless guesses pay by then
                k, probe, self.probe_every = 1, True, min(2 * self.probe_every, AUTO_PROBE_MOST)
        self.retry = False
        if k:
            self.idle = 0
        self.chosen[k] = self.chosen.get(k, 0) + 1
        if not drafting:
            return [g[:k] for g in offered]
        counts = [min(k, m) for _, m in offers]
        if probe:  # one row's draft guesses: a step's width costs the same whichever rows guess, and each draft
            # that guesses first reads its row's backlog (at first its prompt): the row with the least to read
            row = min((self._backlog(r), i) for i, (r, m) in enumerate(zip(requests, counts, strict=True)) if m)[1]
            counts = [c if i == row else 0 for i, c in enumerate(counts)]
        drawn = self._draw(requests, counts)
        self.retry = self.caught_up
        return drawn

    def _backlog(self, request: BatchRequest) -> int:
        """How many of the row's tokens its draft would read before guessing (all of them before its first)."""
        return cast(BatchDraft, self.drafts).backlog(request.uid, request.context)

    def _draw(self, requests: list[BatchRequest], counts: list[int]) -> list[list[int]]:
        """The drafts' guesses, ``counts[i]`` for row ``i`` (:class:`~.draft.BatchDraft`: one draft forward a step
        for every row); notes whether some draft read a backlog of its row's history (its prompt, or the tokens
        decided while the count was 0): such a tick's time is mostly the drafts' reading, once, not what a step
        of its width costs, so ``"auto"`` does not time it."""
        drafts = cast(BatchDraft, self.drafts)
        asked = {r.uid: (r.context, c) for r, c in zip(requests, counts, strict=True) if c}
        joining = any(uid not in drafts for uid in asked)  # (it reads its history first, whatever it guesses)
        drawn = drafts.propose(asked)
        self.caught_up = joining or any(drafts.read.get(uid, 0) > AUTO_GUESSES + 1 for uid in asked)
        return [drawn.get(r.uid, []) for r in requests]

    def record(self, uid: int, proposed: int, confirmed: int) -> None:
        """A row's pass: ``proposed`` guesses, ``confirmed`` of them held."""
        tally = self.tallies.get(uid)
        if tally is None or not proposed:
            return
        tally.proposed += proposed
        tally.confirmed += confirmed
        self.proposed += proposed
        self.confirmed += confirmed
        tally.held = AUTO_DECAY * tally.held + confirmed
        tally.failed = AUTO_DECAY * tally.failed + (confirmed < proposed)


def check_speculation(prompt_lookup: object, num_draft_tokens: object, draft_model: object = None) -> None:
    """Raise ``ValueError`` (``TypeError`` for a draft that is not a model) naming the problem unless the
    generator's speculation settings are good ones (decided from the arguments alone, alike on every rank)."""
    if draft_model is not None:
        check_proposer(draft_model, prompt_lookup)  # one proposer; a model, whole
        kinds = sorted(
            {type(c).__name__ for c in make_prompt_cache(cast(nn.Module, draft_model)) if type(c) is not KVCache}
        )
        if kinds:
            raise ValueError(
                f"draft_model's layers keep {kinds} caches: the batch's drafts need plain KV caches (cut back per "
                "row), so leave draft_model out or use another draft"
            )
    elif isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or prompt_lookup < 1:
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


__all__ = [
    "AUTO_GUESSES",
    "MAX_GUESSES",
    "BatchSpeculation",
    "RowTally",
    "StepCosts",
    "check_speculation",
    "choose_guesses",
    "common_cut",
    "cut_rows",
    "emitted",
    "expected_tokens",
    "padded_inputs",
    "speculable",
]
