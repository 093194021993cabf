"""The per-request timing object (`llmrt` in responses and the access log) from the engine's RequestMetrics."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from llmrt.outputs import RequestOutput


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 6)


def request_timing(outputs: Sequence[Optional[RequestOutput]]) -> Optional[dict[str, Any]]:
    """queue_time, ttft, tpot, e2e (seconds), cached prompt tokens, preemptions and speculative proposals
    verified / accepted of one API request.

    An API request with several prompts (one engine request each) reports the earliest queue time and first
    token, the latest end, the mean TPOT, and summed counts. None when no prompt has an output yet.
    """
    metrics = [o.metrics for o in outputs if o is not None]
    if not metrics:
        return None
    queue = [m.queue_time for m in metrics if m.queue_time is not None]
    ttft = [m.ttft for m in metrics if m.ttft is not None]
    tpot = [m.tpot for m in metrics if m.tpot is not None]
    e2e = [m.e2e for m in metrics if m.e2e is not None]
    return {
        "queue_time": _round(min(queue)) if queue else None,
        "ttft": _round(min(ttft)) if ttft else None,
        "tpot": _round(sum(tpot) / len(tpot)) if tpot else None,
        "e2e": _round(max(e2e)) if e2e else None,
        "cached_tokens": sum(m.num_cached_tokens for m in metrics),
        "preemptions": sum(m.num_preemptions for m in metrics),
        "spec_proposed": sum(m.spec_proposed for m in metrics),
        "spec_accepted": sum(m.spec_accepted for m in metrics),
    }
