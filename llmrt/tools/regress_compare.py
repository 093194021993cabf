"""`llmrt regress compare`: replay a golden file's requests against another endpoint and report what changed.

Outputs are compared on token ids when both runs have them (the endpoints honour vLLM's
`return_tokens_as_token_ids`), else on token texts, else (only one run has ids) on the text's characters; the
report says which. Reported: the exact-match rate (same tokens and finish reason); for each mismatch the first diverging token
position and the logprob margin there in both runs (how much likelier each run found its own token than the
other run's: a margin near zero is a near-tie flip, a large one a real change); finish-reason changes; TTFT,
TPOT and end-to-end percentiles old vs new with the change in %; the server's memory figures old vs new
(after each run) and how much each grew during its run.
The exit status is 1 when a threshold is crossed, else 0.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from llmrt.bench.serve import percentiles
from llmrt.errors import InvalidRequestError
from llmrt.table import format_table

LATENCY_METRICS = ("ttft", "tpot", "e2e")
LATENCY_STATS = ("mean", "p50", "p90", "p99")


BASES = {"ids": "token ids", "texts": "token texts", "chars": "characters of the text"}


def basis(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What two records are compared on: token ids when both have them, token texts when neither has, else (one
    endpoint ignored return_tokens_as_token_ids: an id and a text cannot be compared) the text's characters."""
    if old.get("token_ids") is not None and new.get("token_ids") is not None:
        return "ids"
    if old.get("token_ids") is None and new.get("token_ids") is None and (old.get("tokens") or new.get("tokens")):
        return "texts"
    return "chars"


def _sequence(rec: dict[str, Any], on: str) -> list[Any]:
    """A request's output as the sequence it is compared on."""
    if on == "ids":
        return rec["token_ids"]
    return (rec.get("tokens") or []) if on == "texts" else list(rec.get("text") or "")


def _margin(rec: dict[str, Any], pos: int, own: Any, other: Any) -> Optional[float]:
    """logprob(own token) - logprob(other token) at `pos` in this run; a lower bound when `other` was not in
    its top list (then the least likely listed alternative stands in); None without logprobs."""
    if pos >= len(rec.get("logprobs") or []) or rec["logprobs"][pos] is None:
        return None
    top = rec["top_logprobs"][pos] if pos < len(rec.get("top_logprobs") or []) else {}
    key = other if isinstance(other, str) else f"token_id:{other}"
    if key in top:
        return rec["logprobs"][pos] - top[key]
    return rec["logprobs"][pos] - min(top.values()) if top else None


def compare_request(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One request old vs new: match, first divergence and margins, finish reasons."""
    on = basis(old, new)
    a, b = _sequence(old, on), _sequence(new, on)
    row: dict[str, Any] = {"index": old["index"], "mode": old["mode"], "basis": on,
                           "old_finish": old["finish_reason"], "new_finish": new["finish_reason"], "old_tokens": len(a), "new_tokens": len(b),
                           "ok": bool(old["ok"] and new["ok"]), "error": new.get("error")}
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if pos is None and len(a) != len(b):
        pos = min(len(a), len(b))  # one is a prefix of the other
    row["match"] = row["ok"] and pos is None and old["finish_reason"] == new["finish_reason"]
    row["first_diff"] = pos
    row["old_token"] = row["new_token"] = row["margin_old"] = row["margin_new"] = None
    if pos is not None and pos < len(a) and pos < len(b):
        row["old_token"], row["new_token"] = a[pos], b[pos]
    if pos is not None and pos < len(a) and pos < len(b) and on != "chars":  # a character has no logprob
        row["margin_old"] = _margin(old, pos, a[pos], b[pos])
        row["margin_new"] = _margin(new, pos, b[pos], a[pos])
    return row


def _latency(records: list[dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    ok = [r for r in records if r["ok"]]
    return {m: {k[:-3]: v for k, v in percentiles([r[f"{m}_s"] for r in ok if r[f"{m}_s"] is not None]).items()}
            for m in LATENCY_METRICS}


def _change(old: Optional[float], new: Optional[float]) -> Optional[float]:
    return (new - old) / old * 100.0 if old and new is not None else None


def _growth(server: dict[str, Any]) -> dict[str, float]:
    """How much each memory series grew during one run (after - before)."""
    before, after = server["before"]["memory"], server["after"]["memory"]
    return {k: after[k] - before[k] for k in after if k in before}


def compare_runs(golden: dict[str, Any], run: dict[str, Any], near_tie: float) -> dict[str, Any]:
    """The whole report (also what --json prints)."""
    rows = [compare_request(o, n) for o, n in zip(golden["requests"], run["requests"])]
    mismatches = [r for r in rows if not r["match"]]
    for r in mismatches:
        margins = [m for m in (r["margin_old"], r["margin_new"]) if m is not None]
        r["near_tie"] = bool(margins) and max(margins) <= near_tie
    lat_old, lat_new = _latency(golden["requests"]), _latency(run["requests"])
    latency = [{"metric": m, "stat": s, "old_ms": lat_old[m][s], "new_ms": lat_new[m][s],
                "change_pct": _change(lat_old[m][s], lat_new[m][s])} for m in LATENCY_METRICS for s in LATENCY_STATS]
    mem_old, mem_new = golden["server"]["after"]["memory"], run["server"]["after"]["memory"]
    grew_old = _growth(golden["server"])
    grew_new = _growth(run["server"])
    memory = [{"series": k, "old": mem_old.get(k), "new": mem_new.get(k),
               "delta": (mem_new[k] - mem_old[k]) if k in mem_old and k in mem_new else None,
               "change_pct": _change(mem_old.get(k), mem_new.get(k)),
               "old_run_growth": grew_old.get(k), "new_run_growth": grew_new.get(k)}
              for k in sorted(set(mem_old) | set(mem_new))]
    return {"golden": {"base_url": golden["base_url"], "model": golden["model"], "date": golden["date"],
                       "version": golden["server"]["before"]["version"]},
            "new": {"base_url": run["base_url"], "model": run["model"], "date": run["date"],
                    "version": run["server"]["before"]["version"]},
            "compared_on": _compared_on(golden, run, rows),
            "num_requests": len(rows), "exact_match_rate": (len(rows) - len(mismatches)) / len(rows) if rows else None,
            "num_mismatches": len(mismatches), "num_near_ties": sum(1 for r in mismatches if r["near_tie"]),
            "num_failed": sum(1 for r in rows if not r["ok"]),
            "finish_reason_changes": [{"index": r["index"], "old": r["old_finish"], "new": r["new_finish"]}
                                      for r in rows if r["ok"] and r["old_finish"] != r["new_finish"]],
            "mismatches": mismatches, "latency": latency, "memory": memory}


def _compared_on(golden: dict[str, Any], run: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """What the outputs were compared on, and why when it is not token ids."""
    counts = {b: sum(1 for r in rows if r["basis"] == b) for b in BASES}
    text = ", ".join(f"{BASES[b]} ({n} requests)" for b, n in counts.items() if n) or "nothing"
    ignored = [r["base_url"] for r in (golden, run) if not r.get("token_ids")]
    if ignored and (counts["texts"] or counts["chars"]):
        text += f"; no token ids from {' and '.join(ignored)} (return_tokens_as_token_ids ignored there)"
    return text


def parse_percent(text: str) -> float:
    """'10%' or '10' -> 10.0."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a percentage such as 10%") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a non-negative percentage")
    return value


def violations(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Every threshold the report crosses, as sentences."""
    out = []
    if report["num_failed"] > args.max_failed:
        out.append(f"{report['num_failed']} requests failed (allowed: {args.max_failed})")
    rate = report["exact_match_rate"]
    if args.allow_near_ties and report["num_requests"]:
        rate = (report["num_requests"] - report["num_mismatches"] + report["num_near_ties"]) / report["num_requests"]
    if rate is not None and rate < args.min_exact_match:
        out.append(f"exact-match rate {rate:.1%} is under {args.min_exact_match:.1%}")
    if args.max_latency_regression is not None:
        stats, limit = set(args.latency_stats.split(",")), args.max_latency_regression
        for row in report["latency"]:
            if row["stat"] in stats and row["change_pct"] is not None and row["change_pct"] > limit:
                out.append(f"{row['metric']} {row['stat']} regressed {row['change_pct']:+.1f}% "
                           f"({row['old_ms']:.2f} -> {row['new_ms']:.2f} ms; allowed +{limit:g}%)")
    if args.max_memory_increase is not None:
        for row in report["memory"]:
            if row["change_pct"] is not None and row["change_pct"] > args.max_memory_increase:
                out.append(f"{row['series']} grew {row['change_pct']:+.1f}% (allowed +{args.max_memory_increase:g}%)")
    return out


def render(report: dict[str, Any]) -> str:
    """The readable report."""
    g, n = report["golden"], report["new"]
    lines = [f"golden: {g['base_url']} model {g['model']} version {(g['version'] or {}).get('version')} ({g['date']})",
             f"new:    {n['base_url']} model {n['model']} version {(n['version'] or {}).get('version')} ({n['date']})",
             f"exact match: {report['num_requests'] - report['num_mismatches']}/{report['num_requests']} "
             f"({report['exact_match_rate']:.1%}); mismatches {report['num_mismatches']} "
             f"(near-ties {report['num_near_ties']}); failed {report['num_failed']}; finish-reason changes "
             f"{len(report['finish_reason_changes'])}", f"compared on: {report['compared_on']}", ""]
    if report["mismatches"]:
        shown = [{**r, "old_token": _shown(r["old_token"]), "new_token": _shown(r["new_token"])}
                 for r in report["mismatches"]]
        lines += ["mismatches (first diverging token; margin = logprob(own token) - logprob(other run's token)):",
                  format_table(shown, ["index", "mode", "basis", "first_diff", "old_token", "new_token", "margin_old",
                                       "margin_new", "near_tie", "old_finish", "new_finish", "error"]), ""]
    lines += ["latency (client side):", format_table(report["latency"], ["metric", "stat", "old_ms", "new_ms",
                                                                         ("change_pct", "change %")])]
    if report["memory"]:
        lines += ["", "server memory (after each run):",
                  format_table(report["memory"], ["series", "old", "new", "delta", ("change_pct", "change %"),
                                                  "old_run_growth", "new_run_growth"])]
    return "\n".join(lines)


def _shown(token: Any) -> Any:
    """A token as a table cell: texts quoted (a newline or a space stays visible), ids as they are."""
    return json.dumps(token) if isinstance(token, str) else token


def plot(golden: dict[str, Any], run: dict[str, Any], path: str) -> None:
    """Latency CDFs old vs new (TTFT, TPOT, e2e) as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric in zip(axes, LATENCY_METRICS):
        for label, recs in (("old", golden["requests"]), ("new", run["requests"])):
            xs = sorted(r[f"{metric}_s"] * 1000.0 for r in recs if r["ok"] and r[f"{metric}_s"] is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post", label=label)
        ax.set_title(f"{metric.upper()} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"llmrt regress: {golden['base_url']} (old) vs {run['base_url']} (new)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The compare-only flags."""
    p.add_argument("--min-exact-match", type=lambda t: parse_percent(t) / 100.0, default=1.0, metavar="PCT",
                   help="fail when fewer requests match exactly (default: 100%%)")
    p.add_argument("--allow-near-ties", action="store_true",
                   help="count mismatches whose margin is within --near-tie as matches for --min-exact-match")
    p.add_argument("--near-tie", type=float, default=0.05,
                   help="a mismatch is a near-tie when both runs' margins are at most this many nats (default: 0.05)")
    p.add_argument("--max-latency-regression", type=parse_percent, default=None, metavar="PCT",
                   help="fail when a latency statistic (--latency-stats) of TTFT, TPOT or e2e grew more than this, "
                        "e.g. 10%% (default: not checked)")
    p.add_argument("--latency-stats", default="p50,p90",
                   help=f"statistics checked by --max-latency-regression, from {','.join(LATENCY_STATS)} "
                        "(default: p50,p90)")
    p.add_argument("--max-memory-increase", type=parse_percent, default=None, metavar="PCT",
                   help="fail when a server memory series grew more than this (default: not checked)")
    p.add_argument("--max-failed", type=int, default=0, help="failed requests allowed (default: 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="PNG", help="write latency CDFs old vs new to this PNG")
    p.add_argument("--save", default=None, metavar="JSON", help="also write the new run (a golden file itself)")


def run_compare(args: argparse.Namespace) -> int:
    """`llmrt regress compare`: replay, compare, print, exit 1 on a crossed threshold."""
    from llmrt.tools.regress import FORMAT_VERSION, run_workload

    try:
        golden = json.loads(Path(args.golden).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"cannot read the golden file {args.golden}: {e}", param="golden") from None
    if golden.get("tool") != "llmrt regress" or golden.get("format") != FORMAT_VERSION:
        raise InvalidRequestError(f"{args.golden} is not a file written by `llmrt regress record`", param="golden")
    bad = set(args.latency_stats.split(",")) - set(LATENCY_STATS)
    if bad:
        raise InvalidRequestError(f"--latency-stats: unknown {', '.join(sorted(bad))}", param="latency_stats")
    run = run_workload(args.base_url, golden["workload"], args.model, top_logprobs=golden["top_logprobs"],
                       concurrency=args.concurrency or golden["concurrency"], timeout=args.timeout,
                       progress=not args.no_progress,
                       warmup=golden.get("warmup", 0) if args.warmup is None else args.warmup)
    if args.save:
        Path(args.save).write_text(json.dumps(run, indent=1) + "\n")
    report = compare_runs(golden, run, args.near_tie)
    report["violations"] = violations(report, args)
    if args.plot:
        plot(golden, run, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render(report))
        print("\n" + ("FAIL: " + "; ".join(report["violations"]) if report["violations"] else "PASS"))
    sys.stdout.flush()
    return 1 if report["violations"] else 0
