"""Wall-clock breakdown of a W2 decode step (one sequence), without torch.profiler's per-op overhead.

Wraps the step's parts (engine step, runner input preparation, model forward, every Linear, the attention backend
and its decode kernel, norms, rotary, activation, embedding, logits, sampler, output processing) with
perf_counter timers, runs W2 (256-token prompt, 128 output tokens) `--reps` times and reports per decode step the
median over the reps of each part's mean, plus the TPOT of an unwrapped run in the same process (the wrappers cost
~0.3 us a call, ~130 calls a step). "model python" is the model forward minus the timed parts inside it.

usage: python decode_breakdown.py MODEL WORKLOAD [--dtype bfloat16] [--quantization int4] [--reps 3] [--out F]
"""
import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from llmrt import LLM, SamplingParams
from llmrt.engine.core import EngineCore
from llmrt.engine.llm import LLM as _LLM
from llmrt.engine.output_processor import OutputProcessor
from llmrt.model.layers.activation import GatedActivation
from llmrt.model.layers.embedding import Embedding
from llmrt.model.layers.linear import Linear
from llmrt.model.layers.norms import RMSNorm
from llmrt.model.layers.rotary import RotaryEmbedding
from llmrt.model.layers.sampler import Sampler
from llmrt.worker.model_runner import ModelRunner

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--quantization")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
ap.add_argument("--out")
args = ap.parse_args()

TOTAL: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
ON = [False]


def timed(owner, name: str, label: str) -> None:
    """Accumulate the wall time of owner.name (a class attribute or an instance's) under `label`."""
    fn = getattr(owner, name)

    def inner(*a, **k):
        if not ON[0]:
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTAL[label] += time.perf_counter() - t
            CALLS[label] += 1
    setattr(owner, name, inner)


def main() -> None:
    """Breakdown of W2 decode steps, as JSON on stdout (and --out)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = json.load(open(args.workload))["W2"]["prompt"]
    kw = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory=256 << 20, **kw)
    runner = llm.engine.executor.worker.model_runner
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731

    def tpot() -> float:
        t = time.perf_counter()
        llm.generate([prompt], sp(1), use_tqdm=False)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([prompt], sp(128), use_tqdm=False)
        return (time.perf_counter() - t - ttft) / 127 * 1e3

    tpot()
    plain = [tpot() for _ in range(args.reps)]
    for owner, name, label in [(_LLM, "_step", "step"), (EngineCore, "step", "engine_step"),
                               (ModelRunner, "execute", "execute"), (ModelRunner, "_prepare", "prepare"),
                               (ModelRunner, "model_inputs", "model_inputs"), (type(runner.model), "forward", "model"),
                               (type(runner.model), "compute_logits", "logits"), (Linear, "forward", "linear"),
                               (type(runner.attn_backend), "forward", "attention"), (RMSNorm, "forward", "norm"),
                               (RotaryEmbedding, "forward", "rotary"), (GatedActivation, "forward", "act"),
                               (Embedding, "forward", "embed"), (Sampler, "sample", "sampler"),
                               (OutputProcessor, "process", "output_processing")]:
        timed(owner, name, label)
    from llmrt.attention import cpu_paged
    kernels = cpu_paged.load_kernel()
    if hasattr(kernels, "decode_write"):  # the kernel ops themselves (decode_write also stores the new K/V)
        for field in ("decode", "decode_write", "cache_write"):
            fn = getattr(kernels, field)
            holder = type("H", (), {field: staticmethod(fn)})
            timed(holder, field, "attention_kernel")
            object.__setattr__(kernels, field, getattr(holder, field))
    else:  # older checkouts: the decode kernel behind _decode, K/V stored by index_copy_ outside it
        timed(type(runner.attn_backend), "_decode", "attention_kernel")
    reps = []
    for _ in range(args.reps):
        llm.generate([prompt], sp(1), use_tqdm=False)  # the prompt's blocks prefix-cached, as in the plain runs
        llm._submit([prompt], [sp(128)])
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        while llm.engine.has_unfinished_requests():
            TOTAL.clear()
            ON[0] = True
            llm._step()
            ON[0] = False
            if llm.engine.last_step_tokens == 1:
                steps += 1
                for k, v in TOTAL.items():
                    sums[k] += v
        reps.append({k: v / steps * 1e3 for k, v in sums.items()})
    med = {k: statistics.median(r.get(k, 0.0) for r in reps) for k in reps[0]}
    inner = sum(med.get(k, 0.0) for k in ("linear", "attention", "norm", "rotary", "act", "embed"))
    med["model_python"] = med["model"] - inner + med["logits"]  # "linear" includes the LM head, called in logits
    med["execute_rest"] = med["execute"] - med["prepare"] - med["model_inputs"] - med["model"] - med["logits"] \
        - med["sampler"]
    med["outside_execute"] = med["step"] - med["execute"]
    med["attention_outside_kernel"] = med["attention"] - med.get("attention_kernel", 0.0)
    res = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
           "threads": torch.get_num_threads(), "load": os.getloadavg()[0], "plain_tpot_ms": plain,
           "wrapped_decode_step_ms_median": med}
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
