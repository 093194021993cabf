"""The router's added latency on one instance: (via the router) - (direct), same request, same instance.

    PYTHONPATH=. python benchmarks/router_hop.py [--baseline-tree /path/to/other/checkout] [--requests 300]

One `llmrt serve` (the embedded model) and one `llmrt route --backend` to it (from this tree, and with
--baseline-tree also one from that checkout, to compare two relays side by side). Each round sends the same
/tokenize body (no engine step: the hop alone) straight to the instance and through each router, rotating which
goes first; the added latency is the paired difference, p50/p99. Also, per router process and per request: its
CPU time, and the time it sat runnable but waiting for a core (/proc/PID/schedstat), which is what a busy
machine adds to every hop. Writes benchmarks/router-hop.json and a row per router in benchmarks/router-hop.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402

from llmrt.bench.report import load_average, machine_info, now_iso, write_results  # noqa: E402
from llmrt.router import instances  # noqa: E402

BODY = {"prompt": "Once upon a time"}


def _router(tree: str, backend: str, tag: str) -> tuple[subprocess.Popen, str, str]:
    """`llmrt route` run from `tree` (its cwd and PYTHONPATH: `-m` puts the cwd first on sys.path)."""
    log = f"/tmp/llmrt-router-hop-{os.getpid()}-{tag}.log"
    proc = subprocess.Popen([sys.executable, "-m", "llmrt.cli", "route", "--backend", backend, "--port", "0",
                             "--disable-access-log", "--health-interval", "1"], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, cwd=tree, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": tree, "PYTHONUNBUFFERED": "1",
                                 "PYTHONDONTWRITEBYTECODE": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.3)
        m = re.search(r"llmrt route: .* on (http://\S+)", Path(log).read_text(errors="replace"))
        if m:
            return proc, m.group(1), log
        if proc.poll() is not None:
            break
    raise RuntimeError(f"router from {tree} did not start:\n{Path(log).read_text(errors='replace')[-2000:]}")


def _commit(tree: str) -> str:
    """The tree's short commit, with + when its working tree has changes."""
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True)
    return (head.stdout.strip() or "?") + ("+" if dirty.stdout.strip() else "")


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) summed over the process's threads."""
    run = wait = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "schedstat").read_text().split()
        run, wait = run + int(fields[0]) / 1e9, wait + int(fields[1]) / 1e9
    return run, wait


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))]


async def _rounds(targets: dict[str, str], n: int, warmup: int = 10) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in targets}
    keys = list(targets)
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n + warmup):
            order = keys[i % len(keys):] + keys[:i % len(keys)]  # rotate who goes first: drift hits all alike
            row = {}
            for key in order:
                t = time.perf_counter()
                r = await client.post(f"{targets[key]}/tokenize", json=BODY)
                row[key] = time.perf_counter() - t
                r.raise_for_status()
            if i >= warmup:
                for key, v in row.items():
                    times[key].append(v)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", default=None, help="another llmrt checkout whose router is measured too")
    p.add_argument("--requests", type=int, default=300, help="rounds (each: direct + every router)")
    p.add_argument("--output-dir", default=str(Path(__file__).parent))
    args = p.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    trees = {f"{label} ({_commit(tree)})": tree
             for label, tree in (("this tree", here), ("baseline", args.baseline_tree)) if tree}
    load_start = load_average()
    with instances.launch_instances(1, None, ["--disable-access-log"]) as urls:
        routers = {name: _router(tree, urls[0], str(k)) for k, (name, tree) in enumerate(trees.items())}
        try:
            targets = {"direct": urls[0], **{name: r[1] for name, r in routers.items()}}
            before = {name: (_schedstat(r[0].pid), psutil.Process(r[0].pid).cpu_times())
                      for name, r in routers.items()}
            times = asyncio.run(_rounds(targets, args.requests))
            after = {name: (_schedstat(r[0].pid), psutil.Process(r[0].pid).cpu_times())
                     for name, r in routers.items()}
        finally:
            for proc, _, log in routers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
                os.unlink(log)
    n = args.requests + 10
    result: dict[str, Any] = {"date": now_iso(), "machine": machine_info("client"), "requests": args.requests,
                              "trees": trees, "load_avg_1m": {"start": load_start, "end": load_average()},
                              "direct_ms": {"p50": _q(times["direct"], .5) * 1000,
                                            "p99": _q(times["direct"], .99) * 1000}, "routers": {}}
    for name in routers:
        added = [(a - b) * 1000 for a, b in zip(times[name], times["direct"])]
        (run0, wait0), cpu0 = before[name]
        (run1, wait1), cpu1 = after[name]
        result["routers"][name] = {
            "added_p50_ms": _q(added, .5), "added_p99_ms": _q(added, .99),
            "routed_p50_ms": _q(times[name], .5) * 1000,
            "cpu_ms_per_request": ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / n * 1000,
            "runqueue_wait_ms_per_request": (wait1 - wait0) / n * 1000,
            "on_cpu_ms_per_request": (run1 - run0) / n * 1000}
    for name, fig in result["routers"].items():
        summary = {"router": name, "direct p50 ms": result["direct_ms"]["p50"],
                   "added p50 ms": fig["added_p50_ms"],
                   "added p99 ms": fig["added_p99_ms"], "router CPU ms/req": fig["cpu_ms_per_request"],
                   "router run-queue wait ms/req": fig["runqueue_wait_ms_per_request"],
                   "load 1m": f"{load_start}-{load_average()}", "json": "router-hop.json"}
        write_results("router-hop", result, args.output_dir, summary=summary, key=["router"])
        print(name, summary, flush=True)


if __name__ == "__main__":
    main()
