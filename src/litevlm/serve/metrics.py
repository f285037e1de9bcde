"""Server metrics through prometheus_client, one registry per app (two servers in a process never share counts)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Stage histograms shown even before the first request; any other stage the pipeline reports is added.
STAGE_METRICS = ("select_views", "vit", "select_tokens", "prefill", "decode", "total")
# Seconds; a tiny model on a GPU answers in about a millisecond, a 2B model on a CPU in tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Request counters and latency histograms; updated from the event loop and the model thread
    (prometheus_client's metrics are thread-safe)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, in_flight: Callable[[], float], queue_capacity: int):
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
        Gauge("litevlm_in_flight_requests", "Admitted chat requests not yet finished.", registry=r).set_function(
            in_flight
        )
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

    def observe_answer(self, timings_ms: dict[str, float], prompt_tokens: int, completion_tokens: int) -> None:
        for stage, ms in timings_ms.items():
            self.stages.labels(stage).observe(ms / 1000.0)
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
