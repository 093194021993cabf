"""The dashboard's data: a ring buffer of once-a-second samples of the engine and of recent request latencies."""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional, Sequence

from llmrt.outputs import RequestOutput

PERCENTILES = (50, 90, 99)


@dataclass
class Sample:
    """The server's state at one instant (t: Unix seconds); latencies are percentiles over the sliding window."""

    t: float
    running: int
    waiting: int
    preempted: int
    batch_seqs: int
    batch_tokens: int
    kv_usage: float
    engine_tokens_per_s: float  # tokens the engine computed per second (prompt + output), recent average
    output_tokens_per_s: float  # tokens of requests that finished within the window, per second
    requests_per_s: float
    ttft_p50: Optional[float] = None
    ttft_p90: Optional[float] = None
    ttft_p99: Optional[float] = None
    tpot_p50: Optional[float] = None
    tpot_p90: Optional[float] = None
    tpot_p99: Optional[float] = None
    spec_acceptance: Optional[float] = None  # accepted / proposed speculative tokens since the last sample
    collective_share: Optional[float] = None  # tensor parallel: collective time / step time since the last sample


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Timeline:
    """Samples `engine_stats()` every `interval_s` into a ring of `history_s` seconds; finished requests feed the
    latency percentiles and throughput over the last `window_s` seconds."""

    def __init__(self, engine_stats: Callable[[], Optional[dict[str, Any]]], *, interval_s: float = 1.0,
                 history_s: float = 600.0, window_s: float = 30.0):
        self.engine_stats = engine_stats
        self.interval_s, self.window_s = interval_s, window_s
        self.samples: deque[Sample] = deque(maxlen=max(1, int(history_s / interval_s)))
        self._finished: deque[tuple[float, Optional[float], Optional[float], int]] = deque()  # t, ttft, tpot, tokens
        self._last_steps: Optional[int] = None
        self._last_spec = (0, 0)  # cumulative (proposed, accepted) speculative tokens at the last sample
        self._last_collective = (0.0, 0.0)  # cumulative (collective, step) seconds at the last sample
        self._task: Optional[asyncio.Task] = None
        self._started = time.time()

    def observe_request(self, outputs: Sequence[Optional[RequestOutput]]) -> None:
        """Add the engine requests of one API request that finished without an error."""
        now = time.time()
        for out in outputs:
            if out is None or not out.finished or out.error is not None:
                continue
            m = out.metrics
            self._finished.append((now, m.ttft, m.tpot, sum(len(c.token_ids) for c in out.outputs)))

    def sample(self) -> Sample:
        """Take one sample now and append it to the ring."""
        now = time.time()
        while self._finished and self._finished[0][0] < now - self.window_s:
            self._finished.popleft()
        st = self.engine_stats() or {}
        steps = st.get("num_steps")
        # The engine's rate is an average over its recent steps: with no new step since the last sample it is 0.
        stepped = steps is None or self._last_steps is None or steps != self._last_steps
        self._last_steps = steps
        total = st.get("kv_blocks_total") or 0
        free = st.get("kv_blocks_free", total) or 0
        # Right after start-up the window is only as long as the server has been up.
        window = min(self.window_s, max(self.interval_s, now - self._started))
        ttfts = [x[1] for x in self._finished if x[1] is not None]
        tpots = [x[2] for x in self._finished if x[2] is not None]
        s = Sample(t=now, running=int(st.get("num_running") or 0), waiting=int(st.get("num_waiting") or 0),
                   preempted=int(st.get("num_preempted") or 0), batch_seqs=int(st.get("last_step_seqs") or 0),
                   batch_tokens=int(st.get("last_step_tokens") or 0),
                   kv_usage=(1.0 - free / total) if total else 0.0,
                   engine_tokens_per_s=float(st.get("drain_tokens_per_s") or 0.0) if stepped else 0.0,
                   output_tokens_per_s=sum(x[3] for x in self._finished) / window,
                   requests_per_s=len(self._finished) / window)
        for q in PERCENTILES:
            setattr(s, f"ttft_p{q}", percentile(ttfts, q))
            setattr(s, f"tpot_p{q}", percentile(tpots, q))
        s.spec_acceptance = self._spec_acceptance(st)
        s.collective_share = self._collective_share(st)
        if not stepped:
            s.batch_seqs = s.batch_tokens = 0  # the last step's figures are stale when the engine is idle
        self.samples.append(s)
        return s

    def _collective_share(self, st: dict[str, Any]) -> Optional[float]:
        """Rank 0's share of step time inside collectives since the last sample; None without steps or TP."""
        now = (float(st.get("collective_seconds") or 0.0), float(st.get("collective_step_seconds") or 0.0))
        coll, step = now[0] - self._last_collective[0], now[1] - self._last_collective[1]
        self._last_collective = now
        return coll / step if step > 0 else None

    def _spec_acceptance(self, st: dict[str, Any]) -> Optional[float]:
        """The share of speculative proposals accepted since the last sample; None when none were verified."""
        spec = (sum(st.get("spec_proposed_by_position") or ()), sum(st.get("spec_accepted_by_position") or ()))
        proposed, accepted = spec[0] - self._last_spec[0], spec[1] - self._last_spec[1]
        self._last_spec = spec
        return accepted / proposed if proposed > 0 else None

    def columns(self) -> dict[str, Any]:
        """The ring as columns (one list per Sample field), the shape the dashboard's charts take."""
        names = [f.name for f in fields(Sample)]
        rows = [asdict(s) for s in self.samples]
        return {"interval_s": self.interval_s, "window_s": self.window_s,
                "series": {n: [r[n] for r in rows] for n in names}}

    def start(self) -> None:
        """Sample every interval_s in a task of the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)
