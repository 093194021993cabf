"""`llmrt bench structured`: throughput with every request under a JSON schema against the same requests free.

One process, one engine, the same prompts and weights: the runs alternate (free, constrained, free, ...) and the
best of each mode is compared, by wall time and by this process's CPU time (steadier on a shared machine). The schema (an array of at least 64 records with bounded strings, integers and
enums) cannot be finished within the output length, so every constrained sample runs to exactly `--output-len`
tokens like the free ones (`ignore_eos`): the difference is the grammar's cost per step (bitmask fill, apply,
matcher advance), not different amounts of work.

The random 110m model ships a synthetic word-level tokenizer that cannot spell JSON; its grammar is compiled
against a real tokenizer of the same vocabulary size instead (`--tokenizer`, default: the repository's Llama 2
test tokenizer, 32000 ids with byte fallback).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from llmrt.bench import random_model
from llmrt.bench.report import load_average, log, machine_info, now_iso, write_results
from llmrt.table import format_table
from llmrt.bench.prompts import make_prompts, vocab_pool

REPO_LLAMA2_TOKENIZER = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tokenizers" / "llama2"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "age", "role", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the `bench structured` flags on p."""
    p.add_argument("model", nargs="?", default=None, help="local HF model directory (default: --random-model 110m)")
    p.add_argument("--random-model", choices=sorted(random_model.SIZES), default=None,
                   help="a cached random-weight Llama of this size (default 110m when no MODEL is given)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer the grammar is compiled against (default: MODEL's own; with --random-model the "
                        "repository's tests/fixtures/tokenizers/llama2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations dtype (default float32)")
    p.add_argument("--num-prompts", type=int, default=32, help="concurrent requests (default 32)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating; best counts (default 3)")
    p.add_argument("--out-dir", default="benchmarks", help="where results go (default benchmarks/)")
    p.add_argument("--no-save", action="store_true", help="print only; write nothing under --out-dir")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, print it, and save it under --out-dir unless --no-save."""
    from llmrt import LLM, SamplingParams, StructuredOutputs

    size = args.random_model or (None if args.model else "110m")
    model = random_model.cached_random_llama(size, args.dtype) if size else args.model
    tokenizer = args.tokenizer or (str(REPO_LLAMA2_TOKENIZER) if size else model)
    if size and not Path(tokenizer).is_dir():
        raise SystemExit(f"bench: no tokenizer at {tokenizer}; give --tokenizer (same vocabulary size as the model)")
    load = load_average()
    llm = LLM(model, dtype=args.dtype, tokenizer=tokenizer, max_num_seqs=max(args.num_prompts, 1))
    prompts = make_prompts(vocab_pool(model), args.num_prompts, args.prompt_len, args.prompt_len, seed=0)
    free = SamplingParams(max_tokens=args.output_len, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output_len, temperature=1.0, seed=0,
                                 structured=StructuredOutputs(json=SCHEMA))
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured=constrained.structured))  # warm up, compile

    runs: dict[str, list[dict[str, Any]]] = {"free": [], "json_schema": []}
    for _ in range(max(args.repeats, 1)):
        for mode, params in (("free", free), ("json_schema", constrained)):
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            finishes = sorted({o.outputs[0].finish_reason or "" for o in outs})
            runs[mode].append({"seconds": seconds, "cpu_seconds": cpu, "output_tokens": tokens,
                               "output_tok_s": tokens / seconds, "output_tok_per_cpu_s": tokens / cpu,
                               "finish_reasons": finishes})
            log(f"{mode}: {tokens} tokens in {seconds:.2f} s ({cpu:.2f} CPU s) = {tokens / seconds:.1f} tok/s "
                f"({finishes})")
    valid = _valid_prefixes(llm, prompts, constrained)
    best = {mode: max(r, key=lambda x: x["output_tok_s"]) for mode, r in runs.items()}
    loss = 1.0 - best["json_schema"]["output_tok_s"] / best["free"]["output_tok_s"]
    # CPU seconds of this process: on a machine shared with other jobs they move far less than wall time.
    best_cpu = {mode: max(r, key=lambda x: x["output_tok_per_cpu_s"]) for mode, r in runs.items()}
    cpu_loss = 1.0 - best_cpu["json_schema"]["output_tok_per_cpu_s"] / best_cpu["free"]["output_tok_per_cpu_s"]
    rows = [{"mode": m, **{k: v for k, v in best[m].items() if k != "finish_reasons"},
             "best_tok_per_cpu_s": best_cpu[m]["output_tok_per_cpu_s"]} for m in runs]
    print(format_table(rows, ["mode", "output_tokens", ("seconds", "best s"), ("output_tok_s", "out tok/s"),
                              ("best_tok_per_cpu_s", "out tok/CPU-s")]))
    print(f"throughput loss under the JSON schema: {loss * 100:.1f}% wall, {cpu_loss * 100:.1f}% per CPU second "
          "(target < 15%)")
    result = {"date": now_iso(), "model": size or model, "tokenizer": tokenizer, "dtype": args.dtype,
              "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "temperature": 1.0, "repeats": args.repeats},
              "schema": SCHEMA, "runs": runs, "best": best, "throughput_loss": loss,
              "best_per_cpu_second": best_cpu, "throughput_loss_per_cpu_second": cpu_loss,
              "constrained_outputs_are_valid_json_prefixes": valid,
              "machine": machine_info("cpu"), "loadavg_start": load, "loadavg_end": load_average()}
    if not args.no_save:
        summary = {"model": size or Path(model).name, "requests": args.num_prompts, "output_len": args.output_len,
                   "free_tok_s": round(best["free"]["output_tok_s"], 1),
                   "json_tok_s": round(best["json_schema"]["output_tok_s"], 1), "loss_pct": round(loss * 100, 1),
                   "loss_per_cpu_s_pct": round(cpu_loss * 100, 1),
                   "load_start": load, "load_end": result["loadavg_end"]}
        paths = write_results("structured-throughput", result, args.out_dir, summary, key=["model"])
        log(f"wrote {paths[0]} and {paths[1]}")
    return result


def _valid_prefixes(llm: Any, prompts: list[list[int]], params: Any) -> bool:
    """Whether the constrained texts are prefixes of JSON the schema allows (spot check: they start a record
    list and contain no raw control characters)."""
    outs = llm.generate(prompts[:4], params)
    return all(o.outputs[0].text.startswith('{"records": [{"name": "') and
               not any(ord(ch) < 0x20 for ch in o.outputs[0].text) for o in outs)


def main(argv: list[str] | None = None) -> None:
    """Standalone entry point (python -m llmrt.bench.structured)."""
    parser = argparse.ArgumentParser(prog="llmrt bench structured", description=__doc__.splitlines()[0])
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args(argv))["best"], indent=2))


if __name__ == "__main__":
    main()
