"""Observability against a real `llmrt serve`: counters after a known set of requests, KV usage back to zero,
`llmrt bench serve` against the live server, and the dashboard in headless Chromium."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import REPO, run_server, wait_until

pytestmark = pytest.mark.slow

MODEL = "stories260K"


@pytest.fixture(scope="module")
def server():
    with run_server(None, "--enable-debug-endpoints") as url:
        yield url


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus-client: {(sample name, labels other than model): value}."""
    resp = httpx.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model") == MODEL
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_equal_what_was_sent_and_kv_returns_to_zero(server):
    before = scrape(server)
    v1 = f"{server}/v1"
    usages, reasons, itl_gaps = [], [], 0
    greedy = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    first = httpx.post(f"{v1}/completions", json=greedy, timeout=60).json()
    text = first["choices"][0]["text"]
    # The same greedy request stopped by a string from its own output finishes with "stop".
    stop = text.strip().split()[1]
    stopped = httpx.post(f"{v1}/completions", json={**greedy, "stop": [stop]}, timeout=60).json()
    chat = httpx.post(f"{v1}/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
        "ignore_eos": True, "min_tokens": 6}, timeout=60).json()
    for body in (first, stopped, chat):
        usages.append(body["usage"])
        reasons += [c["finish_reason"] for c in body["choices"]]
        assert body["llmrt"]["ttft"] > 0 and body["llmrt"]["e2e"] >= body["llmrt"]["ttft"]
    itl_gaps = (first["usage"]["completion_tokens"] - 1) + (stopped["usage"]["completion_tokens"] - 1) + (6 - 1)
    assert reasons.count("stop") >= 1 and stopped["choices"][0]["finish_reason"] == "stop"
    # Errors: a validation 400, an unknown model 404, a deadline 408 (the embedded model cannot finish 400 tokens
    # in 20 ms).
    assert httpx.post(f"{v1}/completions", json={**greedy, "max_tokens": -2}).status_code == 400
    assert httpx.post(f"{v1}/completions", json={**greedy, "model": "other"}).status_code == 404
    r = httpx.post(f"{v1}/completions", json={**greedy, "max_tokens": 400, "ignore_eos": True, "timeout": 0.02},
                   timeout=60)
    assert r.status_code == 408, r.text
    assert wait_until(lambda: get(scrape(server), "llmrt_kv_cache_usage_ratio") == 0.0, timeout=10)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    assert delta("llmrt_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("llmrt_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    for reason in ("stop", "length"):
        assert delta("llmrt_request_success_total", finish_reason=reason) == reasons.count(reason), reason
    assert delta("llmrt_request_errors_total", code="invalid_request") == 1
    assert delta("llmrt_request_errors_total", code="model_not_found") == 1
    assert delta("llmrt_request_errors_total", code="deadline_exceeded") == 1
    for hist in ("llmrt_time_to_first_token_seconds", "llmrt_e2e_request_latency_seconds",
                 "llmrt_request_queue_time_seconds", "llmrt_request_prefill_time_seconds",
                 "llmrt_time_per_output_token_seconds", "llmrt_request_prompt_tokens",
                 "llmrt_request_generation_tokens"):
        assert delta(f"{hist}_count") == 3, hist
    assert delta("llmrt_inter_token_latency_seconds_count") == itl_gaps
    assert get(after, "llmrt_num_requests_running") == 0 and get(after, "llmrt_num_requests_waiting") == 0
    assert get(after, "llmrt_kv_cache_free_blocks") == get(after, "llmrt_kv_cache_total_blocks") > 0
    for process in ("server", "engine_core"):
        assert get(after, "llmrt_process_resident_memory_bytes", process=process) > 10_000_000
    # The access log has one JSON line per request, with the timings.
    lines = [json.loads(ln) for ln in server.log().splitlines() if ln.startswith('{"request_id"')]
    ok = [ln for ln in lines if ln.get("response_id") == first["id"]]
    assert len(ok) == 1 and ok[0]["status"] == 200 and ok[0]["metrics"]["ttft"] == pytest.approx(
        first["llmrt"]["ttft"], abs=1e-5)


def test_bench_serve_counts_what_the_server_finished(server, tmp_path):
    before = scrape(server)
    cmd = [sys.executable, "-m", "llmrt.cli", "bench", "serve", "--base-url", f"{server}/v1", "--model", MODEL,
           "--concurrency", "2", "--duration", "3", "--prompt-len", "uniform:8,24", "--output-len", "fixed:8",
           "--slo-ttft-ms", "60000", "--output-dir", str(tmp_path), "--name", "run", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = scrape(server)
    report = json.loads((tmp_path / "run.json").read_text())
    s = report["summary"]
    finished = sum(v - get(before, name, **dict(labels)) for (name, labels), v in after.items()
                   if name == "llmrt_request_success_total")
    assert s["num_requests"] >= 2 and s["num_failed"] == 0
    assert s["num_requests"] == finished
    assert s["output_tokens"] == 8 * s["num_requests"]
    assert s["ttft"]["p50_ms"] > 0 and s["tpot"]["p99_ms"] >= s["tpot"]["p50_ms"] and s["goodput"] > 0
    assert (tmp_path / "run.png").stat().st_size > 10_000 and (tmp_path / "serve-stories260K.md").exists()
    assert all(r["server_timing"] is not None for r in report["requests"])  # the final chunk's llmrt object


def _chromium():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        # A missing browser is a broken set-up, not a reason to pass without testing the dashboard.
        pytest.fail("chromium and chromedriver are not installed (make test installs them with apt-get)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def test_dashboard_draws_in_headless_chromium(server):
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                         "max_tokens": 16, "ignore_eos": True}, timeout=120)

    threads = [threading.Thread(target=load) for _ in range(2)]
    driver = _chromium()
    try:
        for t in threads:
            t.start()
        driver.get(f"{server}/dashboard")
        assert driver.title == "llmrt dashboard"

        def drawn() -> bool:
            # Every chart has samples; the request and latency charts have seen non-zero values.
            return driver.execute_script("""
                const c = window.llmrtCharts || {};
                const ids = ["batch", "requests", "kv", "throughput", "ttft", "tpot", "spec", "collective"];
                if (!ids.every(id => c[id] && c[id].data[0].length > 0)) return false;
                const any = id => c[id].data.slice(1).some(s => s.some(v => v !== null && v > 0));
                return ["batch", "requests", "kv", "ttft", "tpot"].every(any);
            """)

        assert wait_until(drawn, timeout=120, interval=0.5), driver.execute_script(
            "return JSON.stringify(Object.keys(window.llmrtCharts || {}))")
        # The canvases have pixels drawn on them (uPlot draws the series and axes into a canvas).
        painted = driver.execute_script("""
            return Array.from(document.querySelectorAll("canvas")).map(cv => {
                const px = cv.getContext("2d").getImageData(0, 0, cv.width, cv.height).data;
                let n = 0; for (let i = 3; i < px.length; i += 4) if (px[i] > 0) n++;
                return n;
            });""")
        assert len(painted) == 8 and all(n > 100 for n in painted), painted
        assert "samples every" in driver.find_element("id", "status").text
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        driver.quit()
