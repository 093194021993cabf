"""Metrics in-process over the scripted fake engine: counters equal what was sent, the `llmrt` timing object,
the dashboard timeline; and the pure parts of `bench serve` (length distributions, percentiles, goodput)."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from llmrt.bench.client import RequestResult
from llmrt.bench.serve import (LengthDist, Workload, meets_slo, parse_lengths, percentiles, summarize,
                               throughput_series)
from llmrt.errors import CapacityExceededError, EngineDeadError
from llmrt.metrics.prometheus import length_buckets
from llmrt.metrics.timeline import Timeline, percentile
from llmrt.metrics.timing import request_timing
from llmrt.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmrt.server.app import build_app
from test_server_app import FakeEngine, _events


def scrape(client: TestClient) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model): value}; parsed by prometheus-client."""
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model") == "fake-model"
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def client(engine) -> TestClient:
    args = SimpleNamespace(served_model_name=None, model=None, enable_debug_endpoints=False)
    with TestClient(build_app(engine, args), raise_server_exceptions=False) as c:
        yield c


def test_counters_equal_what_was_sent(client, engine):
    before = scrape(client)
    usage = []
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200
    usage.append(r.json()["usage"])
    r = client.post("/v1/completions", json={"prompt": ["Hi", "Once upon"], "max_tokens": 3, "n": 2})
    usage.append(r.json()["usage"])
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    usage.append(_events(r)[-2]["usage"])
    # Errors: validation (400), unknown model (404), admission (429), an engine failure mid-stream.
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "Hi", "model": "nope"}).status_code == 404
    engine.admission_error = CapacityExceededError("full", retry_after=2.0)
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 429
    engine.admission_error = None
    engine.fail_after = (2, EngineDeadError("the engine core process died"))
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "stream": True})
    assert any(isinstance(e, dict) and "error" in e for e in _events(r))
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("llmrt_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("llmrt_generation_tokens_total") == sum(u["completion_tokens"] for u in usage) == 4 + 12 + 5
    assert delta("llmrt_request_success_total", finish_reason="length") == 1 + 4 + 1  # one per choice
    assert delta("llmrt_request_success_total", finish_reason="stop") == 0
    assert delta("llmrt_request_errors_total", code="invalid_request") == 1
    assert delta("llmrt_request_errors_total", code="model_not_found") == 1
    assert delta("llmrt_request_errors_total", code="capacity_exceeded") == 1
    assert delta("llmrt_request_errors_total", code="engine_dead") == 1
    engine_requests = 1 + 2 + 1  # one per prompt of the requests that finished
    for hist in ("llmrt_time_to_first_token_seconds", "llmrt_time_per_output_token_seconds",
                 "llmrt_e2e_request_latency_seconds", "llmrt_request_prompt_tokens",
                 "llmrt_request_generation_tokens"):
        assert delta(f"{hist}_count") == engine_requests, hist
    # One gap per token after the first, of sample 0 of each finished engine request.
    assert delta("llmrt_inter_token_latency_seconds_count") == 3 + 2 + 2 + 4
    assert value(after, "llmrt_kv_cache_usage_ratio") == 0.0  # the fake engine's stats: every block free
    assert value(after, "llmrt_process_resident_memory_bytes", process="server") > 0


def test_timing_object_on_responses_and_final_chunk(client):
    body = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).json()
    t = body["llmrt"]
    assert set(t) == {"queue_time", "ttft", "tpot", "e2e", "cached_tokens", "preemptions", "spec_proposed", "spec_accepted"}
    assert 0 <= t["ttft"] <= t["e2e"] and t["tpot"] >= 0 and t["cached_tokens"] == 0 and t["preemptions"] == 0
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 3}).json()
    assert body["llmrt"]["e2e"] >= body["llmrt"]["ttft"] >= 0
    for include_usage in (False, True):
        events = _events(client.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": include_usage}}))
        chunks = [e for e in events if isinstance(e, dict)]
        assert events[-1] == "[DONE]"
        assert "llmrt" in chunks[-1] and chunks[-1]["llmrt"]["e2e"] >= 0
        assert not any("llmrt" in c for c in chunks[:-1])


def test_metrics_and_dashboard_polls_stay_out_of_the_access_log(client, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="llmrt.access"):
        client.get("/metrics")
        client.get("/dashboard/data")
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "user": "alice"})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmrt.access"]
    assert [ln["endpoint"] for ln in lines] == ["/v1/completions"]
    line = lines[0]
    assert line["user"] == "alice" and line["model"] == "fake-model" and line["status"] == 200
    assert line["method"] == "POST" and line["request_id"] and line["completion_tokens"] == 2
    assert {"queue_time", "ttft", "tpot", "e2e", "cached_tokens", "preemptions"} <= set(line["metrics"])


def test_dashboard_page_and_assets_are_served(client):
    page = client.get("/dashboard")
    assert page.status_code == 200 and "uPlot.iife.min.js" in page.text and "http" not in page.text.split("<body>")[1]
    for asset in ("uPlot.iife.min.js", "uPlot.min.css", "dashboard.js", "uPlot.LICENSE"):
        assert client.get(f"/dashboard/static/{asset}").status_code == 200, asset
    data = client.get("/dashboard/data").json()
    assert data["model"] == "fake-model" and {"t", "kv_usage", "ttft_p99"} <= set(data["series"])


# -- the dashboard timeline ---------------------------------------------------------------------------------------
def _finished(ttft: float, tpot: float, tokens: int) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=ttft,
                       last_token_time=ttft + tpot * (tokens - 1), finished_time=ttft + tpot * (tokens - 1),
                       num_generation_steps=tokens, num_preemptions=1, num_cached_tokens=16)
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", list(range(tokens)), finish_reason="length")],
                         True, m)


def test_timeline_samples_engine_and_latency_percentiles():
    stats: dict[str, Any] = {"num_running": 3, "num_waiting": 2, "kv_blocks_total": 100, "kv_blocks_free": 25,
                             "num_steps": 10, "last_step_seqs": 3, "last_step_tokens": 40, "drain_tokens_per_s": 50.0}
    tl = Timeline(lambda: stats, interval_s=1.0, history_s=3.0, window_s=30.0)
    for i in range(10):
        tl.observe_request([_finished(0.1 * (i + 1), 0.01, 5)])
    s = tl.sample()
    assert (s.running, s.waiting, s.batch_seqs, s.batch_tokens) == (3, 2, 3, 40)
    assert s.kv_usage == pytest.approx(0.75) and s.engine_tokens_per_s == 50.0
    assert s.ttft_p50 == pytest.approx(0.55) and s.ttft_p99 == pytest.approx(0.991)
    assert s.tpot_p90 == pytest.approx(0.01)
    s = tl.sample()  # no engine step since the last sample: idle, so no batch and no engine rate
    assert s.batch_seqs == 0 and s.engine_tokens_per_s == 0.0
    for _ in range(3):
        tl.sample()
    cols = tl.columns()["series"]
    assert len(cols["t"]) == 3 and cols["kv_usage"] == [pytest.approx(0.75)] * 3
    assert s.spec_acceptance is None  # nothing proposed
    stats.update(spec_proposed_by_position=[8, 4], spec_accepted_by_position=[7, 2])
    assert tl.sample().spec_acceptance == pytest.approx(0.75)
    stats.update(spec_proposed_by_position=[12, 6], spec_accepted_by_position=[8, 2])
    assert tl.sample().spec_acceptance == pytest.approx(1 / 6)  # the share since the last sample, not cumulative
    assert tl.sample().collective_share is None  # one rank: no collectives
    stats.update(collective_seconds=0.2, collective_step_seconds=1.0)
    assert tl.sample().collective_share == pytest.approx(0.2)
    stats.update(collective_seconds=0.5, collective_step_seconds=2.0)
    assert tl.sample().collective_share == pytest.approx(0.3)  # since the last sample


def test_request_timing_and_buckets():
    t = request_timing([_finished(0.2, 0.01, 5), None, _finished(0.1, 0.03, 3)])
    assert t["ttft"] == pytest.approx(0.1) and t["tpot"] == pytest.approx(0.02) and t["e2e"] == pytest.approx(0.24)
    assert t["queue_time"] == 0.0 and t["cached_tokens"] == 32 and t["preemptions"] == 2
    assert request_timing([None]) is None
    assert length_buckets(300) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert percentile([], 50) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0


# -- bench serve, without a server ---------------------------------------------------------------------------------
def test_length_distributions(tmp_path):
    assert parse_lengths("fixed:7", "prompt_len").sample(None, 3) == 7
    u = parse_lengths("uniform:3,5", "prompt_len")
    import random
    rng = random.Random(0)
    assert {u.sample(rng, i) for i in range(200)} == {3, 4, 5}
    path = tmp_path / "lens.jsonl"
    path.write_text('{"prompt_len": 4, "output_len": 9}\n{"prompt_len": 6, "output_len": 2}\n\n')
    j = parse_lengths(f"jsonl:{path}", "output_len")
    assert [j.sample(rng, i) for i in range(3)] == [9, 2, 9]
    for bad in ("fixed:0", "uniform:5,3", "normal:3", f"jsonl:{tmp_path / 'missing'}", "uniform:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lengths(bad, "prompt_len")
    w = Workload(LengthDist("fixed:4", "fixed", 4, 4), u, "tokens", (10, 20), seed=1)
    assert w.request(3) == w.request(3) and len(w.request(3).prompt) == 4
    assert all(10 <= t < 20 for t in w.request(5).prompt)
    text = Workload(LengthDist("fixed:6", "fixed", 6, 6), u, "text", (10, 20), seed=1).request(0)
    assert isinstance(text.prompt, str) and len(text.prompt.split()) == 6


def test_summary_percentiles_goodput_and_throughput():
    def result(start: float, ttft: float, itl: float, n: int, ok: bool = True) -> RequestResult:
        r = RequestResult(start=start, ok=ok, output_tokens=n if ok else 0, prompt_tokens=10 if ok else 0,
                          status=200 if ok else 429)
        r.token_times = [start + ttft + k * itl for k in range(n)] if ok else []
        r.end = r.token_times[-1] if ok else start + 0.01
        return r

    rs = [result(0.0, 0.1, 0.02, 11), result(0.5, 0.3, 0.05, 11), result(1.0, 0.0, 0.0, 0, ok=False)]
    assert meets_slo(rs[0], 200, 30) and not meets_slo(rs[1], 200, 30) and meets_slo(rs[1], 400, None)
    pairs = [(None, r) for r in rs]
    s = summarize(pairs, 0.0, 2.0, slo_ttft_ms=200, slo_tpot_ms=None)
    assert s["num_requests"] == 2 and s["num_failed"] == 1 and s["errors_by_status"] == {"429": 1}
    assert s["output_tokens"] == 22 and s["request_throughput"] == 1.0 and s["goodput"] == 0.5
    assert s["ttft"]["p50_ms"] == pytest.approx(200) and s["tpot"]["mean_ms"] == pytest.approx(35)
    assert s["itl"]["p99_ms"] == pytest.approx(50) and percentiles([])["p50_ms"] is None
    series = throughput_series(rs, 0.0, 2.0)
    assert sum(series["output_tokens_per_s"]) == pytest.approx(22) and sum(series["requests_per_s"]) == 2
