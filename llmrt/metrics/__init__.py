"""Observability: Prometheus collectors, per-request timings, resource sampling and the dashboard timeline."""
from llmrt.metrics.prometheus import ServerMetrics
from llmrt.metrics.timeline import Timeline
from llmrt.metrics.timing import request_timing

__all__ = ["ServerMetrics", "Timeline", "request_timing"]
