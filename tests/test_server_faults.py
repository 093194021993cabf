"""A real `llmrt serve` under bad input, overload, disconnects, deadlines and injected engine faults."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import httpx
import openai
import pytest

from server_utils import all_blocks_free, run_server, wait_until

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
T = 60.0  # the longest any single HTTP call here may take


def _greedy(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def _post(base: str, path: str, timeout: float = T, **kw: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", timeout=timeout, **kw)


def _assert_error(r: httpx.Response, status: int, code: str, param: Optional[str], retryable: bool) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code and body["error"]["param"] == param, body
    assert body["retryable"] is retryable and body["error"]["message"]


def _healthy(base: str) -> bool:
    return httpx.get(f"{base}/health", timeout=5).status_code == 200


def _access_log(base) -> list[dict[str, Any]]:
    return [json.loads(line) for line in base.log().splitlines() if line.startswith("{")]


# -- one server for bad input, disconnects, OOM and stalls -----------------------------------------------------
@pytest.fixture(scope="module")
def server(checkpoints):
    with run_server(checkpoints["llama3"], "--enable-debug-endpoints", "--health-step-timeout", "1") as base:
        yield base


BAD_INPUTS: list[tuple[str, dict[str, Any], int, str, Optional[str], bool]] = [
    # (path, httpx kwargs, status, code, param, retryable)
    ("/v1/completions", {"content": b'{"prompt": "x", "max_tokens": ', "headers": {"content-type": "application/json"}},
     400, "invalid_request", None, False),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": "ten"}}, 400, "invalid_request", "max_tokens", False),
    ("/v1/completions", {"json": {"prompt": 42}}, 400, "invalid_request", "prompt", False),
    ("/v1/chat/completions", {"json": {"messages": {"role": "user"}}}, 400, "invalid_request", "messages", False),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": -5}}, 400, "invalid_request", "max_tokens", False),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": 10**12}}, 400, "context_length_exceeded",
     "max_tokens", False),
    ("/v1/completions", {"json": {"prompt": "x", "temperature": 7.5}}, 400, "invalid_request", "temperature", False),
    ("/v1/completions", {"json": {"prompt": "x", "temperature": -1}}, 400, "invalid_request", "temperature", False),
    ("/v1/chat/completions", {"json": {"messages": []}}, 400, "invalid_request", "messages", False),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "pirate", "content": "arr"}]}}, 400, "invalid_request",
     "messages", False),
    ("/v1/completions", {"json": {"model": "gpt-17", "prompt": "x"}}, 404, "model_not_found", "model", False),
    ("/v1/completions", {"json": {"prompt": [7] * 300}}, 400, "context_length_exceeded", "prompt", False),
    ("/v1/completions", {"json": {"prompt": "Once " * 400}}, 400, "context_length_exceeded", "prompt", False),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "Once " * 400}]}}, 400,
     "context_length_exceeded", "messages", False),
    ("/v1/completions", {"json": {"prompt": [1, 2, 10**6]}}, 400, "invalid_request", "prompt", False),
    ("/v1/completions", {"json": {"prompt": [1, -2]}}, 400, "invalid_request", "prompt", False),
    ("/v1/completions", {"json": {"prompt": "x", "logit_bias": {"999999": 3}}}, 400, "invalid_request",
     "logit_bias", False),
    ("/v1/completions", {"content": b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}',
                         "headers": {"content-type": "application/json"}}, 400, "invalid_request", None, False),
]


def test_bad_input_while_a_good_request_runs(server):
    reference = _post(server, "/v1/completions", json=_greedy(48)).json()["choices"][0]["text"]
    results: dict[int, httpx.Response] = {}
    good: list[httpx.Response] = []

    def fire(i: int) -> None:
        path, kw, *_ = BAD_INPUTS[i]
        results[i] = _post(server, path, **kw)

    def good_requests() -> None:
        for _ in range(3):
            good.append(_post(server, "/v1/completions", json=_greedy(48)))

    threads = [threading.Thread(target=good_requests)]
    threads += [threading.Thread(target=fire, args=(i,)) for i in range(len(BAD_INPUTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=T)
    assert not any(t.is_alive() for t in threads)
    for i, (path, kw, status, code, param, retryable) in enumerate(BAD_INPUTS):
        _assert_error(results[i], status, code, param, retryable)
    assert [g.status_code for g in good] == [200] * 3
    assert all(g.json()["choices"][0]["text"] == reference for g in good)
    assert wait_until(lambda: all_blocks_free(server), timeout=10)
    assert _healthy(server)


def test_streaming_client_leaving_frees_its_blocks(server):
    with httpx.stream("POST", f"{server}/v1/completions", json=_greedy(230, stream=True), timeout=T) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
                if events == 3:
                    break
    assert wait_until(lambda: all_blocks_free(server), timeout=5)
    r = _post(server, "/v1/completions", json=_greedy(8))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    cancelled = [e for e in _access_log(server) if e.get("stream") and e.get("error") == "cancelled"]
    assert cancelled and cancelled[-1]["completion_tokens"] < 230


def test_non_streaming_client_leaving_aborts_the_request(server):
    before = httpx.get(f"{server}/debug/stats", timeout=5).json()["num_steps"]
    # A stalled step keeps the request from finishing before the client leaves, however fast the machine is.
    _post(server, "/debug/fault", json={"kind": "stall", "seconds": 1.0})
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", json=_greedy(230), timeout=0.3)
    assert wait_until(lambda: all_blocks_free(server), timeout=5)
    steps = httpx.get(f"{server}/debug/stats", timeout=5).json()["num_steps"] - before
    assert steps < 230  # it did not run to the end
    assert wait_until(lambda: any(e.get("status") == 499 for e in _access_log(server)), timeout=5)


def _stats(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/debug/stats", timeout=5).json()


def test_oom_in_a_step_is_absorbed(server):
    prompts = [PROMPT, "Lily and Tom"]
    expected = [_post(server, "/v1/completions", json={**_greedy(128), "prompt": p}).json()["choices"][0]["text"]
                for p in prompts]
    preemptions = _stats(server)["num_preemptions"]
    # The stall holds the engine's next step until both requests have arrived, so the OOM hits a step of two.
    assert _post(server, "/debug/fault", json={"kind": "stall", "seconds": 1.5}).status_code == 200
    assert _post(server, "/debug/fault", json={"kind": "oom"}).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_post, server, "/v1/completions", json={**_greedy(128), "prompt": p}) for p in prompts]
        results = [f.result(timeout=T) for f in futures]
    assert [r.status_code for r in results] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in results] == expected
    assert all(r.json()["usage"]["completion_tokens"] == 128 for r in results)
    assert _stats(server)["num_preemptions"] > preemptions  # the OOM step happened, and was absorbed so
    assert _healthy(server)


def test_stalled_engine_makes_health_503_while_it_lasts(server):
    seen: list[tuple[float, int]] = []

    def health() -> int:
        status = httpx.get(f"{server}/health", timeout=5).status_code
        seen.append((round(time.monotonic() - start, 2), status))
        return status

    assert _post(server, "/debug/fault", json={"kind": "stall", "seconds": 5}).json()["kind"] == "stall"
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, server, "/v1/completions", json=_greedy(8))
        assert wait_until(lambda: health() == 503, timeout=4.5, interval=0.1), seen
        r = httpx.get(f"{server}/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "unhealthy" and r.json()["reason"], (r.text, seen)
        done = pending.result(timeout=T)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8, done.text
    assert wait_until(lambda: health() == 200, timeout=5), seen


# -- a small queue: overload and deadlines ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(checkpoints):
    with run_server(checkpoints["llama3"], "--enable-debug-endpoints", "--max-waiting-requests", "4",
                    "--max-num-seqs", "2") as base:
        yield base


def test_overload_gets_429_with_retry_after_and_the_rest_completes(small_server):
    reference = _post(small_server, "/v1/completions", json=_greedy(32)).json()["choices"][0]["text"]
    barrier = threading.Barrier(30)

    def one(_: int) -> httpx.Response:
        barrier.wait(timeout=T)
        return _post(small_server, "/v1/completions", json=_greedy(32))

    with ThreadPoolExecutor(30) as pool:
        results = list(pool.map(one, range(30), timeout=2 * T))
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code != 200]
    assert ok and refused, [r.status_code for r in results]
    for r in refused:
        _assert_error(r, 429, "capacity_exceeded", None, True)
        assert int(r.headers["retry-after"]) >= 1
    for r in ok:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"] == reference
        assert r.json()["usage"]["completion_tokens"] == 32
    assert _healthy(small_server)
    assert wait_until(lambda: all_blocks_free(small_server), timeout=10)


def test_queued_request_past_its_timeout_gets_408(small_server):
    # The stall is armed while the engine is idle and holds the first step that the long requests start: the
    # late request is queued behind it for longer than its timeout however fast this machine decodes (polling
    # for the long requests to be running races with them finishing on a fast machine).
    _post(small_server, "/debug/fault", json={"kind": "stall", "seconds": 2.0})
    with ThreadPoolExecutor(2) as pool:
        long = [pool.submit(_post, small_server, "/v1/completions", json=_greedy(200)) for _ in range(2)]
        assert wait_until(lambda: httpx.get(f"{small_server}/debug/stats", timeout=5).json().get("num_streams") == 2,
                          timeout=10)
        start = time.monotonic()
        r = _post(small_server, "/v1/completions", json={**_greedy(8), "prompt": "Lily", "timeout": 0.5})
        _assert_error(r, 408, "deadline_exceeded", None, True)
        assert time.monotonic() - start < 5
        results = [f.result(timeout=T) for f in long]
    assert all(x.status_code == 200 and x.json()["usage"]["completion_tokens"] == 200 for x in results)
    assert wait_until(lambda: all_blocks_free(small_server), timeout=10)


# -- engine death (last: the server does not come back) ---------------------------------------------------------
def test_engine_death_fails_the_stream_and_health(checkpoints):
    with run_server(checkpoints["llama3"], "--enable-debug-endpoints") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=30, max_retries=0)
        # 50 ms per step: the stream cannot finish its 230 tokens before the crash lands (with the fast kernels a
        # tiny model generated them all while the client was still reading the first events)
        _post(base, "/debug/fault", json={"kind": "slow", "seconds": 0.05})
        stream = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=230, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError) as e:
            for i, _ in enumerate(stream):
                if i == 2:
                    _post(base, "/debug/fault", json={"kind": "crash"})
        assert e.value.code == "engine_dead"
        assert wait_until(lambda: not _healthy(base), timeout=5)
        r = httpx.get(f"{base}/health", timeout=5)
        assert r.status_code == 503 and "died" in r.json()["reason"]
        _assert_error(_post(base, "/v1/completions", json=_greedy(4)), 503, "engine_dead", None, True)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "hi"}])


def test_a_killed_server_leaves_no_named_semaphores(checkpoints):
    """SIGKILL of the whole process group (API process, engine core, resource tracker) leaves nothing in /dev/shm:
    the API and the core talk over pipes, not mp.Queue (whose named semaphores only a clean exit unlinks)."""
    import os
    import signal
    from pathlib import Path

    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("sem.mp-*")}
    with run_server(checkpoints["llama3"]) as base:
        r = httpx.post(f"{base}/v1/completions", json=_greedy(4), timeout=30)
        assert r.status_code == 200
        os.killpg(base.proc.pid, signal.SIGKILL)
        base.proc.wait(timeout=10)
    time.sleep(0.5)  # the engine core may still be dying
    assert {p.name for p in shm.glob("sem.mp-*")} - before == set()


def _children(pid: int) -> list[int]:
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_sigterm_stops_the_server_cleanly():
    """SIGTERM: exit code 0 (the process skips the interpreter's teardown once its engine has stopped), the
    engine core gone with it, and the log's last line whole."""
    import os
    import signal
    from pathlib import Path

    with run_server() as base:
        r = httpx.post(f"{base}/v1/completions", json=_greedy(4), timeout=30)
        assert r.status_code == 200
        children = _children(base.proc.pid)
        assert children  # the engine core (and the resource tracker)
        base.proc.send_signal(signal.SIGTERM)
        assert base.proc.wait(timeout=15) == 0
        for pid in children:
            assert wait_until(lambda: not os.path.exists(f"/proc/{pid}") or
                              Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", timeout=10)
        log = Path(base.log_path).read_text()
        assert log.endswith("\n") and '"endpoint": "/v1/completions"' in log
