"""Speculative decoding's proposers: guesses of the next tokens that one pipeline pass then verifies.

Only the last rank runs the proposer: it guesses the next pass's tokens while
the ranks before it compute the current pass (assuming the pass confirms every
guess), and the guesses travel in the step's message to every rank. A draft
model draws its guesses with the decode's sampler, as mlx-lm's
``speculative_generate_step`` does. What the guesses are never changes the
output's distribution, only how many tokens one pass yields: the last rank
samples every position as plain decoding would and keeps the guesses up to the
first one its samples disagree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..schedule.batch_plan import fingerprint
from .draft_step import COMPILED_TOKENS, FixedKVCache, compiled_forward, read
from .protocol import MAX_GUESSES
from .sampling import Sampler

SpeculationMode = Literal["auto", "serial", "pipelined"]
SPECULATION_MODES: tuple[SpeculationMode, ...] = ("serial", "pipelined", "auto")
"""``generate_step(speculation=...)``: ``"serial"``, one pass through the ranks at a time; ``"pipelined"``, a pass
started every tick on the assumption that the passes in flight confirm every guess; ``"auto"``, pipelined where it
can be, if :data:`AUTO_PIPELINES`."""
AUTO_PIPELINES = False
"""Whether ``speculation="auto"`` pipelines where it can (more than one rank, no logits processors, no split head).
Off: pipelined passes measured barely ahead of serial ones with a draft and a fixed count and behind them with prompt
lookup and with ``num_draft_tokens="auto"`` (figures and command: docs/performance.md, "Pipelined passes"), so
``"auto"`` runs the serial passes."""

DRAFT_PREFILL_STEP = 512
"""The draft model reads a long history in chunks of this many tokens (its memory stays bounded)."""


class Proposer(Protocol):
    """Guesses up to ``k`` tokens that follow ``history`` (the prompt and every token decided so far).

    ``sampler`` is the decode's (``None``: greedy); a proposer that draws its
    guesses uses it for all but the first ``greedy`` of them, which it takes greedily.
    """

    def propose(self, history: Sequence[int], k: int, sampler: Sampler | None = None, greedy: int = 0) -> list[int]: ...

    def fingerprint(self) -> int:
        """The same on every rank exactly when the ranks' proposers give the same guesses."""
        ...


class DraftModel:
    """A small model with the target's tokenizer, whole on every rank (only the last rank runs it).

    It reads and draws as mlx-lm's ``speculative_generate_step`` does: the
    prompt but its last token in chunks of :data:`DRAFT_PREFILL_STEP`, then the
    last token alone, and each guess drawn with the decode's sampler from the
    log-probabilities of the step before, so that a seeded sampled decode draws
    the same keys and guesses. Its cache follows the history: what it holds
    beyond the longest prefix it shares with the history (the rejected guesses)
    is cut off before it reads on. It reads a few tokens at a time through a
    compiled forward where the model allows (:func:`~.draft_step.compiled_forward`).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.forward = compiled_forward(model)
        self.cache: list[Any] = make_prompt_cache(model)
        if self.forward is not None:
            self.cache = [FixedKVCache() for _ in self.cache]
        self.tokens: list[int] = []  # what the cache holds, in order

    def propose(self, history: Sequence[int], k: int, sampler: Sampler | None = None, greedy: int = 0) -> list[int]:
        if k <= 0 or not history:
            return []
        kept = common_prefix(self.tokens, history)
        kept = min(kept, len(history) - 1)  # the last token is read again: its logits give the first guess
        trim_prompt_cache(self.cache, len(self.tokens) - kept)
        self.tokens = list(history[:kept])
        pending = list(history[kept:])
        if len(pending) > 2:  # a prompt: all but its last token first, one chunk at a time (its memory stays bounded)
            for start in range(0, len(pending) - 1, DRAFT_PREFILL_STEP):
                self._read(pending[start : min(start + DRAFT_PREFILL_STEP, len(pending) - 1)])
                mx.eval([c.state for c in self.cache])  # pyright: ignore[reportUnknownMemberType]
            pending = pending[-1:]
        # The k steps are one lazy chain (each guess feeds the next step unevaluated), evaluated as it is built:
        # one wait for the last guess, not one round trip per guess.
        logits = self._read(pending)
        chain: list[mx.array] = []
        for i in range(k):
            last = logits[:, -1, :]
            if sampler is None or i < greedy:
                guess = mx.argmax(last, axis=-1)
            else:
                guess = sampler(last - mx.logsumexp(last, axis=-1, keepdims=True))  # mlx-lm's log-probabilities
            guess = guess.astype(mx.int32)
            chain.append(guess)
            mx.async_eval(guess)  # pyright: ignore[reportUnknownMemberType]
            if i < k - 1:
                logits = self._forward(guess)
        guesses = cast(list[int], mx.concatenate(chain).tolist())
        self.tokens.extend(guesses[:-1])
        return guesses

    def _read(self, tokens: list[int]) -> mx.array:
        """The logits over ``tokens`` (the history's), which the cache holds from then on."""
        self.tokens.extend(tokens)
        return self._forward(mx.array(tokens, dtype=mx.int32))

    def _forward(self, ids: mx.array) -> mx.array:
        """The logits over ``ids``, read into the cache: a few ids through the compiled forward where there is one."""
        if ids.size <= COMPILED_TOKENS and self.forward is not None:
            return self.forward(ids, cast(list[FixedKVCache], self.cache))
        return read(self.model, self.cache, ids)

    def fingerprint(self) -> int:
        return draft_fingerprint(self.model)


def draft_fingerprint(model: nn.Module) -> int:
    """A draft's parameter shapes and a checksum of its weights (a different draft guesses differently)."""
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    shapes = [d for _, a in leaves for d in a.shape]
    checksum = sum(cast(float, mx.sum(mx.abs(a.astype(mx.float32))).item()) for _, a in leaves[:4])
    return fingerprint([*shapes, int(checksum * 1000) % (1 << 24)])


class PromptLookup:
    """Prompt-lookup decoding: the tokens that followed the latest earlier match of the history's last n-gram.

    Tries n-grams of ``max_ngram`` tokens down to one and proposes what followed
    the most recent earlier occurrence (vLLM's ``ngram`` speculator works the
    same way); proposes nothing when no n-gram occurred before.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram

    def propose(self, history: Sequence[int], k: int, sampler: Sampler | None = None, greedy: int = 0) -> list[int]:
        del sampler, greedy  # it draws nothing: what followed the match, whatever the sampler
        if k <= 0:
            return []
        # One scan back from the end: each earlier place of the last token, with how many tokens before it match
        # the history's tail; the latest place of each match length is that n-gram's latest match, and the
        # longest length found wins (what trying n = max_ngram .. 1 in turn gives), in one pass over the history
        # (a batch proposes for every row in every tick).
        length = len(history)
        longest = min(self.max_ngram, length - 1)
        if longest < 1:
            return []
        last = history[-1]
        best, best_end = 0, -1
        for end in range(length - 2, -1, -1):
            if history[end] != last:
                continue
            matched = 1
            while matched < longest and end - matched >= 0 and history[end - matched] == history[-1 - matched]:
                matched += 1
            if matched > best:
                best, best_end = matched, end
                if best == longest:
                    break
        if best == 0:
            return []
        return list(history[best_end + 1 : best_end + 1 + k])

    def fingerprint(self) -> int:
        return fingerprint([1, self.max_ngram])


def proposer_of(draft_model: nn.Module | None, prompt_lookup: int | None) -> Proposer | None:
    """The proposer ``generate_step``'s arguments ask for (``None``: no speculation); checks them."""
    check_proposer(draft_model, prompt_lookup)
    if prompt_lookup is not None:
        return PromptLookup(prompt_lookup)
    return None if draft_model is None else DraftModel(draft_model)


def check_proposer(draft_model: object, prompt_lookup: object) -> None:
    """Raise ``ValueError`` (``TypeError`` for a draft that is not a model) naming the problem unless the
    arguments ask for at most one good proposer (the batch's checks too, which build no :class:`DraftModel`)."""
    if draft_model is not None and prompt_lookup is not None:
        raise ValueError("pass draft_model or prompt_lookup, not both")
    if prompt_lookup is not None:
        if isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or prompt_lookup < 1:
            raise ValueError(
                f"prompt_lookup must be a positive int (the longest n-gram matched), got {prompt_lookup!r}"
            )
    elif draft_model is not None:
        if not isinstance(draft_model, nn.Module):
            raise TypeError(f"draft_model must be an mlx-lm model (an nn.Module), got {type(draft_model).__name__}")
        if hasattr(draft_model, "_pipemlx_stage"):
            raise ValueError("draft_model must be a whole model on every rank, not a sharded one")


def check_speculation_mode(mode: object, world_size: int, processors: bool, split_head: bool) -> None:
    """Raise ``ValueError`` naming the problem unless ``mode`` is a :data:`SpeculationMode` the model can run."""
    if mode not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {list(SPECULATION_MODES)}, got {mode!r}")
    if mode != "pipelined":
        return
    if world_size < 2:
        raise ValueError("speculation='pipelined' needs more than one rank: use 'serial' or 'auto'")
    if processors:
        raise ValueError("speculation='pipelined' takes no logits_processors: use 'serial' or 'auto'")
    if split_head:
        raise ValueError("speculation='pipelined' needs the whole output head on the last rank, not head='split'")


def accepted(guesses: mx.array, tokens: mx.array) -> mx.array:
    """How many of ``guesses`` (k) the sampled ``tokens`` (k + 1) confirm, in order: lazily, as an int32 scalar."""
    if guesses.size == 0:
        return mx.array(0, dtype=mx.int32)
    same = (tokens[: guesses.size] == guesses).astype(mx.int32)
    return mx.sum(mx.cumprod(same)).astype(mx.int32)


PREFIX_BLOCK = 64
""":func:`common_prefix` compares this many tokens at a time as slices (in C) before it looks token by token."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Called per row and per tick (a draft's cache against its row's history, the prefix cache's entries against a
    prompt) on histories of thousands of tokens that usually differ only near the end: whole blocks are compared
    as slices, and only the first block that differs token by token.
    """
    n = min(len(a), len(b))
    start = 0
    while start < n:
        end = min(start + PREFIX_BLOCK, n)
        if list(a[start:end]) != list(b[start:end]):
            break
        start = end
    while start < n and a[start] == b[start]:
        start += 1
    return start


AUTO_LIMIT = 8
"""The most tokens ``num_draft_tokens="auto"`` guesses in one pass."""
LEAVE_AFTER = 8
"""Pipelined speculation with ``num_draft_tokens="auto"`` leaves for the serial decode only after this many passes
were verified (see :meth:`DraftLength.next_pipelined`)."""
LEAVE_MARGIN = 1.1
"""How much faster than plain decoding (its estimate) pipelined passes must promise to be, to stay."""
EXPLORE_EVERY = 32
"""``num_draft_tokens="auto"`` that stopped guessing guesses one token again after this many plain passes."""


class DraftLength:
    """How many tokens the next pass guesses: a fixed count, or ``"auto"``.

    ``"auto"`` keeps the count, from none to :data:`AUTO_LIMIT`, that
    maximises the expected tokens per second: a pass of ``k`` guesses yields
    ``(1 - p**(k + 1)) / (1 - p)`` tokens when each guess holds with
    probability ``p`` (measured: confirmed guesses over guesses up to and
    including the first wrong one), and costs ``t0 + t1*k`` seconds (a line
    fitted to the passes measured so far, the guesses made ahead included;
    until two lengths were seen, a guess costs a tenth of a pass) plus, when
    the guesses made ahead do not stand (probability ``1 - p**(k + 1)``),
    ``k`` guesses proposed again at ``d`` seconds each (measured). Where guessing does
    not pay (guesses that rarely hold, or a draft that costs more than it
    saves) it stops guessing, and tries one guess again every
    :data:`EXPLORE_EVERY` passes so that it notices when guessing pays again.
    The last rank decides, and proposes that many.
    """

    def __init__(self, setting: int | str) -> None:
        if setting != "auto" and (isinstance(setting, bool) or not isinstance(setting, int) or setting < 1):
            raise ValueError(f"num_draft_tokens must be a positive int or 'auto', got {setting!r}")
        if isinstance(setting, int) and setting > MAX_GUESSES:
            raise ValueError(f"num_draft_tokens must be at most {MAX_GUESSES} (guesses in one step), got {setting}")
        self.fixed = setting if isinstance(setting, int) else None
        self.confirmed = 1  # a prior of one confirmed and one wrong guess: p starts at one half
        self.tried = 2
        self.passes: dict[int, tuple[int, float]] = {}  # guesses -> (passes, seconds in all)
        self.plain_in_a_row = 0  # passes without guesses since the last one with some
        self.proposals = (0, 0.0)  # guesses proposed again after a pass, and the seconds they took
        self.ticks: dict[int, tuple[int, float]] = {}  # pipelined: guesses started -> (ticks, seconds in all)
        self.proposing = (0, 0.0)  # pipelined: ticks, and the seconds rank 0 proposed in them

    def record_proposal(self, guesses: int, seconds: float) -> None:
        """``guesses`` proposed again once a pass's tokens were known (the guesses made ahead did not stand)."""
        self.proposals = (self.proposals[0] + guesses, self.proposals[1] + seconds)

    def record(self, guesses: int, accepted: int, seconds: float) -> None:
        """One pass measured: ``guesses`` proposed, ``accepted`` of them confirmed, ``seconds`` on the last rank
        (less the guesses proposed again after it: :meth:`record_proposal`)."""
        count, total = self.passes.get(guesses, (0, 0.0))
        self.passes[guesses] = (count + 1, total + seconds)
        self.plain_in_a_row = self.plain_in_a_row + 1 if guesses == 0 else 0
        self.record_guesses(guesses, accepted)

    def record_guesses(self, guesses: int, accepted: int) -> None:
        """``accepted`` of a pass's ``guesses`` confirmed (pipelined, the token the next pass starts with counts
        as one more guess of the pass, when its guesses all held)."""
        if guesses:
            self.confirmed += accepted
            self.tried += accepted + (1 if accepted < guesses else 0)

    def record_tick(self, guesses: int, seconds: float, proposing: float) -> None:
        """Pipelined speculation, rank 0: a tick that started a pass of ``guesses`` guesses took ``seconds``,
        ``proposing`` of them in the proposer (which plain decoding does not run)."""
        count, total = self.ticks.get(guesses, (0, 0.0))
        self.ticks[guesses] = (count + 1, total + seconds)
        self.proposing = (self.proposing[0] + 1, self.proposing[1] + proposing)

    def next_pipelined(self, world_size: int, verified: int) -> int | None:
        """Pipelined speculation, rank 0: the guesses of the pass it starts now, or ``None``: leave pipelining
        for the serial decode, where (``"auto"``) the measured rate says pipelined passes lose to plain decoding.

        A pass of ``k`` guesses stands when the pass before it confirmed its ``k`` guesses and the token guessed
        after them (probability ``q = p**(k + 1)``, ``p`` as in :meth:`next`); a pass verified yields
        ``(1 - q) / (1 - p)`` tokens, and one that breaks the chain leaves the last rank ``world_size - 1`` ticks
        without a pass to verify. A tick costs ``t0 + t1*k`` (a line fitted to the ticks measured, the slowest
        rank's part and the tick's message). Plain decoding costs about ``world_size`` ticks of no guesses per
        token (each rank in turn) less the proposing (``d`` a tick, measured); pipelining stays while its best
        rate beats that by :data:`LEAVE_MARGIN` (the estimate of plain decoding counts a message per rank where
        it sends one per token). ``verified`` passes must have been measured before it leaves."""
        if self.fixed is not None:
            return self.fixed
        if not any(self.ticks.get(k) for k in range(1, AUTO_LIMIT + 1)):
            return 2  # no tick with guesses measured yet
        p = min(self.confirmed / self.tried, 0.99)
        t0, t1 = _fitted({k: total / count for k, (count, total) in self.ticks.items()})
        t1 = max(t1, t0 / 100)  # a guess is never free (a noisy fit is): more guesses must earn their place

        def rate(k: int) -> float:
            q = p ** (k + 1)
            return (1 - q) / (1 - p) / ((1 + (1 - q) * (world_size - 1)) * max(t0 + t1 * k, 1e-9))

        best = max(range(AUTO_LIMIT + 1), key=rate)
        ticks, proposing = self.proposing
        plain = 1 / (world_size * max(t0 - (proposing / ticks if ticks else 0.0), 1e-9))
        if verified >= LEAVE_AFTER and rate(best) < LEAVE_MARGIN * plain:
            return None
        return best

    def next(self) -> int:
        """The count for the next pass."""
        if self.fixed is not None:
            return self.fixed
        if not any(self.passes.get(k) for k in range(1, AUTO_LIMIT + 1)):
            return 2  # no pass with guesses measured yet
        p = min(self.confirmed / self.tried, 0.99)
        t0, t1 = self._cost_line()
        guesses, seconds = self.proposals
        d = seconds / guesses if guesses else t1

        def rate(k: int) -> float:
            return (1 - p ** (k + 1)) / (1 - p) / max(t0 + t1 * k + (1 - p ** (k + 1)) * k * d, 1e-9)

        best = max(range(AUTO_LIMIT + 1), key=rate)
        if best == 0 and self.plain_in_a_row >= EXPLORE_EVERY:
            return 1
        return best

    def _cost_line(self) -> tuple[float, float]:
        return _fitted({k: total / count for k, (count, total) in self.passes.items()})


def _fitted(means: dict[int, float]) -> tuple[float, float]:
    """``(t0, t1)``: the line ``t0 + t1*k`` through the mean seconds of each count ``k`` measured (least squares;
    one count measured: a guess costs a tenth of a pass)."""
    if len(means) == 1:
        ((k, t),) = means.items()
        return t / (1 + 0.1 * k), 0.1 * t / (1 + 0.1 * k)
    n = len(means)
    mean_k = sum(means) / n
    mean_t = sum(means.values()) / n
    slope = sum((k - mean_k) * (t - mean_t) for k, t in means.items()) / sum((k - mean_k) ** 2 for k in means)
    slope = max(slope, 0.0)
    return max(mean_t - slope * mean_k, 1e-9), slope
