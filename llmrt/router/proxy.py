"""The relay: send a request to a chosen instance, retry elsewhere when that is safe, stream SSE as it arrives.

Safe to retry (on another instance, within the retry budget): a connection that failed or broke before any
response byte, 429, and 503-like answers an llmrt body does not mark `retryable: false`. Never: 4xx (408
included), 500, and a stream that already sent an event (its client gets one clean error event instead).

The upstream client is aiohttp (C-accelerated HTTP parsing): it costs about a third of httpx's client CPU per
request, and the router's whole CPU per request fell by half (benchmarks/README.md, "The hop"); on a busy
machine the router's CPU per request is its added latency.
"""
from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmrt.errors import EngineDeadError, LLMRTError, ModelNotFoundError, UnavailableError, UpstreamTimeoutError
from llmrt.router.backends import Backend, BackendPool
from llmrt.router.metrics import RouterMetrics
from llmrt.router.policies import Choice, RouteInfo
from llmrt.router.prompts import ParsedRequest, PrefixConfig, parse_body
from llmrt.router.retry import RetryBudget, retry_after_s, retryable_response
from llmrt.router.versions import VERSION_HEADER, VersionRules
from llmrt.server.errors import error_response, sse_error_event

logger = logging.getLogger("llmrt.router")

INSTANCE_HEADER = "x-llmrt-instance"
# Failures before a response: the request may or may not have reached the engine, but inference has no side
# effects, so another instance may take it. A read timeout is the request being slow, not the instance down: it
# is never retried and never counts toward ejection. aiohttp's read timeout subclasses its connection error, so
# every site catches `_READ_TIMEOUT` before `_RETRYABLE_EXC`.
_READ_TIMEOUT = aiohttp.SocketTimeoutError
_RETRYABLE_EXC = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length", "authorization",
                         "content-encoding", "x-request-id"})
_REWRITE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def upstream_session(timeout_s: float) -> aiohttp.ClientSession:
    """The pooled relay client: keep-alive connections to every instance, TCP_NODELAY (aiohttp's default), no
    total deadline (a stream may run long), `timeout_s` between reads, 5 s to connect."""
    connector = aiohttp.TCPConnector(limit=1000, limit_per_host=0, keepalive_timeout=30.0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(5.0, timeout_s), sock_read=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar())


@dataclass
class Router:
    """What the proxy routes share: backends, policy, versions, retries, metrics and the pooled client."""

    pool: BackendPool
    policy: Any
    versions: VersionRules
    budget: RetryBudget
    metrics: RouterMetrics
    client: Optional[aiohttp.ClientSession] = None  # made in the app's lifespan (it needs the running loop)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    max_retries: int = 2
    backend_api_key: Optional[str] = None

    def candidates(self, parsed: ParsedRequest, pin: Optional[str], tried: set[str]) -> tuple[list[Backend], Optional[str]]:
        """Available backends for this request: its version rules, its model, not yet tried, not busy."""
        now = time.monotonic()
        pool = [b for b in self.pool.available() if b.url not in tried]
        if parsed.model is not None:
            serving = [b for b in pool if any(m.get("id") == parsed.model for m in b.models)]
            pool = serving or pool  # nobody lists it: let a backend answer model_not_found
        chosen, version = self.versions.candidates(pool, pin)
        free = [b for b in chosen if b.busy_until <= now]
        return free or chosen, version

    async def forward(self, request: Request) -> Response:
        """Relay one client request; the response names the instance and model version that served it."""
        t0 = time.perf_counter()
        raw = await request.body()
        parsed = parse_body(raw, self.prefix) if request.method == "POST" else ParsedRequest(info=RouteInfo())
        pin = request.headers.get(VERSION_HEADER) or parsed.pin
        record = _access(request)
        headers = self._upstream_headers(request, record)
        self.budget.record_request()
        tried: set[str] = set()
        last: Optional[Response] = None
        overhead = 0.0  # the router's own time: each attempt's choosing and rewriting, never the backend's
        reason = ""
        mark = t0
        retries = 0
        free_retry = False  # the last attempt was refused by a draining instance: it did no work, so no retry is spent
        for attempt in itertools.count():
            if attempt:
                if not free_retry:
                    if retries >= self.max_retries:
                        break
                    if not self.budget.try_spend():
                        self.metrics.budget_exhausted.inc()
                        break
                    retries += 1
                self.metrics.retries.labels(reason).inc()
            free_retry = False
            cands, _ = self.candidates(parsed, pin, tried)
            if not cands:
                if pin is not None and not any(b.version == pin for b in self.pool.backends):
                    return self._fail(ModelNotFoundError(f"no instance serves model version {pin!r}",
                                                         param="model_version"), record)
                break
            choice: Choice = self.policy.choose(cands, parsed.info, self.pool.backends)
            b = choice.backend
            tried.add(b.url)
            self._count_decision(choice)
            record.update(instance=b.name, model_version=b.version, attempts=attempt + 1)
            b.in_flight += 1
            b.in_flight_tokens += parsed.info.est_tokens
            released = False

            def release(b: Backend = b) -> None:
                nonlocal released
                if not released:
                    released = True
                    b.in_flight -= 1
                    b.in_flight_tokens -= parsed.info.est_tokens

            url = f"{b.url}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
            overhead += time.perf_counter() - mark
            assert self.client is not None
            try:
                upstream = await self.client.request(request.method, url, data=raw, headers=headers,
                                                     allow_redirects=False)
            except _READ_TIMEOUT:
                release()
                return self._timed_out(b, None, record, "its response headers")
            except _RETRYABLE_EXC as e:
                release()
                reason = self._attempt_failed(b, "connect", f"{type(e).__name__}: {e}")
                mark = time.perf_counter()
                continue
            except aiohttp.ClientError as e:  # a malformed answer (bad status line, headers): not the network
                release()
                self.metrics.errors.labels(b.name, "protocol").inc()
                return self._fail(UnavailableError(f"instance {b.name} sent an unreadable answer: "
                                                   f"{type(e).__name__}: {e}"), record)
            t1 = mark = time.perf_counter()
            self.metrics.requests.labels(b.name, str(upstream.status)).inc()
            if upstream.status >= 400:
                try:
                    body = await upstream.read()
                except _READ_TIMEOUT:
                    release()
                    return self._timed_out(b, upstream, record, "its error body")
                except _RETRYABLE_EXC as e:
                    upstream.close()
                    release()
                    reason = self._attempt_failed(b, "connect", f"error body broken: {type(e).__name__}")
                    mark = time.perf_counter()
                    continue
                upstream.release()
                release()
                if retryable_response(upstream.status, _json(body)):
                    reason = f"status_{upstream.status}"
                    if _code(body) == "draining":  # going away on purpose: stop routing there before the next poll
                        b.draining = True
                        free_retry = True  # each backend is tried once, so this cannot loop
                        self.metrics.errors.labels(b.name, "draining").inc()
                    elif upstream.status == 429:  # busy, not broken: avoid it until its Retry-After
                        b.busy_until = time.monotonic() + (retry_after_s(upstream.headers) or 1.0)
                        self.metrics.errors.labels(b.name, "status").inc()
                    else:
                        self._attempt_failed(b, "status", f"HTTP {upstream.status}")
                    last = self._response(upstream, body, b)
                    continue
                self.pool.record_success(b)
                self.metrics.overhead.observe(overhead + time.perf_counter() - t1)
                return self._response(upstream, body, b)  # the request's own outcome: passed through unchanged
            if "text/event-stream" in upstream.headers.get("content-type", ""):
                try:
                    first = await upstream.content.readany()
                    if not first:
                        raise aiohttp.ClientPayloadError("end of stream")
                except _READ_TIMEOUT:
                    release()
                    return self._timed_out(b, upstream, record, "the stream's first event")
                except _RETRYABLE_EXC as e:
                    upstream.close()
                    release()
                    reason = self._attempt_failed(b, "connect", f"stream ended before its first event: "
                                                                f"{type(e).__name__}")
                    mark = time.perf_counter()
                    continue
                t1 = time.perf_counter()
                self.pool.record_success(b)
                self.metrics.overhead.observe(overhead + time.perf_counter() - t1)
                return StreamingResponse(self._relay(b, upstream, first, release, record, t0),
                                         status_code=upstream.status, headers=self._headers(upstream, b))
            try:
                body = await upstream.read()
            except _READ_TIMEOUT:
                release()
                return self._timed_out(b, upstream, record, "its body")
            except _RETRYABLE_EXC as e:
                upstream.close()
                release()
                reason = self._attempt_failed(b, "connect", f"body broken: {type(e).__name__}")
                mark = time.perf_counter()
                continue
            upstream.release()
            release()
            self.pool.record_success(b)
            t2 = time.perf_counter()
            if request.url.path in _REWRITE_PATHS:
                body = _tag_body(body, b)
            self.metrics.overhead.observe(overhead + time.perf_counter() - t2)
            self.metrics.latency.labels(b.name).observe(time.perf_counter() - t0)
            return self._response(upstream, body, b)
        if last is not None:
            self.metrics.client_errors.labels("retries_spent").inc()
            return last  # every instance refused: the last refusal, as the instance sent it
        return self._fail(UnavailableError("no instance can take the request now (all down, draining or "
                                           "failing); retry later"), record)

    async def _relay(self, b: Backend, upstream: aiohttp.ClientResponse, first: bytes,
                     release: Any, record: dict, t0: float) -> AsyncIterator[bytes]:
        """Relay SSE bytes as they arrive; tag the `llmrt` object; a broken stream ends with one error event."""
        tail = first
        pending = b""
        complete = False
        try:
            chunk = first
            while chunk:
                pending += chunk
                if b'"llmrt"' in pending:
                    out, pending = _tag_events(pending, b)
                else:
                    out, pending = pending, b""
                if out:
                    yield out
                tail = (tail + chunk)[-64:]
                chunk = await upstream.content.readany()  # b"" at the end
            if pending:
                yield pending
            if b"[DONE]" not in tail:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
            complete = True
            self.metrics.latency.labels(b.name).observe(time.perf_counter() - t0)
        except _READ_TIMEOUT:
            self.metrics.errors.labels(b.name, "timeout").inc()
            self.metrics.client_errors.labels("upstream_timeout").inc()
            record["error"] = "upstream_timeout"
            yield sse_error_event(self._timeout_error(b, "the stream's next event")).encode() + b"data: [DONE]\n\n"
        except _RETRYABLE_EXC as e:
            self.metrics.errors.labels(b.name, "stream_broken").inc()
            self.metrics.client_errors.labels("stream_broken").inc()
            self.pool.record_failure(b, f"stream broken: {type(e).__name__}")
            record["error"] = "engine_dead"
            err = EngineDeadError(f"the instance serving this stream ({b.name}) failed after the stream started "
                                  f"({type(e).__name__}); streams are not retried once they sent tokens")
            yield sse_error_event(err).encode() + b"data: [DONE]\n\n"
        finally:
            release()
            if complete:
                upstream.release()  # the connection goes back to the pool
            else:
                upstream.close()  # the client went away (or the stream broke): the instance sees it and aborts

    def _timeout_error(self, b: Backend, waiting_for: str) -> UpstreamTimeoutError:
        assert self.client is not None
        return UpstreamTimeoutError(f"instance {b.name} sent nothing for {self.client.timeout.sock_read:g} s while "
                                    f"the router waited for {waiting_for}; not retried (the request itself is "
                                    f"probably slow: stream it, or raise the router's --upstream-timeout)")

    def _timed_out(self, b: Backend, upstream: Optional[aiohttp.ClientResponse], record: dict,
                   waiting_for: str) -> Response:
        """A read timeout: the client gets 504 upstream_timeout; the instance is not marked as failing."""
        if upstream is not None:
            upstream.close()  # the instance sees the connection go and aborts the request
        self.metrics.errors.labels(b.name, "timeout").inc()
        return self._fail(self._timeout_error(b, waiting_for), record)

    def _attempt_failed(self, b: Backend, kind: str, reason: str) -> str:
        """Count a failed attempt against b (passive ejection); the retry reason."""
        self.metrics.errors.labels(b.name, kind).inc()
        self.pool.record_failure(b, reason)
        logger.info("attempt on %s failed (%s)", b.name, reason)
        return kind

    def _count_decision(self, choice: Choice) -> None:
        self.metrics.decisions.labels(self.policy.name, choice.backend.name).inc()
        if choice.home is not None:
            self.metrics.affinity.labels(self.policy.name, "hit" if choice.home else "miss").inc()

    def _upstream_headers(self, request: Request, record: dict) -> dict[str, str]:
        """The client's headers minus hop-by-hop ones, its credentials and every x-llmrt-* (never trusted)."""
        out = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP_BY_HOP and not k.lower().startswith("x-llmrt-")}
        if record.get("request_id"):
            out["x-request-id"] = str(record["request_id"])
        if self.backend_api_key:
            out["authorization"] = f"Bearer {self.backend_api_key}"
        return out

    def _headers(self, upstream: aiohttp.ClientResponse, b: Backend) -> dict[str, str]:
        out = {k: v for k, v in upstream.headers.items()
               if k.lower() not in _HOP_BY_HOP and not k.lower().startswith("x-llmrt-")}
        out[INSTANCE_HEADER] = b.name
        out[VERSION_HEADER] = b.version
        return out

    def _response(self, upstream: aiohttp.ClientResponse, body: bytes, b: Backend) -> Response:
        return Response(body, status_code=upstream.status, headers=self._headers(upstream, b))

    def _fail(self, e: LLMRTError, record: dict) -> Response:
        record["error"] = e.code
        self.metrics.client_errors.labels(e.code).inc()
        return error_response(e)


def _access(request: Request) -> dict:
    record = request.scope.get("state", {}).get("access")
    return record if isinstance(record, dict) else {}


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _code(body: bytes) -> Optional[str]:
    obj = _json(body)
    err = obj.get("error") if isinstance(obj, dict) else None
    return err.get("code") if isinstance(err, dict) else None


def _tag(obj: Any, b: Backend) -> bool:
    if isinstance(obj, dict) and isinstance(obj.get("llmrt"), dict):
        obj["llmrt"]["instance"], obj["llmrt"]["model_version"] = b.name, b.version
        return True
    return False


def _tag_body(body: bytes, b: Backend) -> bytes:
    """A JSON response with instance and model_version added to its `llmrt` object."""
    obj = _json(body)
    return json.dumps(obj).encode() if _tag(obj, b) else body


def _tag_events(data: bytes, b: Backend) -> tuple[bytes, bytes]:
    """Complete SSE events of data with the `llmrt` objects tagged; the incomplete rest is returned to wait."""
    head, sep, rest = data.rpartition(b"\n\n")
    if not sep:
        return b"", data
    events = []
    for event in (head + sep).split(b"\n\n")[:-1]:
        if event.startswith(b"data: {") and b'"llmrt"' in event:
            obj = _json(event[6:])
            if _tag(obj, b):
                event = b"data: " + json.dumps(obj).encode()
        events.append(event + b"\n\n")
    return b"".join(events), rest
