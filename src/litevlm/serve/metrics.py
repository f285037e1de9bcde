"""Server metrics through prometheus_client, one registry per app (two servers in a process never share counts)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Stage histograms shown even before the first request; any other stage the pipeline reports is added. "total" is
# the five stages' sum, "e2e" the answer's whole time from the images as given (decoding included) to the last token.
STAGE_METRICS = ("select_views", "vit", "select_tokens", "prefill", "decode", "total", "e2e")
# Seconds; a tiny model on a GPU answers in about a millisecond, a 2B model on a CPU in tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Request counters and latency histograms; updated from the event loop and the model thread
    (prometheus_client's metrics are thread-safe)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        in_flight: Callable[[], float],
        queue_capacity: int,
        view_cache: Callable[[], object] | None = None,
        batch: Callable[[], float] | None = None,
        waiting: Callable[[], float] | None = None,
    ):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "litevlm_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter("litevlm_errors", "Refused or failed chat requests, by error code.", ["code"], registry=r)
        self.cancelled = Counter(
            "litevlm_cancelled_requests",
            "Chat requests dropped unfinished: the client disconnected or the deadline passed.",
            ["reason", "where"],
            registry=r,
        )
        self.stages = Histogram(
            "litevlm_stage_latency_seconds",
            "Pipeline stage wall time per answered request.",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for stage in STAGE_METRICS:
            self.stages.labels(stage)
        self.queue_wait = Histogram(
            "litevlm_queue_wait_seconds",
            "Time from arrival until the model starts on a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "litevlm_request_latency_seconds",
            "Chat request time from arrival to a finished answer.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "litevlm_time_to_first_token_seconds",
            "Time from a chat request's arrival until its first answer text is made.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("litevlm_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.completion_tokens = Counter("litevlm_completion_tokens", "Tokens generated.", registry=r)
        self.views_encoded = Counter(
            "litevlm_views_encoded", "Camera views decoded and encoded (not served from the view cache).", registry=r
        )
        if view_cache is not None:
            r.register(ViewCacheCollector(view_cache))
        Gauge("litevlm_in_flight_requests", "Admitted chat requests not yet finished.", registry=r).set_function(
            in_flight
        )
        if batch is not None:
            Gauge(
                "litevlm_batch_occupancy", "Answers decoding together in the running batch.", registry=r
            ).set_function(batch)
        if waiting is not None:
            Gauge(
                "litevlm_queue_waiting", "Admitted requests waiting to join the running batch.", registry=r
            ).set_function(waiting)
        Gauge("litevlm_queue_capacity", "Requests that may wait besides the one being answered.", registry=r).set(
            queue_capacity
        )

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def count_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def count_cancelled(self, reason: str, where: str) -> None:
        """reason: 'disconnected' or 'deadline'; where: 'queued' (never started) or 'running'."""
        self.cancelled.labels(reason, where).inc()

    def observe_answer(
        self, timings_ms: dict[str, float], prompt_tokens: int, completion_tokens: int, cache: dict | None = None
    ) -> None:
        """One answer's stage times and token counts; `cache` is its `Answer.cache` (views encoded, cache hits)."""
        for stage, ms in timings_ms.items():
            self.stages.labels(stage).observe(ms / 1000.0)
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if cache:
            self.views_encoded.inc(cache.get("encoded", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ViewCacheCollector(Collector):
    """The pipeline's view cache (`litevlm.frame.ViewCache.stats()`), read when /metrics is rendered: whatever cache
    the pipeline holds then (None, the cache turned off: zeros). Its counters restart with a new cache, which
    Prometheus takes as a counter reset."""

    def __init__(self, view_cache: Callable[[], object]):
        self.view_cache = view_cache

    def collect(self):
        cache = self.view_cache()
        stats = cache.stats() if cache is not None else {}
        for name, doc in (
            ("hits", "Camera views served from the view cache."),
            ("misses", "Camera views looked up in the view cache and not found."),
            ("evictions", "Encoded views dropped from the view cache, least recently used first, to stay in bounds."),
        ):
            yield CounterMetricFamily(f"litevlm_view_cache_{name}", doc, value=stats.get(name, 0))
        for name, doc in (
            ("bytes", "Bytes of encoded views the view cache holds."),
            ("max_bytes", "The view cache's bound in bytes (0: no cache)."),
            ("entries", "Encoded views the view cache holds."),
        ):
            yield GaugeMetricFamily(f"litevlm_view_cache_{name}", doc, value=stats.get(name, 0))
