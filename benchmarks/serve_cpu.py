"""Where a served stream's CPU goes, per process and thread, per output token (issue 17, serving overhead).

Starts `llmrt serve MODEL`, streams one long greedy completion (`--tokens`, forced length) with the bench client
(httpx, as serve_overhead.py), and reads /proc/<pid>/task/<tid>/schedstat (nanoseconds on the CPU, and the
number of times each thread was scheduled in) for the API process, the engine-core process and this client
before and after. On a 2-core host every millisecond spent outside the engine core's decode threads is taken
from them, so the per-token sums here are what the served TPOT pays over the offline one.

Run: PYTHONPATH=. python benchmarks/serve_cpu.py MODEL [--dtype bfloat16] [--tokens 1000] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import httpx

from llmrt.bench.client import stream_completion
from llmrt.bench.server_process import serve


def threads(pid: int) -> dict[str, tuple[int, int]]:
    """'comm/tid' -> (ns on CPU, times scheduled in) for every thread of `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run_ns, _, slices = (int(v) for v in (task / "schedstat").read_text().split())
            comm = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
        out[f"{comm}/{task.name}"] = (run_ns, slices)
    return out


def children(pid: int) -> list[int]:
    """The direct child processes of `pid`."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


def snapshot(roles: dict[str, int]) -> dict[str, dict[str, tuple[int, int]]]:
    return {role: threads(pid) for role, pid in roles.items()}


def main() -> None:
    """Stream, diff the counters, print CPU per token per thread (only threads that ran) and per process."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the per-round figures as JSON here")
    args = ap.parse_args()
    prompt = list(range(100, 356))
    results = []
    with serve(args.model, "--dtype", args.dtype, "--served-model-name", "m", "--max-model-len",
               str(args.tokens + 512)) as url:
        api = url.proc.pid
        kids = children(api)
        core = max(kids, key=lambda k: len(list(Path(f"/proc/{k}/task").iterdir())))  # the one with OpenMP threads
        roles = {"api": api, "engine core": core, "client": os.getpid()}
        for k in kids:
            print(f"child {k}: {Path(f'/proc/{k}/cmdline').read_text().replace(chr(0), ' ')[:100]}")
        client = httpx.AsyncClient()

        async def stream(n: int):
            return await stream_completion(client, url + "/v1", "m", prompt, n)

        asyncio.run(stream(16))  # warm-up
        for r in range(args.rounds):
            before = snapshot(roles)
            t = time.perf_counter()
            res = asyncio.run(stream(args.tokens))
            wall = time.perf_counter() - t
            after = snapshot(roles)
            assert res.ok and res.output_tokens == args.tokens, (res.error, res.output_tokens)
            n = args.tokens
            tpot = (res.token_times[-1] - res.token_times[0]) / (n - 1) * 1e3
            rows, per_role = [], defaultdict(float)
            for role in roles:
                for name, (ns, sl) in after[role].items():
                    ns0, sl0 = before[role].get(name, (0, 0))
                    if ns - ns0 > 0:
                        us = (ns - ns0) / n / 1e3
                        rows.append((role, name, us, (sl - sl0) / n))
                        per_role[role] += us
            print(f"round {r}: TPOT {tpot:.2f} ms, wall {wall:.2f} s, {n} tokens; CPU us per token:")
            for role, name, us, sl in sorted(rows, key=lambda x: (x[0], -x[2])):
                if us >= 5:
                    print(f"  {role:12s} {name:28s} {us:8.1f} us  {sl:5.2f} slices/token")
            print("  per process: " + ", ".join(f"{k} {v:.0f} us" for k, v in per_role.items()), flush=True)
            results.append({"tpot_ms": tpot, "per_process_us": per_role,
                            "threads": [{"role": a, "thread": b, "us": c, "slices": d} for a, b, c, d in rows]})
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "tokens": args.tokens,
                                              "load_average": os.getloadavg(), "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
