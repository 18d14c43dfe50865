"""The OpenAI wire format: request checking, error bodies and response objects (pure Python, no MLX, no HTTP).

:func:`parse_chat` and :func:`parse_completion` turn a decoded JSON body into a
:class:`ParsedRequest` or raise :class:`ApiError` (status, OpenAI-style error
body). The ``*_object`` and ``*_chunk`` functions build what the endpoints send:
the same fields, types and ``object`` names as OpenAI's API, so that the
``openai`` client and other OpenAI-compatible clients read them unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from .requests import SamplingParams
from .settings import RequestDefaults

MAX_STOP_STRINGS = 4
MAX_SEED = (1 << 31) - 1
CONTEXT_CAP = 1 << 20  # the most tokens a count in a request may name
REPLACEMENT = "\ufffd"  # what a decoder shows for the bytes of an unfinished UTF-8 character
ROLES = ("system", "developer", "user", "assistant", "tool")

Kind = Literal["chat", "completion"]
UNSUPPORTED = {
    "draft_model": "the draft model is the server's (--draft-model); 'draft': false opts a request out",
    "num_draft_tokens": "guesses per pass are the server's setting (--num-draft-tokens)",
    "adapters": "the adapters are the server's (--adapter-path), not a request's",
    "xtc_probability": "XTC sampling draws from a random generator the ranks do not share per request",
    "tools": "tool calls are not parsed from the answers",
    "role_mapping": "the chat template renders the roles",
}
"""Request fields of mlx_lm.server that pipemlx serve refuses (a 400 naming the field), with the reason."""
NO_DEFAULTS = RequestDefaults()


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def shutting_down() -> ApiError:
    """503: the server is stopping."""
    return unavailable("the server is shutting down", code="shutting_down")


def unavailable(message: str, *, code: str = "pipeline_unavailable") -> ApiError:
    """503: the pipeline cannot serve (a rank was lost or stalled, the server is stopping or loading)."""
    return ApiError(503, message, type="server_error", code=code)


@dataclass
class ParsedRequest:
    """A checked request: what to generate from, and how."""

    kind: Kind
    model: str | None
    messages: list[dict[str, str]] | None = None
    template_args: dict[str, Any] = field(default_factory=dict[str, Any])
    """``chat_template_kwargs``: arguments for the chat template (mlx_lm.server's field)."""
    prompt: str | list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = field(default_factory=tuple[str, ...])
    cache_salt: str | None = None
    """vLLM's field: requests reuse cached prompt prefixes only with requests of the same salt (and API key)."""


MAX_SALT_CHARS = 1024


def parse_chat(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> ParsedRequest:
    """``POST /v1/chat/completions``'s body, checked; ``defaults`` for what it does not say."""
    obj = _object(body)
    messages = obj.get("messages")
    if messages is None:
        raise bad_request("'messages' is a required property", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    checked = [_message(m, i) for i, m in enumerate(cast(list[Any], messages))]
    request = ParsedRequest("chat", _model(obj), messages=checked)
    _common(obj, request, defaults)
    return request


def parse_completion(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> ParsedRequest:
    """``POST /v1/completions``'s body, checked: ``prompt`` is text, a list of one text, or token ids."""
    obj = _object(body)
    prompt = obj.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is a required property", param="prompt")
    if isinstance(prompt, list) and len(cast(list[Any], prompt)) == 1 and isinstance(cast(list[Any], prompt)[0], str):
        prompt = cast(list[Any], prompt)[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", param="prompt")
        text_or_ids: str | list[int] = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in cast(list[Any], prompt)):
        text_or_ids = [int(t) for t in cast(list[Any], prompt)]
    else:
        raise bad_request("'prompt' must be a non-empty string or a list of token ids (one prompt)", param="prompt")
    request = ParsedRequest("completion", _model(obj), prompt=text_or_ids)
    _common(obj, request, defaults)
    return request


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return cast(dict[str, Any], body)


def _model(obj: dict[str, Any]) -> str | None:
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    return model


def _message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", param=where)
    entry = cast(dict[str, Any], message)
    role = entry.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    content = entry.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        texts: list[str] = []
        for part in cast(list[Any], content):
            if not isinstance(part, dict) or cast(dict[str, Any], part).get("type") != "text":
                raise bad_request(f"{where}.content: only text parts are supported", param=f"{where}.content")
            text = cast(dict[str, Any], part).get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content: a text part needs a 'text' string", param=f"{where}.content")
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    return {"role": cast(str, role), "content": content}


def _common(obj: dict[str, Any], request: ParsedRequest, defaults: RequestDefaults) -> None:
    """The sampling and streaming fields both endpoints share."""
    stream = obj.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", param="stream")
    request.stream = bool(stream)
    options = obj.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        request.include_usage = bool(cast(dict[str, Any], options).get("include_usage", False))
    for name in ("max_tokens", "max_completion_tokens"):
        value = obj.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise bad_request(f"'{name}' must be a whole number of at least 1, got {value!r}", param=name)
        request.max_tokens = int(value)
    request.sampling = _sampling(obj, defaults)
    request.stop = _stop(obj.get("stop"))
    salt = obj.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS:
            raise bad_request(
                f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters", param="cache_salt"
            )
        request.cache_salt = salt
    if obj.get("logit_bias"):
        raise bad_request("logit_bias is not supported by pipemlx serve", param="logit_bias")
    for name, why in UNSUPPORTED.items():
        if obj.get(name) not in (None, 0, [], {}):
            raise bad_request(f"{name} is not supported by pipemlx serve: {why}", param=name)
    template_args = obj.get("chat_template_kwargs")
    if template_args is not None:
        if not isinstance(template_args, dict):
            raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        request.template_args = cast(dict[str, Any], template_args)
    n = obj.get("n")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", param="n")
    if _asks_logprobs(obj, request.kind):
        raise bad_request("logprobs are not supported by pipemlx serve", param="logprobs")
    if request.kind == "completion" and obj.get("echo"):
        raise bad_request("echo is not supported by pipemlx serve", param="echo")


def _sampling(obj: dict[str, Any], defaults: RequestDefaults) -> SamplingParams:
    """The request's :class:`SamplingParams`: the server's defaults (``--temp``, ``--top-p``, ...), with each field
    the request sends checked and taken (null: not sent)."""
    sent = {name: check(name, obj[name]) for name, check in SAMPLING_FIELDS.items() if obj.get(name) is not None}
    return replace(defaults.sampling, **sent)


def _within(low: float, high: float, *, whole: bool = False, above_low: bool = False) -> Callable[[str, Any], Any]:
    """A check of a number (a whole one: ``whole``) from ``low`` (or above it) to ``high``."""
    span = f"in ({low:g}, {high:g}]" if above_low else f"from {low:g} to {high:g}"
    if whole:
        span = f"of at least {int(low)} and at most {int(high)}"

    def check(name: str, value: Any) -> float | int:
        if (
            not (_is_int if whole else _is_number)(value)
            or value > high
            or (value <= low if above_low else value < low)
        ):
            raise bad_request(f"'{name}' must be a {'whole ' * whole}number {span}, got {value!r}", param=name)
        return int(value) if whole else float(value)

    return check


def _seed(name: str, value: Any) -> int:
    if not _is_int(value):
        raise bad_request(f"'{name}' must be a whole number, got {value!r}", param=name)
    return int(value) % (MAX_SEED + 1)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {value!r}", param=name)
    return value


SAMPLING_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "temperature": _within(0, 2),
    "top_p": _within(0, 1, above_low=True),
    "min_p": _within(0, 1),
    "top_k": _within(0, CONTEXT_CAP, whole=True),  # 0: all tokens
    "seed": _seed,
    "repetition_penalty": _within(0, 10),
    "presence_penalty": _within(-2, 2),
    "frequency_penalty": _within(-2, 2),
    **{f"{kind}_context_size": _within(1, CONTEXT_CAP, whole=True) for kind in ("repetition", "presence", "frequency")},
    "draft": _flag,  # pipemlx's own: False opts the request out of speculative decoding
}
"""Each :class:`SamplingParams` field a request may send, and its check (OpenAI's and mlx_lm.server's names)."""


def _asks_logprobs(obj: dict[str, Any], kind: Kind) -> bool:
    """Chat asks with ``logprobs: true`` (or ``top_logprobs`` above 0); a completion with any ``logprobs``
    number, 0 too (OpenAI then returns the chosen tokens' log probabilities)."""
    logprobs = obj.get("logprobs")
    if kind == "completion":
        return logprobs is not None and logprobs is not False
    return bool(logprobs) or bool(obj.get("top_logprobs"))


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    items = cast(list[Any], stop)
    if len(items) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in items):
        raise bad_request(f"'stop' takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return tuple(cast(list[str], items))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- responses ---------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_object(
    kind: Kind, request_id: str, model: str, text: str, finish_reason: str, usage_: dict[str, Any], created: int
) -> dict[str, Any]:
    """The whole answer of a request that did not stream."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
        "system_fingerprint": None,
    }


def chunk_object(
    kind: Kind,
    request_id: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    finish_reason: str | None = None,
    first: bool = False,
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One server-sent event's object; ``usage_`` alone makes the final usage chunk (no choices)."""
    if usage_ is not None:
        choices: list[dict[str, Any]] = []
    elif kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    obj: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage_ is not None:
        obj["usage"] = usage_
    return obj


def models_object(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "pipemlx"}]}


def now() -> int:
    return int(time.time())


def stop_strings_hold(text: str, stops: Sequence[str], start: int = 0, end: int | None = None) -> int:
    """How many characters at the end of ``text[start:end]`` could be the start of a stop string (held back while
    streaming). Only the characters from ``start`` are looked at: the work is quadratic in how many those are
    (those not sent yet: a few), never in the answer's or a stop string's length."""
    end = len(text) if end is None else end
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, end - start), longest, -1):
            if text.startswith(stop[:size], end - size, end):
                longest = size
                break
    return longest


def unfinished_chars(text: str) -> int:
    """How many characters at the end of ``text`` are U+FFFD: bytes of a character whose other bytes may come
    with the next token (a detokenizer that decodes every token shows them so), held back while streaming."""
    return len(text) - len(text.rstrip(REPLACEMENT))


class StopText:
    """The text a request may release so far: cut at the first stop string, holding back a possible stop's start."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.sent = 0
        self.stopped = False
        self.final: str | None = None

    def update(self, text: str) -> str:
        """Given the whole text decoded so far, return what can be sent now; sets ``stopped`` at a stop string."""
        if self.stopped:
            return ""
        if self.stops:
            # A stop string cannot begin before ``sent``: its start would have been held back (linear work per
            # token, where searching from ``sent`` less the longest stop's length was quadratic for long stops).
            found = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
            if found:
                cut = min(found)
                self.stopped = True
                self.final = text[:cut]
                piece = text[self.sent : cut] if cut > self.sent else ""
                self.sent = max(self.sent, cut)
                return piece
        settled = len(text) - unfinished_chars(text)  # a character still arriving may complete a stop string
        ready = settled - stop_strings_hold(text, self.stops, min(self.sent, settled), settled)
        if ready <= self.sent:
            return ""
        piece = text[self.sent : ready]
        self.sent = ready
        return piece

    def finish(self, text: str) -> str:
        """At the end of the request: the rest of ``text`` (up to a stop string)."""
        if self.stopped:
            return ""
        piece = self.update(text)
        if self.stopped:
            return piece
        rest = text[self.sent :]
        self.sent = len(text)
        return piece + rest

    def text_of(self, text: str) -> str:
        """The request's final text."""
        return self.final if self.final is not None else text
