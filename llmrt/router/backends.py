"""The instances behind a router: their state, active health checks (/health, /load) and passive ejection."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

import aiohttp

logger = logging.getLogger("llmrt.router")


@dataclass
class HealthConfig:
    """How instances are watched: poll interval, ejection threshold and cool-down."""

    interval_s: float = 1.0  # active checks of /health and /load
    timeout_s: float = 2.0
    eject_after: int = 3  # consecutive connect errors / retryable 5xx that eject an instance
    cooldown_s: float = 5.0  # an ejected instance waits this long, then must pass an active check to come back


@dataclass
class Backend:
    """One `llmrt serve` instance and what the router knows about it."""

    url: str
    name: str = ""
    version: str = ""  # its model version (from /load or /version)
    models: list[dict] = field(default_factory=list)  # its /v1/models cards
    healthy: bool = False  # the latest active check passed
    draining: bool = False
    ejected_until: float = 0.0  # monotonic time; > now while ejected
    ejected: bool = False  # ejected and not yet re-admitted by a passing check
    busy_until: float = 0.0  # after a 429: avoid until Retry-After has passed
    consecutive_failures: int = 0
    in_flight: int = 0  # the router's own requests on it now
    in_flight_tokens: int = 0  # their estimated tokens (prompt + max_tokens)
    polled_queued_tokens: int = 0  # /load queued_prompt_tokens at the last poll
    polled_running: int = 0
    kv_usage: float = 0.0
    ejections: int = 0

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.name:
            parts = urlsplit(self.url)
            self.name = parts.netloc or self.url

    def available(self, now: float) -> bool:
        """Healthy, not draining, not ejected: may take new requests."""
        return self.healthy and not self.draining and not self.ejected

    def outstanding_tokens(self) -> int:
        """Least-load's score: tokens queued at the last poll plus the router's own in-flight tokens."""
        return self.polled_queued_tokens + self.in_flight_tokens

    def snapshot(self) -> dict:
        """The state shown by GET /admin/backends."""
        now = time.monotonic()
        return {"name": self.name, "url": self.url, "version": self.version, "healthy": self.healthy,
                "draining": self.draining, "ejected": self.ejected, "available": self.available(now),
                "in_flight": self.in_flight, "outstanding_tokens": self.outstanding_tokens(),
                "kv_usage": self.kv_usage, "consecutive_failures": self.consecutive_failures,
                "ejections": self.ejections}


class BackendPool:
    """The set of backends (changed at run time by the admin routes) and their health watcher."""

    def __init__(self, urls: list[str], config: HealthConfig, api_key: Optional[str] = None,
                 on_eject: Optional[Callable[[Backend, str], None]] = None):
        self.backends: list[Backend] = [Backend(u) for u in urls]
        self.config = config
        # the relay's pooled session (proxy.upstream_session), set once the event loop runs: one HTTP client
        self.client: Optional[aiohttp.ClientSession] = None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.on_eject = on_eject
        self._task: Optional[asyncio.Task] = None

    # -- membership ------------------------------------------------------------------------------------
    def add(self, url: str) -> Backend:
        """Add (or return) the backend at url; it takes traffic once an active check passes."""
        url = url.rstrip("/")
        for b in self.backends:
            if b.url == url:
                return b
        b = Backend(url)
        self.backends.append(b)
        return b

    def remove(self, url: str) -> bool:
        """Forget the backend at url; in-flight requests on it finish."""
        before = len(self.backends)
        self.backends = [b for b in self.backends if b.url != url.rstrip("/")]
        return len(self.backends) < before

    def available(self) -> list[Backend]:
        """The backends that may take new requests now."""
        now = time.monotonic()
        return [b for b in self.backends if b.available(now)]

    # -- passive checks --------------------------------------------------------------------------------
    def record_success(self, b: Backend) -> None:
        """A response that was not a connect error or a retryable 5xx."""
        b.consecutive_failures = 0

    def record_failure(self, b: Backend, reason: str) -> None:
        """A connect error or retryable 5xx; eject after `eject_after` in a row."""
        b.consecutive_failures += 1
        if b.consecutive_failures >= self.config.eject_after and not b.ejected:
            self.eject(b, reason)

    def eject(self, b: Backend, reason: str) -> None:
        """Stop routing to b until the cool-down passes and an active check succeeds."""
        b.ejected, b.ejected_until, b.healthy = True, time.monotonic() + self.config.cooldown_s, False
        b.ejections += 1
        logger.warning("ejected backend %s (%s) for at least %.1f s", b.name, reason, self.config.cooldown_s)
        if self.on_eject is not None:
            self.on_eject(b, reason)

    # -- active checks ---------------------------------------------------------------------------------
    async def check(self, b: Backend) -> None:
        """Poll /health and /load (and /v1/models once); re-admit an ejected backend after its cool-down."""
        if b.ejected and time.monotonic() < b.ejected_until:
            return
        assert self.client is not None, "BackendPool.client is set in the app's lifespan"
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        try:
            async with self.client.get(f"{b.url}/health", timeout=timeout) as r:
                health_ok = r.status == 200
            async with self.client.get(f"{b.url}/load", headers=self.headers, timeout=timeout) as r:
                load_ok = r.status == 200
                figures = await r.json(content_type=None) if load_ok else {}
            if not b.models or not b.version:
                async with self.client.get(f"{b.url}/v1/models", headers=self.headers, timeout=timeout) as r:
                    if r.status == 200:
                        b.models = list((await r.json(content_type=None)).get("data") or [])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            if b.healthy:
                logger.info("backend %s failed its check: %s", b.name, type(e).__name__)
            b.healthy = False
            if not b.ejected:
                self.record_failure(b, f"health check: {type(e).__name__}")
            else:
                b.ejected_until = time.monotonic() + self.config.cooldown_s
            return
        ok = health_ok and load_ok and isinstance(figures, dict)
        if ok:
            b.version = str(figures.get("model_version") or b.version)
            b.draining = bool(figures.get("draining"))
            b.polled_queued_tokens = int(figures.get("queued_prompt_tokens") or 0)
            b.polled_running = int(figures.get("running") or 0)
            b.kv_usage = float(figures.get("kv_usage") or 0.0)
            if b.ejected:
                logger.warning("re-admitted backend %s after its cool-down", b.name)
            b.ejected, b.consecutive_failures = False, 0
        b.healthy = ok

    async def check_all(self) -> None:
        """One round of active checks, concurrently."""
        await asyncio.gather(*(self.check(b) for b in list(self.backends)))

    def start(self) -> None:
        """Check every `interval_s` in the background until stop()."""
        async def loop() -> None:
            while True:
                try:
                    await self.check_all()
                except Exception:  # noqa: BLE001 - the watcher must survive any one bad answer
                    logger.exception("health check round failed")
                await asyncio.sleep(self.config.interval_s)
        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        """Stop the background checks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

