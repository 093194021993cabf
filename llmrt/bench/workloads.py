"""Scheduling and caching workloads against real `llmrt serve` processes: scheduling policies on a mixed workload, prefix
caching on a shared system prompt, and decode time per token against context length.

Each configuration runs in its own server (started here on 127.0.0.1 with a free port) and the variants of one
benchmark run one after another in the same invocation, on the same prompts, so their ratios are comparable.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

from llmrt.bench import random_model, server_process
from llmrt.bench.client import RequestResult, stream_completion
from llmrt.bench.report import load_average, machine_info, now_iso, write_results
from llmrt.table import format_table


def log(msg: str) -> None:
    """Progress to stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def serve(model_dir: str, *args: str, startup_timeout: float = 300.0) -> Iterator[str]:
    """A benchmark's `llmrt serve model_dir *args` (access log off), yielding its base URL once healthy."""
    with server_process.serve(model_dir, "--disable-access-log", *args, startup_timeout=startup_timeout) as url:
        yield url


def random_prompt(rng: Any, n: int, vocab: int) -> list[int]:
    """n random token ids, avoiding the three special ids of the random models."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def vocab_size(model_dir: str) -> int:
    """The checkpoint's vocabulary size."""
    import json

    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _check(name: str, run: dict[str, Any]) -> None:
    if run.get("failed"):
        raise RuntimeError(f"{name}: {run['failed']} requests failed, e.g. {run['errors'][:1]}")


def pct(xs: list[float], q: float) -> Optional[float]:
    """The q-quantile (0..1) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def _timed(delay: float, coro_fn: Any) -> RequestResult:
    await asyncio.sleep(delay)
    return await coro_fn()


def _model(args: argparse.Namespace, max_positions: Optional[int] = None) -> str:
    if args.model:
        return args.model
    log(f"random model {args.random_model} (float32): building or reusing the cached checkpoint")
    return random_model.cached_random_llama(args.random_model, "float32", max_positions=max_positions)


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="a local HF checkpoint (default: --random-model)")
    p.add_argument("--random-model", default="110m", choices=sorted(random_model.SIZES),
                   help="random-weight Llama to build or reuse when no MODEL is given (default: 110m)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--output-dir", default="benchmarks", help="where JSON + Markdown results go (default: benchmarks)")
    p.add_argument("--no-write", action="store_true", help="print only, write no files")
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds the client waits on a response before counting it failed (default: 1800)")


# -- mixed workload: policies ---------------------------------------------------------------------------------
async def _mixed_run(url: str, model: str, args: argparse.Namespace, priority_field: bool,
                     vocab: int) -> dict[str, Any]:
    import random

    rng = random.Random(args.seed)
    longs = [random_prompt(rng, args.long_prompt, vocab) for _ in range(args.num_long)]
    shorts = [random_prompt(rng, args.short_prompt, vocab) for _ in range(args.num_short)]
    async with httpx.AsyncClient(timeout=None) as client:
        base = url + "/v1"
        extra_long = {"priority": 1} if priority_field else None
        extra_short = {"priority": 0} if priority_field else None
        t = args.request_timeout
        tasks = [_timed(0.0, lambda p=p: stream_completion(client, base, model, p, args.long_output, extra=extra_long,
                                                            timeout=t))
                 for p in longs]
        tasks += [_timed(args.short_start + i * args.short_interval,
                         lambda p=p: stream_completion(client, base, model, p, args.short_output, extra=extra_short,
                                                       timeout=t))
                  for i, p in enumerate(shorts)]
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    long_res, short_res = results[:args.num_long], results[args.num_long:]
    failed = [r.error for r in results if not r.ok]
    ttfts = [r.ttft for r in short_res if r.ok and r.ttft is not None]
    out_tokens = sum(r.output_tokens for r in results if r.ok)
    return {
        "short_ttft_p50_s": pct(ttfts, 0.5), "short_ttft_p99_s": pct(ttfts, 0.99),
        "short_ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "long_ttft_p50_s": pct([r.ttft for r in long_res if r.ok and r.ttft], 0.5),
        "long_e2e_max_s": max((r.e2e for r in long_res if r.ok), default=None),
        "elapsed_s": elapsed, "output_tokens": out_tokens, "throughput_tok_s": out_tokens / elapsed,
        "failed": len(failed), "errors": failed[:3],
    }


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    """Short requests arriving while long ones run: short-request TTFT and throughput under each policy."""
    model_dir = _model(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: dict[str, Any] = {}
    for policy in policies:
        log(f"mixed workload, policy {policy}")
        with serve(model_dir, "--served-model-name", "bench", "--dtype", "float32", "--scheduling-policy", policy,
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-num-seqs", str(args.max_num_seqs)) as url:
            runs[policy] = asyncio.run(_mixed_run(url, "bench", args, policy == "priority", vocab_size(model_dir)))
        log(f"  {policy}: {runs[policy]}")
        _check(f"policy {policy}", runs[policy])
    ref = runs.get("fcfs")
    rows = []
    for policy, r in runs.items():
        row = {"policy": policy, **{k: v for k, v in r.items() if k != "errors"}}
        if ref and r["short_ttft_p99_s"] and ref["short_ttft_p99_s"]:
            row["p99_ttft_gain_vs_fcfs"] = ref["short_ttft_p99_s"] / r["short_ttft_p99_s"]
            row["throughput_vs_fcfs"] = r["throughput_tok_s"] / ref["throughput_tok_s"]
        rows.append(row)
    cols = ["policy", "short_ttft_p50_s", "short_ttft_p99_s", "p99_ttft_gain_vs_fcfs", "throughput_tok_s",
            "throughput_vs_fcfs", "long_e2e_max_s", "failed"]
    print(format_table(rows, cols))
    workload = {k: getattr(args, k) for k in ("num_long", "long_prompt", "long_output", "num_short", "short_prompt",
                                              "short_output", "short_start", "short_interval",
                                              "max_num_batched_tokens", "max_num_seqs", "seed")}
    result = {"date": now_iso(), "machine": machine_info(), "load_average": load_average(), "dtype": "float32",
              "model": args.model or f"random-{args.random_model}", "workload": workload, "rows": rows}
    if not args.no_write:
        for row in rows:
            write_results("sched-mixed", result, args.output_dir,
                          summary={"policy": row["policy"], "short p50 TTFT s": row["short_ttft_p50_s"],
                                   "short p99 TTFT s": row["short_ttft_p99_s"],
                                   "p99 gain vs fcfs": row.get("p99_ttft_gain_vs_fcfs"),
                                   "tok/s": row["throughput_tok_s"], "tok/s vs fcfs": row.get("throughput_vs_fcfs")},
                          key=["policy"])
    return result


# -- shared prefix: prefix caching ------------------------------------------------------------------------------
async def _prefix_run(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import random

    rng = random.Random(args.seed)
    system = random_prompt(rng, args.prefix_len, vocab)
    prompts = [system + random_prompt(rng, args.suffix_len, vocab) for _ in range(args.num_requests)]
    async with httpx.AsyncClient(timeout=None) as client:
        tasks = [_timed(i * args.interval, lambda p=p: stream_completion(client, url + "/v1", model, p, args.output_len,
                                                                         timeout=args.request_timeout))
                 for i, p in enumerate(prompts)]
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {"ttft_mean_s": statistics.fmean(ttfts) if ttfts else None, "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p99_s": pct(ttfts, 0.99), "elapsed_s": elapsed,
            "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in ok) if ok else None,
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
            "failed": len(results) - len(ok), "errors": [r.error for r in results if not r.ok][:3]}


def run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    """A common system prompt across many requests, with prefix caching on and off."""
    model_dir = _model(args)
    runs: dict[str, Any] = {}
    for name, flags in (("on", []), ("off", ["--no-prefix-caching"])):
        log(f"shared prefix, prefix caching {name}")
        with serve(model_dir, "--served-model-name", "bench", "--dtype", "float32", "--max-num-seqs",
                   str(args.max_num_seqs), *flags) as url:
            runs[name] = asyncio.run(_prefix_run(url, "bench", args, vocab_size(model_dir)))
        log(f"  {name}: {runs[name]}")
        _check(f"prefix caching {name}", runs[name])
    rows = [{"prefix_caching": k, **{a: b for a, b in v.items() if a != "errors"}} for k, v in runs.items()]
    on, off = runs["on"], runs["off"]
    speedup = {m: off[m] / on[m] for m in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s") if on[m] and off[m]}
    print(format_table(rows, ["prefix_caching", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "elapsed_s",
                              "cached_tokens_mean", "prompt_tokens_mean", "failed"]))
    print("TTFT speed-up with prefix caching: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items()))
    workload = {k: getattr(args, k) for k in ("num_requests", "prefix_len", "suffix_len", "output_len", "interval",
                                              "max_num_seqs", "seed")}
    result = {"date": now_iso(), "machine": machine_info(), "load_average": load_average(), "dtype": "float32",
              "model": args.model or f"random-{args.random_model}", "workload": workload, "rows": rows,
              "ttft_speedup": speedup}
    if not args.no_write:
        write_results("prefix-cache", result, args.output_dir,
                      summary={"requests": args.num_requests, "prefix": args.prefix_len,
                               "TTFT mean on s": on["ttft_mean_s"], "TTFT mean off s": off["ttft_mean_s"],
                               "mean speed-up": speedup.get("ttft_mean_s"), "p99 speed-up": speedup.get("ttft_p99_s"),
                               "cached tokens/request": on["cached_tokens_mean"]},
                      key=["requests", "prefix"])
    return result


# -- decode time per token against context length ---------------------------------------------------------------
async def _context_run(url: str, model: str, prompt: list[int], output_len: int, timeout: float) -> RequestResult:
    async with httpx.AsyncClient(timeout=None) as client:
        return await stream_completion(client, url + "/v1", model, prompt, output_len, timeout=timeout)


def run_context(args: argparse.Namespace) -> dict[str, Any]:
    """One request at a time with 1k/4k/16k tokens of context: time per output token after the first."""
    import random

    contexts = [int(c) for c in args.contexts.split(",")]
    need = max(contexts) + args.output_len
    model_dir = _model(args, max_positions=need if not args.model else None)
    rng = random.Random(args.seed)
    rows = []
    kv_bytes = str(args.kv_cache_memory)
    with serve(model_dir, "--served-model-name", "bench", "--dtype", "float32", "--max-model-len", str(need),
               "--kv-cache-memory", kv_bytes, "--no-prefix-caching") as url:
        for ctx in contexts:
            log(f"context {ctx}")
            r = asyncio.run(_context_run(url, "bench", random_prompt(rng, ctx, vocab_size(model_dir)), args.output_len,
                                          args.request_timeout))
            if not r.ok:
                raise RuntimeError(f"context {ctx}: {r.error}")
            itls = r.itls
            rows.append({"context": ctx, "ttft_s": r.ttft, "tpot_ms": r.tpot * 1000,
                         "itl_p50_ms": pct(itls, 0.5) * 1000, "output_tokens": r.output_tokens})
            log(f"  {rows[-1]}")
    base = rows[0]["tpot_ms"]
    for row in rows:
        row["tpot_vs_first"] = row["tpot_ms"] / base
    print(format_table(rows, ["context", "ttft_s", "tpot_ms", "itl_p50_ms", "tpot_vs_first"]))
    result = {"date": now_iso(), "machine": machine_info(), "load_average": load_average(), "dtype": "float32",
              "model": args.model or f"random-{args.random_model}", "output_len": args.output_len, "rows": rows}
    if not args.no_write:
        for row in rows:
            write_results("decode-context", result, args.output_dir,
                          summary={"context": row["context"], "TPOT ms": row["tpot_ms"],
                                   "vs shortest": row["tpot_vs_first"], "TTFT s": row["ttft_s"]},
                          key=["context"])
    return result


def add_subcommands(sub: Any) -> None:
    """`llmrt bench mixed | prefix | context`."""
    m = sub.add_parser("mixed", help="scheduling policies: short requests arriving while long ones run")
    _common_args(m)
    m.add_argument("--policies", default="fcfs,short-first,priority",
                   help="comma-separated policies to compare, fcfs first (default: fcfs,short-first,priority)")
    m.add_argument("--num-long", type=int, default=4, help="long requests, all sent at the start (default: 4)")
    m.add_argument("--long-prompt", type=int, default=2000, help="long prompt tokens (default: 2000)")
    m.add_argument("--long-output", type=int, default=256, help="long output tokens (default: 256)")
    m.add_argument("--num-short", type=int, default=16, help="short requests (default: 16)")
    m.add_argument("--short-prompt", type=int, default=32, help="short prompt tokens (default: 32)")
    m.add_argument("--short-output", type=int, default=16, help="short output tokens (default: 16)")
    m.add_argument("--short-start", type=float, default=0.5, help="seconds before the first short one (default: 0.5)")
    m.add_argument("--short-interval", type=float, default=1.0, help="seconds between short ones (default: 1.0)")
    m.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="server step budget, the prefill chunk size (default: 512)")
    m.add_argument("--max-num-seqs", type=int, default=32, help="server batch slots (default: 32)")
    m.set_defaults(func=lambda a: (run_mixed(a), 0)[1])

    p = sub.add_parser("prefix", help="prefix caching on vs off on a shared system prompt")
    _common_args(p)
    p.add_argument("--num-requests", type=int, default=64, help="requests (default: 64)")
    p.add_argument("--prefix-len", type=int, default=1500, help="shared system prompt tokens (default: 1500)")
    p.add_argument("--suffix-len", type=int, default=32, help="per-request tokens after it (default: 32)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens (default: 16)")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between request starts (default: 0.25)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="server batch slots (default: 64)")
    p.set_defaults(func=lambda a: (run_prefix(a), 0)[1])

    c = sub.add_parser("context", help="decode time per token at growing context lengths")
    _common_args(c)
    c.add_argument("--contexts", default="1024,4096,16384", help="context lengths (default: 1024,4096,16384)")
    c.add_argument("--output-len", type=int, default=32, help="output tokens per request (default: 32)")
    c.add_argument("--kv-cache-memory", default="1GiB", help="server KV budget (default: 1GiB)")
    c.set_defaults(func=lambda a: (run_context(a), 0)[1])
