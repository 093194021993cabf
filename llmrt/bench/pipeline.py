"""`llmrt bench parallel --pp 2`: one rank against TP=2 and PP=2 (gloo) on this machine, side by side.

Per engine: W1-style batch throughput and single-stream TPOT (as `bench parallel`), and for the pipelined one
each stage's share of its step time spent waiting for another stage (the bubble), rank 0's bytes sent point
to point per step and its time in tensor-parallel collectives per step, from the engine's own counters (the
/metrics llmrt_pipeline_* and llmrt_collective_* figures). Beside them `llmrt plan`'s estimate for the same
steps with this host's gloo as the link (from the all-reduce probe). The engines stay loaded and are measured in
alternating rounds; each keeps its best round.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from llmrt.bench.report import load_average, log, machine_info, now_iso, write_results
from llmrt.table import format_table


def _counters(llm: Any) -> dict[str, Any]:
    st = llm.engine.stats()
    return {"coll_s": st.collective_seconds, "coll_steps": st.collective_steps, "bytes": st.collective_bytes,
            "step_s": st.collective_step_seconds, "wait": list(st.pipeline_wait_seconds),
            "total": list(st.pipeline_stage_seconds)}


def _phase(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The figures of the steps between two counter readings."""
    steps = b["coll_steps"] - a["coll_steps"]
    if not steps:
        return {}
    out = {"steps": steps, "collective_ms_per_step": (b["coll_s"] - a["coll_s"]) / steps * 1e3,
           "bytes_per_step": (b["bytes"] - a["bytes"]) / steps,
           "step_ms": (b["step_s"] - a["step_s"]) / steps * 1e3}
    if b["wait"]:
        waits = [y - x for x, y in zip(a["wait"] or [0.0] * len(b["wait"]), b["wait"])]
        totals = [y - x for x, y in zip(a["total"] or [0.0] * len(b["total"]), b["total"])]
        out["bubble_share_by_stage"] = [w / t if t else 0.0 for w, t in zip(waits, totals)]
        out["bubble_share"] = sum(waits) / sum(totals) if sum(totals) else 0.0
        out["wait_ms_per_step_by_stage"] = [w / steps * 1e3 for w in waits]
    return out


def _measure(llm: Any, batch: list[list[int]], single: list[int], output_len: int) -> dict[str, Any]:
    from llmrt import SamplingParams

    def timed(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    timed([single[:8]], 2)  # warm-up: first-call allocations and kernel loads stay out of the figures
    c0 = _counters(llm)
    one = timed([single], 1)
    tpot = (timed([single], 1 + output_len) - one) / output_len
    c1 = _counters(llm)
    seconds = timed(batch, output_len)
    c2 = _counters(llm)
    return {"batch_tok_s": len(batch) * output_len / seconds, "tpot_s": tpot, "single": _phase(c0, c1),
            "batch": _phase(c1, c2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run PP=1 / TP=args.tp / PP=args.pp alternately, print the table, write benchmarks/parallel_pp.{json,md}."""
    import torch

    from llmrt import LLM
    from llmrt.bench.parallel import prepare_workload
    from llmrt.distributed.comm_model import Device, Link, estimate_step
    from llmrt.executor.distributed import usable_cores
    from llmrt.worker.pipeline_step import num_micro_batches

    w = prepare_workload(args)
    model, cfg, batch, single, load_start, allreduce, opts = (w.model, w.cfg, w.batch, w.single, w.load_start,
                                                              w.allreduce, w.opts)
    tp_name, pp_name = f"tp{args.tp}", f"pp{args.pp}"
    # One split engine per process (one process group): the split engines are started afresh in every round
    # and shut down after it; the one-rank engine stays loaded.
    makers = {"pp1": lambda: LLM(model, **opts), tp_name: lambda: LLM(model, tensor_parallel_size=args.tp, **opts),
              pp_name: lambda: LLM(model, pipeline_parallel_size=args.pp, pipeline_micro_batches=args.micro_batches,
                                   **opts)}
    engines = {"pp1": makers["pp1"]()}
    per_rank: dict[str, list[int]] = {"pp1": [engines["pp1"].engine.executor.worker.model_runner.weights_bytes()]}
    threads = {"pp1": usable_cores(), tp_name: max(1, usable_cores() // args.tp),
               pp_name: max(1, usable_cores() // args.pp)}
    best: dict[str, dict[str, Any]] = {}
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(max(args.rounds, 1)):
            for name in makers:
                torch.set_num_threads(threads[name])  # rank 0 shares this process
                llm = engines.get(name) or makers[name]()
                try:
                    res = _measure(llm, batch, single, args.output_len)
                    if name != "pp1":
                        per_rank[name] = llm.engine.executor.rank_parameter_bytes()
                finally:
                    if name != "pp1":
                        llm.shutdown()
                rounds.append({"round": r + 1, "engine": name, "load": load_average(), **res})
                log(f"round {r + 1} {name}: batch {res['batch_tok_s']:.1f} tok/s, TPOT {res['tpot_s'] * 1e3:.1f} ms"
                    + (f", bubble {res['batch'].get('bubble_share', 0):.0%}" if name == pp_name else ""))
                prev = best.get(name, {})
                if "batch_tok_s" not in prev or res["batch_tok_s"] > prev["batch_tok_s"]:
                    prev = {**prev, "batch_tok_s": res["batch_tok_s"], "batch": res["batch"]}
                if "tpot_s" not in prev or res["tpot_s"] < prev["tpot_s"]:
                    prev = {**prev, "tpot_s": res["tpot_s"], "single": res["single"]}
                best[name] = prev
    finally:
        for llm in engines.values():
            llm.shutdown()
    # This host's gloo as the plan's link: a 2-rank all-reduce is 2 latencies + the row over the bandwidth.
    g = allreduce["gloo"]
    latency = g[1] / 2
    extra = g[256] - g[1]
    bandwidth = 255 * cfg["hidden_size"] * 4 / extra if extra > 0 else 100e9
    link = Link(bandwidth, latency)
    est = {}
    for phase, tokens, rows in (("single", 1, 1), ("batch", args.num_prompts, args.num_prompts)):
        m = num_micro_batches(args.micro_batches, args.pp, rows)
        e = estimate_step(cfg, tp=1, pp=args.pp, link=link, device=Device(1e12, 1e15), elem_bytes=4, params=1,
                          tokens=tokens, sampled_rows=rows, micro_batches=m)
        t = estimate_step(cfg, tp=args.tp, pp=1, link=link, device=Device(1e12, 1e15), elem_bytes=4, params=1,
                          tokens=tokens, sampled_rows=rows)
        est[phase] = {"pp_ms": e.pp_seconds * 1e3, "pp_bubble": e.bubble_share, "pp_bytes": e.comm_bytes_per_token
                      * tokens, "tp_ms": t.tp_seconds * 1e3, "micro_batches": m}
    rows = _table(best, est, per_rank, args, tp_name, pp_name)
    print(format_table(rows, ["figure", "pp1", tp_name, pp_name]))
    result = {"date": now_iso(), "machine": machine_info("cpu"), "dtype": "float32", "model": args.random_model,
              "args": vars(args) | {"func": None}, "loadavg_start": load_start, "loadavg_end": load_average(),
              "threads": threads, "best": best, "rounds": rounds, "per_rank_parameter_bytes": per_rank,
              "allreduce_probe": allreduce, "plan_link": {"bandwidth": bandwidth, "latency": latency},
              "plan_estimate": est, "table": rows}
    if not args.no_save:
        b1, bt, bp = best["pp1"], best[tp_name], best[pp_name]
        summary = {"model": args.random_model, "tp": args.tp, "pp": args.pp, "load_start": load_start,
                   "load_end": result["loadavg_end"],
                   "tp_batch_ratio": round(bt["batch_tok_s"] / b1["batch_tok_s"], 2),
                   "pp_batch_ratio": round(bp["batch_tok_s"] / b1["batch_tok_s"], 2),
                   "tp_tpot_ratio": round(bt["tpot_s"] / b1["tpot_s"], 2),
                   "pp_tpot_ratio": round(bp["tpot_s"] / b1["tpot_s"], 2),
                   "pp_bubble_batch": round(bp["batch"].get("bubble_share", 0.0), 2),
                   "pp_bubble_1seq": round(bp["single"].get("bubble_share", 0.0), 2)}
        paths = write_results("parallel_pp", result, args.out_dir, summary, key=["model", "tp", "pp"])
        log(f"wrote {paths[0]} and {paths[1]}")
    return result


def _table(best: dict[str, Any], est: dict[str, Any], per_rank: dict[str, list[int]], args: argparse.Namespace,
           tp_name: str, pp_name: str) -> list[dict[str, str]]:
    b1, bt, bp = best["pp1"], best[tp_name], best[pp_name]
    ratio = lambda x, y: f"{x / y:.2f}x"  # noqa: E731
    rows = [
        {"figure": "batch throughput (tok/s)", "pp1": f"{b1['batch_tok_s']:.1f}",
         tp_name: f"{bt['batch_tok_s']:.1f} ({ratio(bt['batch_tok_s'], b1['batch_tok_s'])})",
         pp_name: f"{bp['batch_tok_s']:.1f} ({ratio(bp['batch_tok_s'], b1['batch_tok_s'])})"},
        {"figure": "single-stream TPOT (ms)", "pp1": f"{b1['tpot_s'] * 1e3:.1f}",
         tp_name: f"{bt['tpot_s'] * 1e3:.1f} ({ratio(bt['tpot_s'], b1['tpot_s'])})",
         pp_name: f"{bp['tpot_s'] * 1e3:.1f} ({ratio(bp['tpot_s'], b1['tpot_s'])})"},
    ]
    for phase, label in (("single", "decode, 1 seq"), ("batch", f"batch run of {args.num_prompts}")):
        s, e = bp[phase], est[phase]
        rows.append({"figure": f"bubble share, {label} (measured by stage | plan, M={e['micro_batches']})",
                     "pp1": "-", tp_name: "-",
                     pp_name: " / ".join(f"{x:.0%}" for x in s.get("bubble_share_by_stage", []))
                     + f" | {e['pp_bubble']:.0%}"})
        rows.append({"figure": f"comm per step, {label}: TP collective ms | PP bytes sent by rank 0 "
                               f"(plan: TP ms | PP ms)", "pp1": "-",
                     tp_name: f"{bt[phase].get('collective_ms_per_step', 0):.2f} ms | plan {e['tp_ms']:.2f} ms",
                     pp_name: f"{s.get('bytes_per_step', 0) / 1024:.1f} KiB | plan {e['pp_ms']:.2f} ms"})
    rows.append({"figure": "parameter bytes per rank (MiB)", **{k: " / ".join(f"{b / 2**20:.1f}" for b in v)
                                                                 for k, v in per_rank.items()}})
    return rows
