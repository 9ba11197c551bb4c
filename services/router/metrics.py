"""The router's Prometheus metrics, under the names of services.contracts.metric_names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.contracts import metric_names as M


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # per app: tests and `serve` run several apps in one process
        r = self.registry
        self.requests = Counter(M.ROUTER_REQUESTS, "requests answered, by HTTP status", ["status"], registry=r)
        self.upstream_errors = Counter(M.ROUTER_UPSTREAM_ERRORS, "failed attempts to reach a replica",
                                       registry=r)
        self.retries = Counter(M.ROUTER_RETRIES, "requests re-sent to another replica", registry=r)
        self.queue_depth = Gauge(M.ROUTER_QUEUE_DEPTH, "requests waiting for a replica with room", registry=r)
        self.model_queue_depth = Gauge(M.ROUTER_MODEL_QUEUE_DEPTH, "requests waiting for a replica with room, "
                                       "by base model (what scales that model's replicas)", ["model"], registry=r)
        self.held = Gauge(M.ROUTER_REQUESTS_HELD, "requests held while no replica is ready (scale from zero)",
                          registry=r)
        self.prefix_match = Histogram(M.ROUTER_PREFIX_MATCH_RATIO, "share of the prompt cached on the chosen "
                                      "replica", buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0), registry=r)
        self.healthy_replicas = Gauge(M.ROUTER_HEALTHY_REPLICAS, "replicas routable now", registry=r)
        self.decisions = Counter(M.ROUTER_ROUTING_DECISIONS, "routing decisions by policy and replica",
                                 ["policy", "replica"], registry=r)
        self.index_fallbacks = Counter(M.ROUTER_INDEX_FALLBACKS, "prefix index reads not made (Redis "
                                       "unreachable, no connection free, or skipped while it is down): those "
                                       "decisions went on load only",
                                       registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
