"""`llmrt bench spec`: what speculative decoding buys and costs, three measurements in one process.

1. copy-heavy: one stream at a time on the embedded model, prompts that end by restarting a story the model
   already told (seed + its own greedy continuation + seed), so the continuation repeats text in the context and
   n-grams recur. TPOT with `ngram` (k = --ngram-k) against no speculation; acceptance and mean accepted length.
2. ceiling: the random 110m model with itself as the draft (every proposal accepted under greedy decoding), one
   stream, k = 1, 2, 4, 8: time per generated token against no speculation. Proposing k tokens costs k draft
   steps, so this shows what verification and proposing cost when nothing is rejected.
3. compute-bound: --concurrency requests with random prompts on the 110m model at once, throughput with `ngram`
   against without: the step rule should switch speculation off in such steps (target >= 0.95x).

Each comparison alternates its configurations for --rounds rounds and keeps each one's best, so a machine shared
with other work skews both sides alike.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Optional

from llmrt.bench import random_model
from llmrt.bench.report import (add_run_arguments, alternate, best_of, load_average, log, machine_info, now_iso,
                                write_results)
from llmrt.bench.prompts import make_prompts, vocab_pool
from llmrt.table import format_table

KV_BYTES = 512 << 20  # per engine of parts 2 and 3 (the 110m model: ~7k tokens; part 3 gets twice that)
SEEDS = ["Once upon a time", "Lily and Ben went to the park.", "One day, a little dog found a ball.",
         "Tom had a big red car."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the `bench spec` flags on p."""
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="default float32")
    p.add_argument("--output-len", type=int, default=128, help="tokens per single-stream request (default 128)")
    p.add_argument("--ngram-k", type=int, default=4, help="n-gram proposals per step in part 1 (default 4)")
    p.add_argument("--draft-ks", default="1,2,4,8", help="k values of part 2 (default 1,2,4,8)")
    p.add_argument("--ceiling-output-len", type=int, default=None,
                   help="tokens per request in part 2 (default: --output-len)")
    p.add_argument("--concurrency", type=int, default=32, help="requests at once in part 3 (default 32)")
    p.add_argument("--batch-output-len", type=int, default=64, help="tokens per request in part 3 (default 64)")
    p.add_argument("--parts", default="copy,ceiling,batch", help="which parts to run (default all three)")
    p.add_argument("--random-model", default="110m", choices=sorted(random_model.SIZES),
                   help="the model of parts 2 and 3 (default 110m)")
    add_run_arguments(p)


def _spec_counts(llm: Any) -> tuple[int, int, int]:
    st = llm.engine.stats()
    return sum(st.spec_proposed_by_position), sum(st.spec_accepted_by_position), st.spec_verify_steps


def _run(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Generate `prompts` as one batch; wall time, output tokens, mean TPOT and the speculation counted meanwhile."""
    before = _spec_counts(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    proposed, accepted, steps = (a - b for a, b in zip(_spec_counts(llm), before))
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds,
            "tpot_s": sum(tpots) / len(tpots) if tpots else None, "proposed": proposed, "accepted": accepted,
            "verify_steps": steps, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def _single_streams(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Each prompt alone, one after the other; TPOT is the mean over them."""
    runs = [_run(llm, [p], params) for p in prompts]
    total = lambda k: sum(r[k] for r in runs)  # noqa: E731
    return {"tpot_s": sum(r["tpot_s"] for r in runs) / len(runs), "output_tokens": total("output_tokens"),
            "proposed": total("proposed"), "accepted": total("accepted"), "verify_steps": total("verify_steps"),
            "token_ids": [r["token_ids"][0] for r in runs]}


def _acceptance(res: dict[str, Any]) -> dict[str, Optional[float]]:
    return {"acceptance": res["accepted"] / res["proposed"] if res["proposed"] else None,
            "mean_accepted_len": res["accepted"] / res["verify_steps"] if res["verify_steps"] else None}


def copy_heavy(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: single streams that continue text already in the context, ngram vs none."""
    from llmrt import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    plain = LLM(None, dtype=args.dtype)
    prompts = []
    for out in plain.generate(SEEDS, params):
        seed = list(out.prompt_token_ids)
        prompts.append(seed + list(out.outputs[0].token_ids) + seed[1:])  # seed[0] is BOS
    spec = LLM(None, dtype=args.dtype, speculative={"method": "ngram", "num_tokens": args.ngram_k})
    best = best_of(alternate({"none": plain, f"ngram k={args.ngram_k}": spec},
                             lambda llm: _single_streams(llm, prompts, params), args.rounds), "tpot_s", lower=True)
    base = best["none"]
    rows = []
    for name, res in best.items():
        rows.append({"config": name, "tpot_ms": res["tpot_s"] * 1e3, "speedup": base["tpot_s"] / res["tpot_s"],
                     **_acceptance(res), "same_tokens": res["token_ids"] == base["token_ids"]})
    return {"model": "stories260K (embedded)", "prompts": len(prompts), "output_len": args.output_len, "rows": rows}


def ceiling(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Part 2: the 110m model drafting for itself at each k (acceptance 1), one stream."""
    from llmrt import LLM, SamplingParams

    output_len = args.ceiling_output_len or args.output_len
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = make_prompts(vocab_pool(model), 2, 64, 64, seed=0)
    kv = dict(kv_cache_memory=KV_BYTES)  # five engines at once: each gets a small cache, not the 2 GiB default
    configs = {"none": LLM(model, dtype=args.dtype, **kv)}
    for k in (int(x) for x in args.draft_ks.split(",")):
        configs[f"draft=self k={k}"] = LLM(model, dtype=args.dtype, **kv,
                                          speculative={"method": "draft", "model": model, "num_tokens": k})
    best = best_of(alternate(configs, lambda llm: _single_streams(llm, prompts, params), args.rounds), "tpot_s",
                   lower=True)
    base = best["none"]
    rows = [{"config": name, "tpot_ms": res["tpot_s"] * 1e3, "vs_none": res["tpot_s"] / base["tpot_s"],
             **_acceptance(res), "same_tokens": res["token_ids"] == base["token_ids"]} for name, res in best.items()]
    return {"model": f"random {args.random_model}", "prompts": len(prompts), "output_len": output_len,
            "rows": rows}


def compute_bound(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Part 3: many random-prompt requests at once, ngram enabled vs not."""
    from llmrt import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.batch_output_len, temperature=0, ignore_eos=True)
    prompts = make_prompts(vocab_pool(model), args.concurrency, 64, 64, seed=1)
    n = max(args.concurrency, 1)
    configs = {"none": LLM(model, dtype=args.dtype, max_num_seqs=n, kv_cache_memory=2 * KV_BYTES),
               f"ngram k={args.ngram_k}": LLM(model, dtype=args.dtype, max_num_seqs=n, kv_cache_memory=2 * KV_BYTES,
                                              speculative={"method": "ngram", "num_tokens": args.ngram_k})}
    best = best_of(alternate(configs, lambda llm: _run(llm, prompts, params), args.rounds), "tok_s")
    base = best["none"]
    rows = [{"config": name, "tok_s": res["tok_s"], "vs_none": res["tok_s"] / base["tok_s"],
             "proposed": res["proposed"], **_acceptance(res)} for name, res in best.items()]
    return {"model": f"random {args.random_model}", "concurrency": n, "output_len": args.batch_output_len,
            "rows": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen parts, print a table each, and save them under --out-dir unless --no-save."""
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"copy", "ceiling", "batch"}
    if unknown:
        raise SystemExit(f"bench spec: unknown parts {sorted(unknown)}; choose among copy, ceiling, batch")
    load = load_average()
    result: dict[str, Any] = {"date": now_iso(), "dtype": args.dtype, "rounds": args.rounds,
                              "machine": machine_info("cpu"), "loadavg_start": load}
    model = random_model.cached_random_llama(args.random_model, args.dtype) if parts - {"copy"} else None
    if "copy" in parts:
        result["copy_heavy"] = copy_heavy(args)
        print(format_table(result["copy_heavy"]["rows"], ["config", "tpot_ms", "speedup", "acceptance",
                                                          "mean_accepted_len", "same_tokens"]))
    if "ceiling" in parts:
        result["ceiling"] = ceiling(args, model)
        print(format_table(result["ceiling"]["rows"], ["config", "tpot_ms", "vs_none", "acceptance",
                                                       "mean_accepted_len", "same_tokens"]))
    if "batch" in parts:
        result["compute_bound"] = compute_bound(args, model)
        print(format_table(result["compute_bound"]["rows"], ["config", "tok_s", "vs_none", "proposed",
                                                             "acceptance"]))
    result["loadavg_end"] = load_average()
    if not args.no_save:
        summary: dict[str, Any] = {"load_start": load, "load_end": result["loadavg_end"]}
        if "copy_heavy" in result:
            r = result["copy_heavy"]["rows"][1]
            summary.update(copy_speedup=round(r["speedup"], 2), copy_acceptance=_round(r["acceptance"]))
        if "ceiling" in result:
            summary.update({f"self_{row['config'].split()[-1]}": round(row["vs_none"], 2)
                            for row in result["ceiling"]["rows"][1:]})
        if "compute_bound" in result:
            summary["batch_vs_none"] = round(result["compute_bound"]["rows"][1]["vs_none"], 3)
        paths = write_results("spec-decode", result, args.out_dir, summary)
        log(f"wrote {paths[0]} and {paths[1]}")
    return result


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)
