"""One request, one shape: what a client asked (:class:`Request`, with one :class:`SamplingParams`), how it
ended on the ranks (:class:`RequestResult`), and their wire forms, derived from the types.

The HTTP parser (:mod:`.openai_api`) fills a :class:`SamplingParams`; the book
(:mod:`.book`) numbers the request and makes it a :class:`Request`, which
travels unchanged to every rank in one wire form, JSON (:func:`to_json` /
:func:`from_json`): over the front's link, and as the bytes of rank 0's
broadcast (:mod:`.broadcast`). The form is read off the dataclasses' fields,
so a new field is a change to its type, the parser that fills it and the code
that uses it (here: :meth:`SamplingParams.sampler`), and nothing in between.
Reading it checks every field's type and raises :class:`ValueError` naming
the field.

The request's number (:attr:`Request.id`) is its one id from end to end: the
front's book, the link, the broadcast, each rank's scheduler, ``/health``
and the OpenAI response id (:func:`response_id`).

No MLX at import: the front process and the HTTP side use this module without it.
"""

from __future__ import annotations

import math
import secrets
import types
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    import mlx.core as mx

    Sampler = Callable[[mx.array], mx.array]
    LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

Outcome = Literal["stop", "length", "cancelled", "failed"]
OUTCOMES = ("none", "stop", "length", "cancelled", "failed")
"""How a rank's last request ended, as its ``outcome`` field numbers it."""
INSTANCE = secrets.token_hex(6)
"""This process's part of the OpenAI response ids (request numbers start at 1 in every server process)."""

PENALTY_CONTEXT = 20
"""The tokens a penalty looks back over unless the request says (mlx-lm's server's default)."""

T = TypeVar("T")


@dataclass(frozen=True)
class SamplingParams:
    """How a request draws its tokens; float fields hold what the request asked (the broadcast carries float32)."""

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    """Tokens less likely than ``min_p`` times the likeliest are dropped (0: none), as mlx-lm's sampler does."""
    top_k: int = 0
    """Only the ``top_k`` likeliest tokens are drawn from (0: all)."""
    seed: int | None = None
    """``None``: rank 0 draws one at admission (temperature above 0), so every rank samples alike."""
    # Penalties over the last ``*_context_size`` tokens (0: none), as mlx-lm's make_logits_processors applies them:
    # OpenAI's presence and frequency penalties and mlx-lm's server's multiplicative repetition penalty.
    repetition_penalty: float = 0.0
    repetition_context_size: int = PENALTY_CONTEXT
    presence_penalty: float = 0.0
    presence_context_size: int = PENALTY_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = PENALTY_CONTEXT
    draft: bool = True
    """Speculative decoding when the server does it; False: this request opted out."""

    def sampler(self) -> Sampler | None:
        """mlx-lm's sampler over MLX's global random generator (``None``: greedy, the argmax)."""
        if self.temperature <= 0:
            return None
        from mlx_lm.sample_utils import make_sampler  # pyright: ignore[reportUnknownVariableType]

        made: Sampler = make_sampler(self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)
        return made

    def processors(self) -> list[LogitsProcessor] | None:
        """mlx-lm's logits processors for the penalties (``None``: none); only the last rank runs them."""
        from mlx_lm.sample_utils import make_logits_processors  # pyright: ignore[reportUnknownVariableType]

        names = ("repetition", "presence", "frequency")
        made: list[LogitsProcessor] = make_logits_processors(
            **{f"{n}_penalty": getattr(self, f"{n}_penalty") for n in names},
            **{f"{n}_context_size": getattr(self, f"{n}_context_size") for n in names},
        )
        return made or None

    def keyed_sampler(self, seed: int, drawn: int = 0) -> Sampler | None:
        """The draws of :meth:`sampler` after ``mx.random.seed(seed)``, from a key of the request's own (a batch
        holds other requests); ``drawn`` keys are skipped first (a request resumed after ``drawn`` tokens)."""
        if self.temperature <= 0:
            return None
        import mlx.core as mx
        from mlx_lm.sample_utils import (  # pyright: ignore[reportUnknownVariableType]
            apply_min_p,  # pyright: ignore[reportUnknownVariableType]
            apply_top_k,  # pyright: ignore[reportUnknownVariableType]
            apply_top_p,  # pyright: ignore[reportUnknownVariableType]
        )

        state = [mx.random.key(seed)]
        for _ in range(drawn):
            state[0] = mx.random.split(state[0])[0]
        # Evaluated here: left lazy, the key would be computed on a helper thread that lacks this thread's stream.
        mx.eval(state[0])  # pyright: ignore[reportUnknownMemberType]
        temperature, top_p, min_p, top_k = self.temperature, self.top_p, self.min_p, self.top_k

        def sample(logprobs: mx.array) -> mx.array:  # mlx-lm's filters, in its order
            if 0 < top_p < 1:
                logprobs = apply_top_p(logprobs, top_p)
            if min_p != 0:
                logprobs = apply_min_p(logprobs, min_p)
            if top_k > 0:
                logprobs = apply_top_k(logprobs, top_k)
            pair = mx.random.split(state[0])
            state[0] = pair[0]
            return mx.random.categorical(logprobs * (1.0 / temperature), key=pair[1])

        return sample


@dataclass(frozen=True)
class Request:
    """What a client asked, numbered by the book: its prompt's tokens, how many to generate, how to sample, where
    to stop. ``drawn``: of ``tokens``, the last ``drawn`` were generated before (a request resumed on a new group)."""

    id: int
    tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    drawn: int = 0
    partition: str = ""
    """The prefix cache's partition this request may reuse and extend (:mod:`.prefix_cache`): a digest of its API
    key and ``cache_salt`` (empty: the shared one); the salt itself never leaves the front."""

    def resumed(self, generated: Sequence[int]) -> Request:
        """The request that continues this one after ``generated`` tokens: they join the prompt and count against
        ``max_tokens``, and a sampler skips the keys they used."""
        return replace(
            self,
            tokens=self.tokens + list(generated),
            max_tokens=self.max_tokens - len(generated),
            drawn=self.drawn + len(generated),
        )

    def with_seed(self, seed: int | None) -> Request:
        return replace(self, sampling=replace(self.sampling, seed=seed))


@dataclass(frozen=True)
class RequestResult:
    """How a request ended on the ranks (rank 0's figures)."""

    outcome: Outcome
    cached: int = 0
    """Prompt positions reused from the prefix cache."""
    cache_tokens: int = 0
    """Positions its cache held at the end."""
    prefilled: int = 0
    """Prompt positions computed by this request (those processed, of a prefill cut short)."""
    error: str | None = None
    """``"TypeName: message"`` of what failed it."""
    proposed: int = 0
    """Speculative decoding: tokens guessed, and of them the pipeline confirmed ``accepted``."""
    accepted: int = 0
    generated: int = 0
    """Tokens the ranks generated for it (this admission): an end of sequence or ``max_tokens`` ends the decode
    in the step that yields it, so no more than the client got."""


def describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def response_id(kind: str, number: int) -> str:
    """The OpenAI id of request ``number`` of this server process."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{INSTANCE}{number:08x}"


# --- the wire forms, read off the fields ---------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """``value`` (a dataclass of the types below) as JSON-ready values."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in cast(Sequence[Any], value)]
    return value


def from_json(cls: type[T], data: Any) -> T:
    """The ``cls`` that :func:`to_json` made ``data`` of; :class:`ValueError` naming the first field that is not
    what the type says (a missing field with a default takes it)."""
    return cast(T, _read(cls, data, cls.__name__))


def _read(kind: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(kind), get_args(kind)
    if is_dataclass(kind):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        data = cast(dict[str, Any], value)
        hints = get_type_hints(kind)
        values: dict[str, Any] = {}
        for f in fields(kind):
            if f.name in data:
                values[f.name] = _read(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif not _has_default(f):
                raise ValueError(f"{where}.{f.name} is missing")
        return cast(Callable[..., Any], kind)(**values)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        failures: list[str] = []
        for inner in [a for a in args if a is not type(None)]:
            try:
                return _read(inner, value, where)
            except ValueError as exc:
                failures.append(str(exc))
        raise ValueError(" or ".join(failures))
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        entries = cast(dict[Any, Any], value).items()
        return {_read(args[0], k, where): _read(args[1], v, f"{where}[{k!r}]") for k, v in entries}
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        items = [_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(cast(list[Any], value))]
        return items if origin is list else tuple(items)
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: expected a whole number, got {value!r}")
        return value
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if kind in (str, Path):
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {type(value).__name__}")
        return value if kind is str else Path(value)
    raise TypeError(f"{where}: no wire form for {kind!r}")


def _has_default(f: Any) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING
