"""The throughput cost of `--deterministic` on the random 110m Llama: both engines in one process, alternating rounds.

    PYTHONPATH=. python benchmarks/deterministic.py [--dtype float32,bfloat16] [--rounds 3]

Workload per round: a batch of prompts (uniform 64-256 random tokens, 32 forced output tokens, greedy) and one
single-stream request (128-token prompt, 32 output tokens), where fixed 32-row matmul tiles cost the most.
With several dtypes, all their engines alternate in the same rounds (the order reversed every other round).
Best-of rounds per engine; writes benchmarks/deterministic-<dtype>.json and a row of benchmarks/deterministic.md
per dtype.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmrt import LLM, SamplingParams  # noqa: E402
from llmrt.bench.random_model import cached_random_llama  # noqa: E402
from llmrt.bench.report import load_average, machine_info, now_iso, write_results  # noqa: E402


def _round(llm: LLM, prompts: list[list[int]], single: list[int], out_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True, min_tokens=out_len)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch_s = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    one = llm.generate([single], params)[0]
    return {"batch_out_tok_s": tokens / batch_s, "single_tpot_ms": one.metrics.tpot * 1000.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, or both comma-separated (all engines alternate in one run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output-dir", default=str(Path(__file__).parent))
    args = p.parse_args()
    dtypes = args.dtype.split(",")
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        p.error("--dtype: float32, bfloat16 or float32,bfloat16")
    model = cached_random_llama("110m", "float32")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 32000) for _ in range(rng.randint(64, 256))] for _ in range(args.num_prompts)]
    single = [rng.randrange(10, 32000) for _ in range(128)]
    load_start = load_average()
    engines = {(dtype, name): LLM(model, dtype=dtype, deterministic=det, kv_cache_memory=1 << 30, max_num_seqs=32)
               for dtype in dtypes for name, det in (("default", False), ("deterministic", True))}
    for llm in engines.values():  # warm-up: first-call allocations and kernel selection
        _round(llm, prompts[:2], single, 4)
    best: dict[tuple[str, str], dict[str, float]] = {k: {} for k in engines}
    rounds = []
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))  # alternating: drift hits every engine
        for key in order:
            fig = _round(engines[key], prompts, single, args.output_len)
            rounds.append({"round": r, "dtype": key[0], "engine": key[1], **fig, "load_avg_1m": load_average()})
            print(rounds[-1], flush=True)
            b = best[key]
            b["batch_out_tok_s"] = max(b.get("batch_out_tok_s", 0.0), fig["batch_out_tok_s"])
            b["single_tpot_ms"] = min(b.get("single_tpot_ms", float("inf")), fig["single_tpot_ms"])
    load = f"{load_start}-{load_average()}"
    for dtype in dtypes:
        d, n = best[(dtype, "deterministic")], best[(dtype, "default")]
        summary = {"batch tok/s default": n["batch_out_tok_s"], "batch tok/s deterministic": d["batch_out_tok_s"],
                   "batch ratio": d["batch_out_tok_s"] / n["batch_out_tok_s"],
                   "single TPOT ms default": n["single_tpot_ms"],
                   "single TPOT ms deterministic": d["single_tpot_ms"],
                   "single ratio": n["single_tpot_ms"] / d["single_tpot_ms"], "load avg": load}
        result = {"date": now_iso(), "machine": machine_info(), "dtype": dtype, "model": "random-110m",
                  "run_with": dtypes,
                  "workload": {"num_prompts": args.num_prompts, "prompt_len": "uniform:64,256",
                               "output_len": args.output_len, "single_prompt_len": 128, "rounds": args.rounds},
                  "load_avg_1m": {"start": load_start, "end": load_average()},
                  "best": {k[1]: v for k, v in best.items() if k[0] == dtype},
                  "rounds": [x for x in rounds if x["dtype"] == dtype], "summary": summary}
        write_results(f"deterministic-{dtype}", result, args.output_dir, summary=summary, table="deterministic")
        print(dtype, summary)


if __name__ == "__main__":
    main()
