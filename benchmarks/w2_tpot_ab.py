"""W2 time per output token of two checkouts, alternating fresh processes in rounds (the lead's A/B for the decode
step): per process one warm-up, then `--reps` runs of W2 (256-token prompt, 128 forced tokens); each reports its
best wall TPOT and best CPU TPOT (process CPU time per decode step, which other processes' time slices on a loaded
host do not inflate; with more than one thread it also counts threads spinning at barriers).

usage: python w2_tpot_ab.py OLD_DIR NEW_DIR MODEL WORKLOAD [--dtype bfloat16] [--quantization int4] [--threads 1]
       [--rounds 3] [--reps 3] [--env-old K=V ...] [--env-new K=V ...] [--out FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time, torch
from llmrt import LLM, SamplingParams
model, workload, dtype, quant, threads, reps = sys.argv[1:7]
if int(threads):
    torch.set_num_threads(int(threads))
prompt = json.load(open(workload))["W2"]["prompt"]
kw = {"quantization": quant} if quant != "none" else {}
llm = LLM(model, dtype=dtype, max_model_len=1024, kv_cache_memory=256 << 20, **kw)
sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
def run(n):
    w, c = time.perf_counter(), time.process_time()
    out = llm.generate([prompt], sp(n), use_tqdm=False)
    return time.perf_counter() - w, time.process_time() - c, out[0].outputs[0].token_ids
run(128)
walls, cpus = [], []
for _ in range(int(reps)):
    w1, c1, _ = run(1)
    w, c, toks = run(128)
    walls.append((w - w1) / 127 * 1e3)
    cpus.append((c - c1) / 127 * 1e3)
print(json.dumps({"wall_tpot_ms": min(walls), "cpu_tpot_ms": min(cpus), "first_tokens": toks[:16]}))
'''

ap = argparse.ArgumentParser()
ap.add_argument("old")
ap.add_argument("new")
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--quantization", default="none")
ap.add_argument("--threads", type=int, default=1, help="0: torch's default")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--env-old", nargs="*", default=[], help="K=V set for the old side's processes only")
ap.add_argument("--env-new", nargs="*", default=[], help="K=V set for the new side's processes only")
ap.add_argument("--out")
args = ap.parse_args()


def one(checkout: str, env: list[str]) -> dict:
    """One fresh process against `checkout` with `env` added: its figures and the load average around it."""
    load0 = os.getloadavg()[0]
    extra = dict(e.split("=", 1) for e in env)
    out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.workload, args.dtype, args.quantization,
                          str(args.threads), str(args.reps)], env={**os.environ, **extra, "PYTHONPATH": checkout},
                         check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["load"] = [load0, os.getloadavg()[0]]
    return res


rounds = []
for r in range(args.rounds):
    first, second = ("old", "new") if r % 2 == 0 else ("new", "old")
    side = {"old": (args.old, args.env_old), "new": (args.new, args.env_new)}
    pair = {first: one(*side[first])}
    pair[second] = one(*side[second])
    rounds.append(pair)
    print(json.dumps({k: {m: v[m] for m in ("wall_tpot_ms", "cpu_tpot_ms", "load")} for k, v in pair.items()}),
          flush=True)
summary = {}
for k in ("wall_tpot_ms", "cpu_tpot_ms"):
    old = min(p["old"][k] for p in rounds)
    new = min(p["new"][k] for p in rounds)
    ratios = [p["new"][k] / p["old"][k] for p in rounds]
    summary[k] = {"old_best": old, "new_best": new, "new_over_old_best": new / old,
                  "new_over_old_median_of_rounds": statistics.median(ratios)}
same = all(p["old"]["first_tokens"] == p["new"]["first_tokens"] for p in rounds)
res = {"args": vars(args), "rounds": rounds, "summary": summary, "same_first_16_tokens": same}
print(json.dumps({"summary": summary, "same_first_16_tokens": same}, indent=1))
if args.out:
    json.dump(res, open(args.out, "w"), indent=1)
