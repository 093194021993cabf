"""The `llmrt` command: generate, serve, route, bench (throughput, serve, structured, spec, mixed, prefix, context,
router, quality), plan, regress (record, compare), tokens."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Optional

from llmrt.config import DEFAULT_MODEL_NAME
from llmrt.engine_args import add_engine_arguments, engine_kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a completion (or a chat reply) for one prompt."""
    from llmrt import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop or None,
                            repetition_penalty=args.repetition_penalty, ignore_eos=args.ignore_eos)
    prompt: Any = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        sys.stdout.write(args.prompt)
    for piece in llm.stream(prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(prog="llmrt", description="llmrt: an LLM inference runtime you can read and measure")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
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

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /version), "
                                       "with Prometheus metrics at /metrics and a live dashboard at /dashboard.")
    serve.add_argument("model", nargs="?", default=None,
                       help=f"local HF checkpoint directory (default: the embedded {DEFAULT_MODEL_NAME})")
    from llmrt.server.launch import add_serve_arguments, run_server

    add_serve_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=run_server)

    bench = sub.add_parser("bench", help="benchmarks")
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

    route = sub.add_parser("route", help="route the OpenAI API over many llmrt instances (policies, versions, "
                                         "canaries, health checks, safe retries)",
                           description="A router in front of llmrt serve instances: give them with --backend, or "
                                       "start them with --launch N. Same OpenAI API; x-llmrt-instance and "
                                       "x-llmrt-model-version name who served each call. See docs/router.md.")
    from llmrt.router.launch import add_route_arguments, run_route

    add_route_arguments(route)
    route.set_defaults(func=run_route)
    from llmrt.bench import parallel as bench_parallel

    bp = bench_sub.add_parser("parallel", help="tensor parallelism here: TP=1 vs TP=2 throughput, TPOT, collective "
                                               "time against the plan estimate, gloo vs shared-memory all-reduce",
                              description=bench_parallel.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_parallel.add_arguments(bp)
    bp.set_defaults(func=lambda a: (bench_parallel.run(a), 0)[1])
    from llmrt.bench import router as bench_router

    br = bench_sub.add_parser("router", help="routing policies on a shared-system-prompt workload over local "
                                             "instances, and the router's added latency",
                              description=bench_router.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_router.add_arguments(br)
    br.set_defaults(func=lambda a: (bench_router.run(a), 0)[1])

    plan = sub.add_parser("plan", help="memory breakdown and capacity for a model config, without weights",
                          description="Print how weights, activations and KV blocks split a device's memory for "
                                      "an HF config.json (a model directory or the file), and how many sequences "
                                      "fit at each context length. Uses the engine's own formulas.")
    from llmrt import plan as plan_cmd

    plan_cmd.add_arguments(plan)
    plan.set_defaults(func=plan_cmd.run)

    regress = sub.add_parser("regress", help="record a workload's outputs and latencies, compare another endpoint "
                                             "against them (safe upgrades, CI gates)")
    from llmrt.tools import regress as regress_cmd

    regress_cmd.add_subcommands(regress.add_subparsers(dest="regress_command", required=True))

    from llmrt.tools import tokens as tokens_cmd, tokens_report

    tok = sub.add_parser("tokens", help="what requests cost in tokens: parts, shares, repeated prefixes, FLOPs, KV",
                         description=tokens_cmd.__doc__, epilog=tokens_report.EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    tokens_report.add_arguments(tok)
    tok.set_defaults(func=tokens_report.run)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `llmrt` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from llmrt.errors import LLMRTError

    try:
        return int(args.func(args) or 0)
    except LLMRTError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
