"""`llmrt bench router`: routing policies over N local instances on a shared-system-prompt workload, and the
router's own added latency.

N `llmrt serve` instances and one `llmrt route` process start here on 127.0.0.1. Each round runs the
`llmrt bench serve` load (streaming completions; request i starts with shared prefix i mod K) once per policy,
the policy switched on the running router (PUT /admin/policy), in a rotating order; every run draws fresh
prefixes (its own seed), so no policy finds another's prefixes cached. Per policy the best round (lowest mean
TTFT) is kept. Added latency: requests sent alternately straight to an instance and through the router to that
same instance (a 1-token completion, and /tokenize, which involves no engine step, so it times the hop alone); the paired
differences' p50/p99, next to the router's own in-process time (its llmrt_router_overhead_seconds histogram).
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time
from typing import Any, Optional

import httpx

from llmrt.bench import serve as bench_serve
from llmrt.bench.report import load_average, machine_info, now_iso, write_results
from llmrt.router import instances
from llmrt.table import format_table

POLICIES = ("round-robin", "least-load", "prefix-affinity")


def log(msg: str) -> None:
    """Progress to stderr."""
    print(f"[bench router] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `bench router` flags."""
    p.add_argument("model", nargs="?", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--model-name", default="stories260K", help="the model name requests carry (default: stories260K)")
    p.add_argument("--instances", type=int, default=3, help="local instances behind the router (default: 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every policy once (default: 3)")
    p.add_argument("--num-requests", type=int, default=48, help="requests per run (default: 48)")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight (default: 6)")
    p.add_argument("--shared-prefix-len", type=int, default=256, help="system prompt tokens (default: 256)")
    p.add_argument("--num-prefixes", type=int, default=8, help="distinct system prompts (default: 8)")
    p.add_argument("--prompt-len", default="fixed:16", help="each request's own tokens (default: fixed:16)")
    p.add_argument("--output-len", default="fixed:16", help="output tokens (default: fixed:16)")
    p.add_argument("--overhead-requests", type=int, default=150,
                   help="pairs of tiny requests (direct, via the router) for the added latency (default: 150)")
    p.add_argument("--serve-args", default="", help="extra flags for the instances, one shell-quoted string")
    p.add_argument("--router-args", default="", help="extra flags for the router, one shell-quoted string "
                                                     "(e.g. \"--affinity-load-factor 2\")")
    p.add_argument("--output-dir", default="benchmarks", help="where the JSON and Markdown go (default: benchmarks)")
    p.add_argument("--name", default="router-policies", help="file name of the JSON (default: router-policies)")


def _pcts(xs: list[float]) -> dict[str, Optional[float]]:
    return bench_serve.percentiles(xs)


async def _policy_run(base: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cfg = bench_serve.RunConfig(f"{base}/v1", args.model_name, args.concurrency, None, args.num_requests, None,
                                seed, 300.0)
    workload = bench_serve.Workload(bench_serve.parse_lengths(args.prompt_len, "prompt_len"),
                                    bench_serve.parse_lengths(args.output_len, "output_len"), "tokens", (10, 500),
                                    seed, args.shared_prefix_len, args.num_prefixes)
    pairs, start, end = await bench_serve.run_load(cfg, workload, progress=False)
    summary = bench_serve.summarize(pairs, start, end, None, None)
    ok = [r for _, r in pairs if r.ok]
    summary["cached_share"] = sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))
    return summary


async def _pairs(base: str, urls: list[str], n: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """n requests to `path` straight to an instance and n through the router to the same instance (the router's
    policy is `session` meanwhile and every body carries one `user`), alternating which goes first; p50/p99 of
    each and of the paired differences."""
    direct: list[float] = []
    routed: list[float] = []
    body = {**body, "user": "bench-router-hop"}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=20)) as client:
        served = (await client.post(f"{base}{path}", json=body)).headers["x-llmrt-instance"]
        (same,) = [u for u in urls if u.split("//", 1)[1] == served]
        for i in range(n + 5):
            pair = []
            for url in ((same, base) if i % 2 else (base, same)):
                t = time.perf_counter()
                r = await client.post(f"{url}{path}", json=body)
                pair.append((url, time.perf_counter() - t, r.status_code))
            if i < 5:
                continue  # warm-up: connections, first steps
            for url, dt, status in pair:
                assert status == 200, status
                (routed if url == base else direct).append(dt)
    diffs = [r - d for r, d in zip(routed, direct)]
    return {"direct_ms": _pcts(direct), "routed_ms": _pcts(routed), "added_ms": _pcts(diffs),
            "added_p50_of_medians_ms": (_pcts(routed)["p50_ms"] or 0) - (_pcts(direct)["p50_ms"] or 0)}


async def _overhead(base: str, urls: list[str], n: int, router_pid: int) -> dict[str, Any]:
    """Added latency on a 1-token completion (engine noise included) and on /tokenize (no engine: the hop alone),
    and the router process's CPU time per relayed /tokenize request (what it costs, whatever the waits for a
    core on a loaded machine; its background health checks are included, so this is an upper bound)."""
    import psutil

    completion = {"model": "stories260K", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}
    out = {"completion": await _pairs(base, urls, n, "/v1/completions", completion)}
    proc = psutil.Process(router_pid)
    before = proc.cpu_times()
    out["tokenize"] = await _pairs(base, urls, n, "/tokenize", {"prompt": "Once upon a time"})
    after = proc.cpu_times()
    out["router_cpu_ms_per_request"] = ((after.user + after.system) - (before.user + before.system)) / n * 1000
    return out


def _histogram_quantiles(text: str, name: str) -> dict[str, Optional[float]]:
    """p50/p99 (ms) of a Prometheus histogram by linear interpolation within buckets."""
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, Optional[float]] = {}
    for q in (0.5, 0.99):
        if not total:
            out[f"p{int(q * 100)}_ms"] = None
            continue
        target, lo_b, lo_c = q * total, 0.0, 0.0
        for b, c in buckets:
            if c >= target:
                hi = b if b != float("inf") else lo_b
                frac = (target - lo_c) / (c - lo_c) if c > lo_c else 0.0
                out[f"p{int(q * 100)}_ms"] = (lo_b + (hi - lo_b) * frac) * 1000
                break
            lo_b, lo_c = b, c
    out["count"] = total
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the instances and the router, run the rounds and the overhead pairs, write the results."""
    import shlex

    admin = secrets.token_hex(8)
    load_start = load_average()
    extra = ["--disable-access-log", *shlex.split(args.serve_args)]
    log(f"starting {args.instances} instances")
    with instances.launch_instances(args.instances, args.model, extra) as urls:
        router = instances.start("route", *(a for u in urls for a in ("--backend", u)), "--port", "0",
                                 "--admin-api-key", admin, "--disable-access-log", "--health-interval", "0.5",
                                 *shlex.split(args.router_args))
        try:
            base = instances.wait_healthy(router, 120)
            best: dict[str, dict[str, Any]] = {}
            runs: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                order = POLICIES[rnd % len(POLICIES):] + POLICIES[:rnd % len(POLICIES)]
                for k, policy in enumerate(order):
                    httpx.put(f"{base}/admin/policy", json={"policy": policy},
                              headers={"Authorization": f"Bearer {admin}"}).raise_for_status()
                    seed = 1000 + rnd * 10 + POLICIES.index(policy)
                    s = asyncio.run(_policy_run(base, args, seed))
                    s.update(policy=policy, round=rnd, load_1m=load_average())
                    runs.append(s)
                    log(f"round {rnd} {policy}: mean TTFT {s['ttft']['mean_ms']:.1f} ms, cached "
                        f"{s['cached_share']:.2f}, failed {s['num_failed']}, load {s['load_1m']}")
                    if policy not in best or s["ttft"]["mean_ms"] < best[policy]["ttft"]["mean_ms"]:
                        best[policy] = s
            httpx.put(f"{base}/admin/policy", json={"policy": "session"},
                      headers={"Authorization": f"Bearer {admin}"}).raise_for_status()
            overhead = asyncio.run(_overhead(base, urls, args.overhead_requests, router.proc.pid))
            overhead["router_histogram_ms"] = _histogram_quantiles(httpx.get(f"{base}/metrics").text,
                                                                   "llmrt_router_overhead_seconds")
        finally:
            instances.stop(router)
    aff, rr, ll = (best[p]["ttft"]["mean_ms"] for p in ("prefix-affinity", "round-robin", "least-load"))
    result = {"name": args.name, "date": now_iso(), "machine": machine_info("client"),
              "load_avg_1m": {"start": load_start, "end": load_average()},
              "config": {k: getattr(args, k) for k in ("instances", "rounds", "num_requests", "concurrency",
                                                       "shared_prefix_len", "num_prefixes", "prompt_len",
                                                       "output_len", "overhead_requests", "serve_args",
                                                       "router_args")},
              "best": best, "runs": runs, "overhead": overhead,
              "ttft_speedup_vs_round_robin": rr / aff, "ttft_speedup_vs_least_load": ll / aff}
    rows = [{"policy": p, "mean TTFT ms": best[p]["ttft"]["mean_ms"], "p50 TTFT ms": best[p]["ttft"]["p50_ms"],
             "p99 TTFT ms": best[p]["ttft"]["p99_ms"], "cached share": best[p]["cached_share"],
             "req/s": best[p]["request_throughput"], "failed": best[p]["num_failed"], "load 1m": best[p]["load_1m"]}
            for p in POLICIES]
    print(format_table(rows, list(rows[0])), flush=True)
    a = overhead["tokenize"]["added_ms"]
    print(f"prefix-affinity mean TTFT: {result['ttft_speedup_vs_round_robin']:.2f}x better than round-robin, "
          f"{result['ttft_speedup_vs_least_load']:.2f}x than least-load; router added latency (/tokenize pairs) p50 "
          f"{a['p50_ms']:.2f} ms, p99 {a['p99_ms']:.2f} ms (own overhead histogram p50 "
          f"{overhead['router_histogram_ms']['p50_ms']} ms)", flush=True)
    json_path, md_path = write_row(result, args.output_dir)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return result


def write_row(result: dict[str, Any], out_dir: str) -> tuple[Any, Any]:
    """Write the JSON and the result's row of benchmarks/router.md."""
    c, best, o = result["config"], result["best"], result["overhead"]
    a = o["tokenize"]["added_ms"]
    summary = {"instances": c["instances"], "workload": f"{c['num_prefixes']}x{c['shared_prefix_len']}-token "
               f"prefixes + {c['prompt_len']}, out {c['output_len']}, c{c['concurrency']}",
               "instance flags": c.get("serve_args") or "-", "router flags": c.get("router_args") or "-",
               **{f"{p} mean TTFT ms": best[p]["ttft"]["mean_ms"] for p in POLICIES},
               **{f"{p} cached": best[p]["cached_share"] for p in POLICIES},
               "affinity vs rr": result["ttft_speedup_vs_round_robin"],
               "affinity vs ll": result["ttft_speedup_vs_least_load"],
               "hop added p50 ms": a["p50_ms"], "hop added p99 ms": a["p99_ms"],
               "own p50 ms": o["router_histogram_ms"]["p50_ms"], "own p99 ms": o["router_histogram_ms"]["p99_ms"],
               "router CPU ms/req": o.get("router_cpu_ms_per_request"),
               "load 1m": result["load_avg_1m"]["end"], "json": f"{result['name']}.json"}
    return write_results(result["name"], result, out_dir, summary=summary,
                         key=["instances", "workload", "instance flags", "router flags"], table="router")
