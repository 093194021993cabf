"""`llmrt bench throughput`: offline throughput of llmrt against Hugging Face `generate`, on the same prompts.

What it measures, in one process, on one device:
  1. llmrt: every prompt submitted at once to `LLM.generate` (continuous batching decides the rest); output
     tokens/s, total (prompt + output) tokens/s, requests/s, mean TTFT and TPOT from the request metrics.
  2. Hugging Face (`--hf-baseline`, on by default): `AutoModelForCausalLM.generate` on the same token ids and
     weights, in static batches (left padding + attention mask), once per `--hf-batch-sizes` entry; the best
     output tokens/s is the baseline. `--hf-max-prompts K` runs HF on the first K prompts only; the rates are
     per token, so they stay comparable (nothing is scaled).
  3. Single stream (`--single-stream`): one 256-token prompt, 128 output tokens. llmrt: TPOT from its metrics.
     HF: (t(generate 128 tokens) - t(generate 1 token)) / 127, which removes the prefill.
  4. Compute floor: the device's matmul FLOP/s for a [2048, hidden] x [hidden, ffn] GEMM in the run's dtype
     (best of 5); floor_tokens_per_s = flops / (2 * n_params), n_params counting every tensor stored in the
     checkpoint (embeddings and lm_head included, tied weights once). Both systems report the fraction of it
     they reach in total tokens/s.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from llmrt.bench import random_model
from llmrt.bench.hf_baseline import bench_hf, hf_generate, load_hf, single_hf
from llmrt.bench.prompts import count_params, make_prompts, model_config, vocab_pool
from llmrt.bench.report import load_average, log, machine_info, now_iso, write_results
from llmrt.bench.timing import DTYPES, compute_floor, rates
from llmrt.table import format_table



@dataclass
class Workload:
    """The request mix: all lengths in tokens."""

    num_prompts: int = 64
    min_prompt_len: int = 64
    max_prompt_len: int = 512
    output_len: int = 128
    single_prompt_len: int = 256
    single_output_len: int = 128
    temperature: float = 0.0
    seed: int = 0


QUICK = dict(num_prompts=8, min_prompt_len=16, max_prompt_len=64, output_len=16,
             single_prompt_len=32, single_output_len=16)


# ----------------------------------------------------------------------------------------------- arguments

def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the `bench throughput` flags on p."""
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face model directory (default: the embedded stories260K; "
                        "not allowed together with --random-model)")
    p.add_argument("--random-model", choices=sorted(random_model.SIZES), default=None,
                   help="benchmark a random-weight Llama of this size instead of MODEL; built once and cached "
                        "under --cache-dir as <size>-<dtype> (dtype auto builds float32)")
    p.add_argument("--cache-dir", default=None,
                   help="where --random-model checkpoints are cached (default: ~/.cache/llmrt/random-models)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations dtype for llmrt, HF and the GEMM probe "
                        "(auto: the checkpoint's dtype)")
    p.add_argument("--device", default="auto",
                   help="device for both systems and the GEMM probe: auto (cuda if available, else cpu), cpu, cuda")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=None, help="number of requests (default 64; 8 with --quick)")
    g.add_argument("--min-prompt-len", type=int, default=None,
                   help="shortest prompt in tokens; lengths are uniform in [min, max] (default 64; 16 with --quick)")
    g.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt in tokens (default 512; 64 with --quick)")
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request, forced (ignore_eos / min_new_tokens) (default 128; 16 with --quick)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature for both systems; 0 is greedy (default 0)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for prompt lengths and token ids (random ids from the vocabulary, special tokens "
                        "excluded) (default 0)")
    g.add_argument("--quick", action="store_true",
                   help="smoke-test workload: 8 prompts of 16-64 tokens, 16 output tokens, and a 32-token / "
                        "16-output single-stream probe; explicit workload flags still win")
    e = p.add_argument_group("llmrt engine")
    e.add_argument("--max-num-seqs", type=int, default=64, help="llmrt: most sequences per step (default 64)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="llmrt: most tokens per step (default 2048)")
    e.add_argument("--block-size", type=int, default=16, help="llmrt: KV cache block size in tokens (default 16)")
    e.add_argument("--kv-cache-memory", type=int, default=None,
                   help="llmrt: bytes for the KV cache (default: the engine's own budget)")
    h = p.add_argument_group("baselines")
    h.add_argument("--hf-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also time Hugging Face generate on the same prompts and weights (default on)")
    h.add_argument("--hf-batch-sizes", default="8,32",
                   help="comma-separated static batch sizes to try for HF; the best is reported (default 8,32)")
    h.add_argument("--hf-max-prompts", type=int, default=None,
                   help="run HF on only the first K prompts (default: all); per-token rates stay comparable")
    h.add_argument("--single-stream", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure one-request decode latency: 256-token prompt, 128 output tokens; "
                        "HF part only with --hf-baseline (default on)")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="benchmarks",
                   help="where <name>.json and <name>.md are written (default benchmarks)")
    o.add_argument("--name", default=None,
                   help="results file stem (default: throughput-<model>-<dtype>[-quick])")


def resolve_workload(args: argparse.Namespace) -> Workload:
    """The workload from the flags: explicit flags, then --quick values, then the defaults."""
    base = asdict(Workload())
    if args.quick:
        base.update(QUICK)
    for key in ("num_prompts", "min_prompt_len", "max_prompt_len", "output_len"):
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    w = Workload(**{**base, "temperature": args.temperature, "seed": args.seed})
    if w.num_prompts < 1 or w.output_len < 1 or not 1 <= w.min_prompt_len <= w.max_prompt_len:
        raise SystemExit("bench: need --num-prompts >= 1, --output-len >= 1 and 1 <= min-prompt-len <= max-prompt-len")
    return w


def resolve_model(args: argparse.Namespace) -> tuple[str, str, str]:
    """(model dir, short model name, dtype name) from MODEL / --random-model and --dtype."""
    from llmrt.config import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, parse_dtype

    if args.model and args.random_model:
        raise SystemExit("bench: give either MODEL or --random-model, not both")
    if args.random_model:
        dtype = "float32" if args.dtype == "auto" else args.dtype
        log(f"random model {args.random_model} ({dtype}): building or reusing the cached checkpoint")
        path = random_model.cached_random_llama(args.random_model, dtype, args.cache_dir)
        return path, f"random-{args.random_model}", dtype
    path = args.model or str(DEFAULT_MODEL_DIR)
    hf_config = json.loads((Path(path) / "config.json").read_text())
    dtype = str(parse_dtype(args.dtype, hf_config)).replace("torch.", "")
    return path, (Path(path).resolve().name if args.model else DEFAULT_MODEL_NAME), dtype


def resolve_device(name: str) -> str:
    """auto -> cuda when available, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


# ------------------------------------------------------------------------------------------------ llmrt

def load_llmrt(model_dir: str, dtype: str, device: str, args: argparse.Namespace) -> Any:
    """An llmrt LLM with the engine flags passed through."""
    from llmrt import LLM

    return LLM(model_dir, dtype=dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               kv_cache_memory=args.kv_cache_memory, device=device)


def llmrt_params(output_len: int, temperature: float) -> Any:
    """Forced-length SamplingParams: exactly output_len tokens, EOS ignored."""
    from llmrt import SamplingParams

    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature)


def bench_llmrt(llm: Any, prompts: list[list[int]], w: Workload) -> dict[str, Any]:
    """Time one generate over all prompts; rates plus mean TTFT / TPOT from the request metrics."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, llmrt_params(w.output_len, w.temperature))
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != w.output_len * len(prompts):
        log(f"warning: llmrt produced {n_out} output tokens, expected {w.output_len * len(prompts)}")
    res = rates(elapsed, len(prompts), sum(map(len, prompts)), n_out)
    res["mean_ttft_s"] = _mean([o.metrics.ttft for o in outs])
    res["mean_tpot_s"] = _mean([o.metrics.tpot for o in outs])
    res["mean_e2e_s"] = _mean([o.metrics.e2e for o in outs])
    return res


def single_llmrt(llm: Any, prompt: list[int], w: Workload) -> dict[str, Any]:
    """One request alone: its TTFT and TPOT from the metrics."""
    out = llm.generate([prompt], llmrt_params(w.single_output_len, w.temperature))[0]
    return {"ttft_s": out.metrics.ttft, "tpot_s": out.metrics.tpot, "output_tokens": len(out.outputs[0].token_ids)}


# ------------------------------------------------------------------------------------------------ Hugging Face

def parse_sizes(text: str) -> list[int]:
    """'8,32' -> [8, 32]."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bench: --hf-batch-sizes must be comma-separated integers, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"bench: --hf-batch-sizes needs positive integers, got {text!r}")
    return sizes


# ------------------------------------------------------------------------------------------------ run

def check_fits(cfg: dict[str, Any], w: Workload) -> None:
    """Refuse a workload longer than the model's context before loading anything."""
    limit = int(cfg.get("max_position_embeddings") or 2048)
    need = max(w.max_prompt_len + w.output_len, w.single_prompt_len + w.single_output_len)
    if need > limit:
        raise SystemExit(f"bench: prompt + output reaches {need} tokens, over the model's {limit}")


def run_llmrt(model_dir: str, dtype: str, device: str, args: argparse.Namespace, w: Workload,
              prompts: list[list[int]], pool: torch.Tensor) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Load llmrt, warm up, time the workload, then the single-stream probe."""
    log("llmrt: loading")
    llm = load_llmrt(model_dir, dtype, device, args)
    warm = make_prompts(pool, 2, 8, 16, w.seed + 1)
    llm.generate(warm, llmrt_params(4, w.temperature))
    log(f"llmrt: {len(prompts)} prompts")
    res = bench_llmrt(llm, prompts, w)
    single = None
    if args.single_stream:
        log("llmrt: single stream")
        single = single_llmrt(llm, make_prompts(pool, 1, w.single_prompt_len, w.single_prompt_len, w.seed + 2)[0], w)
    del llm
    gc.collect()
    return res, single


def run_hf(model_dir: str, dtype: str, device: str, args: argparse.Namespace, w: Workload,
           prompts: list[list[int]], pool: torch.Tensor) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Load the HF model, warm up, time each batch size, then the single-stream probe."""
    log("hf: loading")
    model = load_hf(model_dir, dtype, device)
    hf_generate(model, make_prompts(pool, 2, 8, 16, w.seed + 1), 4, w.temperature, device)
    subset = prompts[:args.hf_max_prompts] if args.hf_max_prompts else prompts
    res = bench_hf(model, subset, parse_sizes(args.hf_batch_sizes), w, device)
    single = None
    if args.single_stream:
        log("hf: single stream")
        single = single_hf(model, make_prompts(pool, 1, w.single_prompt_len, w.single_prompt_len, w.seed + 2)[0],
                           w, device)
    del model
    gc.collect()
    return res, single


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summarize(result: dict[str, Any]) -> None:
    """Add the floor fractions and llmrt/HF ratios to result in place."""
    floor = result["floor"]["floor_tokens_per_s"]
    llmrt, hf, single = result["llmrt"], result["hf"], result["single_stream"]
    llmrt["floor_fraction"] = llmrt["total_tokens_per_s"] / floor
    if hf:
        hf["floor_fraction"] = hf["total_tokens_per_s"] / floor
        for r in hf["runs"]:
            r["floor_fraction"] = r["total_tokens_per_s"] / floor
        result["llmrt_vs_hf_output_tokens_per_s"] = _ratio(llmrt["output_tokens_per_s"], hf["output_tokens_per_s"])
    if single:
        single["llmrt_vs_hf_speed"] = _ratio(single.get("hf_tpot_s"), single.get("llmrt_tpot_s"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by args; print the report, write json + md, return the result dict."""
    w = resolve_workload(args)
    load_start = load_average()
    model_dir, model_name, dtype = resolve_model(args)
    device = resolve_device(args.device)
    cfg = model_config(model_dir)
    check_fits(cfg, w)
    pool = vocab_pool(model_dir)
    prompts = make_prompts(pool, w.num_prompts, w.min_prompt_len, w.max_prompt_len, w.seed)
    n_params = count_params(model_dir)
    log(f"compute floor: {dtype} GEMM probe")
    floor = compute_floor(cfg, dtype, device, n_params)
    llmrt_res, llmrt_single = run_llmrt(model_dir, dtype, device, args, w, prompts, pool)
    hf_res, hf_single = run_hf(model_dir, dtype, device, args, w, prompts, pool) if args.hf_baseline else (None, None)
    single = None
    if args.single_stream:
        single = {"prompt_len": w.single_prompt_len, "output_len": w.single_output_len,
                  "llmrt_tpot_s": llmrt_single["tpot_s"], "llmrt_ttft_s": llmrt_single["ttft_s"],
                  "hf_tpot_s": hf_single["tpot_s"] if hf_single else None, "hf": hf_single}
    name = args.name or f"throughput-{model_name}-{dtype}" + ("-quick" if args.quick else "")
    result: dict[str, Any] = {
        "name": name, "date": now_iso(), "model": str(model_dir), "model_name": model_name,
        "random_model": args.random_model, "dtype": dtype, "device": device, "n_params": n_params,
        "n_params_note": "every tensor in the checkpoint's safetensors (embeddings and lm_head included, "
                         "tied weights once)",
        "workload": asdict(w),
        "engine_args": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                        "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory},
        "llmrt": llmrt_res, "hf": hf_res, "llmrt_vs_hf_output_tokens_per_s": None,
        "single_stream": single, "floor": floor, "machine": machine_info(device), "versions": versions(),
        "load_avg_1m": {"start": load_start, "end": load_average()},
    }
    summarize(result)
    print(render(result), flush=True)
    paths = write_results(name, result, args.output_dir, summary=md_summary(result),
                          key=["model", "prompts", "in len", "out len", "hf prompts"])
    log(f"wrote {paths[0]} and {paths[1]}")
    return result


def versions() -> dict[str, str]:
    """torch, transformers and llmrt versions."""
    import transformers

    try:
        from importlib.metadata import version
        llmrt_version = version("llmrt")
    except Exception:
        llmrt_version = "unknown"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "llmrt": llmrt_version}


# ------------------------------------------------------------------------------------------------ report

def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else x * 1000.0


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row for llmrt and one per HF batch size."""
    rows = []
    l = result["llmrt"]
    rows.append({"system": "llmrt", "prompts": l["num_requests"], "batch": f"<= {result['engine_args']['max_num_seqs']}",
                 **{k: l[k] for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")},
                 "ttft_ms": _ms(l["mean_ttft_s"]), "tpot_ms": _ms(l["mean_tpot_s"]), "floor_pct": 100 * l["floor_fraction"]})
    for r in (result["hf"] or {}).get("runs", []):
        best = r["batch_size"] == result["hf"]["best_batch_size"]
        rows.append({"system": "hf generate" + (" (best)" if best else ""), "prompts": r["num_requests"],
                     "batch": r["batch_size"],
                     **{k: r[k] for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")},
                     "floor_pct": 100 * r["floor_fraction"]})
    return rows


COLUMNS = [("system", "system"), ("prompts", "prompts"), ("batch", "batch"), ("requests_per_s", "req/s"),
           ("output_tokens_per_s", "output tok/s"), ("total_tokens_per_s", "total tok/s"),
           ("ttft_ms", "mean TTFT ms"), ("tpot_ms", "mean TPOT ms"), ("floor_pct", "% of floor")]


def render(result: dict[str, Any]) -> str:
    """The human-readable report."""
    w, f = result["workload"], result["floor"]
    lines = [f"llmrt bench throughput: {result['model_name']} ({result['n_params'] / 1e6:.1f}M params), "
             f"{result['dtype']} on {result['device']} ({result['machine']['cpu']}, "
             f"{result['machine']['torch_threads']} torch threads; 1-min load average "
             f"{result['load_avg_1m']['start']} at start, {result['load_avg_1m']['end']} at end)",
             f"workload: {w['num_prompts']} prompts of {w['min_prompt_len']}-{w['max_prompt_len']} tokens, "
             f"{w['output_len']} output tokens each, temperature {w['temperature']}", "",
             format_table(table_rows(result), COLUMNS), ""]
    if result["llmrt_vs_hf_output_tokens_per_s"] is not None:
        lines.append(f"llmrt / HF (best batch {result['hf']['best_batch_size']}) output tok/s: "
                     f"{result['llmrt_vs_hf_output_tokens_per_s']:.2f}x")
    s = result["single_stream"]
    if s:
        hf_part = (f", HF {_ms(s['hf_tpot_s']):.2f} ms -> llmrt/HF speed {s['llmrt_vs_hf_speed']:.2f}x"
                   if s.get("llmrt_vs_hf_speed") else "")
        tpot = f"{_ms(s['llmrt_tpot_s']):.2f} ms" if s["llmrt_tpot_s"] is not None else "-"
        lines.append(f"single stream ({s['prompt_len']}-token prompt, {s['output_len']} output): "
                     f"llmrt TPOT {tpot}{hf_part}")
    m, k, n = f["gemm_shape"]
    probes = ", ".join(f"{d} {v / 1e9:.1f}" for d, v in f.get("probes_flops_per_s", {}).items())
    lines += [f"compute floor: GEMM [{m}x{k}]x[{k}x{n}] best of ({probes}) = {f['flops_per_s'] / 1e9:.1f} GFLOP/s / "
              f"(2 x {result['n_params'] / 1e6:.2f}M params) = {f['floor_tokens_per_s']:,.1f} total tok/s",
              f"  (n_params: {result['n_params_note']})"]
    return "\n".join(lines)


def md_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The Markdown row: configuration and headline figures."""
    w, l, h, s = result["workload"], result["llmrt"], result["hf"] or {}, result["single_stream"] or {}
    return {"model": result["model_name"], "prompts": w["num_prompts"],
            "in len": f"{w['min_prompt_len']}-{w['max_prompt_len']}", "out len": w["output_len"],
            "llmrt out tok/s": l["output_tokens_per_s"], "llmrt total tok/s": l["total_tokens_per_s"],
            "hf prompts": h.get("num_requests"), "hf best batch": h.get("best_batch_size"),
            "hf out tok/s": h.get("output_tokens_per_s"), "llmrt/hf": result["llmrt_vs_hf_output_tokens_per_s"],
            "llmrt TPOT ms (1 stream)": _ms(s.get("llmrt_tpot_s")), "hf TPOT ms (1 stream)": _ms(s.get("hf_tpot_s")),
            "floor tok/s": result["floor"]["floor_tokens_per_s"], "llmrt of floor": l["floor_fraction"],
            "hf of floor": h.get("floor_fraction")}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """`python -m llmrt.bench.throughput ...`: the same as `llmrt bench throughput ...`."""
    p = argparse.ArgumentParser(prog="llmrt bench throughput", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
