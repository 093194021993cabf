"""Where a replayed decode step's time goes, op by op (step graphs on, as served; issue 17's "profile first").

decode_breakdown.py times a step's parts from Python, which needs step graphs off (their replay has no Python to
wrap); this script asks the step graph interpreter itself to time every op it calls (`StepGraph.set_timing`), so
the figures are those of the step as it runs by default. W2 (256-token prompt, 128 output tokens) `--reps` times
after a warm-up; per decode step: each op kind's ms (ops grouped by name and argument shapes, e.g. the four linear
shapes of a decoder layer), the sum of the timed ops, and the step's TPOT in the same process with timing off.

usage: python step_graph_profile.py MODEL WORKLOAD [--dtype bfloat16] [--quantization int4] [--reps 3] [--out F]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from llmrt import LLM, SamplingParams
from llmrt.bench.report import load_average, machine_info, now_iso


def main() -> None:
    """Run W2 with and without op timing; print and optionally write the per-op-kind table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kw = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory=256 << 20, **kw)
    graphs = llm.engine.executor.worker.model_runner.step_graphs
    assert graphs is not None, "step graphs are off (LLMRT_STEP_GRAPHS=0) or unavailable here"
    prompt = json.load(open(args.workload))["W2"]["prompt"]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)

    def w2() -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return (time.perf_counter() - t - prefill) / 127 * 1e3

    w2()  # records and checks the 1-sequence graph
    plain = [w2() for _ in range(args.reps)]
    graphs.set_timing(True)
    timed = [w2() for _ in range(args.reps)]
    ops, steps = graphs.timings()[1]  # W2's steps decode one sequence: the graph keyed 1
    graphs.set_timing(False)
    per_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # label -> [ms, calls a step]
    for label, ms in ops:
        per_kind[label][0] += ms
        per_kind[label][1] += 1
    rows = sorted(((label, ms / max(steps, 1), n) for label, (ms, n) in per_kind.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"{now_iso()} {machine_info()} load {load_average()}")
    print(f"TPOT untimed {min(plain):.3f} ms (reps {', '.join(f'{t:.3f}' for t in plain)}), timed "
          f"{min(timed):.3f} ms; timed ops {total:.3f} ms a step over {steps} replayed steps")
    print(f"{'ms/step':>8} {'share':>6} {'calls':>5}  op(argument shapes)")
    for label, ms, n in rows:
        print(f"{ms:8.3f} {ms / total:6.1%} {n:5d}  {label}")
    if args.out:
        json.dump({"when": now_iso(), "machine": machine_info(), "model": args.model, "dtype": args.dtype,
                   "quantization": args.quantization, "tpot_untimed_ms": plain, "tpot_timed_ms": timed,
                   "timed_ops_ms_per_step": total, "ops": [{"op": l, "ms_per_step": m, "calls_per_step": n}
                                                            for l, m, n in rows]},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
