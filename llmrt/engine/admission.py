"""Admission control: a bounded waiting queue and a queue-delay limit, with Retry-After from the drain rate."""
from __future__ import annotations

from typing import Optional

from llmrt.engine.messages import EngineStats
from llmrt.errors import CapacityExceededError, DrainingError


class AdmissionController:
    """Refuses new requests at once (429) when the queue is full or would make them wait too long.

    The waiting count is exact: the core's latest stats count every request it has acknowledged, and the
    requests sent since but not yet acknowledged are counted here, whatever step they arrive in.
    """

    def __init__(self, max_waiting_requests: Optional[int], max_queue_delay_ms: Optional[float]):
        self.max_waiting_requests = max_waiting_requests
        self.max_queue_delay_ms = max_queue_delay_ms
        self.drain_tokens_per_s = 0.0  # exponential moving average of tokens the engine computes per second
        self._unacknowledged: dict[str, int] = {}  # request id -> prompt tokens, sent but not yet taken in
        self._last_core_time: Optional[float] = None
        self._last_num_steps = 0
        self.draining = False  # set by POST /admin/drain: refuse every new request, finish the admitted ones

    @property
    def num_unacknowledged(self) -> int:
        """Requests sent to the core that it has not yet taken in."""
        return len(self._unacknowledged)

    def admit(self, stats: Optional[EngineStats], prompt_tokens: int) -> None:
        """Raise CapacityExceededError if a request of `prompt_tokens` must not join the queue now (DrainingError
        while draining)."""
        if self.draining:
            raise DrainingError("this instance is draining: it finishes its admitted requests and takes no new "
                                "ones; retry on another instance")
        waiting = (stats.num_waiting if stats else 0) + len(self._unacknowledged)
        queued_tokens = (stats.waiting_tokens if stats else 0) + sum(self._unacknowledged.values()) + prompt_tokens
        delay = queued_tokens / self.drain_tokens_per_s if self.drain_tokens_per_s > 0 else None
        retry_after = max(1.0, delay or 1.0)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise CapacityExceededError(
                f"the server is at capacity: {waiting} requests are waiting (limit {self.max_waiting_requests}); "
                f"retry after about {retry_after:.0f} s", retry_after=retry_after)
        if self.max_queue_delay_ms is not None and delay is not None and delay * 1000 > self.max_queue_delay_ms:
            raise CapacityExceededError(
                f"the server is at capacity: the queue would delay this request about {delay * 1000:.0f} ms "
                f"(limit {self.max_queue_delay_ms:.0f} ms); retry after about {retry_after:.0f} s",
                retry_after=retry_after)

    def submitted(self, request_id: str, prompt_tokens: int) -> None:
        """Count a request sent to the engine core until the core acknowledges it."""
        self._unacknowledged[request_id] = prompt_tokens

    def acknowledged(self, request_ids: list[str]) -> None:
        """The core took these in (queued or refused): from now on its stats count them."""
        for request_id in request_ids:
            self._unacknowledged.pop(request_id, None)

    def observe_step(self, stats: EngineStats, core_time: float) -> None:
        """Fold one step's figures into the drain rate."""
        if stats.num_steps == self._last_num_steps:
            return  # a message without a new step (an abort, say)
        self._last_num_steps = stats.num_steps
        if self._last_core_time is not None and stats.last_step_tokens:
            dt = core_time - self._last_core_time
            if 0 < dt < 10:
                rate = stats.last_step_tokens / dt
                self.drain_tokens_per_s = rate if self.drain_tokens_per_s == 0 else 0.8 * self.drain_tokens_per_s + 0.2 * rate
        self._last_core_time = core_time
