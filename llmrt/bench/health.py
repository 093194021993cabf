"""`llmrt bench health`: how fast /health and /metrics answer while large bodies are being tokenized.

Starts `llmrt serve` (or uses --url), then `--clients` threads each send `--requests` large bodies in turn
(/tokenize, /v1/completions and /v1/chat/completions with a prompt of `--body-mib` MiB of text, which the
server tokenizes and then serves or refuses), while a prober calls /health (and /metrics) every
`--interval-ms`. Reports the probes' latency percentiles measured only while the load runs.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any, Optional

import httpx

from llmrt.bench.report import load_average, machine_info, now_iso, write_results

_ROUTES = ("/tokenize", "/v1/completions", "/v1/chat/completions")


def _large_body(route: str, size: int) -> bytes:
    text = ("Once upon a time, a little girl named Lily went to the park. " * (size // 62 + 1))[:size]
    if route == "/tokenize":
        body: dict[str, Any] = {"prompt": text}
    elif route == "/v1/completions":
        body = {"prompt": text, "max_tokens": 1}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return json.dumps(body).encode()


def _percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def health_under_load(base: str, *, clients: int = 4, requests: int = 2, body_bytes: int = 1 << 20,
                      interval_s: float = 0.02, idle_probes: int = 50) -> dict[str, Any]:
    """Run the load against `base` and probe it; the probes' latencies (seconds) and statuses, and the load's."""
    bodies = {route: _large_body(route, body_bytes) for route in _ROUTES}
    load_status: list[int] = []
    load_seconds: list[float] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=base, timeout=600.0) as c:
            for j in range(requests):
                route = _ROUTES[(k + j) % len(_ROUTES)]
                start = time.monotonic()
                r = c.post(route, content=bodies[route], headers={"content-type": "application/json"})
                with lock:
                    load_status.append(r.status_code)
                    load_seconds.append(time.monotonic() - start)

    probes: dict[str, list[tuple[float, int]]] = {"/health": [], "/metrics": []}
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    with httpx.Client(base_url=base, timeout=30.0) as probe:
        probe.get("/health")  # a warm connection: the figure is the server's answer, not a TCP handshake
        idle = []  # the same probe with no load: what this machine gives at best right now
        for _ in range(idle_probes):
            start = time.perf_counter()
            probe.get("/health")
            idle.append(time.perf_counter() - start)
            time.sleep(interval_s)
        started = time.monotonic()
        for t in threads:
            t.start()
        n = 0
        while any(t.is_alive() for t in threads):
            path = "/metrics" if n % 5 == 4 else "/health"
            start = time.perf_counter()
            status = probe.get(path).status_code
            probes[path].append((time.perf_counter() - start, status))
            n += 1
            time.sleep(interval_s)
        wall = time.monotonic() - started
    for t in threads:
        t.join()
    out: dict[str, Any] = {"load_wall_s": round(wall, 3), "load_requests": len(load_status),
                           "load_statuses": sorted(set(load_status)),
                           "load_mean_s": round(sum(load_seconds) / max(len(load_seconds), 1), 3)}
    out["health_idle"] = {"n": len(idle), **{f"p{q}_ms": round(1000 * (_percentile(idle, q) or 0), 2)
                                             for q in (50, 90, 99)}, "max_ms": round(1000 * max(idle, default=0), 2)}
    for path, samples in probes.items():
        lat = [s for s, _ in samples]
        name = path.strip("/")
        out[name] = {"n": len(samples), "non_200": sum(1 for _, st in samples if st != 200),
                     **{f"p{q}_ms": round(1000 * (_percentile(lat, q) or 0), 2) for q in (50, 90, 99)},
                     "max_ms": round(1000 * max(lat, default=0), 2)}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    p.add_argument("--url", default=None, help="a running server's base URL (default: start llmrt serve)")
    p.add_argument("--clients", type=int, default=4, help="concurrent senders of large bodies (default: 4)")
    p.add_argument("--requests", type=int, default=3, help="large bodies per client (default: 3)")
    p.add_argument("--body-mib", type=float, default=1.0, help="prompt text per body in MiB (default: 1)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="pause between probes (default: 20)")
    p.add_argument("--out-dir", default="benchmarks", help="where the JSON and Markdown go (default: benchmarks)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure, print and write benchmarks/health-under-load.{json,md}."""
    from llmrt.bench.server_process import serve

    load_before = load_average()
    kw = dict(clients=args.clients, requests=args.requests, body_bytes=int(args.body_mib * (1 << 20)),
              interval_s=args.interval_ms / 1000)
    if args.url:
        figures = health_under_load(args.url, **kw)
    else:
        with serve(None, "--disable-access-log") as url:
            figures = health_under_load(str(url), **kw)
    result = {"date": now_iso(), "machine": machine_info(), "load_average_before": load_before,
              "load_average_after": load_average(), "clients": args.clients, "requests": args.requests,
              "body_mib": args.body_mib, **figures}
    print(json.dumps(result, indent=2))
    h = figures["health"]
    write_results("health-under-load", result, out_dir=args.out_dir,
                  summary={"clients x MiB": f"{args.clients} x {args.body_mib:g}",
                           "idle health p99 ms": figures["health_idle"]["p99_ms"], "health p50 ms": h["p50_ms"],
                           "health p99 ms": h["p99_ms"], "health max ms": h["max_ms"],
                           "metrics p99 ms": figures["metrics"]["p99_ms"], "probes": h["n"],
                           "load avg": load_before})
    return result
