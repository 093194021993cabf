"""Where one engine step's time goes: W2 (one sequence decoding) and W1 (64 sequences decoding, mid-workload).

Runs the offline LLM on the peers' model, then profiles `steps` engine steps with torch.profiler, with ranges
around the parts: scheduler, input preparation (runner._prepare), model forward, attention backend, sampler,
output processing. Reported per step: GEMMs (aten::linear, inclusive, plus llmrt's linear kernels and oneDNN's
linear on prepacked weights), the fused
layer ops (llmrt_fused_*), attention (backend forward, of which KV
writes = index_copy_ and KV gathers = index_select), sampling, input preparation, and the rest of the step
(Python and scheduler overhead, norms/rotary/activations), plus the counts of tensor allocations (aten::empty*) and
of profiled ops (every aten::/llmrt* call, nested ones included).
The profiler's own overhead inflates the Python share; compare before/after runs of this script only.

usage: python profile_step.py MODEL_DIR WORKLOAD_JSON [--dtype float32] [--steps 8] [--attention-backend auto]
"""
import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from llmrt import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--attention-backend", default="auto")
ap.add_argument("--w1-seqs", type=int, default=64)
args = ap.parse_args()


def wrap(obj, name: str, label: str) -> None:
    """Put obj.name inside a profiler range called `label`."""
    fn = getattr(obj, name)

    def inner(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    setattr(obj, name, inner)


def breakdown(llm: LLM, steps: int) -> dict:
    """Profile `steps` engine steps; per-step milliseconds by part."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            with record_function("#step"):
                llm._step()
        wall = time.perf_counter() - t
    ev = {e.key: e for e in prof.key_averages()}

    def ms(key: str) -> float:
        return ev[key].cpu_time_total / 1e3 / steps if key in ev else 0.0
    allocs = sum(e.count for k, e in ev.items() if k.startswith("aten::empty")) / steps
    # llmrt's own GEMV kernels (torch.ops.llmrt_<isa>.linear_*) and oneDNN on prepacked dense copies
    # (mkldnn::_linear_pointwise) are called directly, not through aten::linear.
    gemm = ms("aten::linear") + ms("mkldnn::_linear_pointwise") + sum(
        ms(k) for k in ev if k.startswith("llmrt_") and "::linear_" in k)
    fused = sum(ms(k) for k in ev if k.startswith("llmrt_fused"))
    ops = sum(e.count for k, e in ev.items() if "::" in k and not k.startswith("#")) / steps
    parts = {"step_wall_ms": wall * 1e3 / steps, "profiled_step_ms": ms("#step"), "gemm_ms": gemm,
             "fused_ops_ms": fused, "ops_per_step": ops,
             "attention_ms": ms("#attention"), "kv_write_ms": ms("aten::index_copy_"),
             "kv_gather_ms": ms("aten::index_select"), "sdpa_ms": ms("aten::scaled_dot_product_attention"),
             "sampler_ms": ms("#sampler"), "prepare_inputs_ms": ms("#prepare"), "forward_ms": ms("#forward"),
             "scheduler_ms": ms("#schedule"), "tensor_allocations_per_step": allocs}
    parts["rest_of_forward_ms"] = parts["forward_ms"] - parts["gemm_ms"] - parts["attention_ms"]
    parts["outside_runner_ms"] = parts["profiled_step_ms"] - ms("#execute")
    return parts


def main() -> None:
    """Profile a W2 step and a W1 step, print JSON."""
    wl = json.load(open(args.workload))
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=64, kv_cache_memory=2 << 30,
              enable_prefix_caching=False, attention_backend=args.attention_backend)
    runner = llm.engine.executor.worker.model_runner
    wrap(runner, "_prepare", "#prepare")
    wrap(runner, "execute", "#execute")
    wrap(runner.model, "forward", "#forward")
    wrap(runner.attn_backend, "forward", "#attention")
    wrap(runner.sampler, "forward", "#sampler")
    wrap(llm.engine.scheduler, "schedule", "#schedule")
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    out = {"dtype": args.dtype, "threads": torch.get_num_threads(),
           "attention_backend": type(runner.attn_backend).name}
    # W2: one sequence, 256-token prompt, profiled 32 tokens into its decode.
    (w2,) = llm._submit([wl["W2"]["prompt"]], [greedy])
    for _ in range(32):
        llm._step()
    out["W2_decode_step"] = breakdown(llm, args.steps)
    llm.engine.abort_request(w2)
    llm.processor.abort(w2)
    # W1: 64 sequences decoding together, profiled once every prompt is in and 32 tokens are out.
    llm._submit(wl["W1"]["prompts"][:args.w1_seqs], [greedy] * args.w1_seqs)
    sched = llm.engine.scheduler
    while sched.num_waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running):
        llm._step()
    for _ in range(32):
        llm._step()
    out["W1_decode_step_64_seqs"] = breakdown(llm, max(2, args.steps // 2))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
