"""The whole request on a sharded model, as mlx-lm's API: ``generate_step`` and ``stream_generate``.

:func:`generate_step` checks its arguments on every rank before anything is sent, prefills the prompt
(:func:`pipemlx.pipeline_prefill`), then hands the decode to :mod:`pipemlx.runtime.decode`, whose steps agree on
every token and on every stop (see ``docs/design.md``, "The request lifecycle"); its stop sequences are
:mod:`pipemlx.runtime.stops`'. :func:`stream_generate` turns that decode into mlx-lm's ``GenerationResponse``
stream: the text, the end-of-sequence tokens, the finish reason and the speeds, the same on every rank.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Generator, Iterable, Sequence
from contextlib import closing
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, maybe_quantize_kv_cache  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.generate import generate_step as mlx_generate_step  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.generate import stream_generate as mlx_stream_generate  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.tokenizer_utils import TokenizerWrapper  # pyright: ignore[reportUnknownVariableType]

from ..errors import renamed
from .decode import DecodeRun, DecodeStream, Speculation
from .prefill import (
    DEFAULT_QUANTIZED_KV_START,
    CancelCheck,
    PrefillOptions,
    ProgressCallback,
    check_kv_quantization,
    check_prompt,
    check_rotating_caches,
    check_timeout,
)
from .protocol import decode_settings
from .sampling import LogitsProcessor, Sampler
from .speculative import DraftLength, SpeculationMode, check_speculation_mode, proposer_of
from .stage import is_sharded, stage_of
from .stops import StopSet

NO_TOKEN = -1
"""``GenerationResponse.token`` of :func:`stream_generate`'s closing ``"cancelled"`` response: it adds no token."""


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
    logprobs: bool = True,
    speculation: SpeculationMode = "auto",
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

    ``logits_processors`` and ``sampler`` are called in every rank's process,
    as mlx-lm calls them in one: each step the last rank's logits reach every
    rank (one vocabulary-sized message per step; greedy decoding without
    processors sends none), and each rank calls its processors with the token
    history and logits mlx-lm's see, then its sampler with the log-probabilities,
    and yields those log-probabilities. The token every rank yields is the last
    rank's sample: a random sampler seeded alike on every rank draws alike, one
    that is not may draw another token on another rank, and that draw is
    dropped (the ranks never split). A processor or sampler that raises on a
    rank before the last raises there before that step's token; the other
    ranks yield it, and the request then ends on every rank (``stop.reason``
    ``"failed"``). With speculation only the last rank's sampler also draws the
    guesses. Greedy decoding without processors: ``logprobs`` is the last
    rank's; the other ranks yield ``None`` unless ``share_logprobs`` sends it
    to them too (one vocabulary-sized message per token). Pass a sampler and
    processors on every rank or on none (the prefill's handshake compares it).
    ``logprobs=False`` (pipemlx's; pass it on every rank): every rank yields ``None`` in place of the
    log-probabilities; with ``head="split"`` and greedy decoding the whole logits are then never gathered (each
    rank's best logit and its id decide the token, as with the shared head).

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
    prompt (ignored without speculation). ``speculation`` (pipemlx's): ``"serial"`` verifies one pass at a time;
    ``"pipelined"`` starts a pass every tick while the later ranks verify the earlier ones (rank 0 proposes,
    assuming the passes in flight confirm every guess; a pass built on a guess that failed is dropped on every
    rank), so that every rank computes at once: it needs more than one rank, no ``logits_processors`` and a
    head the last rank holds whole (``ValueError`` otherwise), and a sampler draws each position with the random
    state plain decoding gives it, so a seeded sampler yields plain decoding's tokens; ``"auto"`` (the default)
    is ``"serial"`` (measured faster overall: :data:`~pipemlx.runtime.speculative.AUTO_PIPELINES`).

    ``stream`` is mlx-lm's (its third argument), accepted so that mlx-lm code
    runs unchanged, but every rank computes on its stage's own stream
    (``stage_of(model).compute_stream``, on the device that was the default
    when the model was sharded): a stream or device on that device (or
    ``None``) is accepted; one on another device raises ``ValueError``,
    anything else ``TypeError``, before anything is sent.

    A model that is not sharded (an engine's one-machine path) runs as mlx-lm runs it: this returns
    ``mlx_lm.generate.generate_step``'s own generator (tokens and logprobs as ``mx.array``, processors and sampler
    called in this process) with mlx-lm's arguments; ``prefill_step_size="auto"`` is mlx-lm's default there. The
    arguments only pipemlx has (``should_cancel``, ``timeout``, ``share_logprobs``, ``stop_tokens``,
    ``draft_model``, ``prompt_lookup``, ``history``) raise ``ValueError`` there unless left at their defaults.
    """
    if not is_sharded(model):
        _refuse_pipemlx_only(
            "generate_step",
            should_cancel=should_cancel is not None,
            timeout=timeout is not None,
            share_logprobs=share_logprobs,
            stop_tokens=bool(list(stop_tokens)),
            draft_model=draft_model is not None,
            num_draft_tokens=num_draft_tokens != 2,
            prompt_lookup=prompt_lookup is not None,
            history=len(history) > 0,
            logprobs=not logprobs,
            speculation=speculation != "auto",
        )
        options: dict[str, Any] = {
            "max_tokens": max_tokens,
            "sampler": sampler,
            "logits_processors": None if logits_processors is None else list(logits_processors),
            "max_kv_size": max_kv_size,
            "prompt_cache": prompt_cache,
            "kv_bits": kv_bits,
            "kv_group_size": kv_group_size,
            "quantized_kv_start": quantized_kv_start,
            "prompt_progress_callback": prompt_progress_callback,
            "input_embeddings": input_embeddings,
        }
        if prefill_step_size != "auto":
            options["prefill_step_size"] = prefill_step_size
        if stream is not None:
            options["stream"] = stream
        # mlx-lm's own generator, not a DecodeStream: the one-machine path is mlx-lm's, attributes and all.
        return cast(DecodeStream, mlx_generate_step(prompt, model, **options))  # pyright: ignore[reportUnknownMemberType]
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
    stops = StopSet.of(stop_tokens)
    if not _positive_or_none(max_kv_size):
        raise ValueError(f"max_kv_size must be a positive int or None, got {max_kv_size!r}")
    if prompt_cache is None and max_kv_size is not None:  # mlx-lm ignores max_kv_size with a prompt_cache
        check_rotating_caches(kv_bits, stage.info.unquantizable_bounded, stage.info.total_layers, max_kv_size)
    check_rotating_caches(kv_bits, stage.info.unquantizable, stage.info.total_layers)
    proposer = proposer_of(draft_model, prompt_lookup)
    draft_length = DraftLength(num_draft_tokens)
    check_speculation_mode(speculation, stage.world_size, bool(logits_processors), stage.info.head == "split")
    if prompt_cache is None:
        prompt_cache = stage.new_cache(model, max_kv_size)
    speculating = Speculation(
        proposer,
        draft_length,
        max_tokens,
        sampler,
        speculation,
        tokens=[int(t) for t in history] if proposer is not None else [],
    )
    run = DecodeRun(
        stage,
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=list(logits_processors or []),
        quantize=lambda c: maybe_quantize_kv_cache(c, quantized_kv_start, kv_group_size, kv_bits),
        timeout=timeout or stage.info.timeout,
        share_logprobs=share_logprobs,
        stop_tokens=stops,
        speculation=speculating,
        logprobs=logprobs,
    )
    prefill = PrefillOptions(
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=prompt_progress_callback,
        should_cancel=should_cancel,
        timeout=run.timeout,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        decode_settings=decode_settings(share_logprobs, run.processing),
        speculation=speculating.handshake,
    )
    generator = run.run(tokens, prompt_cache, prefill)
    run.generator = weakref.ref(generator)
    return DecodeStream(run, generator)


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
    text). The last response has ``finish_reason``
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

    ``max_tokens=0`` raises mlx-lm's ``ValueError`` ("Maximum number of tokens must be non-zero"), on every rank
    before anything is sent. A model that is not sharded runs as mlx-lm runs it: this returns
    ``mlx_lm.stream_generate``'s own generator (``prefill_step_size="auto"`` is mlx-lm's default there; the
    arguments only pipemlx has raise ``ValueError`` unless left at their defaults, as in :func:`generate_step`).
    """
    if max_tokens == 0:  # mlx-lm 0.32.2's stream_generate: the same error, not an empty stream
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not is_sharded(model):
        _refuse_pipemlx_only(
            "stream_generate",
            **{name: name in kwargs for name in _PIPEMLX_ONLY if name != "draft_model" and name != "num_draft_tokens"},
        )
        if kwargs.get("prefill_step_size") == "auto":
            del kwargs["prefill_step_size"]
        responses = mlx_stream_generate(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)  # pyright: ignore[reportUnknownMemberType]
        return cast(ResponseStream, responses)
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
    eos = StopSet.of(cast(Iterable[int], wrapper.eos_token_ids)) | StopSet.of(extra_stops)
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
    eos: StopSet,
) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's ``stream_generate`` loop over a pipemlx token generator."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps = 0.0
    token, logprobs, n = 0, cast(Any, None), -1
    finish: str | None = None
    stops = eos.matcher()
    with closing(generator):
        for n, (token, logprobs) in enumerate(generator):
            if n == 0:
                prompt_tps = prompt_tokens / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            if stops.advance(token):
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


_PIPEMLX_ONLY = (
    "should_cancel",
    "timeout",
    "share_logprobs",
    "stop_tokens",
    "draft_model",
    "num_draft_tokens",
    "prompt_lookup",
    "history",
    "logprobs",
    "speculation",
)
"""generate_step's arguments that mlx-lm's has not: refused (unless at their defaults) on a model that is not sharded."""


def _refuse_pipemlx_only(function: str, **given: bool) -> None:
    """Name the pipemlx-only arguments ``given`` (True: set) that a model that is not sharded cannot take."""
    named = sorted(name for name, was_set in given.items() if was_set)
    if named:
        raise ValueError(
            f"{function} on a model that is not sharded is mlx-lm's; {', '.join(named)} "
            "exist only on a sharded model (pipemlx.shard_model / load_sharded): leave them out or shard the model"
        )


def _positive_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
