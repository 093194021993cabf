"""Speculative decoding through `llmrt serve`: the flags, the per-request opt-out, and what the server reports."""
from __future__ import annotations

import httpx
import pytest

from server_utils import run_server

pytestmark = pytest.mark.slow
# A story with a repeated stretch, so n-gram proposals have something to copy.
PROMPT = "Lily had a red ball. Lily had a red ball. Lily had a red ball. Lily had a"


def _complete(base: str, **extra) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "stories260K", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_served_speculation_reports_and_opts_out():
    with run_server(None, "--speculative-method", "ngram", "--num-speculative-tokens", "4") as base:
        on = _complete(base)
        off = _complete(base, speculative=False)
        assert on["choices"][0]["text"] == off["choices"][0]["text"]  # greedy: the same tokens either way
        assert on["llmrt"]["spec_proposed"] > 0 and 0 < on["llmrt"]["spec_accepted"] <= on["llmrt"]["spec_proposed"]
        assert off["llmrt"]["spec_proposed"] == 0 == off["llmrt"]["spec_accepted"]
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert _metric(metrics, "llmrt_spec_decode_proposed_tokens_total") == on["llmrt"]["spec_proposed"]
        assert _metric(metrics, "llmrt_spec_decode_accepted_tokens_total") == on["llmrt"]["spec_accepted"]
        # Per position: never more accepted than proposed, and later positions accept no more than earlier ones.
        by_pos = [sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("llmrt_spec_decode_accepted_tokens_total{") and f'position="{j}"' in line
                      and 'method="ngram"' in line) for j in range(1, 5)]
        assert by_pos[0] > 0 and by_pos == sorted(by_pos, reverse=True)
        spans = _metric(metrics, "llmrt_spec_decode_verify_steps_total")
        assert _metric(metrics, "llmrt_spec_decode_accepted_length_count") == spans > 0
        assert _metric(metrics, "llmrt_spec_decode_accepted_length_sum") == on["llmrt"]["spec_accepted"]
        assert _metric(metrics, "llmrt_spec_decode_propose_seconds_total") > 0
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": "stories260K", "prompt": "a", "speculative": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
