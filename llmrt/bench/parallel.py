"""`llmrt bench parallel`: tensor parallelism on this machine, TP=1 against TP=2 over gloo and over the
shared-memory all-reduce (`--cpu-all-reduce gloo | shm`), side by side.

1. Batch throughput (W1-style: --num-prompts random prompts of --input-len tokens, --output-len tokens each, all
   at once) and single-stream TPOT ((time of 1 + n tokens - time of 1 token) / n, so prefill drops out).
2. Rank 0's time inside collectives per step, its share of the step and bytes per token, from the engine's own
   counters (the same figures as /metrics llmrt_collective_*).
3. `llmrt plan`'s communication estimate for the same steps, with each transport's link fitted here (all-reduce
   of 1 row: latency; of 256 rows: bandwidth), beside the measured collective time.
4. The all-reduce probe: two processes, gloo against shared memory (llmrt/bench/allreduce_probe.py).

The three configurations run in alternating rounds (TP=1 stays loaded; a process holds one split engine at a
time, so each round builds it afresh and warms it up); each keeps its best round, and the ratios to TP=1 are
also given round by round (the range), since a shared machine moves every figure.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from llmrt.bench import random_model
from llmrt.bench.prompts import make_prompts, model_config, vocab_pool
from llmrt.bench.allreduce_probe import SIZES
from llmrt.bench.report import (add_run_arguments, alternate, load_average, log, machine_info, now_iso,
                                write_results)
from llmrt.sampling_params import SamplingParams
from llmrt.table import format_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the `bench parallel` flags on p."""
    p.add_argument("--random-model", default="110m", choices=sorted(random_model.SIZES), help="default 110m")
    p.add_argument("--tp", type=int, default=2, help="ranks of the split engine (default 2)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: with > 1, compare one rank, TP=--tp and PP=--pp instead (bubble, p2p "
                        "bytes; llmrt/bench/pipeline.py, benchmarks/parallel_pp.*) (default 1)")
    p.add_argument("--micro-batches", type=int, default=0,
                   help="micro-batches per pipelined step; 0: one per stage when there are enough sequences (default 0)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests in the batch run (default 16)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    add_run_arguments(p)


def _collectives(llm: Any) -> tuple[float, int, int, float]:
    st = llm.engine.stats()
    return st.collective_seconds, st.collective_steps, st.collective_bytes, st.collective_step_seconds


def _measure(llm: Any, batch: list[list[int]], single: list[int], output_len: int) -> dict[str, Any]:
    def timed(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    before = _collectives(llm)
    one = timed([single], 1)
    tpot = (timed([single], 1 + output_len) - one) / output_len
    mid = _collectives(llm)
    seconds = timed(batch, output_len)
    after = _collectives(llm)
    res: dict[str, Any] = {"batch_tok_s": len(batch) * output_len / seconds, "tpot_s": tpot}
    for name, (a, b) in (("single", (before, mid)), ("batch", (mid, after))):
        secs, steps, nbytes, step_s = (y - x for x, y in zip(a, b))
        if steps:
            res[f"{name}_collective_ms_per_step"] = secs / steps * 1e3
            res[f"{name}_collective_share"] = secs / step_s
            res[f"{name}_steps"] = steps
            res[f"{name}_collective_bytes"] = nbytes
    return res


def _best(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch figures of the fastest batch round and the single-stream figures of the lowest-TPOT round."""
    batch = max(results, key=lambda r: r["batch_tok_s"])
    single = min(results, key=lambda r: r["tpot_s"])
    return {**batch, **{k: v for k, v in single.items() if k.startswith("single") or k == "tpot_s"}}


def _ratios(runs: dict[str, list[dict[str, Any]]], name: str, key: str, base: str = "tp1") -> list[float]:
    """`name`'s `key` over `base`'s, round by round (the two ran in the same round)."""
    return [a[key] / b[key] for a, b in zip(runs[name], runs[base])]


def _ratio_cell(best: float, per_round: list[float]) -> str:
    return f"{best:.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"


def _plan_link(times: dict[int, float], hidden: int, tp: int) -> Any:
    """A Link fitted to a probe's all-reduce times: latency from 1 row, bandwidth from 256 rows over 1."""
    from llmrt.distributed.comm_model import Link

    latency = times[1] / (2 * (tp - 1))
    extra = times[256] - times[1]  # when noise hides it, latency alone (a 100 GB/s stand-in)
    bandwidth = (2 * (tp - 1) / tp) * 255 * hidden * 4 / extra if extra > 0 else 100e9
    return Link(bandwidth, latency)


@dataclass
class SplitWorkload:
    """What `bench parallel` and `bench parallel --pp` share: the model, its prompts, this host's all-reduce probe
    (the plan's link figures) and the engines' options."""

    model: str
    cfg: dict[str, Any]
    batch: list[list[int]]
    single: list[int]
    load_start: float
    allreduce: dict[str, Any]
    opts: dict[str, Any]


def prepare_workload(args: argparse.Namespace) -> SplitWorkload:
    """The random model, a batch of `num_prompts` prompts and one single-stream prompt, and the all-reduce probe."""
    from llmrt.bench.allreduce_probe import probe

    model = random_model.cached_random_llama(args.random_model)
    cfg = model_config(model)
    pool = vocab_pool(model)
    batch = make_prompts(pool, args.num_prompts, args.input_len, args.input_len, seed=0)
    single = make_prompts(pool, 1, args.input_len, args.input_len, seed=1)[0]
    load_start = load_average()
    log(f"all-reduce probe (hidden {cfg['hidden_size']}): this host's latency and bandwidth for the plan")
    allreduce = probe(cfg["hidden_size"])
    opts = dict(dtype="float32", max_model_len=args.input_len + args.output_len + 8,
                max_num_seqs=max(args.num_prompts, 1), kv_cache_memory=256 << 20)
    return SplitWorkload(str(model), cfg, batch, single, load_start, allreduce, opts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, print it, write benchmarks/parallel.{json,md} (with --pp > 1: the pipeline one)."""
    if args.pp > 1:
        from llmrt.bench.pipeline import run as run_pipeline

        return run_pipeline(args)
    import torch

    from llmrt import LLM
    from llmrt.bench.allreduce_probe import TRANSPORTS
    from llmrt.distributed.comm_model import Device, estimate_step
    from llmrt.executor.distributed import usable_cores

    w = prepare_workload(args)
    model, cfg, batch, single, load_start, allreduce, opts = (w.model, w.cfg, w.batch, w.single, w.load_start,
                                                              w.allreduce, w.opts)
    split = {f"tp{args.tp} {t}": t for t in TRANSPORTS}
    tp1 = LLM(model, **opts)
    # Rank 0 of a split engine shares this process: each engine runs with its own intra-op threads (all cores
    # for TP=1, cores / ranks for each TP rank, as in their own processes). A process holds one split engine at a
    # time, so each round builds it afresh (and warms it up) before measuring.
    threads = {"tp1": usable_cores(), **{name: max(1, usable_cores() // args.tp) for name in split}}
    per_rank: dict[str, list[int]] = {}

    def measure(name: str) -> dict[str, Any]:
        llm = tp1 if name == "tp1" else LLM(model, tensor_parallel_size=args.tp, cpu_all_reduce=split[name], **opts)
        try:
            torch.set_num_threads(threads[name])
            llm.generate([single], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
            res = _measure(llm, batch, single, args.output_len)
            if name != "tp1":
                assert llm.engine.executor.comm.transport == split[name]
                per_rank[name] = llm.engine.executor.rank_parameter_bytes()
            return res
        finally:
            if llm is not tp1:
                llm.shutdown()

    try:
        runs = alternate({name: name for name in ("tp1", *split)}, measure, args.rounds)
        weights_tp1 = tp1.engine.executor.worker.model_runner.weights_bytes()
    finally:
        tp1.shutdown()
    best = {name: _best(results) for name, results in runs.items()}
    # Only the communication part of the plan's estimate is compared (compute here is measured, not modelled).
    links = {t: _plan_link(allreduce[t], cfg["hidden_size"], args.tp) for t in TRANSPORTS}
    est = {t: {name: estimate_step(cfg, tp=args.tp, pp=1, link=links[t], device=Device(1e12, 1e15), elem_bytes=4,
                                   params=1, tokens=tokens, sampled_rows=rows).tp_seconds
               for name, tokens, rows in (("single", 1, 1), ("batch", args.num_prompts, args.num_prompts))}
           for t in TRANSPORTS}
    names = ["tp1", *split]
    b1 = best["tp1"]

    def row(figure: str, cell) -> dict[str, str]:  # type: ignore[no-untyped-def]
        return {"figure": figure, **{n: cell(n) for n in names}}

    rows = [
        row("batch throughput (tok/s)", lambda n: f"{best[n]['batch_tok_s']:.1f}"),
        row("  vs TP=1: best (round range)", lambda n: "-" if n == "tp1" else _ratio_cell(
            best[n]["batch_tok_s"] / b1["batch_tok_s"], _ratios(runs, n, "batch_tok_s"))),
        row("  shm vs gloo, batch throughput: best (round range)", lambda n: "" if "shm" not in n else
            _ratio_cell(best[n]["batch_tok_s"] / best[f"tp{args.tp} gloo"]["batch_tok_s"],
                        _ratios(runs, n, "batch_tok_s", f"tp{args.tp} gloo"))),
        row("single-stream TPOT (ms)", lambda n: f"{best[n]['tpot_s'] * 1e3:.1f}"),
        row("  vs TP=1: best (round range)", lambda n: "-" if n == "tp1" else _ratio_cell(
            best[n]["tpot_s"] / b1["tpot_s"], _ratios(runs, n, "tpot_s"))),
        row("  shm vs gloo, TPOT: best (round range)", lambda n: "" if "shm" not in n else
            _ratio_cell(best[n]["tpot_s"] / best[f"tp{args.tp} gloo"]["tpot_s"],
                        _ratios(runs, n, "tpot_s", f"tp{args.tp} gloo"))),
        row("collective ms / decode step, 1 seq (measured | plan)", lambda n: "-" if n == "tp1" else
            f"{best[n]['single_collective_ms_per_step']:.2f} | {est[split[n]]['single'] * 1e3:.2f}"),
        row(f"collective ms / step, batch (measured | plan: decode of {args.num_prompts})", lambda n: "-"
            if n == "tp1" else f"{best[n]['batch_collective_ms_per_step']:.2f} | {est[split[n]]['batch'] * 1e3:.2f}"),
        row("collective share of step (1 seq | batch)", lambda n: "-" if n == "tp1" else
            f"{best[n]['single_collective_share']:.0%} | {best[n]['batch_collective_share']:.0%}"),
        row("parameter MiB per rank", lambda n: f"{weights_tp1 / 2**20:.1f}" if n == "tp1" else
            " / ".join(f"{b / 2**20:.1f}" for b in per_rank[n])),
    ]
    probe_rows = [{"rows": r, **{f"{t} ms": f"{allreduce[t][r] * 1e3:.3f}" for t in TRANSPORTS},
                   "gloo / shm": f"{allreduce['gloo'][r] / allreduce['shm'][r]:.1f}x"} for r in SIZES]
    load_end = load_average()
    print(f"load average {load_start} at the start, {load_end} at the end; {args.rounds} alternating rounds")
    print(format_table(rows, ["figure", *names]))
    print()
    print(format_table(probe_rows, ["rows", *(f"{t} ms" for t in TRANSPORTS), "gloo / shm"]))
    result = {"date": now_iso(), "machine": machine_info("cpu"), "dtype": "float32", "model": args.random_model,
              "args": vars(args) | {"func": None}, "loadavg_start": load_start, "loadavg_end": load_end,
              "threads": threads, "runs": runs, "best": best, "per_rank_parameter_bytes": per_rank,
              "weights_bytes_tp1": weights_tp1, "allreduce_probe": allreduce,
              "plan_links": {t: {"bandwidth": lk.bandwidth, "latency": lk.latency} for t, lk in links.items()},
              "plan_estimate_seconds": est, "table": rows, "probe_table": probe_rows}
    if not args.no_save:
        shm, gloo = best[f"tp{args.tp} shm"], best[f"tp{args.tp} gloo"]
        summary = {"model": args.random_model, "tp": args.tp, "load_start": load_start, "load_end": load_end,
                   "batch_ratio_shm": round(shm["batch_tok_s"] / b1["batch_tok_s"], 2),
                   "batch_ratio_gloo": round(gloo["batch_tok_s"] / b1["batch_tok_s"], 2),
                   "tpot_ratio_shm": round(shm["tpot_s"] / b1["tpot_s"], 2),
                   "tpot_ratio_gloo": round(gloo["tpot_s"] / b1["tpot_s"], 2),
                   "coll_ms_1seq_shm": round(shm["single_collective_ms_per_step"], 2),
                   "coll_ms_1seq_gloo": round(gloo["single_collective_ms_per_step"], 2),
                   "gloo_1row_ms": round(allreduce["gloo"][1] * 1e3, 3),
                   "shm_1row_ms": round(allreduce["shm"][1] * 1e3, 3)}
        paths = write_results("parallel", result, args.out_dir, summary, key=["model", "tp"])
        log(f"wrote {paths[0]} and {paths[1]}")
    return result
