"""The whole request on a sharded model: pipelined prefill, then decoding with bounded waits and agreed stops.

Per decoded token each rank runs its layers and sends on; only the last rank
applies the head and samples, and one small all-gather per token hands every
rank the token id together with every rank's word on whether to go on (see
``docs/design.md``, "The request lifecycle"). Nothing is evaluated ahead: a
token is computed only after every consumer asked for it, so when a generator
ends nothing is left in flight. A consumer that stops (``break``, ``close()``,
an exception) still runs the step the others are running, saying "stop" in its
all-gather. Like mlx-lm, the forward pass of the last yielded token always runs
before the generator ends, so the cache holds the prompt and every yielded token.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.generate import GenerationResponse, maybe_quantize_kv_cache  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.tokenizer_utils import TokenizerWrapper  # pyright: ignore[reportUnknownVariableType]

from ..errors import renamed
from ..schedule.batch_plan import fingerprint
from .caches import always_trimmable, cache_offset, cache_state, trim_to
from .failure import stand_in
from .prefill import (
    DEFAULT_QUANTIZED_KV_START,
    CancelCheck,
    PrefillOptions,
    ProgressCallback,
    check_kv_quantization,
    check_prompt,
    check_rotating_caches,
    check_timeout,
    prefill_before_decode,
)
from .protocol import DECODE, GUESSES, Status, Table, gather
from .sampling import (
    LogitsProcessor,
    Sampler,
    VocabShard,
    choose,
    log_probabilities,
    pick_tokens,
    processed,
    shared_head,
)
from .speculative import DraftLength, Proposer, accepted, proposer_of
from .stage import PipelineStage, stage_of
from .waits import wait_for

NO_TOKEN = -1
"""``GenerationResponse.token`` of :func:`stream_generate`'s closing ``"cancelled"`` response: it adds no token."""


@dataclass(frozen=True)
class DecodeStop:
    """Why a decode ended, the same on every rank (:attr:`DecodeStream.stop`).

    ``length``: ``max_tokens`` reached; ``stop``: one of ``stop_tokens`` was yielded; ``cancelled``: a
    rank's consumer stopped or its ``should_cancel`` said yes; ``failed``: a callback or the model raised.
    """

    reason: Literal["length", "cancelled", "failed", "stop"]
    tokens: int  # yielded before the end
    ranks: tuple[int, ...] = ()  # that asked to stop (cancelled) or failed (failed)


@renamed(step_size="prefill_step_size", progress_callback="prompt_progress_callback")
def generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream: mx.Stream | mx.ThreadLocalStream | None = None,
    *,
    prompt_cache: list[Any] | None = None,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int | Literal["auto"] = "auto",
    prompt_progress_callback: ProgressCallback | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    should_cancel: CancelCheck | None = None,
    timeout: float | None = None,
    share_logprobs: bool = False,
    stop_tokens: Iterable[int | Sequence[int]] = (),
    input_embeddings: mx.array | None = None,
    draft_model: nn.Module | None = None,
    num_draft_tokens: int | Literal["auto"] = 2,
    prompt_lookup: int | None = None,
    history: Sequence[int] = (),
) -> DecodeStream:
    """mlx-lm's ``generate_step`` for a sharded model: yield ``(token, logprobs)`` pairs, the same on every rank.

    Call it on every rank with the same arguments. ``prompt`` holds the *new*
    tokens: ``prompt_cache`` may already hold a prefix (the ranks check that
    they hold the same number of positions). The prompt is prefilled with
    :func:`pipemlx.pipeline_prefill` in chunks of ``prefill_step_size``
    (``"auto"``, the default: the ranks choose, see :func:`pipemlx.pipeline_prefill`), reporting progress exactly as mlx-lm does
    (``(0, M)``, each chunk, then ``(M, M)`` once the first token exists), and
    then decoded; the tokens are the ones one process holding the whole model
    yields with the same sampler. ``max_tokens=-1`` means no limit; ``max_tokens=0`` yields nothing (the prompt
    is prefilled), as in mlx-lm.
    ``max_kv_size`` bounds a cache made here (no ``prompt_cache``) as mlx-lm
    does: rotating caches of that many positions. mlx-lm cannot quantize a
    rotating cache, so ``kv_bits`` is refused with ``ValueError`` on every rank,
    before anything is sent and whatever the prompt's length, on a model with
    sliding-window layers and with a ``max_kv_size`` that makes the caches rotating.

    Only the last rank applies the head, runs ``logits_processors`` and
    samples, so a random ``sampler`` needs no seed shared by the ranks (seed
    the last rank as a single process would be seeded). ``logprobs`` is that
    rank's log-probability vector; the other ranks yield ``None`` unless
    ``share_logprobs`` sends it to them too (one vocabulary-sized message per
    token).

    Stops are agreed: when any rank's consumer stops early or its
    ``should_cancel()`` (polled before every token) says yes, every rank's
    generator ends after the same token and nothing is left in flight; the
    reason is in the returned :class:`DecodeStream`'s ``stop``. A generator
    dropped without being closed is closed by the next pipemlx call on any
    sharded model, or at exit. The generator also ends after yielding a token
    that completes one of ``stop_tokens``: token ids, or sequences of them, as
    :class:`pipemlx.BatchGenerator` takes them (an int is a sequence of one;
    the ranks check they hold the same ones). ``timeout``
    bounds every wait (seconds; default: the model's). Raises
    :class:`PrefillCancelled` when the prefill is cancelled, an error raised by
    a callback on its own rank, :class:`PipelineTimeoutError` /
    :class:`PeerLostError` when a peer stalls or dies, and
    ``ValueError``/``TypeError`` for bad arguments before anything is sent
    (``input_embeddings``, which mlx-lm takes for multimodal prompts, is
    accepted only as ``None``).

    Speculative decoding: with a ``draft_model`` (a small whole model with the
    same tokenizer, passed on every rank) or ``prompt_lookup=n`` (guesses from
    the latest earlier match of the last ``n``-gram in the prompt and the
    tokens so far), the last rank guesses up to ``num_draft_tokens`` tokens
    (``"auto"``: as many as maximise the measured tokens per second; at most
    16) while the ranks before it compute, the guesses reach every rank in the
    step's message,
    one pass through the pipeline checks them all, and the last rank keeps the
    guesses up to the first one its own sampling disagrees with: the output is
    what decoding without guesses gives (greedy: the same tokens; a sampler: the
    same distribution). Every cache is cut back by the rejected positions.
    Speculation turns itself off, on every rank, where some cache cannot be cut
    back (rotating or recurrent caches). A consumer that stops in the middle of
    a pass's tokens ends the request after that pass's tokens on the other ranks.
    ``history``: the token ids ``prompt_cache`` already holds before ``prompt``
    (a reused prefix, the same on every rank); the proposer reads them before
    the prompt, so guesses after a reused prefix are as good as after the whole
    prompt (ignored without speculation).

    ``stream`` is mlx-lm's (its third argument), accepted so that mlx-lm code
    runs unchanged, but every rank computes on its stage's own stream
    (``stage_of(model).compute_stream``, on the device that was the default
    when the model was sharded): a stream or device on that device (or
    ``None``) is accepted; one on another device raises ``ValueError``,
    anything else ``TypeError``, before anything is sent.
    """
    stage = stage_of(model)
    stage.check_usable()
    stage.check_stream(stream)
    if input_embeddings is not None:
        raise ValueError("input_embeddings is not supported on a sharded model: pass token ids as the prompt")
    tokens = check_prompt(prompt)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < -1:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"max_tokens must be a non-negative int or -1 (no limit), got {max_tokens!r}")
    check_timeout(timeout)
    check_kv_quantization(kv_bits, kv_group_size, stage.info.kv_dims)
    stops = stop_sequences(stop_tokens)
    if not _positive_or_none(max_kv_size):
        raise ValueError(f"max_kv_size must be a positive int or None, got {max_kv_size!r}")
    if prompt_cache is None and max_kv_size is not None:  # mlx-lm ignores max_kv_size with a prompt_cache
        check_rotating_caches(kv_bits, stage.info.unquantizable_bounded, stage.info.total_layers, max_kv_size)
    check_rotating_caches(kv_bits, stage.info.unquantizable, stage.info.total_layers)
    proposer = proposer_of(draft_model, prompt_lookup)
    draft_length = DraftLength(num_draft_tokens)
    if prompt_cache is None:
        prompt_cache = stage.new_cache(model, max_kv_size)
    request = _Request(
        stage,
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=list(logits_processors or []),
        quantize=lambda c: maybe_quantize_kv_cache(c, quantized_kv_start, kv_group_size, kv_bits),
        timeout=timeout or stage.info.timeout,
        share_logprobs=share_logprobs,
        stop_tokens=stops,
        proposer=proposer,
        draft_length=draft_length,
        tokens=[int(t) for t in history] if proposer is not None else [],
    )
    prefill = PrefillOptions(
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=prompt_progress_callback,
        should_cancel=should_cancel,
        timeout=request.timeout,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        decode_settings=2 if share_logprobs else 1,  # protocol.DECODE_SETTINGS
        speculation=request.speculation,
    )
    generator = request.run(tokens, prompt_cache, prefill)
    request.generator = weakref.ref(generator)
    return DecodeStream(request, generator)


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | mx.array | list[int],
    max_tokens: int = 256,
    draft_model: nn.Module | None = None,
    **kwargs: Any,
) -> ResponseStream:
    """mlx-lm's ``stream_generate`` for a sharded model: ``GenerationResponse`` objects, the same text on every rank.

    ``prompt`` is text (encoded as mlx-lm does) or token ids; ``kwargs`` are
    :func:`generate_step`'s. Every rank stops at the tokenizer's end-of-sequence
    tokens and at ``stop_tokens`` alike (token ids or sequences of them; the
    token that ends one, like an end-of-sequence token, is not added to the
    text). ``max_tokens=0`` prefills the prompt and yields nothing, as in mlx-lm. The last response has ``finish_reason``
    ``"stop"`` (end of sequence or a stop token), ``"length"`` (``max_tokens``)
    or ``"cancelled"`` (a rank's consumer or ``should_cancel`` stopped the
    request). Each token is in one response only: a ``"cancelled"`` response
    adds no token (``token`` -1, :data:`NO_TOKEN`, and ``logprobs`` ``None``;
    its ``text`` is what the detokenizer still held, and
    ``generation_tokens`` counts the tokens before it). A request cancelled
    after its prefill but before its first token gives that one response,
    with ``generation_tokens`` 0 and empty ``text``; one cancelled during
    the prefill raises :class:`PrefillCancelled`, as :func:`generate_step`
    does. ``draft_model``, ``num_draft_tokens`` and ``prompt_lookup``
    speculate as in :func:`generate_step` (each response's ``from_draft`` says
    whether its token was a confirmed guess; the returned generator's
    ``guesses`` is the tally of guessed and confirmed tokens, the acceptance rate).
    """
    if draft_model is None and kwargs.get("prompt_lookup") is None:
        kwargs.pop("num_draft_tokens", None)  # mlx-lm drops it too when there is no draft model
    extra_stops = cast(Iterable[int | Sequence[int]], kwargs.pop("stop_tokens", ()))
    wrapper = cast(Any, tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer))
    if isinstance(prompt, str):
        bos = wrapper.bos_token
        ids: list[int] = wrapper.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        prompt = mx.array(ids, dtype=mx.int32)
    elif not isinstance(prompt, mx.array):
        # mx.array([]) is float32: an empty prompt must be named as empty, not as a bad dtype.
        prompt = mx.array(prompt) if len(prompt) else mx.array([], dtype=mx.int32)
    eos = stop_sequences(cast(Iterable[int], wrapper.eos_token_ids)) | stop_sequences(extra_stops)
    generator = generate_step(prompt, model, max_tokens=max_tokens, stop_tokens=eos, draft_model=draft_model, **kwargs)
    return ResponseStream(generator, _responses(generator, wrapper, prompt.size, max_tokens, eos))


class ResponseStream(Generator[GenerationResponse, None, None]):
    """What :func:`stream_generate` returns: mlx-lm's generator of ``GenerationResponse`` objects, and the tally of
    its decode's speculative guesses (:attr:`guesses`), which the responses alone do not carry."""

    def __init__(self, decode: DecodeStream, inner: Generator[GenerationResponse, None, None]) -> None:
        self._decode = decode
        self._inner = inner

    @property
    def guesses(self) -> tuple[int, int]:
        """``(proposed, accepted)`` guessed tokens so far (:attr:`DecodeStream.guesses`)."""
        return self._decode.guesses

    def send(self, value: None) -> GenerationResponse:
        return self._inner.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> GenerationResponse:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self._inner.throw(typ, val, tb)

    def close(self) -> None:
        self._inner.close()


def _responses(
    generator: DecodeStream,
    tokenizer: Any,
    prompt_tokens: int,
    max_tokens: int,
    eos: frozenset[tuple[int, ...]],
) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's ``stream_generate`` loop over a pipemlx token generator."""
    if max_tokens == 0:  # as mlx-lm: the prompt is prefilled, nothing is yielded
        with closing(generator):
            for _ in generator:
                pass
        return
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps = 0.0
    token, logprobs, n = 0, cast(Any, None), -1
    finish: str | None = None
    recent: list[int] = []
    longest = max((len(s) for s in eos), default=1)
    with closing(generator):
        for n, (token, logprobs) in enumerate(generator):
            if n == 0:
                prompt_tps = prompt_tokens / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            recent = [*recent, token][-longest:]
            if ends_a_sequence(recent, eos):
                finish = "stop"
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                finish = "length"
                break
            yield _response(
                detokenizer.last_segment,
                token,
                logprobs,
                prompt_tokens,
                prompt_tps,
                n + 1,
                tic,
                None,
                generator.from_draft,
            )
    if finish is None:  # the generator stopped (a cancel): its last token was yielded already, the end adds none
        token, logprobs = NO_TOKEN, None
        reason = generator.stop.reason if generator.stop is not None else "length"
        finish = reason if reason in ("stop", "length") else "cancelled"
    if n < 0:  # stopped after the prefill, before the first token: say so, as a cancellation after one would
        prompt_tps = prompt_tokens / max(time.perf_counter() - tic, 1e-9)
        yield _response("", NO_TOKEN, None, prompt_tokens, prompt_tps, 0, time.perf_counter(), finish)
        return
    detokenizer.finalize()
    from_draft = generator.from_draft and token != NO_TOKEN
    yield _response(
        detokenizer.last_segment, token, logprobs, prompt_tokens, prompt_tps, n + 1, tic, finish, from_draft
    )


def _response(
    text: str,
    token: int,
    logprobs: Any,
    prompt_tokens: int,
    prompt_tps: float,
    generated: int,
    tic: float,
    finish: str | None,
    from_draft: bool = False,
) -> GenerationResponse:
    return GenerationResponse(
        text=text,
        token=token,
        logprobs=logprobs,
        from_draft=from_draft,
        prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tps,
        generation_tokens=generated,
        generation_tps=generated / max(time.perf_counter() - tic, 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=finish,
    )


def stop_sequences(entries: Iterable[int | Sequence[int]]) -> frozenset[tuple[int, ...]]:
    """``stop_tokens`` as sequences: token ids and sequences of them (an int is a sequence of one); an empty sequence
    raises ``ValueError`` (on every rank alike, before anything is sent)."""
    sequences: set[tuple[int, ...]] = set()
    for entry in entries:
        sequence = (int(entry),) if isinstance(entry, int) else tuple(int(t) for t in entry)
        if not sequence:
            raise ValueError("stop_tokens holds an empty sequence; every stop sequence needs at least one token")
        sequences.add(sequence)
    return frozenset(sequences)


def ends_a_sequence(tokens: Sequence[int], sequences: frozenset[tuple[int, ...]]) -> bool:
    """Whether ``tokens`` (the latest ones) end with one of ``sequences``."""
    return any(len(s) <= len(tokens) and tuple(tokens[len(tokens) - len(s) :]) == s for s in sequences)


def _positive_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _fingerprint(sequences: frozenset[tuple[int, ...]]) -> int:
    """The stop sequences as one number the ranks compare: each sequence's tokens + 1, then 0, in sorted order."""
    return fingerprint(t for s in sorted(sequences) for t in (*(x + 1 for x in s), 0))


@dataclass
class _Part:
    """This rank's part of a decode step, lazily: what it moves on the wire and what it computed."""

    moved: list[mx.array]  # its receive and send (evaluating these runs the rank's own part)
    token: mx.array | None = None  # the last rank's sampled token (after the accepted guesses)
    accepted: mx.array | None = None  # how many guesses the last rank's samples confirmed
    logprobs: mx.array | None = None  # the last rank's log-probabilities, one row per position
    hidden: mx.array | None = None  # the last rank's final hidden state, when the ranks share the head


class DecodeStream(Generator[tuple[int, "mx.array | None"], None, "DecodeStop | None"]):
    """What :func:`generate_step` returns: mlx-lm's generator of ``(token, logprobs)`` pairs.

    Once it has ended, :attr:`stop` says why (the same on every rank; also the generator's return value);
    :attr:`shared_head` says whether its steps after the first shared the output head among the ranks.
    """

    def __init__(self, request: _Request, inner: Generator[tuple[int, mx.array | None], None, DecodeStop | None]):
        self._request = request
        self._inner = inner

    @property
    def stop(self) -> DecodeStop | None:
        """Why the decode ended; ``None`` while it runs, or when it ended in an error."""
        return self._request.stop

    @property
    def shared_head(self) -> bool:
        return self._request.shares_head

    @property
    def speculating(self) -> bool:
        """Whether the steps guessed tokens (every rank could cut its caches back)."""
        return self._request.speculating

    @property
    def from_draft(self) -> bool:
        """Whether the last token yielded was a guess the pipeline confirmed."""
        return self._request.from_draft

    @property
    def decided(self) -> list[int]:
        """Every token the request decided, the same on every rank: what the caches hold after the prompt once
        the generator ended. A consumer that stopped in the middle of a pass (with guesses) saw fewer."""
        return list(self._request.decided)

    @property
    def guesses(self) -> tuple[int, int]:
        """Speculative decoding's tally so far: ``(proposed, accepted)`` guesses."""
        return self._request.proposed, self._request.accepted

    def send(self, value: None) -> tuple[int, mx.array | None]:
        return self._inner.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> tuple[int, mx.array | None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self._inner.throw(typ, val, tb)

    def close(self) -> None:
        self._inner.close()


@dataclass(eq=False)
class _Request:
    """One request's decode on one rank: the steps, the agreement in each, and the trailing step."""

    stage: PipelineStage
    model: nn.Module
    max_tokens: int
    sampler: Sampler | None
    logits_processors: list[LogitsProcessor]
    quantize: Callable[[list[Any]], None]
    timeout: float | None
    share_logprobs: bool
    stop_tokens: frozenset[tuple[int, ...]]
    stopped_at_token: bool = False
    recent: list[int] = field(default_factory=list[int])  # the latest tokens yielded, as long as the longest stop
    generator: weakref.ref[Generator[Any, None, Any]] | None = None
    cache: list[Any] = field(default_factory=list[Any])
    history: mx.array | None = None
    deferred: BaseException | None = None
    vocab_size: int = 0
    stop: DecodeStop | None = None
    shares_head: bool = False  # every rank said it may, in the first step: the later steps share the head
    proposer: Proposer | None = None
    draft_length: DraftLength = field(default_factory=lambda: DraftLength(2))
    pending: list[int] = field(default_factory=list[int])  # the last step's message: the next step's guesses
    speculating: bool = False  # every rank could cut its caches back, in the first step: the later steps guess
    tokens: list[int] = field(default_factory=list[int])  # generate_step's history, the prompt, every decided token
    decided: list[int] = field(default_factory=list[int])  # every decided token
    from_draft: bool = False
    proposed: int = 0
    accepted: int = 0
    offset: int = 0  # the caches' positions before the step running now
    history_length: int = 0  # the logits processors' history's length before it
    proposing: float = 0.0  # the last rank, the step running now: seconds proposing its guesses again after it

    def __post_init__(self) -> None:
        self.stop_fingerprint = _fingerprint(self.stop_tokens)
        # Greedy, no processors, logprobs kept on the last rank, no guesses: this rank may share the head.
        shard = self.stage.info.vocab_shard
        self.may_share_head = shard is not None and self.sampler is None and not self.logits_processors
        self.may_share_head = self.may_share_head and not self.share_logprobs and self.proposer is None
        fixed = self.draft_length.fixed or 0  # "auto": 0
        # The handshake compares it: 0 without a proposer, else the proposer's fingerprint (+ 1) and k above it.
        self.speculation = 0 if self.proposer is None else (self.proposer.fingerprint() + 1) | (fixed << 24)

    def finish(self) -> None:
        """Close the suspended generator: it runs the step the peers are in, saying stop (never raises)."""
        live = self.generator() if self.generator is not None else None
        if live is None:
            return
        try:
            live.close()
        except Exception as exc:  # the stage is marked broken; settle() reports it
            if self.stage.broken is None:
                self.stage.mark_broken(exc)

    def run(
        self, prompt: mx.array, cache: list[Any], prefill: PrefillOptions
    ) -> Generator[tuple[int, mx.array | None], None, DecodeStop | None]:
        """The generator behind :func:`generate_step` (``prefill`` holds its callbacks); returns why it stopped."""
        stage = self.stage
        stage.settle(self.timeout)
        self.cache = cache
        # mlx-lm's history: the prefilled tokens, then each step's input (the prompt's last token first).
        self.history = prompt[:-1] if self.logits_processors else None
        if self.history is not None:
            mx.eval(self.history)  # pyright: ignore[reportUnknownMemberType]  # a local slice: the helper thread cannot run it
        if self.proposer is not None:  # after ``history``, what the cache held before
            self.tokens += [int(t) for t in cast(list[int], prompt.tolist())]
        num_tokens = prompt.size
        prefill_before_decode(self.model, prompt, self.cache, prefill)
        if self.proposer is not None:  # every rank alike: the handshake compared the proposers
            self._open()
        progress, should_cancel = prefill.prompt_progress_callback, prefill.should_cancel
        last = cast(int, prompt[-1].item())
        n = 0
        ended = False  # max_tokens reached, or a stop token yielded
        while True:
            done = ended or n == self.max_tokens
            status = Status.END if done else self._poll(should_cancel)
            started = time.perf_counter()
            guesses = [] if done else self._guess(n)  # alike on every rank, whatever each one's status
            self.proposing = 0.0
            decided, logprobs, table = self._step(last, guesses, n, status)
            seconds = time.perf_counter() - started - self.proposing  # the guesses proposed again: apart
            self.draft_length.record(len(guesses), len(decided) - 1, seconds)
            if n == 0 and progress is not None:
                try:
                    progress(num_tokens, num_tokens)
                except Exception as exc:  # acted on in the next step's agreement, by every rank
                    self.deferred = exc
            if not table.all_ok:
                self._drop_guesses(table, guesses)
                self.stop = _decode_stop(table, n, stopped_at_token=self.stopped_at_token)
                if self.deferred is not None:
                    raise self.deferred
                return self.stop
            kept = self._keep(decided, guesses)
            self.accepted += min(len(decided) - 1, kept)
            self.proposed += len(guesses)
            stopped: BaseException | None = None
            for i in range(kept):
                self.from_draft = i < len(decided) - 1
                stage.open_request = self
                try:
                    yield decided[i], None if logprobs is None else logprobs[i]
                except BaseException as exc:  # the others yield this pass's tokens: stop after them too
                    stopped = exc
                    break
                finally:
                    stage.open_request = None
            n += kept
            last = decided[kept - 1]
            ended = self.stopped_at_token = ends_a_sequence(self.recent, self.stop_tokens)
            if stopped is not None:
                done = ended or n == self.max_tokens
                closing_guesses = [] if done else self._guess(n)
                final = self._step(last, closing_guesses, n, Status.CANCEL)[2]
                self._drop_guesses(final, closing_guesses)
                self.stop = _decode_stop(final, n, stopped_at_token=False)
                raise stopped

    def _guess(self, n: int) -> list[int]:
        """The guesses for the step after ``n`` tokens, as the last message carried them: none unless every rank
        said it can speculate, and never more than ``max_tokens`` leaves room for."""
        if self.proposer is None or not self.speculating:
            return []
        return self.pending[: self._room(n, len(self.pending))]

    def _room(self, n: int, wanted: int) -> int:
        """How many of ``wanted`` guesses the step after ``n`` tokens may carry: as many as tokens are left, as in
        mlx-lm's ``speculative_generate_step`` (the step's own token may then be one too many: it is not yielded)."""
        return wanted if self.max_tokens == -1 else max(0, min(wanted, self.max_tokens - n))

    def _open(self) -> None:
        """Before the first step of a speculative decode: every rank says whether its caches can be cut back at any
        length, and the last rank proposes the first step's guesses (the draft reads the prompt, as mlx-lm's does).

        A proposer that raises fails the first step on every rank (its error is acted on there).
        """
        assert self.proposer is not None
        stage = self.stage
        can = always_trimmable(self.cache)
        guesses: list[int] = []
        saved = _RandomKey() if stage.is_last and self.sampler is not None else None
        if stage.is_last and can:
            try:
                guesses = self.proposer.propose(self.tokens, self._room(0, self.draft_length.next()), self.sampler)
            except Exception as exc:  # acted on in the first step's agreement, by every rank
                self.deferred = exc
                guesses = []
        values = {"can_speculate": int(can), "next_guesses": len(guesses), **_numbered(guesses)}
        try:
            table = GUESSES.exchange(
                stage.group,
                stage.compute_stream,
                values,
                timeout=self.timeout,
                where="the first guesses",
                who=stage.describe(),
            )
        except Exception as exc:
            stage.mark_broken(exc)
            raise
        self.speculating = all(table["can_speculate"])
        self.pending = _guesses_of(table) if self.speculating else []
        if not self.speculating and saved is not None:
            saved.restore()  # no guesses after all: the samples are plain decoding's

    def _guess_ahead(self, guesses: list[int], n: int, wanted: int) -> list[int]:
        """The last rank, while the ranks before it compute this step: the proposer's guesses for the next step if
        this one confirms all of ``guesses`` (``n`` tokens before it), led by its guess of this step's own token."""
        assert self.proposer is not None
        room = self._room(n + len(guesses) + 1, wanted)
        if room <= 0:
            return []
        return self.proposer.propose([*self.tokens, *guesses], room + 1, self.sampler, greedy=1)

    def _guess_next(
        self, guesses: list[int], n: int, wanted: int, part: _Part, ahead: list[int], drawn: _RandomKey | None
    ) -> list[int]:
        """The last rank, once this step's tokens are sampled: the guesses for the next step. ``ahead`` holds them
        when this step confirmed every guess and sampled the token the proposer expected; else it proposes again,
        drawing from where the random generator stood after this step's samples (``drawn``)."""
        assert self.proposer is not None and part.accepted is not None and part.token is not None
        count, token = cast(int, part.accepted.item()), cast(int, part.token.item())
        decided = [*guesses[:count], token]
        room = self._room(n + len(decided), wanted)
        if count == len(guesses) and ahead[:1] == [token]:
            return ahead[1 : 1 + room]
        if drawn is not None:
            drawn.restore()
        if room <= 0:
            return []
        started = time.perf_counter()
        following = self.proposer.propose([*self.tokens, *decided], room, self.sampler)
        self.proposing = time.perf_counter() - started
        self.draft_length.record_proposal(len(following), self.proposing)
        return following

    def _keep(self, decided: list[int], guesses: list[int], kept: int | None = None) -> int:
        """How many of a step's ``decided`` tokens are yielded (up to the first stop token), and the caches and
        histories cut to match: they hold the step's input and the guesses before the last yielded token."""
        if kept is None:
            ends = (
                i + 1
                for i in range(len(decided))
                if ends_a_sequence([*self.recent, *decided[: i + 1]], self.stop_tokens)
            )
            kept = next(ends, len(decided))
            if self.max_tokens != -1:  # a step may decide one token more than max_tokens leaves room for
                kept = min(kept, self.max_tokens - len(self.decided))
        if guesses:
            trim_to(self.cache, self.offset + kept)
            if self.history is not None:
                with mx.stream(self.stage.compute_stream):  # the next step's wait evaluates it in a helper thread
                    self.history = self.history[: self.history_length + kept]
        if self.proposer is not None:
            self.tokens.extend(decided[:kept])
        self.decided.extend(decided[:kept])
        longest = max((len(s) for s in self.stop_tokens), default=1)
        self.recent = [*self.recent, *decided[:kept]][-longest:]
        return kept

    def _drop_guesses(self, table: Table, guesses: list[int]) -> None:
        """After a step that ends the request: the caches keep its input only, as a step without guesses would."""
        if guesses and not table.ranks_with(Status.CHUNK_FAILED):  # (a failed step is undone whole)
            self._keep([], guesses, kept=1)

    def _poll(self, should_cancel: CancelCheck | None) -> Status:
        if self.deferred is not None:
            return Status.FAILED
        if should_cancel is None:
            return Status.OK
        try:
            return Status.CANCEL if should_cancel() else Status.OK
        except Exception as exc:  # acted on by every rank in this step's agreement
            self.deferred = exc
            return Status.FAILED

    def _step(
        self, last: int, guesses: list[int], index: int, status: Status
    ) -> tuple[list[int], mx.array | None, Table]:
        """One forward pass of every rank over ``last`` and ``guesses``, and the step's message: the decided tokens
        (the confirmed guesses, then the last rank's own), their log-probabilities, and every rank's status.

        Each communication is evaluated on its own (this rank's part, the shared head's all-gather, then the step's
        message), so that a lost rank fails at once (:class:`PeerLostError`) rather than after the timeout.
        """
        stage = self.stage
        inputs = mx.array([last, *guesses], dtype=mx.int32)
        mx.eval(inputs)  # pyright: ignore[reportUnknownMemberType]  # a local array: the helper thread cannot run it
        self.offset = offset = cache_offset(self.cache)
        self.history_length = 0 if self.history is None else self.history.size
        where = f"decode step {index}"
        try:
            with mx.stream(stage.compute_stream), stage.without_broadcast():
                stage.received.clear()
                try:
                    part = self._build(inputs, len(guesses))
                except Exception as exc:  # the model failed here: stand in for this rank's part, report it
                    self.deferred = self.deferred or exc
                    status = Status.CHUNK_FAILED
                    draining = f"{stage.describe()} draining token {index}'s input after an error"
                    outgoing = stand_in(stage, 1, inputs.size, lambda r: wait_for(r, self.timeout, lambda: draining))
                    sent = (
                        [] if outgoing is None else [mx.distributed.send(outgoing, stage.rank + 1, group=stage.group)]
                    )
                    part = _Part(moved=sent)
                payload = [self._shared_logprobs(part, inputs.size)] if self.share_logprobs else []
                own = [*part.moved, *(a for a in (part.token, part.hidden) if a is not None), *payload]
                # The last rank proposes the next step's guesses: the likeliest ones while the ranks before it
                # compute this step (it would wait for them), the right ones after it, unless those were the same.
                proposes = stage.is_last and self.speculating and part.token is not None and status == Status.OK
                wanted = self.draft_length.next() if proposes else 0
                ahead: list[int] = []
                following: list[int] = []
                # The samples of this step are drawn: the next step's guesses draw after them, as in mlx-lm.
                drawn = _RandomKey() if proposes and self.sampler is not None else None
                try:
                    ahead = self._guess_ahead(guesses, index, wanted) if proposes else []
                except Exception as exc:  # the proposer failed here: this step says so, every rank stops
                    self.deferred, status, proposes = self.deferred or exc, Status.FAILED, False
                if stage.world_size > 1 or proposes:
                    wait_for(own, self.timeout, lambda: f"{stage.describe()} computing token {index}")
                try:
                    following = self._guess_next(guesses, index, wanted, part, ahead, drawn) if proposes else []
                except Exception as exc:
                    self.deferred, status = self.deferred or exc, Status.FAILED
                if self.shares_head:
                    shard = cast(VocabShard, stage.info.vocab_shard)
                    describe = lambda: f"{stage.describe()} sharing token {index}'s output head"  # noqa: E731
                    payload.append(shared_head(shard, part.hidden, 1, stage.group, self.timeout, describe))
                values: dict[str, int | mx.array] = {
                    "index": index,
                    "max_tokens": self.max_tokens,
                    "stop_tokens": self.stop_fingerprint,
                    "guesses": len(guesses),
                    "guessed": fingerprint(g + 1 for g in guesses),
                    "token": part.token if part.token is not None else 0,
                    "accepted": part.accepted if part.accepted is not None else 0,
                    "shares_head": int(self.may_share_head),
                    "next_guesses": len(following),
                    **_numbered(following),
                }
                gathered = gather(DECODE.row(values, status, payload), stage.group)
            # Greedy logprobs are left lazy (their logits are evaluated): computed when the caller reads them.
            waited = [gathered] if part.logprobs is None or self.sampler is None else [gathered, part.logprobs]
            wait_for(waited, self.timeout, lambda: f"{stage.describe()} in {where}")
            stage.outstanding.clear()  # this pass is complete: nothing for the next one to wait for
        except Exception as exc:  # failed mid-evaluation: a peer may be inside this step's collectives
            stage.mark_broken(exc)
            raise
        table = DECODE.read(gathered, stage.world_size, where)
        if table.ranks_with(Status.CHUNK_FAILED):
            trim_to(self.cache, offset)  # the failed step is in no cache: undo it on every rank
        logprobs = part.logprobs
        if self.share_logprobs and not stage.is_last:
            logprobs = mx.reshape(mx.array(table.payloads[-1]), (inputs.size, -1))
        if self.shares_head:
            (token,) = pick_tokens(table.payloads)
        else:
            token = table.last("token")
        if index == 0:  # every rank holds the same rows: the later steps share the head on every rank, or on none
            self.shares_head = all(table["shares_head"])
        self.pending = _guesses_of(table)
        confirmed = guesses[: table.last("accepted")] if guesses else []
        return [*confirmed, token], logprobs, table

    def _shared_logprobs(self, part: _Part, positions: int) -> mx.array:
        """``share_logprobs``: the last rank's log-probabilities; zeros of the same size on the others."""
        if part.logprobs is not None:
            return mx.reshape(part.logprobs, (-1,))
        return mx.zeros((positions * self.vocab_size,), dtype=mx.float32)

    def _build(self, inputs: mx.array, guesses: int) -> _Part:
        """This rank's part of a step, lazily (see :class:`_Part`)."""
        stage = self.stage
        if self.shares_head and stage.is_last:
            shard = cast(VocabShard, stage.info.vocab_shard)
            hidden = shard.hidden(self.model, inputs[None], self.cache)[:, -1, :]
            self.quantize(self.cache)
            logits = shard.full(hidden)  # read only with the logprobs
            return _Part(moved=[], logprobs=log_probabilities(logits), hidden=hidden)
        output = cast(mx.array, self.model(inputs[None], cache=self.cache))
        self.quantize(self.cache)
        self.vocab_size = output.shape[-1]
        if not stage.is_last:
            # This rank's send is tied to its cache: evaluating the cache sends.
            leaves = cast(list[tuple[str, Any]], tree_flatten(cache_state(self.cache)))
            return _Part(moved=[a for _, a in leaves if isinstance(a, mx.array)])
        logits = output[0]  # one row per position: the input's, then each guess's
        if self.logits_processors:
            rows: list[mx.array] = []
            for i in range(inputs.size):  # each position sees the history up to its own input, as mlx-lm's do
                self.history = inputs[:1] if self.history is None else mx.concatenate([self.history, inputs[i : i + 1]])
                rows.append(processed(logits[i : i + 1], self.history, self.logits_processors))
            logits = mx.concatenate(rows)
        tokens, logprobs = choose(logits, self.sampler)
        count = accepted(inputs[1:], tokens)
        return _Part(
            moved=[], token=mx.reshape(tokens[count], (1,)), accepted=mx.reshape(count, (1,)), logprobs=logprobs
        )


def _decode_stop(table: Table, n: int, *, stopped_at_token: bool) -> DecodeStop:
    """Why a decode ended after ``n`` tokens, from the last step's table (which every rank holds alike)."""
    failed = table.ranks_with(Status.FAILED, Status.CHUNK_FAILED)
    asked = table.ranks_with(Status.CANCEL)
    if failed:
        return DecodeStop("failed", n, failed)
    if asked:
        return DecodeStop("cancelled", n, asked)
    return DecodeStop("stop" if stopped_at_token else "length", n)


def _numbered(guesses: list[int]) -> dict[str, int]:
    """The ``next_i`` fields of a message that carries ``guesses``."""
    return {f"next_{i}": g for i, g in enumerate(guesses)}


def _guesses_of(table: Table) -> list[int]:
    """The guesses the last rank's ``next_i`` fields carry."""
    return [table.last(f"next_{i}") for i in range(table.last("next_guesses"))]


class _RandomKey:
    """Where MLX's global random generator stands now, to come back to: guesses drawn ahead that do not stand are
    drawn again from there, so the keys drawn are the ones one process drawing after the facts draws."""

    def __init__(self) -> None:
        self.key = cast(mx.array, cast(Any, mx.random.state)[0])  # (the stubs type the state as an object)

    def restore(self) -> None:
        high, low = cast(list[int], self.key.tolist())
        mx.random.seed((high << 32) | low)  # a key is two 32-bit words: the seed that makes it
