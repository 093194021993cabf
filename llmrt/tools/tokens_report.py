"""`llmrt tokens` reports: the per-model audit, the access-log summary, tables, JSON and the token-share plot."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from llmrt.errors import InvalidRequestError
from llmrt.table import format_table
from llmrt.tools.tokens import (PARTS, TokenModel, count_request, load_requests, repeated_contents,
                                shared_prefix_tokens)

_GROWTH = (1, 2, 4, 8)  # context multiples of the longest request shown in "cost as context grows"


def audit(model: TokenModel, bodies: list[dict[str, Any]], top: int, block_size: int,
          progress: bool) -> dict[str, Any]:
    """Everything `llmrt tokens` says about one model: per request, totals and shares, repeats, costs."""
    records = [count_request(model, i, b)
               for i, b in enumerate(tqdm(bodies, desc=model.name, unit="req", disable=not progress, file=sys.stderr))]
    ok = [r for r in records if not r.error]
    total = sum(r.total for r in ok)
    parts = {p: sum(r.parts.get(p, 0) for r in ok) for p in PARTS}
    cached = shared_prefix_tokens(ok, block_size)
    requests = []
    for r in records:
        row: dict[str, Any] = {"index": r.index, "kind": r.kind, "tokens": r.total, **r.parts,
                               "max_tokens": r.max_tokens, "messages": r.messages, "error": r.error}
        requests.append(row)
    for r, c in zip(ok, cached):
        row = requests[r.index]
        row["prefix_cacheable"] = c
        if model.cost:
            row["prefill_gflops"] = model.cost.prefill_flops(r.total) / 1e9
            row["prefill_gflops_with_cache"] = model.cost.prefill_flops(r.total, c) / 1e9
            row["kv_mib"] = model.cost.kv_bytes(r.total + (r.max_tokens or 0)) / (1 << 20)
    out: dict[str, Any] = {
        "model": model.name, "num_requests": len(records), "num_errors": len(records) - len(ok),
        "total_tokens": total, "parts": parts, "shares": {p: (v / total if total else None) for p, v in parts.items()},
        "prefix_cacheable_tokens": sum(cached), "prefix_cacheable_share": sum(cached) / total if total else None,
        "repeated": repeated_contents(bodies, records, model.tokenizer), "requests": requests,
    }
    if model.cost and ok:
        longest = sorted(ok, key=lambda r: -r.total)[:top]
        out["longest"] = [{"index": r.index, "tokens": r.total, **_cost_row(model, r.total)} for r in longest]
        base = longest[0].total
        out["growth"] = [{"context": n, **_cost_row(model, n)} for n in
                         sorted({min(base * k, model.cost.max_model_len) for k in _GROWTH})]
    return out


def _cost_row(model: TokenModel, tokens: int) -> dict[str, Any]:
    c = model.cost
    assert c is not None
    return {"prefill_gflops": c.prefill_flops(tokens) / 1e9, "attention_share": c.attention_share(tokens),
            "kv_mib": c.kv_bytes(tokens) / (1 << 20)}


# ------------------------------------------------------------------------------------------------- access log
def read_access_log(path: str) -> list[dict[str, Any]]:
    """The JSON access-log records of a server log (other lines are skipped)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror or e}", param="access_log") from None
    out = []
    for line in lines:
        start = line.find("{")
        if start < 0:
            continue
        try:
            rec = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "endpoint" in rec and "request_id" in rec:
            out.append(rec)
    return out


def _cached(rec: dict[str, Any]) -> int:
    m = rec.get("metrics")
    items = m if isinstance(m, list) else [m] if isinstance(m, dict) else []
    return sum(int(x.get("cached_tokens") or 0) for x in items)


def access_summary(records: list[dict[str, Any]], ratio: float) -> dict[str, Any]:
    """Per route: requests, prompt/output tokens, cached share; and requests whose max_tokens far exceeds use."""
    routes: dict[str, dict[str, Any]] = {}
    oversized = []
    for rec in records:
        if rec.get("prompt_tokens") is None:
            continue  # no usage: an error, a poll, a tokenizer route
        r = routes.setdefault(rec["endpoint"], {"route": rec["endpoint"], "requests": 0, "prompt_tokens": 0,
                                                "output_tokens": 0, "cached_tokens": 0})
        r["requests"] += 1
        r["prompt_tokens"] += rec["prompt_tokens"] or 0
        r["output_tokens"] += rec.get("completion_tokens") or 0
        r["cached_tokens"] += _cached(rec)
        asked, used = rec.get("max_tokens"), rec.get("completion_tokens") or 0
        if isinstance(asked, int) and asked >= ratio * max(used, 1):
            oversized.append({"request_id": rec["request_id"], "route": rec["endpoint"], "max_tokens": asked,
                              "used": used, "ratio": asked / max(used, 1)})
    for r in routes.values():
        r["prompt_mean"] = r["prompt_tokens"] / r["requests"]
        r["output_mean"] = r["output_tokens"] / r["requests"]
        r["cached_share"] = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else None
    with_max = sum(1 for rec in records if isinstance(rec.get("max_tokens"), int))
    return {"routes": sorted(routes.values(), key=lambda r: r["route"]), "oversized_max_tokens": oversized,
            "max_tokens_ratio": ratio, "records": len(records), "records_with_max_tokens": with_max}


# ---------------------------------------------------------------------------------------------------- output
def render(report: dict[str, Any]) -> str:
    """The readable report."""
    lines: list[str] = []
    audits = report["models"]
    if len(audits) > 1:
        rows = [{"index": i, **{a["model"]: a["requests"][i]["tokens"] for a in audits}}
                for i in range(audits[0]["num_requests"])]
        lines += ["prompt tokens per request, by model:", format_table(rows, ["index", *[a["model"] for a in audits]]),
                  ""]
    for a in audits:
        lines += [f"== {a['model']}: {a['num_requests']} requests, {a['total_tokens']} prompt tokens "
                  f"({a['num_errors']} could not be rendered); prefix-cacheable {a['prefix_cacheable_tokens']} "
                  f"({_pct(a['prefix_cacheable_share'])})",
                  "share per part: " + ", ".join(f"{p} {a['parts'][p]} ({_pct(a['shares'][p])})" for p in PARTS), ""]
        cols = ["index", "kind", "tokens", *PARTS, "prefix_cacheable", "prefill_gflops", "kv_mib", "error"]
        lines += [format_table(a["requests"], cols), ""]
        if a["repeated"]:
            lines += ["repeated contents (cacheable: the text before it is the same wherever it appears):",
                      format_table([{**r, "content": json.dumps(r["content"]),
                                     "flagged_requests": ",".join(map(str, r["flagged_requests"])) or "-"}
                                    for r in a["repeated"]],
                                   ["tokens", "requests", "cacheable", "flagged_requests", "tokens_recomputed",
                                    "content"]), ""]
        for r in a["repeated"]:
            for i, n in r["varying_tokens_before"].items():
                lines.append(f"flag: request {i}: a shared {r['tokens']}-token content is preceded by {n} tokens "
                             f"of varying text; move the shared part first to let the prefix cache reuse it")
        if a.get("growth"):
            lines += ["", "longest requests:", format_table(a["longest"], ["index", "tokens", "prefill_gflops",
                                                                        "attention_share", "kv_mib"]),
                      "", "cost as the context grows (prefill of one request; KV of one sequence):",
                      format_table(a["growth"], ["context", "prefill_gflops", "attention_share", "kv_mib"]), ""]
    acc = report.get("access_log")
    if acc:
        lines += [f"access log: {acc['records']} records", format_table(
            acc["routes"], ["route", "requests", "prompt_tokens", "prompt_mean", "output_tokens", "output_mean",
                            "cached_share"])]
        if acc["oversized_max_tokens"]:
            lines += ["", f"max_tokens at least {acc['max_tokens_ratio']:g}x what was used:",
                      format_table(acc["oversized_max_tokens"], ["request_id", "route", "max_tokens", "used", "ratio"])]
        elif not acc["records_with_max_tokens"]:
            lines.append("(the log's records carry no max_tokens: written by a server that does not log it)")
    return "\n".join(lines)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def plot(report: dict[str, Any], path: str, limit: int = 40) -> None:
    """Stacked bars: each request's prompt tokens by part (first `limit` requests), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    audits = report["models"]
    fig, axes = plt.subplots(len(audits), 1, figsize=(12, 3.5 * len(audits)), squeeze=False)
    for ax, a in zip(axes[:, 0], audits):
        reqs = a["requests"][:limit]
        bottom = [0] * len(reqs)
        for part in PARTS:
            vals = [r.get(part) or 0 for r in reqs]
            ax.bar([r["index"] for r in reqs], vals, bottom=bottom, label=f"{part} ({_pct(a['shares'][part])})")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{a['model']}: prompt tokens per request by part")
        ax.set_xlabel("request")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------- CLI
EXAMPLES = """examples:
  llmrt tokens requests.jsonl                                   # the embedded model's tokenizer
  llmrt tokens requests.jsonl --model ./llama3 --model ./qwen2 --plot shares.png
  llmrt tokens requests.jsonl --model ./llama3 --access-log server.log --json

requests.jsonl holds OpenAI request bodies, one per line (chat with `messages` and optional `tools`, or
completions with `prompt`; batch-API lines {"body": {...}} work too)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `llmrt tokens` flags."""
    p.add_argument("requests", help="JSONL of request bodies")
    p.add_argument("--model", action="append", default=None,
                   help="a model directory (tokenizer files; config.json for cost estimates); repeat to compare "
                        "(default: the embedded model)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) for every model")
    p.add_argument("--dtype", default="auto", help="dtype for the KV-byte estimates (default: the checkpoint's)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size the prefix cache shares (default: 16)")
    p.add_argument("--top", type=int, default=5, help="longest requests shown with their costs (default: 5)")
    p.add_argument("--access-log", default=None, help="a server log with JSON access-log lines")
    p.add_argument("--max-tokens-ratio", type=float, default=4.0,
                   help="flag requests whose max_tokens is at least this many times what they used (default: 4)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the token share per part to this PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """`llmrt tokens`."""
    bodies = load_requests(args.requests)
    models = [TokenModel.load(m, args.chat_template, args.dtype) for m in (args.model or [None])]
    report: dict[str, Any] = {"requests": args.requests, "models": [
        audit(m, bodies, args.top, args.block_size, not args.no_progress) for m in models]}
    if args.access_log:
        report["access_log"] = access_summary(read_access_log(args.access_log), args.max_tokens_ratio)
    if args.plot:
        plot(report, args.plot)
        report["plot"] = args.plot
    print(json.dumps(report, indent=1, default=str) if args.json else render(report))
    return 0
