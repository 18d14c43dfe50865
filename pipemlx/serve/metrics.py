"""``/metrics``: the server's figures in Prometheus' text format (``prometheus_client``), on the requests' side.

One :class:`ServeMetrics` per app, with its own :class:`~prometheus_client.CollectorRegistry`
(never the process-wide default one), so that two servers in one process (the
tests) count apart. Nothing here touches MLX or the ranks: the counters are fed
by the HTTP side (:class:`StatusCounter`, every answer's status) and by the
answers (:meth:`ServeMetrics.request_done`, :meth:`ServeMetrics.token`), and
the gauges read the :class:`~.book.Book`'s state when scraped, so the figures
move with the book if it leaves rank 0's process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from .book import Book

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class RankCollector(Collector):
    """Each rank's state as of the last broadcast: up, its last request, its cache and prefix-cache sizes."""

    def __init__(self, book: Book, ranks: int) -> None:
        self.book = book
        self.ranks = ranks

    def collect(self) -> Iterator[GaugeMetricFamily]:
        slots = self.book.rank_slots()
        state = GaugeMetricFamily(
            "pipemlx_rank_state",
            "1 for the state each rank is in (ready, loading, stopping, failed)",
            labels=["rank", "state"],
        )
        last = GaugeMetricFamily("pipemlx_rank_last_request", "the last request each rank finished", labels=["rank"])
        cache = GaugeMetricFamily(
            "pipemlx_rank_cache_tokens", "positions each rank's cache held after its last request", labels=["rank"]
        )
        entries = GaugeMetricFamily(
            "pipemlx_rank_prefix_entries", "entries in each rank's prefix cache", labels=["rank"]
        )
        for r in range(self.ranks):
            slot = slots[r] if r < len(slots) else {}
            state.add_metric([str(r), self.book.status], 1.0)
            last.add_metric([str(r)], float(slot.get("last_seq", 0)))
            cache.add_metric([str(r)], float(slot.get("cache_tokens", 0)))
            entries.add_metric([str(r)], float(slot.get("prefix_entries", 0)))
        yield from (state, last, cache, entries)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class ServeMetrics:
    """The counters, histograms and gauges of one server, in a registry of its own."""

    def __init__(self, book: Book, ranks: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pipemlx_http_requests", "HTTP answers by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.finished = Counter(
            "pipemlx_requests_finished", "generation requests ended, by how (stop, length, cancelled, failed)",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("pipemlx_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("pipemlx_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter(
            "pipemlx_cached_prompt_tokens", "prompt tokens reused from the prefix cache", registry=r
        )
        self.prefix_hits = Counter("pipemlx_prefix_cache_hits", "requests that reused a cached prefix", registry=r)
        self.prefix_misses = Counter("pipemlx_prefix_cache_misses", "requests that reused nothing", registry=r)
        self.draft_proposed = Counter(
            "pipemlx_draft_tokens_proposed", "speculative decoding: tokens guessed (draft model or prompt lookup)",
            registry=r,
        )  # fmt: skip
        self.draft_accepted = Counter(
            "pipemlx_draft_tokens_accepted", "speculative decoding: guessed tokens the pipeline confirmed "
            "(the acceptance rate: accepted over proposed)", registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "pipemlx_time_to_first_token_seconds", "from handing a request out to its first token",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token = Histogram(
            "pipemlx_inter_token_latency_seconds", "between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        _gauge(r, "pipemlx_queue_waiting", "requests waiting in the queue", book.waiting)
        _gauge(r, "pipemlx_requests_running", "requests running on the ranks", book.running_count)
        _gauge(r, "pipemlx_open_streams", "streamed answers open", book.open_streams)
        _gauge(r, "pipemlx_prefix_cache_tokens", "tokens held by the prefix cache", lambda: _prefix_tokens(book))
        _gauge(r, "pipemlx_prefix_cache_budget_tokens", "the prefix cache's bound in tokens", book.prefix_budget_tokens)
        r.register(RankCollector(book, ranks))

    def request_done(self, finish_reason: str, prompt: int, generated: int, cached: int) -> None:
        """Count one ended generation request."""
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)
        self.cached_tokens.inc(cached)
        (self.prefix_hits if cached > 0 else self.prefix_misses).inc()

    def guessed(self, proposed: int, accepted: int) -> None:
        """Count one ended request's speculative guesses: ``proposed`` tokens, ``accepted`` of them confirmed."""
        self.draft_proposed.inc(proposed)
        self.draft_accepted.inc(accepted)

    def text(self) -> bytes:
        """The exposition (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


def _gauge(registry: CollectorRegistry, name: str, doc: str, read: Callable[[], float]) -> None:
    Gauge(name, doc, registry=registry).set_function(read)


def _prefix_tokens(book: Book) -> float:
    slots = book.rank_slots()
    return float(slots[0].get("prefix_tokens", 0)) if slots else 0.0


def endpoint_label(path: str) -> str:
    """A bounded label for a path (unknown paths are ``other``, model ids are not labels)."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in ENDPOINTS else "other"


class StatusCounter:
    """ASGI middleware: count every HTTP answer by endpoint and status (``pipemlx_http_requests``)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(str(scope["path"]))

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)
