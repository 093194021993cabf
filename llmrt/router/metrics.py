"""The router's Prometheus metrics (llmrt_router_*): requests, latency and errors per backend, retries,
ejections, routing decisions by policy, the prefix-affinity hit rate and the router's own added latency."""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    """One registry per router, so that tests and several routers in a process do not collide."""

    def __init__(self, snapshot: Optional[Callable[[], list[dict]]] = None):
        """`snapshot` lists the backends' states (for the per-backend gauges), read at each scrape."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmrt_router_requests", "Upstream attempts by backend and HTTP status",
                                ["backend", "status"], registry=r)
        self.latency = Histogram("llmrt_router_request_duration_seconds",
                                 "Seconds from the router's first attempt to the end of the response, by backend",
                                 ["backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("llmrt_router_errors", "Failed attempts by backend and kind (connect, status, "
                              "draining, stream_broken, timeout, protocol)", ["backend", "kind"], registry=r)
        self.retries = Counter("llmrt_router_retries", "Attempts tried again on another instance, by reason",
                               ["reason"], registry=r)
        self.budget_exhausted = Counter("llmrt_router_retry_budget_exhausted",
                                        "Retries refused because the retry budget was spent", registry=r)
        self.ejections = Counter("llmrt_router_ejections", "Backends ejected after consecutive failures",
                                 ["backend"], registry=r)
        self.decisions = Counter("llmrt_router_routing_decisions", "Requests routed, by policy and backend",
                                 ["policy", "backend"], registry=r)
        self.affinity = Counter("llmrt_router_affinity", "Affinity decisions (prefix-affinity, session): hit = "
                                "the key's home instance took it, miss = it spilled over", ["policy", "result"],
                                registry=r)
        self.overhead = Histogram("llmrt_router_overhead_seconds", "The router's own time per request: parsing, "
                                  "choosing and rewriting, without the backend's", buckets=_OVERHEAD_BUCKETS,
                                  registry=r)
        self.client_errors = Counter("llmrt_router_responses_failed", "Responses the router itself failed (no "
                                     "instance, retries spent, broken streams), by code", ["code"], registry=r)
        if snapshot is not None:
            available = Gauge("llmrt_router_backend_available", "1 while a backend takes new requests",
                              ["backend", "version"], registry=r)
            in_flight = Gauge("llmrt_router_backend_in_flight", "The router's requests on a backend now",
                              ["backend"], registry=r)
            self._gauges = (available, in_flight, snapshot)

    def affinity_hit_rate(self, policy: str) -> Optional[float]:
        """Hits over affinity decisions so far (None before any)."""
        hit = self.affinity.labels(policy, "hit")._value.get()
        miss = self.affinity.labels(policy, "miss")._value.get()
        return hit / (hit + miss) if hit + miss else None

    def render(self) -> bytes:
        """The text exposition format, with the backend gauges refreshed."""
        gauges = getattr(self, "_gauges", None)
        if gauges is not None:
            available, in_flight, snapshot = gauges
            available.clear()
            in_flight.clear()
            for b in snapshot():
                available.labels(b["name"], b["version"]).set(1.0 if b["available"] else 0.0)
                in_flight.labels(b["name"]).set(b["in_flight"])
        return generate_latest(self.registry)
