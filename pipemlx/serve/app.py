"""The HTTP side (rank 0): an ASGI app (Starlette) speaking OpenAI's API, and the uvicorn thread that serves it.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``. A handler checks the request
(4xx with an OpenAI-style error body; nothing reaches the ranks): its size (413 over ``--max-body-bytes``),
its fields, ``max_tokens`` against ``--max-tokens-limit``; tokenizes it, and queues a
:class:`~.book.Ticket` on the :class:`~.book.Book` (429 when the queue is full, or when
``--max-streams`` streams are open). Slow clients are cut off by uvicorn's settings
(:class:`HttpThread`: ``--header-timeout``, ``--idle-timeout``). The answer is one JSON
object, or server-sent events ending in ``data: [DONE]``. While a request
waits or runs, its response also listens for the client going away
(``http.disconnect``): then the request is cancelled, and rank 0's loop stops it on
every rank.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import resource
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import requests
from .book import Book, Event, Ticket
from .metrics import CONTENT_TYPE, ServeMetrics, StatusCounter
from .openai_api import (
    ApiError,
    ParsedRequest,
    bad_request,
    chunk_object,
    completion_object,
    models_object,
    now,
    parse_chat,
    parse_completion,
)
from .settings import HttpLimits, ServeSettings, api_keys

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class Api:
    """The endpoints, over the book of requests (:class:`Book`) and the tokenizer."""

    def __init__(self, book: Book, tokenizer: Any, settings: ServeSettings, context: int | None) -> None:
        self.book = book
        self.tokenizer = tokenizer
        self.settings = settings
        self.context = context
        self.created = now()
        defaults = settings.defaults
        self.template_args: dict[str, Any] = json.loads(defaults.chat_template_args)  # --chat-template-args
        if tokenizer is not None and defaults.chat_template:  # --chat-template
            tokenizer.chat_template = defaults.chat_template
        if tokenizer is not None and defaults.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.metrics = ServeMetrics(book, len(book.split))
        book.metrics = self.metrics

    def app(self) -> Starlette:
        """The ASGI app; with ``cors_origins`` (``"*"`` for any) browsers on those origins may call it (CORS).

        Without them no CORS header is sent, so browsers keep other origins' pages out.
        """
        cors_origins = self.settings.http.cors_origins
        routes = [
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._guard(self.model), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.scrape, methods=["GET"]),
        ]
        middleware = [Middleware(StatusCounter, metrics=self.metrics)]
        if cors_origins:
            middleware.append(
                Middleware(
                    CORSMiddleware,
                    allow_origins=list(cors_origins),
                    allow_methods=["GET", "POST"],
                    allow_headers=["*"],  # Authorization (--api-key) and Content-Type among them
                )
            )
        return Starlette(
            routes=routes,
            middleware=middleware,
            exception_handlers={HTTPException: self._http_error, Exception: self._crash},
        )

    def _guard(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """The API key check, and :class:`ApiError` as its JSON response."""

        async def guarded(request: Request) -> Response:
            try:
                self._check_key(request)
                return await handler(request)
            except ApiError as error:
                return error_response(error)

        return guarded

    def _has_key(self, request: Request) -> bool:
        """The request may see what the API key guards (always, when the server has no key)."""
        try:
            self._check_key(request)
        except ApiError:
            return False
        return True

    def _check_key(self, request: Request) -> int | None:
        """Which of the API keys the request sent (None: the server needs none); 401 for none of them."""
        keys = api_keys(self.settings.http.api_key)
        if not keys:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        sent = token.strip().encode()
        matches = [hmac.compare_digest(sent, key.encode()) for key in keys]  # each compared: no early exit
        if scheme.lower() == "bearer" and any(matches):
            return matches.index(True)
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'"
            if given
            else "no API key given: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        http = cast(HTTPException, exc)
        if http.status_code == 404:
            error = ApiError(404, f"no such endpoint: {request.method} {request.url.path}", code="unknown_url")
        elif http.status_code == 405:
            error = ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        else:
            error = ApiError(http.status_code, str(http.detail))
        return error_response(error)

    async def _crash(self, request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    # --- endpoints ---------------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Ready or not for anyone (load balancers: 200 or 503); the detail only with the API key."""
        report = self.book.health()
        code = 200 if report["status"] == "ready" else 503
        headers = {"Retry-After": "2"} if report["status"] == "recovering" else None
        if not self._has_key(request):
            return JSONResponse({"status": report["status"]}, status_code=code, headers=headers)
        return JSONResponse(report, status_code=code, headers=headers)

    async def scrape(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus' text format; behind the API key unless ``--metrics-public``."""
        if not self.settings.http.metrics_public:
            try:
                self._check_key(request)
            except ApiError as error:
                return error_response(error)
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_object(self.settings.model_id, self.created))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the served model's object, or 404 for any other id (ids may hold slashes)."""
        name = str(request.path_params["model"])
        self._check_model_name(name)
        (entry,) = models_object(self.settings.model_id, self.created)["data"]
        return JSONResponse(entry)

    async def chat(self, request: Request) -> Response:
        parsed = parse_chat(await self._body(request), self.settings.defaults)
        self._check_model(parsed)
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise bad_request("this model has no chat template; use /v1/completions", code="no_chat_template")
        try:
            template_args = {**self.template_args, **parsed.template_args}
            rendered = self.tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, **template_args)
            tokens = list(rendered)
        except Exception as exc:  # the template rejected the conversation (roles out of order, ...)
            raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from None
        return await self._generate(request, parsed, tokens)

    async def completions(self, request: Request) -> Response:
        parsed = parse_completion(await self._body(request), self.settings.defaults)
        self._check_model(parsed)
        prompt = parsed.prompt
        if isinstance(prompt, str):
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special = bos is None or not prompt.startswith(bos)
            tokens = list(self.tokenizer.encode(prompt, add_special_tokens=add_special))
        else:
            tokens = list(cast(list[int], prompt))
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in tokens):
                raise bad_request(f"token ids must be in 0..{vocab - 1}", param="prompt")
        return await self._generate(request, parsed, tokens)

    # --- helpers -----------------------------------------------------------------------------------------------------

    async def _body(self, request: Request) -> Any:
        http = self.settings.http
        raw = await read_capped(request, http.max_body_bytes, http.body_timeout)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a number over 4,300 digits, deep nesting
            why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
            raise bad_request(f"the request body is not valid JSON: {why}") from None

    def _check_model(self, parsed: ParsedRequest) -> None:
        if parsed.model is not None:
            self._check_model_name(parsed.model)

    def _check_model_name(self, name: str) -> None:
        if name != self.settings.model_id:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {self.settings.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def _partition(self, request: Request, salt: str | None) -> str:
        """The request's prefix-cache partition: shared ("") without a salt when the server has one key or none;
        else a digest of which key it sent and its salt (neither is sent to the ranks as it is)."""
        key = self._check_key(request) if len(api_keys(self.settings.http.api_key)) > 1 else None
        if key is None and salt is None:
            return ""
        return hashlib.sha256(json.dumps([key, salt]).encode()).hexdigest()[:32]

    async def _generate(self, request: Request, parsed: ParsedRequest, tokens: list[int]) -> Response:
        if not tokens:
            raise bad_request("the prompt is empty after tokenization", param="prompt")
        context = self.context
        if context is not None and len(tokens) >= context:
            raise bad_request(
                f"the prompt has {len(tokens)} tokens; this server's context is {context} tokens",
                code="context_length_exceeded",
                param="messages" if parsed.kind == "chat" else "prompt",
            )
        max_tokens = parsed.max_tokens
        cap = self.settings.http.max_tokens_limit
        if max_tokens is not None and max_tokens > cap:
            raise bad_request(
                f"max_tokens is {max_tokens}; this server answers at most {cap} tokens (--max-tokens-limit)",
                param="max_tokens",
            )
        if max_tokens is None:
            max_tokens = min(self.settings.defaults.max_tokens, cap)
            if context is not None:
                max_tokens = min(max_tokens, context - len(tokens))
        elif context is not None and len(tokens) + max_tokens > context:
            raise bad_request(
                f"the prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceed this server's "
                f"context of {context} tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )
        partition = self._partition(request, parsed.cache_salt)
        request_ = requests.Request(
            self.book.number(), tokens, max_tokens, parsed.sampling, parsed.stop, partition=partition
        )
        ticket = Ticket(
            request_,
            parsed.kind,
            now(),
            asyncio.get_running_loop(),
            asyncio.Queue(),
            stream=parsed.stream,
            include_usage=parsed.include_usage,
        )
        if not parsed.stream:
            self.book.submit(ticket)
            return WholeAnswer(ticket, self.settings.model_id)
        self.book.open_stream()
        try:
            self.book.submit(ticket)
        except ApiError:
            self.book.close_stream()
            raise
        return EventStream(ticket, self.settings.model_id, self.book.close_stream)


async def read_capped(request: Request, cap: int, timeout: float = 30.0) -> bytes:
    """The request's body, or 413 as soon as it (or its ``Content-Length``) is over ``cap`` bytes, or 408 when it
    has not all arrived within ``timeout`` seconds (a client trickling its body holds no connection for long)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large(cap)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise too_large(cap)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s (--body-timeout)",
            param=None,
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


def too_large(cap: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's cap of {cap} bytes (--max-body-bytes)",
        param=None,
        code="request_too_large",
    )


async def _watch_disconnect(receive: Receive, ticket: Ticket) -> None:
    """Wait for the client to go away, then cancel ``ticket`` (rank 0 stops it on every rank)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ticket.cancel()
            return


class WholeAnswer(Response):
    """A request's answer as one JSON object, sent when the request ends; the client leaving cancels it."""

    def __init__(self, ticket: Ticket, model: str) -> None:
        super().__init__()
        self.ticket = ticket
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ticket = self.ticket
        watcher = asyncio.ensure_future(_watch_disconnect(receive, ticket))
        pieces: list[str] = []
        try:
            while True:
                event = await ticket.events.get()
                if event.kind == "text":
                    pieces.append(event.text)
                    continue
                break
        finally:
            watcher.cancel()
            if not ticket.finished:
                ticket.cancel()
        if event.kind == "error":
            assert event.error is not None
            response: Response = error_response(event.error)
        elif ticket.cancelled.is_set():
            return  # nobody to answer
        else:
            body = completion_object(
                ticket.kind,
                ticket.response_id,
                self.model,
                "".join(pieces),
                event.finish_reason or "stop",
                event.usage or {},
                ticket.created,
            )
            response = JSONResponse(body)
        await response(scope, receive, send)


class EventStream(Response):
    """Server-sent events: a first chunk, one chunk per piece of text, the finish, maybe usage, ``[DONE]``.

    An error after the stream began is an ``error`` event (OpenAI's error body)
    followed by ``[DONE]``. The client leaving cancels the ticket.
    """

    def __init__(self, ticket: Ticket, model: str, closed: Callable[[], None]) -> None:
        super().__init__()
        self.ticket = ticket
        self.model = model
        self.closed = closed  # gives the stream's slot back (--max-streams)

    def _event(self, obj: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ticket = self.ticket
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]
        watcher = asyncio.ensure_future(_watch_disconnect(receive, ticket))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if ticket.kind == "chat":
                first = chunk_object(ticket.kind, ticket.response_id, self.model, ticket.created, text="", first=True)
                await self._send(send, self._event(first))
            while not ticket.cancelled.is_set():
                event = await self._next(ticket, watcher)
                if event is None:
                    break
                if event.kind == "text":
                    chunk = chunk_object(ticket.kind, ticket.response_id, self.model, ticket.created, text=event.text)
                    await self._send(send, self._event(chunk))
                    continue
                if event.kind == "error":
                    assert event.error is not None
                    await self._send(send, self._event(event.error.body()))
                else:
                    last = chunk_object(
                        ticket.kind, ticket.response_id, self.model, ticket.created, finish_reason=event.finish_reason
                    )
                    if ticket.kind == "completion":
                        last["choices"][0]["text"] = ""
                    await self._send(send, self._event(last))
                    if ticket.include_usage and event.usage is not None:
                        tail = chunk_object(
                            ticket.kind, ticket.response_id, self.model, ticket.created, usage_=event.usage
                        )
                        await self._send(send, self._event(tail))
                await self._send(send, b"data: [DONE]\n\n")
                break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            ticket.cancel()  # the client is gone
        finally:
            watcher.cancel()
            self.closed()
            if not ticket.finished:
                ticket.cancel()

    async def _next(self, ticket: Ticket, watcher: asyncio.Future[None]) -> Event | None:
        """The ticket's next event, or ``None`` when the client leaves first."""
        getter = asyncio.ensure_future(ticket.events.get())
        done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        return None

    async def _send(self, send: Send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})


class QuietServer(uvicorn.Server):
    """uvicorn's server whose event loop reports its errors :class:`OncePerBurst` (asyncio's accept loop logs a
    traceback per refused accept when descriptors run out: a flood of connections would fill the disk)."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(OncePerBurst(BURST_S))
        await super().serve(sockets)


class HttpThread:
    """uvicorn serving the app in a thread of its own (rank 0's main thread runs the pipeline)."""

    def __init__(self, app: Starlette, host: str, port: int, limits: HttpLimits) -> None:
        raise_descriptor_limit()
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=bounded_protocol(limits.header_timeout, limits.max_connections),
            timeout_keep_alive=limits.idle_timeout,
        )
        self.server = QuietServer(config)
        self.thread = threading.Thread(target=self._run, name="pipemlx-serve-http", daemon=True)
        self.failure: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # uvicorn exits (SystemExit) when it cannot bind
            self.failure = exc

    @property
    def port(self) -> int:
        """The port listened on (the one chosen when 0 was asked), once started."""
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def start(self, timeout: float = 30.0) -> bool:
        """Start listening; False when uvicorn could not (the port is taken, the host is not ours)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.started:
                return True
            if not self.thread.is_alive():
                return False
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


BURST_S = 10.0
"""Seconds during which the event loop's repeated errors (asyncio's accept loop failing with "too many open
files", once per attempt) are logged once."""


class OncePerBurst:
    """An event loop's exception handler that logs an error once per ``burst_s`` seconds per kind of error, then
    how many it left out: a flood of refused accepts is one line, not a traceback per attempt. asyncio's accept
    loop itself keeps going (it retries after a pause)."""

    def __init__(self, burst_s: float) -> None:
        self.burst_s = burst_s
        self.last: dict[str, float] = {}
        self.left_out: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        kind = f"{context.get('message', '')}: {type(exc).__name__}" if exc is not None else str(context.get("message"))
        now_ = time.monotonic()
        if now_ - self.last.get(kind, -self.burst_s) < self.burst_s:
            self.left_out[kind] = self.left_out.get(kind, 0) + 1
            return
        self.last[kind] = now_
        skipped = self.left_out.pop(kind, 0)
        more = f" ({skipped} more like it in the last {self.burst_s:g} s not shown)" if skipped else ""
        print(f"pipemlx serve: http: {kind}: {exc}{more}", file=sys.stderr, flush=True)


def raise_descriptor_limit() -> int:
    """Raise this process's open-descriptor limit to its hard limit (mlx-lm lowers it to 2,048 on import), so that
    the connection caps, not the descriptors, bound what clients can hold; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # some systems cap it below the hard limit (macOS: OPEN_MAX)
            pass
    return soft


TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
)


def bounded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with two bounds: a connection must send each request's headers within
    ``header_timeout`` seconds (after it opened, then after each answer ended: uvicorn's keep-alive timeout stops
    at the first byte, so a connection trickling a request's headers would hold forever), and past
    ``max_connections`` open connections a new one is answered 503 and closed."""
    body = json.dumps(
        ApiError(503, "too many open connections; try again", type="server_error", code="too_many_connections").body()
    ).encode()
    refusal = TOO_MANY % (len(body), body)

    class Bounded(H11Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
            super().connection_made(transport)  # pyright: ignore[reportArgumentType]
            if len(self.connections) > max_connections:
                self.transport.write(refusal)
                self.transport.close()
                return
            self._arm(None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm(self.cycle)

        def _arm(self, cycle: object) -> None:
            self.loop.call_later(header_timeout, self._headers_due, cycle)

        def _headers_due(self, cycle: object) -> None:
            """Close the connection when no request's headers came since ``cycle`` (None: since it opened)."""
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return Bounded
