"""`llmrt regress record | compare`: replay a workload against an OpenAI-compatible endpoint and keep what it said.

`record` stores, per request, the output token ids (asked for with vLLM's `return_tokens_as_token_ids`, which
llmrt and vLLM honour; from an endpoint that ignores it, the token texts instead), the text, the top logprobs,
the finish reason and the client-side TTFT/TPOT/e2e, plus the server's `/version` and its `/metrics` memory
figures before and after the run. `compare` (llmrt/tools/regress_compare.py)
replays the recorded request bodies against another endpoint and reports what changed.

Requests without a `seed` are made greedy (`temperature: 0`): only greedy or seeded outputs are reproducible.
Seeded requests keep their sampling parameters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

import httpx
from tqdm import tqdm

from llmrt.bench.client import RequestResult, stream_request
from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.errors import InvalidRequestError
from llmrt.tools.jsonl import read_jsonl

FORMAT_VERSION = 1
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")
# /metrics series kept as the server's memory figures: anything named *memory* plus KV-cache occupancy.
_MEMORY_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:memory|cache_usage)[a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+"
                            r"([-+0-9.eE]+|NaN|\+Inf|-Inf)\s*$")


# ------------------------------------------------------------------------------------------------- the workload
def load_workload(path: Optional[str], num_requests: int, seed: int, max_tokens: int) -> list[dict[str, Any]]:
    """Request bodies from a JSONL file (one completions or chat body per line), or a generated sample."""
    if path is None:
        return sample_workload(num_requests, seed, max_tokens)
    bodies = []
    for k, body in read_jsonl(path, "workload"):
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise InvalidRequestError(f"{path}:{k}: expected a completions body (`prompt`) or a chat body "
                                      "(`messages`)", param="workload")
        bodies.append(body)
    return bodies


def sample_workload(num_requests: int, seed: int, max_tokens: int) -> list[dict[str, Any]]:
    """`llmrt bench serve`'s random-words prompts, as completions bodies; every fourth one sampled with a seed."""
    from llmrt.bench.serve import Workload, parse_lengths

    gen = Workload(parse_lengths("uniform:8,48", "prompt_len"), parse_lengths(f"fixed:{max_tokens}", "output_len"),
                   "text", (10, 500), seed)
    bodies = []
    for i in range(num_requests):
        req = gen.request(i)
        body: dict[str, Any] = {"prompt": req.prompt, "max_tokens": req.output_len}
        if i % 4 == 3:
            body.update(temperature=0.8, top_p=0.95, seed=seed * 1000 + i)
        bodies.append(body)
    return bodies


def endpoint_of(body: dict[str, Any]) -> str:
    """`chat/completions` for a body with messages, else `completions`."""
    return "chat/completions" if "messages" in body else "completions"


def prepare(body: dict[str, Any], model: Optional[str], top_logprobs: int) -> tuple[dict[str, Any], str]:
    """The body as sent (streamed, usage and logprobs on; greedy unless seeded) and its mode."""
    out = dict(body)
    if model:
        out["model"] = model
    sampled = out.get("seed") is not None and out.get("temperature", 1.0) != 0
    if not sampled:
        out["temperature"] = 0.0
        out.pop("seed", None)
    out.update(stream=True, stream_options={"include_usage": True}, n=1)
    if endpoint_of(out) == "chat/completions":
        out.update(logprobs=True, top_logprobs=top_logprobs)
    else:
        out["logprobs"] = top_logprobs
    # vLLM renders tokens as "token_id:N" with this; servers that do not know it ignore it.
    out["return_tokens_as_token_ids"] = True
    return out, "sampled" if sampled else "greedy"


# ----------------------------------------------------------------------------------------------------- replaying
def api_root(base_url: str) -> str:
    """http://host:port for http://host:port/v1 (where /version and /metrics live)."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def server_snapshot(base_url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's /version body and the memory series of its /metrics (empty where it has none)."""
    root = api_root(base_url)
    snap: dict[str, Any] = {"version": None, "memory": {}}
    try:
        r = httpx.get(root + "/version", timeout=timeout)
        if r.status_code == 200:
            snap["version"] = r.json()
    except (httpx.HTTPError, ValueError):
        pass
    try:
        r = httpx.get(root + "/metrics", timeout=timeout)
        if r.status_code == 200:
            for line in r.text.splitlines():
                m = _MEMORY_SERIES.match(line.strip())
                if m:
                    snap["memory"][m.group(1)] = float(m.group(2))
    except httpx.HTTPError:
        pass
    return snap


def default_model(base_url: str, timeout: float = 10.0) -> Optional[str]:
    """The first model the endpoint lists at /models (None when it lists none or cannot be reached)."""
    try:
        data = httpx.get(base_url.rstrip("/") + "/models", timeout=timeout).json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return None


def request_record(index: int, endpoint: str, mode: str, r: RequestResult) -> dict[str, Any]:
    """One replayed request as stored: tokens, logprobs, finish reason and timings."""
    tokens = [e["token"] for e in r.logprobs]
    ids = [int(m.group(1)) for m in (_TOKEN_ID.match(t or "") for t in tokens) if m]
    return {"index": index, "endpoint": endpoint, "mode": mode, "ok": r.ok, "status": r.status, "error": r.error,
            "text": r.text, "tokens": tokens, "token_ids": ids if tokens and len(ids) == len(tokens) else None,
            "logprobs": [e["logprob"] for e in r.logprobs], "top_logprobs": [e["top"] for e in r.logprobs],
            "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e}


def token_basis(records: list[dict[str, Any]]) -> str:
    """"ids" when every successful request's tokens came back as `token_id:N` (the endpoint honours
    return_tokens_as_token_ids), else "texts"."""
    done = [r for r in records if r["ok"] and r["tokens"]]
    return "ids" if done and all(r["token_ids"] is not None for r in done) else "texts"


async def replay(base_url: str, bodies: list[dict[str, Any]], modes: list[str], concurrency: int,
                 timeout: float, progress: bool) -> list[dict[str, Any]]:
    """Send every body (streamed), at most `concurrency` at a time; one record per body, in workload order."""
    records: list[Optional[dict[str, Any]]] = [None] * len(bodies)
    bar = tqdm(total=len(bodies), unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    pending = iter(range(len(bodies)))
    async with httpx.AsyncClient(timeout=timeout) as client:
        async def worker() -> None:
            for i in pending:
                ep = endpoint_of(bodies[i])
                r = await stream_request(client, base_url.rstrip("/") + "/" + ep, bodies[i], timeout=timeout)
                records[i] = request_record(i, ep, modes[i], r)
                bar.update(1)
                failed = sum(1 for x in records if x is not None and not x["ok"])
                if failed:
                    bar.set_postfix(failed=failed)
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    bar.close()
    return [r for r in records if r is not None]


def run_workload(base_url: str, bodies: list[dict[str, Any]], model: Optional[str], *, top_logprobs: int,
                 concurrency: int, timeout: float, progress: bool, warmup: int = 0) -> dict[str, Any]:
    """Replay `bodies` (as recorded, or raw from a workload) and return a run: server snapshots and records."""
    model = model or default_model(base_url)
    prepared = [prepare(b, model, top_logprobs) for b in bodies]
    sent, modes = [p[0] for p in prepared], [p[1] for p in prepared]
    if warmup:  # the first requests of a fresh server pay for allocations and lazy set-up: not part of the figures
        asyncio.run(replay(base_url, sent[:warmup], modes[:warmup], 1, timeout, False))
    before, load_start = server_snapshot(base_url), load_average()
    records = asyncio.run(replay(base_url, sent, modes, concurrency, timeout, progress))
    after = server_snapshot(base_url)
    return {"tool": "llmrt regress", "format": FORMAT_VERSION, "date": now_iso(), "base_url": base_url,
            "model": model, "concurrency": concurrency, "top_logprobs": top_logprobs, "warmup": warmup,
            "token_ids": token_basis(records) == "ids",
            "server": {"before": before, "after": after}, "machine": machine_info("client"),
            "load_avg_1m": {"start": load_start, "end": load_average()}, "workload": bodies, "requests": records}


# ------------------------------------------------------------------------------------------------------- the CLI
EXAMPLES = """examples:
  llmrt regress record --base-url http://old:8000/v1 --workload requests.jsonl -o golden.json
  llmrt regress record --base-url http://127.0.0.1:8000/v1 -o golden.json          # a generated sample
  llmrt regress compare golden.json --base-url http://new:8000/v1 --max-latency-regression 10%
  llmrt regress compare golden.json --base-url http://new:8000/v1 --json --plot latency.png

A workload is a JSONL file of OpenAI request bodies, one per line: {"prompt": ..., "max_tokens": ...} goes to
/v1/completions, {"messages": [...]} to /v1/chat/completions. Requests without a seed are sent greedy
(temperature 0); seeded ones keep their sampling parameters. compare exits 1 when a threshold is crossed
(any mismatch by default), so it can gate CI or a canary step."""


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="the OpenAI-compatible API root (default: http://127.0.0.1:8000/v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the body's, else the first of /models)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at once (record default: 1; compare default: the recording's)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default: 600)")
    p.add_argument("--warmup", type=int, default=None,
                   help="send the first N requests once, unmeasured, before the run (record default: 2; compare "
                        "default: the recording's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_subcommands(sub: Any) -> None:
    """`llmrt regress record | compare`."""
    from llmrt.tools import regress_compare

    fmt = argparse.RawDescriptionHelpFormatter
    rec = sub.add_parser("record", help="replay a workload and store outputs, logprobs and latencies as a golden file",
                         description=__doc__, epilog=EXAMPLES, formatter_class=fmt)
    _replay_arguments(rec)
    rec.add_argument("--workload", default=None, help="JSONL of request bodies (default: a generated sample)")
    rec.add_argument("--num-requests", type=int, default=32, help="size of the generated sample (default: 32)")
    rec.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the generated sample (default: 32)")
    rec.add_argument("--seed", type=int, default=0, help="seed of the generated sample (default: 0)")
    rec.add_argument("--top-logprobs", type=int, default=5, help="alternatives kept per token, 0-20 (default: 5)")
    rec.add_argument("-o", "--output", required=True, help="the golden file to write (JSON)")
    rec.set_defaults(func=run_record)

    cmp_ = sub.add_parser("compare", help="replay a golden file's workload against another endpoint and report "
                                          "mismatches, latency and memory changes",
                          description=regress_compare.__doc__, epilog=EXAMPLES, formatter_class=fmt)
    cmp_.add_argument("golden", help="a file written by `llmrt regress record`")
    _replay_arguments(cmp_)
    regress_compare.add_arguments(cmp_)
    cmp_.set_defaults(func=regress_compare.run_compare)


def run_record(args: argparse.Namespace) -> int:
    """`llmrt regress record`: replay, write the golden file, print a one-line summary."""
    if not 0 <= args.top_logprobs <= 20:
        raise InvalidRequestError("--top-logprobs must be in [0, 20]", param="top_logprobs")
    bodies = load_workload(args.workload, args.num_requests, args.seed, args.max_tokens)
    run = run_workload(args.base_url, bodies, args.model, top_logprobs=args.top_logprobs,
                       concurrency=args.concurrency or 1, timeout=args.timeout, progress=not args.no_progress,
                       warmup=2 if args.warmup is None else args.warmup)
    Path(args.output).write_text(json.dumps(run, indent=1) + "\n")
    failed = sum(1 for r in run["requests"] if not r["ok"])
    print(f"recorded {len(run['requests'])} requests ({failed} failed) from {args.base_url} "
          f"(model {run['model']}) to {args.output}", file=sys.stderr)
    return 1 if failed else 0
