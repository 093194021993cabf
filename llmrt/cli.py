"""The `llmrt` command: generate, serve, route, bench (throughput, serve, structured, spec, mixed, prefix, context,
router, quality, peers, parallel), plan, quantize, regress (record, compare), tokens."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable, Optional, Sequence


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a completion (or a chat reply) for one prompt."""
    from llmrt import LLM, SamplingParams
    from llmrt.engine_args import engine_kwargs

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop or None,
                            repetition_penalty=args.repetition_penalty, ignore_eos=args.ignore_eos)
    prompt: Any = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        sys.stdout.write(args.prompt)
    first = True
    try:
        for piece in llm.stream(prompt, params):
            if first:
                first = False
                llm.startup.mark("first token")
                logging.getLogger("llmrt.engine.llm").info("to the first token: %s", llm.startup.describe())
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.shutdown()
    return 0


def _exit_without_teardown(rc: int) -> None:
    """End the process now that `llmrt generate` has written its text, or `llmrt serve` has stopped serving, and
    each has stopped its engine: the interpreter's teardown of torch and the model has nothing left to do but took
    0.4-0.6 s for generate (2 cores; `python -c "import torch"` alone spends ~0.4 s in it), a third of the
    command's cost over `import torch`, and 1.0 s of serve's 1.6 s from SIGTERM to exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)


def _add_generate(gen: argparse.ArgumentParser) -> None:
    from llmrt.config import DEFAULT_MODEL_NAME
    from llmrt.engine_args import add_engine_arguments

    gen.add_argument("model", nargs="?", default=None,
                     help=f"local HF checkpoint directory (default: the embedded {DEFAULT_MODEL_NAME})")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default: 0.8)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0 = off (default: 0)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens under min-p x the top probability")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style repetition penalty")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    gen.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                     help="seed of this request's sampling: the same seed gives the same text")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)


def _add_serve(serve: argparse.ArgumentParser) -> None:
    from llmrt.config import DEFAULT_MODEL_NAME
    from llmrt.engine_args import add_engine_arguments
    from llmrt.server.launch import add_serve_arguments, run_server

    serve.description = ("Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                         "/v1/models, /tokenize, /detokenize, /health, /version), with Prometheus metrics at "
                         "/metrics and a live dashboard at /dashboard.")
    serve.add_argument("model", nargs="?", default=None,
                       help=f"local HF checkpoint directory (default: the embedded {DEFAULT_MODEL_NAME})")
    add_serve_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=run_server)


def _add_bench(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    thr = bench_sub.add_parser("throughput", help="offline throughput vs HF transformers generate, one run")
    from llmrt.bench import throughput

    throughput.add_arguments(thr)
    thr.set_defaults(func=lambda a: (throughput.run(a), 0)[1])
    srv = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server: latency percentiles, "
                                             "throughput, goodput, JSON + PNG",
                               description="Load-test any OpenAI-compatible /v1/completions endpoint (llmrt or "
                                           "another runtime) with streaming requests.")
    from llmrt.bench import serve as bench_serve

    bench_serve.add_arguments(srv)
    srv.set_defaults(func=lambda a: (bench_serve.run(a), 0)[1])
    st = bench_sub.add_parser("structured", help="throughput under a JSON schema vs the same requests free, one run")
    from llmrt.bench import structured

    structured.add_arguments(st)
    st.set_defaults(func=lambda a: (structured.run(a), 0)[1])
    from llmrt.bench import spec as bench_spec

    sp = bench_sub.add_parser("spec", help="speculative decoding: copy-heavy speedup, verification ceiling, "
                                           "compute-bound batches", description=bench_spec.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_spec.add_arguments(sp)
    sp.set_defaults(func=lambda a: (bench_spec.run(a), 0)[1])
    from llmrt.bench import health as bench_health

    hl = bench_sub.add_parser("health", help="/health and /metrics latency while large bodies are tokenized",
                              description=bench_health.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_health.add_arguments(hl)
    hl.set_defaults(func=lambda a: (bench_health.run(a), 0)[1])
    from llmrt.bench import workloads

    workloads.add_subcommands(bench_sub)
    from llmrt.bench import quality

    qu = bench_sub.add_parser("quality", help="perplexity and teacher-forced top-1 agreement of quantized "
                                              "configurations vs the unquantized model", description=quality.__doc__)
    quality.add_arguments(qu)
    qu.set_defaults(func=quality.run)
    from llmrt.bench import parallel as bench_parallel

    bp = bench_sub.add_parser("parallel", help="tensor parallelism here: TP=1 vs TP=2 throughput, TPOT, collective "
                                               "time against the plan estimate, gloo vs shared-memory all-reduce; "
                                               "--pp 2: one rank vs TP=2 vs PP=2 with the pipeline bubble",
                              description=bench_parallel.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_parallel.add_arguments(bp)
    bp.set_defaults(func=lambda a: (bench_parallel.run(a), 0)[1])
    from llmrt.bench import router as bench_router

    br = bench_sub.add_parser("router", help="routing policies on a shared-system-prompt workload over local "
                                             "instances, and the router's added latency",
                              description=bench_router.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_router.add_arguments(br)
    br.set_defaults(func=lambda a: (bench_router.run(a), 0)[1])
    from llmrt.bench import peers as bench_peers

    pe = bench_sub.add_parser("peers", help="llmrt beside HF, vLLM's CPU build and llama.cpp on workloads W1/W2 and "
                                            "cold start, each peer from its own virtualenv",
                              description=bench_peers.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_peers.add_arguments(pe)
    pe.set_defaults(func=lambda a: (bench_peers.run(a), 0)[1])


def _add_route(route: argparse.ArgumentParser) -> None:
    from llmrt.router.launch import add_route_arguments, run_route

    route.description = ("A router in front of llmrt serve instances: give them with --backend, or start them with "
                         "--launch N. Same OpenAI API; x-llmrt-instance and x-llmrt-model-version name who served "
                         "each call. See docs/router.md.")
    add_route_arguments(route)
    route.set_defaults(func=run_route)


def _add_plan(plan: argparse.ArgumentParser) -> None:
    from llmrt import plan as plan_cmd

    plan.description = ("Print how weights, activations and KV blocks split a device's memory for an HF config.json "
                        "(a model directory or the file), and how many sequences fit at each context length. Uses "
                        "the engine's own formulas.")
    plan_cmd.add_arguments(plan)
    plan.set_defaults(func=plan_cmd.run)


def _add_quantize(q: argparse.ArgumentParser) -> None:
    from llmrt.tools import quantize as quantize_cmd

    q.description = quantize_cmd.__doc__
    quantize_cmd.add_arguments(q)
    q.set_defaults(func=quantize_cmd.run)


def _add_regress(regress: argparse.ArgumentParser) -> None:
    from llmrt.tools import regress as regress_cmd

    regress_cmd.add_subcommands(regress.add_subparsers(dest="regress_command", required=True))


def _add_tokens(tok: argparse.ArgumentParser) -> None:
    from llmrt.tools import tokens as tokens_cmd, tokens_report

    tok.description, tok.epilog = tokens_cmd.__doc__, tokens_report.EXAMPLES
    tok.formatter_class = argparse.RawDescriptionHelpFormatter
    tokens_report.add_arguments(tok)
    tok.set_defaults(func=tokens_report.run)


# name -> (one-line help, what fills in its arguments). Only the command being run is filled in, so that
# `llmrt --help` and `llmrt generate` import neither the server, the router nor the benchmarks.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "generate": ("generate text for one prompt, streamed to stdout", _add_generate),
    "serve": ("serve the OpenAI-compatible HTTP API", _add_serve),
    "bench": ("benchmarks", _add_bench),
    "route": ("route the OpenAI API over many llmrt instances (policies, versions, canaries, health checks, "
              "safe retries)", _add_route),
    "plan": ("memory breakdown and capacity for a model config, without weights", _add_plan),
    "quantize": ("write a GPTQ 4-bit checkpoint of a float one, calibrated on activations", _add_quantize),
    "regress": ("record a workload's outputs and latencies, compare another endpoint against them (safe upgrades, "
                "CI gates)", _add_regress),
    "tokens": ("what requests cost in tokens: parts, shares, repeated prefixes, FLOPs, KV", _add_tokens),
}


def _command_of(argv: Sequence[str]) -> Optional[str]:
    """The command named on the command line (the first positional word), if any."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--log-level":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The command line, with the arguments of the command `argv` names (default: sys.argv) filled in."""
    parser = argparse.ArgumentParser(prog="llmrt", description="llmrt: an LLM inference runtime you can read and measure")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = _command_of(sys.argv[1:] if argv is None else argv)
    for name, (help_text, fill) in _COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        if name == wanted:
            fill(cmd)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `llmrt` console script."""
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from llmrt.errors import LLMRTError

    try:
        rc = int(args.func(args) or 0)
    except LLMRTError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        rc = 2
    if argv is None and args.command in ("generate", "serve"):  # the process's own command line, not a caller's
        _exit_without_teardown(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
