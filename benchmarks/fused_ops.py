"""The fused CPU layer ops on and off in one process, alternating blocks of decode steps (llmrt/model/layers/fused.py).

Loads the peers' model with the offline LLM, starts W2's prompt (one sequence) or 64 of W1's prompts (cut to 64
tokens, so the prefill is short), and then times engine steps in alternating blocks with every layer's `fused` flag
on and off (the torch ops are the off side; everything else is the same process and cache). Reports the median
wall and process-CPU step time of each side and their ratios, per workload and dtype, with the load average (run
it with OMP_NUM_THREADS=1 on a loaded host: CPU time then counts the work, not the waits for a time slice).

usage: python fused_ops.py MODEL_DIR WORKLOAD_JSON [--dtypes bfloat16 float32] [--blocks 6] [--steps 8] [--out FILE]
"""
import argparse
import json
import os
import time
from statistics import median

from llmrt import LLM, SamplingParams
from llmrt.model.layers.fused import fused_ops, set_fused

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
ap.add_argument("--blocks", type=int, default=6, help="blocks per side (default 6)")
ap.add_argument("--steps", type=int, default=8, help="engine steps per block (default 8)")
ap.add_argument("--out")
args = ap.parse_args()


def alternate(llm: LLM, model) -> dict:
    """Per-step ms of `blocks` alternating blocks on each side."""
    times = {"fused": [], "torch": []}
    cpu = {"fused": [], "torch": []}  # process CPU time: on an oversubscribed host less bent by time slicing
    for b in range(2 * args.blocks):
        side = ("fused", "torch")[b % 2] if (b // 2) % 2 == 0 else ("torch", "fused")[b % 2]
        set_fused(model, side == "fused")
        for _ in range(args.steps):
            t, c = time.perf_counter(), time.process_time()
            llm._step()
            times[side].append((time.perf_counter() - t) * 1e3)
            cpu[side].append((time.process_time() - c) * 1e3)
    set_fused(model, True)
    res = {f"{k}_median_ms": median(v) for k, v in times.items()}
    res.update({f"{k}_median_cpu_ms": median(v) for k, v in cpu.items()})
    res["torch_over_fused"] = res["torch_median_ms"] / res["fused_median_ms"]
    res["torch_over_fused_cpu"] = res["torch_median_cpu_ms"] / res["fused_median_cpu_ms"]
    return res


def main() -> None:
    """Both workloads in each dtype; print and write the JSON."""
    wl = json.load(open(args.workload))
    ops = fused_ops()
    assert ops is not None, "the fused ops did not load (LLMRT_FUSED=0 or no compiler)"
    out = {"isa": ops.isa, "load_start": os.getloadavg(), "date": time.ctime(), "steps_per_block": args.steps,
           "blocks_per_side": args.blocks}
    for dtype in args.dtypes:
        llm = LLM(args.model, dtype=dtype, max_model_len=1024, max_num_seqs=64, kv_cache_memory=2 << 30,
                  enable_prefix_caching=False)
        model = llm.engine.executor.worker.model_runner.model
        greedy = SamplingParams(max_tokens=2 * args.blocks * args.steps + 8, temperature=0.0, ignore_eos=True)
        rid = llm._submit([wl["W2"]["prompt"]], [greedy])[0]
        for _ in range(4):
            llm._step()
        out[f"W2_{dtype}"] = alternate(llm, model)
        llm.engine.abort_request(rid)
        llm.processor.abort(rid)
        prompts = [p[:64] for p in wl["W1"]["prompts"][:64]]
        llm._submit(prompts, [greedy] * len(prompts))
        for _ in range(4):
            llm._step()
        out[f"W1_64seqs_{dtype}"] = alternate(llm, model)
        print(dtype, out[f"W2_{dtype}"], out[f"W1_64seqs_{dtype}"], flush=True)
        del llm
    out["load_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
