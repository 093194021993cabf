"""`llmrt bench serve`: a load generator for any OpenAI-compatible completions endpoint.

Requests go out at a fixed concurrency (each of N workers sends its next request when the last one ends) or as
a Poisson process at a given rate, until a number of requests has been sent or a duration has passed; the
requests in flight then finish. Every request streams (`/v1/completions`, `stream: true`, usage included) and
asks for a fixed number of output tokens (`ignore_eos`, `min_tokens`), so runs are comparable across runtimes.
Prompts are random token-id lists (or random words with `--prompt-format text`).

Reported: TTFT, TPOT, ITL and end-to-end latency (mean, p50/p90/p99), request and token throughput, and
goodput (requests per second that met every given SLO). Written: a JSON report, a PNG (latency CDFs and
throughput over time) and a row in a Markdown table (`llmrt/bench/report.py`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import itertools

import httpx
from tqdm import tqdm

from llmrt.bench.client import RequestResult, stream_completion
from llmrt.bench.report import load_average, machine_info, now_iso, write_results
from llmrt.table import format_table

_WORDS = ("time", "little", "girl", "park", "tree", "happy", "sun", "dog", "ball", "friend", "house", "red",
          "big", "play", "day", "cat", "bird", "water", "run", "smile")


# ------------------------------------------------------------------------------------------ length distributions
@dataclass
class LengthDist:
    """A distribution of token counts: fixed:N, uniform:A,B (inclusive) or jsonl:PATH (values in file order)."""

    spec: str
    kind: str
    low: int = 0
    high: int = 0
    values: tuple[int, ...] = ()

    def sample(self, rng: random.Random, i: int) -> int:
        """The length of request number i."""
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return self.values[i % len(self.values)]


def parse_lengths(spec: str, field: str) -> LengthDist:
    """Parse a length distribution; jsonl lines are integers or objects with `field` (prompt_len/output_len)."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "fixed":
            n = int(arg)
            if n < 1:
                raise ValueError
            return LengthDist(spec, kind, n, n)
        if kind == "uniform":
            lo, hi = (int(x) for x in arg.split(","))
            if not 1 <= lo <= hi:
                raise ValueError
            return LengthDist(spec, kind, lo, hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected fixed:N or uniform:A,B with 1 <= A <= B") from None
    if kind == "jsonl":
        values = []
        try:
            lines = Path(arg).read_text().splitlines()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{spec!r}: cannot read {arg}: {e.strerror or e}") from None
        for k, line in enumerate(lines, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            value = item.get(field) if isinstance(item, dict) else item
            if not isinstance(value, int) or value < 1:
                raise argparse.ArgumentTypeError(f"{arg}:{k}: expected a positive integer or {{\"{field}\": N}}")
            values.append(value)
        if not values:
            raise argparse.ArgumentTypeError(f"{arg}: no lengths in the file")
        return LengthDist(spec, kind, min(values), max(values), tuple(values))
    raise argparse.ArgumentTypeError(f"{spec!r}: expected fixed:N, uniform:A,B or jsonl:PATH")


# ------------------------------------------------------------------------------------------------ the workload
@dataclass
class PlannedRequest:
    """One request of the run: its prompt (token ids or text) and output length."""

    prompt: Any
    prompt_len: int
    output_len: int


@dataclass
class Workload:
    """Request number i of a run, made on demand: the same seed and i give the same request."""

    prompt_lens: LengthDist
    output_lens: LengthDist
    prompt_format: str  # tokens | text
    token_range: tuple[int, int]
    seed: int
    shared_prefix_len: int = 0  # request i starts with shared prefix number i % num_prefixes (a system prompt)
    num_prefixes: int = 1

    def request(self, i: int) -> PlannedRequest:
        """The i-th request: a random prompt of a drawn length, and a drawn output length."""
        rng = random.Random(self.seed * 1_000_003 + i)
        plen, olen = self.prompt_lens.sample(rng, i), self.output_lens.sample(rng, i)
        if self.prompt_format == "tokens":
            prompt: Any = [rng.randrange(*self.token_range) for _ in range(plen)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(plen))
        if self.shared_prefix_len:
            prefix = self.prefix(i % self.num_prefixes)
            prompt = prefix + prompt if self.prompt_format == "tokens" else f"{prefix} {prompt}"
            plen += self.shared_prefix_len
        return PlannedRequest(prompt, plen, olen)

    def prefix(self, k: int) -> Any:
        """Shared prefix number k: the same for every request that uses it."""
        rng = random.Random(f"prefix-{self.seed}-{k}")
        if self.prompt_format == "tokens":
            return [rng.randrange(*self.token_range) for _ in range(self.shared_prefix_len)]
        return " ".join(rng.choice(_WORDS) for _ in range(self.shared_prefix_len))


# ------------------------------------------------------------------------------------------------------ running
@dataclass
class RunConfig:
    """What to send, how fast, and for how long."""

    base_url: str
    model: str
    concurrency: Optional[int]
    request_rate: Optional[float]
    num_requests: Optional[int]
    duration: Optional[float]
    seed: int
    timeout: float


async def run_load(cfg: RunConfig, workload: Workload, progress: bool = True
                   ) -> tuple[list[tuple[PlannedRequest, RequestResult]], float, float]:
    """Send the workload's requests as configured; (request, result) pairs, start and end (time.perf_counter)."""
    results: list[tuple[PlannedRequest, RequestResult]] = []
    bar = tqdm(total=cfg.num_requests, unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    start = time.perf_counter()
    stop_at = start + cfg.duration if cfg.duration is not None else math.inf
    counter = iter(range(cfg.num_requests) if cfg.num_requests is not None else itertools.count())

    def next_request() -> Optional[PlannedRequest]:
        if time.perf_counter() >= stop_at:
            return None
        i = next(counter, None)
        return workload.request(i) if i is not None else None

    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout) as client:
        async def send(req: PlannedRequest) -> None:
            res = await stream_completion(client, cfg.base_url, cfg.model, req.prompt, req.output_len,
                                          timeout=cfg.timeout)
            results.append((req, res))
            bar.update(1)
            if not res.ok:
                bar.set_postfix(failed=sum(1 for _, r in results if not r.ok))

        if cfg.concurrency is not None:
            async def worker() -> None:
                while (req := next_request()) is not None:
                    await send(req)
            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        else:
            assert cfg.request_rate is not None
            rng = random.Random(cfg.seed + 1)
            tasks = []
            when = start
            while (req := next_request()) is not None:
                tasks.append(asyncio.create_task(send(req)))
                when += rng.expovariate(cfg.request_rate)  # Poisson arrivals: exponential gaps
                delay = when - time.perf_counter()
                if when >= stop_at:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
            await asyncio.gather(*tasks)
    bar.close()
    return results, start, time.perf_counter()


# ------------------------------------------------------------------------------------------------------ figures
def percentiles(values: Sequence[float]) -> dict[str, Optional[float]]:
    """mean, p50, p90, p99 (linear interpolation), in milliseconds."""
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(pos), math.ceil(pos)
        return (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)) * 1000.0

    return {"mean_ms": sum(xs) / len(xs) * 1000.0, "p50_ms": q(50), "p90_ms": q(90), "p99_ms": q(99)}


def meets_slo(r: RequestResult, slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> bool:
    """Whether a completed request met every given SLO (a one-token request has no TPOT to miss)."""
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000.0 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000.0 > slo_tpot_ms:
        return False
    return True


def throughput_series(results: Sequence[RequestResult], start: float, end: float, bin_s: float = 1.0
                      ) -> dict[str, list[float]]:
    """Output tokens/s and completed requests/s per time bin; a request's tokens are spread over its chunks."""
    n = max(1, math.ceil((end - start) / bin_s))
    tokens, done = [0.0] * n, [0.0] * n
    for r in results:
        if r.token_times:
            each = (r.output_tokens or len(r.token_times)) / len(r.token_times)
            for t in r.token_times:
                tokens[min(n - 1, int((t - start) / bin_s))] += each / bin_s
        if r.ok:
            done[min(n - 1, int((r.end - start) / bin_s))] += 1 / bin_s
    return {"t_s": [i * bin_s for i in range(n)], "output_tokens_per_s": tokens, "requests_per_s": done}


def summarize(pairs: Sequence[tuple[PlannedRequest, RequestResult]], start: float, end: float,
              slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> dict[str, Any]:
    """The report's figures."""
    ok = [r for _, r in pairs if r.ok]
    failed = [r for _, r in pairs if not r.ok]
    elapsed = end - start
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]
    errors: dict[str, int] = {}
    for r in failed:
        key = str(r.status) if r.status and r.status != 200 else "stream_error"
        errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(ok), "num_failed": len(failed), "errors_by_status": errors, "duration_s": elapsed,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed, "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "goodput": len(good) / elapsed, "goodput_fraction": len(good) / len(ok) if ok else None,
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl": percentiles([x for r in ok for x in r.itls]),
        "e2e": percentiles([r.e2e for r in ok]),
    }


def per_request(pairs: Sequence[tuple[PlannedRequest, RequestResult]], start: float) -> list[dict[str, Any]]:
    """One compact record per request (times in seconds from the start of the run)."""
    return [{"start_s": round(r.start - start, 6), "prompt_len": p.prompt_len, "output_len": p.output_len,
             "ok": r.ok, "status": r.status, "error": r.error, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
             "itls_s": [round(x, 6) for x in r.itls], "server_timing": r.server_timing}
            for p, r in sorted(pairs, key=lambda pr: pr[1].start)]


# --------------------------------------------------------------------------------------------------------- plot
def plot(result: dict[str, Any], path: Path) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, e2e) and throughput over time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in result["requests"] if r["ok"]]
    samples = {"TTFT": [r["ttft_s"] for r in reqs if r["ttft_s"] is not None],
               "TPOT": [r["tpot_s"] for r in reqs if r["tpot_s"] is not None],
               "ITL": [x for r in reqs for x in r["itls_s"]],
               "end-to-end": [r["e2e_s"] for r in reqs]}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, xs) in zip(axes.flat, samples.items()):
        xs = sorted(x * 1000.0 for x in xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
        ax.set_title(f"{name} CDF ({len(xs)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    series = result["throughput_over_time"]
    ax = axes.flat[4]
    ax.plot(series["t_s"], series["output_tokens_per_s"])
    ax.set_title("output tokens/s (1 s bins)")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    ax.plot(series["t_s"], series["requests_per_s"], color="tab:green")
    ax.set_title("completed requests/s (1 s bins)")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)
    load = result["config"]
    mode = f"concurrency {load['concurrency']}" if load["concurrency"] else f"Poisson rate {load['request_rate']}/s"
    fig.suptitle(f"llmrt bench serve: {result['model']} at {result['base_url']}, {mode}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------- the CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the `bench serve` flags on p."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="the OpenAI-compatible API root; /completions is appended (default: http://127.0.0.1:8000/v1)")
    p.add_argument("--model", required=True, help="the model name to send")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: this many requests in flight, each sent when the previous one ends")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: Poisson arrivals at this many requests per second")
    stop = p.add_mutually_exclusive_group(required=True)
    stop.add_argument("--num-requests", type=int, default=None, help="send this many requests")
    stop.add_argument("--duration", type=float, default=None,
                      help="send requests for this many seconds (those in flight then finish)")
    p.add_argument("--prompt-len", default="uniform:32,128", metavar="DIST",
                   help="prompt length in tokens: fixed:N, uniform:A,B or jsonl:PATH (integers, or objects with "
                        "prompt_len) (default: uniform:32,128)")
    p.add_argument("--output-len", default="fixed:32", metavar="DIST",
                   help="output tokens per request (forced with ignore_eos/min_tokens), same forms as --prompt-len "
                        "with output_len in jsonl (default: fixed:32)")
    p.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens",
                   help="tokens: random token-id lists; text: random words (about one token each) (default: tokens)")
    p.add_argument("--token-range", default="10,500", metavar="LO,HI",
                   help="random prompt token ids are drawn from [LO, HI) (default: 10,500, valid for any vocabulary "
                        "of at least 500)")
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="start every prompt with one of --num-prefixes shared prefixes of N tokens (a system "
                        "prompt; request i uses prefix i mod K), before its own --prompt-len tokens (default: 0)")
    p.add_argument("--num-prefixes", type=int, default=1, metavar="K", help="distinct shared prefixes (default: 1)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT must be at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT must be at most this")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default: 600)")
    p.add_argument("--output-dir", default="benchmarks", help="where the JSON, PNG and Markdown go (default: benchmarks)")
    p.add_argument("--name", default=None,
                   help="file name of the JSON and PNG (default: serve-<model>-c<N> or serve-<model>-r<R>)")
    p.add_argument("--table", default=None,
                   help="Markdown table (file name without .md) that gets this run's row (default: serve-<model>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args: argparse.Namespace) -> tuple[LengthDist, LengthDist, tuple[int, int]]:
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit("error: --concurrency must be at least 1")
    if args.request_rate is not None and not (args.request_rate > 0 and math.isfinite(args.request_rate)):
        raise SystemExit("error: --request-rate must be a positive number")
    if args.num_requests is not None and args.num_requests < 1:
        raise SystemExit("error: --num-requests must be at least 1")
    if args.duration is not None and not args.duration > 0:
        raise SystemExit("error: --duration must be positive")
    try:
        prompt_lens = parse_lengths(args.prompt_len, "prompt_len")
        output_lens = parse_lengths(args.output_len, "output_len")
        lo, hi = (int(x) for x in args.token_range.split(","))
        if not 0 <= lo < hi:
            raise ValueError
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"error: {e}") from None
    except ValueError:
        raise SystemExit(f"error: --token-range {args.token_range!r}: expected LO,HI with 0 <= LO < HI") from None
    return prompt_lens, output_lens, (lo, hi)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the load described by args; print the report, write JSON + PNG + Markdown row, return the result."""
    prompt_lens, output_lens, token_range = _check(args)
    cfg = RunConfig(args.base_url, args.model, args.concurrency, args.request_rate, args.num_requests,
                    args.duration, args.seed, args.timeout)
    if args.shared_prefix_len < 0 or args.num_prefixes < 1:
        raise SystemExit("error: --shared-prefix-len must be >= 0 and --num-prefixes >= 1")
    workload = Workload(prompt_lens, output_lens, args.prompt_format, token_range, args.seed,
                        args.shared_prefix_len, args.num_prefixes)
    load_start = load_average()
    pairs, start, end = asyncio.run(run_load(cfg, workload, progress=not args.no_progress))
    safe_model = args.model.replace("/", "_")
    mode = f"c{args.concurrency}" if args.concurrency else f"r{args.request_rate:g}"
    name = args.name or f"serve-{safe_model}-{mode}"
    result: dict[str, Any] = {
        "name": name, "date": now_iso(), "base_url": args.base_url, "model": args.model,
        "config": {**asdict(cfg), "prompt_len": prompt_lens.spec, "output_len": output_lens.spec,
                   "prompt_format": args.prompt_format, "token_range": list(token_range),
                   "shared_prefix_len": args.shared_prefix_len, "num_prefixes": args.num_prefixes},
        "summary": summarize(pairs, start, end, args.slo_ttft_ms, args.slo_tpot_ms),
        "throughput_over_time": throughput_series([r for _, r in pairs], start, end),
        "machine": machine_info("client"), "load_avg_1m": {"start": load_start, "end": load_average()},
        "requests": per_request(pairs, start),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{name}.png"
    plot(result, png)
    result["plot"] = png.name
    print(render(result), flush=True)
    json_path, md_path = write_results(name, result, args.output_dir, summary=md_summary(result),
                                       key=["model", "load", "prompt len", "output len"],
                                       table=args.table or f"serve-{safe_model}")
    print(f"wrote {json_path}, {png} and {md_path}", file=sys.stderr)
    return result


def md_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The Markdown row: the load and the headline figures."""
    c, s = result["config"], result["summary"]
    load = f"concurrency {c['concurrency']}" if c["concurrency"] else f"rate {c['request_rate']:g}/s"
    return {"model": result["model"], "load": load, "prompt len": c["prompt_len"], "output len": c["output_len"],
            "requests": s["num_requests"], "failed": s["num_failed"], "req/s": s["request_throughput"],
            "out tok/s": s["output_token_throughput"], "TTFT p50 ms": s["ttft"]["p50_ms"],
            "TTFT p99 ms": s["ttft"]["p99_ms"], "TPOT p50 ms": s["tpot"]["p50_ms"], "TPOT p99 ms": s["tpot"]["p99_ms"],
            "ITL p99 ms": s["itl"]["p99_ms"], "e2e p50 ms": s["e2e"]["p50_ms"], "goodput req/s": s["goodput"],
            "load 1m": result["load_avg_1m"]["end"],
            "json": f"{result['name']}.json"}


def render(result: dict[str, Any]) -> str:
    """The human-readable report."""
    s = result["summary"]
    rows = [{"metric": name, **s[key]} for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                                                           ("e2e", "end-to-end"))]
    slo = ", ".join(x for x in (f"TTFT <= {s['slo_ttft_ms']:g} ms" if s["slo_ttft_ms"] is not None else "",
                                f"TPOT <= {s['slo_tpot_ms']:g} ms" if s["slo_tpot_ms"] is not None else "") if x)
    lines = [
        f"{result['name']}: {s['num_requests']} requests completed, {s['num_failed']} failed "
        f"{s['errors_by_status'] or ''} in {s['duration_s']:.1f} s",
        f"  request throughput {s['request_throughput']:.2f} req/s, output {s['output_token_throughput']:.1f} tok/s, "
        f"total {s['total_token_throughput']:.1f} tok/s",
        f"  goodput {s['goodput']:.2f} req/s" + (f" ({slo})" if slo else " (no SLO given: every completed request)"),
        format_table(rows, ["metric", ("mean_ms", "mean ms"), ("p50_ms", "p50 ms"), ("p90_ms", "p90 ms"),
                            ("p99_ms", "p99 ms")]),
    ]
    return "\n".join(lines)
