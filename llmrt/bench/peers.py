"""llmrt beside its peers on the same model, workloads and machine: HF transformers, vLLM's CPU build and llama.cpp
(llama-cpp-python), each run from its own virtualenv as a separate process, in alternating rounds.

Runs benchmarks/peers/bench_{llmrt,hf,vllm,llamacpp}.py for W1 (64 requests, prompts 64-512, 128 forced output
tokens: output tok/s) and W2 (one 256-token prompt, 128 output tokens: TTFT, TPOT) in each dtype, times cold
starts (process spawn to exit after the first token) against `python -c "import torch"`, runs floors.py (GEMM
FLOP/s, memory bandwidth), and writes one table of best-of-rounds figures, ratios and fractions of the floors to
benchmarks/peers-<isa>.{json,md}. The model and workload come from benchmarks/peers/make_model.py (see
benchmarks/peers/README.md for installing the peers).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import llmrt
from llmrt.bench.peers_report import best_of, isa_flags, markdown, ratios

REPO = Path(llmrt.__file__).resolve().parents[1]
SCRIPTS = REPO / "benchmarks" / "peers"
DTYPE_DIRS = {"float32": "llama-syn-f32", "bfloat16": "llama-syn-bf16"}
GGUF = {"float32": "llama-syn-f32.gguf", "bfloat16": "llama-syn-bf16.gguf"}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `llmrt bench peers`."""
    p.add_argument("--models", default="/tmp/peers/models",
                   help="folder with llama-syn-f32/, llama-syn-bf16/, workload.json and the GGUFs (make_model.py)")
    p.add_argument("--hf-python", help="python of the HF transformers virtualenv (or the venv folder); skipped if unset")
    p.add_argument("--vllm-python", help="python of the vllm-cpu virtualenv (or the venv folder); skipped if unset")
    p.add_argument("--llama-python", help="python of the llama-cpp-python virtualenv (or the venv folder)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPE_DIRS))
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds of W1/W2; the best counts (default 2; 0: cold starts only)")
    p.add_argument("--cold-rounds", type=int, default=3, help="alternating rounds of cold starts (default 3)")
    p.add_argument("--skip-w1", action="store_true", help="W2 only (W1 takes minutes per peer)")
    p.add_argument("--only", nargs="+", choices=["llmrt", "hf", "vllm", "llama.cpp"], help="run only these systems")
    p.add_argument("--hf-batch", type=int, default=32, help="HF generate's static batch for W1 (default 32)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--name", help="output name (default: peers-<isa>)")


def _python(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    p = Path(path)
    return str(p / "bin" / "python") if p.is_dir() else str(p)


def _systems(args: argparse.Namespace) -> dict[str, str]:
    """system -> the python that runs it, for the systems given."""
    found = {"llmrt": sys.executable, "hf": _python(args.hf_python), "vllm": _python(args.vllm_python),
             "llama.cpp": _python(args.llama_python)}
    return {k: v for k, v in found.items() if v and (not args.only or k in args.only)}


def _command(system: str, python: str, dtype: str, models: Path, out: str, args: argparse.Namespace) -> list[str]:
    wl = str(models / "workload.json")
    model = str(models / DTYPE_DIRS[dtype])
    skip = ["--skip-w1"] if args.skip_w1 else []
    if system == "llmrt":
        return [python, str(SCRIPTS / "bench_llmrt.py"), model, wl, "--dtype", dtype, "--out", out, *skip]
    if system == "hf":
        short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        return [python, str(SCRIPTS / "bench_hf.py"), model, wl, "--dtype", short, "--batch", str(args.hf_batch),
                "--out", out, *skip]
    if system == "vllm":
        if args.skip_w1:
            raise ValueError("bench_vllm.py always runs W1")
        return [python, str(SCRIPTS / "bench_vllm.py"), model, wl, "--dtype", dtype, "--out", out]
    return [python, str(SCRIPTS / "bench_llamacpp.py"), str(models / GGUF[dtype]), wl, "--out", out, *skip]


def _env(system: str) -> dict[str, str]:
    env = dict(os.environ)
    if system == "llmrt":  # the llmrt these figures are for: this checkout, not whatever is installed
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    else:
        env.pop("PYTHONPATH", None)
    if system == "vllm":
        env.update(VLLM_ENV)
    return env


def _run_once(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, int, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t, proc.returncode, (proc.stdout + proc.stderr)[-2000:]


def run_workloads(args: argparse.Namespace, systems: dict[str, str], models: Path) -> dict[str, Any]:
    """Every system on W1/W2 in each dtype, `rounds` times, the order reversed every other round."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {d: {s: [] for s in systems} for d in args.dtypes}
    order = list(systems)
    for r in range(args.rounds):
        for dtype in args.dtypes:
            for system in (order if r % 2 == 0 else order[::-1]):
                if system == "llama.cpp" and not (models / GGUF[dtype]).exists():
                    continue
                if system == "vllm" and args.skip_w1:
                    continue
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    out = f.name
                load = os.getloadavg()[0]
                cmd = _command(system, systems[system], dtype, models, out, args)
                wall, rc, tail = _run_once(cmd, _env(system), args.timeout)
                result: dict[str, Any] = {"round": r, "load_before": round(load, 2), "wall_s": round(wall, 1)}
                if rc == 0 and os.path.getsize(out):
                    result.update(json.load(open(out)))
                else:
                    result["error"] = f"exit {rc}: {tail}"
                os.unlink(out)
                runs[dtype][system].append(result)
                print(f"round {r} {dtype} {system}: " + (result.get("error") or
                      f"W1 {result.get('W1', {})} W2 TTFT {result['W2']['ttft_ms']:.0f} ms "
                      f"TPOT {result['W2']['tpot_ms']:.1f} ms"), flush=True)
    return runs


def run_cold_starts(args: argparse.Namespace, systems: dict[str, str], models: Path) -> dict[str, list[float]]:
    """Wall seconds from spawn to exit after one generated token, beside `import torch` and `llmrt --help`."""
    py = sys.executable
    gen = [py, "-m", "llmrt.cli", "generate", "--prompt", "Once upon a time", "--max-tokens", "1", "--temperature", "0"]
    cases: dict[str, tuple[list[str], str]] = {
        "python -c 'import torch'": ([py, "-c", "import torch"], "llmrt"),
        "llmrt --help": ([py, "-m", "llmrt.cli", "--help"], "llmrt"),
        "llmrt generate (embedded stories260K)": (gen, "llmrt"),
    }
    for dtype in args.dtypes:
        cases[f"llmrt generate (124.7M, {dtype})"] = (gen[:4] + [str(models / DTYPE_DIRS[dtype])] + gen[4:]
                                                      + ["--dtype", dtype], "llmrt")
    if "hf" in systems:
        cases["HF transformers (124.7M, bfloat16)"] = ([systems["hf"], str(SCRIPTS / "cold_hf.py"),
                                                        str(models / DTYPE_DIRS["bfloat16"])], "hf")
    if "llama.cpp" in systems and (models / GGUF["bfloat16"]).exists():
        cases["llama.cpp (124.7M, BF16 GGUF)"] = ([systems["llama.cpp"], str(SCRIPTS / "cold_llama.py"),
                                                  str(models / GGUF["bfloat16"])], "llama.cpp")
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.cold_rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            cmd, system = cases[name]
            wall, rc, tail = _run_once(cmd, _env(system), args.timeout)
            if rc != 0:
                raise RuntimeError(f"cold start {name!r} failed: {tail}")
            times[name].append(round(wall, 3))
        print(f"cold round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    return times


def run_floors(models: Path) -> dict[str, Any]:
    """floors.py's GEMM FLOP/s, bandwidth and the workloads' floors, in this python."""
    out = subprocess.run([sys.executable, str(SCRIPTS / "floors.py"), str(models / "workload.json")],
                         capture_output=True, text=True, check=True, env=_env("llmrt"))
    return json.loads(out.stdout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run everything, print the table, write JSON + Markdown."""
    from llmrt.bench.report import machine_info, now_iso

    models = Path(args.models)
    if not (models / "workload.json").exists():
        raise SystemExit(f"{models}/workload.json not found: build it with benchmarks/peers/make_model.py")
    systems = _systems(args)
    result: dict[str, Any] = {"date": now_iso(), "machine": {**machine_info(), "isa": isa_flags()},
                              "load_average_start": os.getloadavg(), "systems": {k: v for k, v in systems.items()},
                              "rounds": args.rounds, "argv": sys.argv[1:]}
    result["floors"] = run_floors(models)
    result["runs"] = run_workloads(args, systems, models)
    result["best"] = {d: {s: best_of(rs) for s, rs in by.items()} for d, by in result["runs"].items()}
    result["ratios"] = ratios(result["best"], result["floors"])
    result["cold_start_s"] = run_cold_starts(args, systems, models) if args.cold_rounds else {}
    result["load_average_end"] = os.getloadavg()
    name = args.name or "peers-" + ("avx512bf16" if "avx512_bf16" in result["machine"]["isa"] else
                                    "avx512" if "avx512f" in result["machine"]["isa"] else "avx2")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / f"{name}.md").write_text(text)
    print(text)
    return result
