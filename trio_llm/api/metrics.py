"""``GET /metrics`` in the Prometheus text format (prometheus-client).

Three sources: `HTTPRequestCounter` counts HTTP requests by endpoint and status class as
they are answered; `EngineCollector` reads scheduler gauges from the engine client's last step
statistics at scrape time; `RequestMetrics` receives per-request timing from the engine
client as outputs arrive (see `trio_llm.frontend.engine_client.RequestObserver`) and keeps
counters and histograms. Names follow vLLM's with a ``trio_llm:`` prefix; every series has
a ``model_name`` label, and every engine series an ``engine`` label (the engine's rank
under ``--data-parallel-size``; ``0`` with one engine). All intervals are measured within
one process from monotonic clocks: TTFT, inter-token and end-to-end latency in the API
server (from when the request was submitted to the engine), queue time in the engine
(arrival to first scheduling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trio_llm.api.http.routes import route_path
from trio_llm.api.model_router import ModelRouter, routed_model_name
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.request_timing import RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Scheduler and step statistics of each engine of each loaded model (the
    ``model_name`` label is the model's first name, the ``engine`` label its rank).

    Args:
        engines: the loaded models' engine handles, by name, at scrape time
            (`trio_llm.api.model_router.ModelRouter.engines`).
    """

    def __init__(self, engines: Callable[[], list[tuple[str, EngineHandle]]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for model_name, handle in self.engines():
            for rank, engine in enumerate(handle.engines):
                for kind, name, doc, read in ENGINE_SERIES:
                    family = families.get(name)
                    if family is None:
                        make = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                        family = families[name] = make(
                            f"trio_llm:{name}", doc, labels=["model_name", "engine"]
                        )
                    family.add_metric([model_name, str(rank)], read(engine))
        yield from families.values()


def _last_step(name: str) -> Callable[[EngineClient], float]:
    """The engine's value ``name`` in its last step's statistics (0 before any step)."""

    def value(engine: EngineClient) -> float:
        last = engine.stats.last
        return getattr(last, name) if last is not None else 0

    return value


def _kv_cache_usage(engine: EngineClient) -> float:
    """The fraction of KV blocks in use (0 for an embedding model, which has no cache)."""
    num_blocks = engine.info.num_kv_blocks
    last = engine.stats.last
    free = last.num_free_blocks if last is not None else num_blocks
    return 1 - free / num_blocks if num_blocks else 0.0


#: The counters of the prefix cache's tier on disk (``--prefix-cache-dir``), each
#: ``trio_llm:prefix_cache_disk_<name>``: ``(name, help)``.
_DISK_SERIES = (
    ("hits", "Blocks read back from the prefix cache's tier on disk."),
    ("misses", "Blocks looked for on disk and not found there."),
    ("bytes_read", "Bytes of block files read back from disk."),
    ("bytes_written", "Bytes of block files written to disk."),
    ("evicted", "Block files removed to keep --prefix-cache-disk-bytes."),
    ("refused", "Block files that were not the block they should be (removed, recomputed)."),
    ("dropped", "Blocks not written: the writer's queue was full, or the disk refused."),
)

#: Each engine's series: ``(kind, name, help, value of an engine client)``.
ENGINE_SERIES: tuple[tuple[str, str, str, Callable[[EngineClient], float]], ...] = (
    ("gauge", "num_requests_running", "Requests in the running batch.", _last_step("num_running")),
    (
        "gauge",
        "num_requests_waiting",
        "Requests waiting to be scheduled.",
        _last_step("num_waiting"),
    ),
    (
        "gauge",
        "num_requests_paused",
        "Requests paused in the engine because their client is not reading.",
        _last_step("num_paused"),
    ),
    (
        "counter",
        "request_pauses",
        "Times a request was paused because its client left output unread.",
        lambda engine: engine.num_pauses,
    ),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", _kv_cache_usage),
    (
        "counter",
        "num_preemptions",
        "Requests preempted (no KV blocks, a fair share of the batch, a better-ranked request).",
        lambda engine: engine.stats.num_preemptions,
    ),
    (
        "counter",
        "engine_steps",
        "Engine steps that computed tokens.",
        lambda engine: engine.stats.num_steps,
    ),
    (
        "counter",
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (--enable-prefix-caching).",
        _last_step("prefix_cache_queries"),
    ),
    (
        "counter",
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache, whose KV was not recomputed.",
        _last_step("prefix_cache_hits"),
    ),
    (
        "counter",
        "engine_restarts",
        "Engine core children started to replace a failed one (--engine-restart).",
        lambda engine: engine.num_restarts,
    ),
    (
        "counter",
        "engine_hangs",
        "Times the engine core was found hung (--engine-step-timeout).",
        lambda engine: engine.num_hangs,
    ),
    (
        "gauge",
        "engine_healthy",
        "1 while an engine core child is serving, else 0.",
        lambda engine: float(engine.is_alive),
    ),
    (
        "counter",
        "engine_steps_multi_request",
        "Engine steps that computed tokens for more than one request.",
        lambda engine: engine.stats.num_multi_request_steps,
    ),
    *(
        ("counter", f"prefix_cache_disk_{name}", doc, _last_step(f"disk_{name}"))
        for name, doc in _DISK_SERIES
    ),
)


#: Histogram buckets in seconds: from a fast decode step up to minutes-long requests.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip


class RequestMetrics:
    """Per-request counters and histograms, labelled by model and engine; `observer`
    gives each engine client its `RequestObserver`.

    Args:
        registry: where the metrics are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "engine"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"trio_llm:{name}", doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                f"trio_llm:{name}", doc, labels, registry=registry, buckets=LATENCY_BUCKETS
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of scheduled requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter(
            "request_success", "Requests that finished, by finished_reason.", ("finished_reason",)
        )
        self.aborted = counter(
            "request_aborted",
            "Requests that ended before finishing (client gone, error, shutdown).",
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (s).")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens (s).")
        self.e2e = histogram("e2e_request_latency_seconds", "Submission to finish (s).")
        self.queue = histogram(
            "request_queue_time_seconds", "Engine arrival to first scheduling (s)."
        )

    def observer(self, model_name: str, rank: int) -> EngineRequestMetrics:
        """The observer of engine ``rank`` of model ``model_name`` (its series carry
        ``model_name="<model_name>", engine="<rank>"``)."""
        return EngineRequestMetrics(self, model_name, str(rank))


class EngineRequestMetrics:
    """One engine's `RequestObserver`: label children resolved once, so the per-token
    path only observes."""

    def __init__(self, metrics: RequestMetrics, model_name: str, engine: str) -> None:
        labels = (model_name, engine)
        self._success_by_reason = {
            reason: metrics.success.labels(*labels, reason) for reason in ("stop", "length")
        }
        self._prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self._generation_tokens = metrics.generation_tokens.labels(*labels)
        self._aborted = metrics.aborted.labels(*labels)
        self._ttft = metrics.ttft.labels(*labels)
        self._itl = metrics.itl.labels(*labels)
        self._e2e = metrics.e2e.labels(*labels)
        self._queue = metrics.queue.labels(*labels)

    def on_first_token(self, record: RequestRecord) -> None:
        """Observe the time to first token and count the token."""
        if record.first_token_seconds is not None:
            self._ttft.observe(record.first_token_seconds)
        self._generation_tokens.inc()

    def on_tokens(self, interval: float, count: int) -> None:
        """Observe ``count`` inter-token intervals of ``interval / count`` seconds."""
        for _ in range(count):
            self._itl.observe(interval / count)
        self._generation_tokens.inc(count)

    def on_finished(self, record: RequestRecord) -> None:
        """Count the request by how it ended; observe its latency and queue time."""
        if record.queue_seconds is not None:
            self._queue.observe(record.queue_seconds)
            self._prompt_tokens.inc(record.num_prompt_tokens)
        success = self._success_by_reason.get(record.finish_reason or "")
        if success is not None:
            success.inc()
            self._e2e.observe(record.e2e_seconds)
        else:
            self._aborted.inc()


class HTTPRequestCounter:
    """ASGI middleware: ``trio_llm:http_requests_total{endpoint, status}`` counts each
    answered HTTP request by route and status class (``2xx``, ``4xx``, ...), as vLLM's
    ``http_requests_total`` does; a request whose client left before an answer is counted
    as ``499``'s class, ``4xx``. The ``endpoint`` is a path of `trio_llm.api.http.routes.ROUTES`
    (a path with parameters by its template, ``/v1/responses/{response_id}``;
    ``/v1/models/<name>`` counts as ``/v1/models``); any other path is ``other``, so
    clients cannot grow the number of series.

    Args:
        app: the ASGI app (outermost, so refusals by the other middleware count too).
        registry: where the counter is registered.
        model_name: value of the ``model_name`` label of a request no model answered
            (the default model's first name); one that a model answered carries that
            model's (`trio_llm.api.model_router.routed_model_name`).
    """

    def __init__(self, app: ASGIApp, registry: CollectorRegistry, model_name: str) -> None:
        self.app = app
        self.model_name = model_name
        self.counter = Counter(
            "trio_llm:http_requests",
            "HTTP requests answered, by endpoint and status class.",
            ["model_name", "endpoint", "status"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on and count its answer."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 499

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope["path"]
            endpoint = route_path(path) or "other"
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models"
            model = routed_model_name(scope) or self.model_name
            self.counter.labels(model, endpoint, f"{status // 100}xx").inc()


def make_registry(router: ModelRouter) -> CollectorRegistry:
    """A registry holding only this server's metrics; also attaches `RequestMetrics`.

    Each engine client of each model loaded now or later reports each request's timing
    to the registry's `RequestMetrics` from then on (its ``observer``).
    """
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(router.engines))
    metrics = RequestMetrics(registry)

    def attach(model_name: str, engine: EngineHandle) -> None:
        for rank, client in enumerate(engine.engines):
            client.observer = metrics.observer(model_name, rank)

    router.on_loaded(attach)
    return registry


def render(registry: CollectorRegistry, *, vllm_names: bool = False) -> bytes:
    """The registry in the Prometheus text exposition format; with ``vllm_names``, every
    family a second time under vLLM's ``vllm:`` prefix (same values, same labels)."""
    text = generate_latest(registry)
    if vllm_names:
        text += text.replace(b"trio_llm:", b"vllm:")
    return text
