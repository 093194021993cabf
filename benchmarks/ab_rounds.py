"""Old vs new checkout of llmrt on the peers' workloads, alternating rounds in one run (the shared machine's load
moves a lot between minutes, so only ratios from the same run mean something).

Each round runs benchmarks/peers/bench_llmrt.py once per checkout (a fresh process each, PYTHONPATH set to the
checkout) and records W1 output tok/s (unless --skip-w1), W2 TTFT/TPOT and the load average around the run.

usage: python ab_rounds.py OLD_DIR NEW_DIR MODEL WORKLOAD [--dtypes bfloat16 float32] [--rounds 2] [--skip-w1]
       [--out FILE] [--env-new K=V ...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("old")
ap.add_argument("new")
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--skip-w1", action="store_true")
ap.add_argument("--w2-reps", type=int, default=3)
ap.add_argument("--out")
ap.add_argument("--env-new", nargs="*", default=[], help="K=V set only for the new side (e.g. OMP_PROC_BIND=close)")
args = ap.parse_args()
SCRIPT = Path(__file__).parent / "peers" / "bench_llmrt.py"


def one(checkout: str, dtype: str, extra_env: dict[str, str]) -> dict:
    """One bench_llmrt.py process against `checkout`; its JSON plus the load before and after."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        load0 = os.getloadavg()[0]
        cmd = [sys.executable, str(SCRIPT), args.model, args.workload, "--dtype", dtype, "--out", f.name,
               "--w2-reps", str(args.w2_reps)] + (["--skip-w1"] if args.skip_w1 else [])
        env = {**os.environ, **extra_env, "PYTHONPATH": checkout}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        res = json.load(open(f.name))
    res["load"] = [load0, os.getloadavg()[0]]
    return res


def main() -> None:
    """Alternate old/new per dtype and round; print a summary and write every run's JSON."""
    runs = []
    for r in range(args.rounds):
        for dtype in args.dtypes:
            for name, checkout in (("old", args.old), ("new", args.new)) if r % 2 == 0 else \
                    (("new", args.new), ("old", args.old)):
                res = one(checkout, dtype, dict(kv.split("=", 1) for kv in args.env_new) if name == "new" else {})
                row = {"round": r, "which": name, "dtype": dtype, "load": res["load"],
                       "w1_out_tok_s": res.get("W1", {}).get("output_tok_s"), "w2_ttft_ms": res["W2"]["ttft_ms"],
                       "w2_tpot_ms": res["W2"]["tpot_ms"], "first16": res["W2"]["first16"]}
                print(json.dumps(row), flush=True)
                runs.append(row)
    summary = {}
    for dtype in args.dtypes:
        best = {}
        for name in ("old", "new"):
            rs = [x for x in runs if x["dtype"] == dtype and x["which"] == name]
            best[name] = {"w2_tpot_ms": min(x["w2_tpot_ms"] for x in rs), "w2_ttft_ms": min(x["w2_ttft_ms"] for x in rs)}
            if not args.skip_w1:
                best[name]["w1_out_tok_s"] = max(x["w1_out_tok_s"] for x in rs)
        best["same_first16"] = len({tuple(x["first16"]) for x in runs if x["dtype"] == dtype}) == 1
        summary[dtype] = best
    print(json.dumps(summary, indent=1))
    if args.out:
        json.dump({"old": args.old, "new": args.new, "runs": runs, "best": summary}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
