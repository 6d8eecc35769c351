"""``GET /metrics`` in the Prometheus text format (prometheus-client).

Values are read from the engine client at scrape time, so the request path pays nothing.
Names follow vLLM's metrics with a ``trio_llm:`` prefix where vLLM has one.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trio_llm.frontend.engine_client import EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Scheduler and step statistics of one engine."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        last = stats.last
        num_blocks = self.engine.info.num_kv_blocks
        free = last.num_free_blocks if last is not None else num_blocks

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"trio_llm:{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"trio_llm:{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            return family

        running = last.num_running if last else 0
        waiting = last.num_waiting if last else 0
        yield gauge("num_requests_running", "Requests in the running batch.", running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", 1 - free / num_blocks
        )
        yield counter(
            "num_preemptions", "Requests preempted (no KV blocks).", stats.num_preemptions
        )
        yield counter("engine_steps", "Engine steps that computed tokens.", stats.num_steps)
        yield counter(
            "engine_steps_multi_request",
            "Engine steps that computed tokens for more than one request.",
            stats.num_multi_request_steps,
        )


def make_registry(engine: EngineClient, model_name: str) -> CollectorRegistry:
    """A registry holding only this server's metrics."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format."""
    return generate_latest(registry)
