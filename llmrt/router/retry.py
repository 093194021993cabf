"""When a failed attempt is tried again elsewhere, and how many retries the router may spend."""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# Statuses that say "this instance cannot take it now"; 4xx (408 included) and 500 are the request's own outcome.
_RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


def retryable_response(status: int, body: Any) -> bool:
    """Whether an error response may be retried on another instance: 429 and 503-like statuses, unless an llmrt
    body says `retryable: false`."""
    if status not in _RETRYABLE_STATUS:
        return False
    if isinstance(body, dict) and body.get("retryable") is False:
        return False
    return True


def retry_after_s(headers: Any) -> Optional[float]:
    """The Retry-After header in seconds (the delta form), if any."""
    value = headers.get("retry-after") if headers is not None else None
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


@dataclass
class RetryBudget:
    """Retries may be at most `ratio` of the requests of the last `window_s` seconds, plus `min_retries`, so that
    retries cannot multiply an outage's load."""

    ratio: float = 0.2
    min_retries: int = 10
    window_s: float = 10.0
    _requests: collections.deque = field(default_factory=collections.deque)
    _retries: collections.deque = field(default_factory=collections.deque)
    exhausted: int = 0

    def _trim(self, now: float) -> None:
        for q in (self._requests, self._retries):
            while q and q[0] < now - self.window_s:
                q.popleft()

    def record_request(self) -> None:
        """Count a client request."""
        self._requests.append(time.monotonic())

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and counted) when it is spent."""
        now = time.monotonic()
        self._trim(now)
        if len(self._retries) >= self.min_retries + self.ratio * len(self._requests):
            self.exhausted += 1
            return False
        self._retries.append(now)
        return True
