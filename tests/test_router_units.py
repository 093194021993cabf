"""The router's parts without servers: hash ring, policies, versions and canaries, retry rules and budget,
prompt prefixes, API keys, model versions."""
from __future__ import annotations

import json
import shutil

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from llmrt.config import DEFAULT_MODEL_DIR
from llmrt.router.backends import Backend
from llmrt.router.policies import HashRing, LeastLoad, PrefixAffinity, RouteInfo, Session, make_policy
from llmrt.router.prompts import PrefixConfig, parse_body, prefix_key
from llmrt.router.retry import RetryBudget, retryable_response
from llmrt.router.versions import VersionRules, parse_canary
from llmrt.server.auth import ApiKeyMiddleware
from llmrt.server.instance import model_version


def _backends(n: int, version: str = "v1") -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000", version=version, healthy=True) for i in range(n)]


def test_ring_moves_only_the_removed_backends_keys():
    ring = HashRing()
    urls = [f"http://h{i}" for i in range(4)]
    keys = [f"prefix-{k}".encode() for k in range(400)]
    before = {k: ring.walk(k, urls)[0] for k in keys}
    after = {k: ring.walk(k, urls[:3])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == urls[3] for k in moved)
    assert len({before[k] for k in keys}) == 4  # every backend owns some keys


def test_prefix_affinity_is_sticky_and_bounded_by_load():
    bs = _backends(3)
    policy = PrefixAffinity(load_factor=1.25)
    info = RouteInfo(prefix_key=b"ids:1,2,3")
    home = policy.choose(bs, info, bs).backend
    assert all(policy.choose(bs, info, bs).backend is home for _ in range(5))
    home.in_flight = 4  # a hot prefix: its home is over 1.25 x the mean
    spill = policy.choose(bs, info, bs)
    assert spill.backend is not home and spill.home is False
    assert policy.choose(bs, info, bs).backend is spill.backend  # the same next instance on the ring


def test_least_load_and_session():
    bs = _backends(3)
    bs[0].in_flight_tokens, bs[1].polled_queued_tokens = 100, 50
    assert LeastLoad().choose(bs, RouteInfo(), bs).backend is bs[2]
    s = Session()
    picks = {u: s.choose(bs, RouteInfo(user=u), bs).backend for u in ("ann", "bob", "cy")}
    assert all(s.choose(bs, RouteInfo(user=u), bs).backend is b for u, b in picks.items())
    gone = picks["ann"]
    rest = [b for b in bs if b is not gone]
    assert s.choose(rest, RouteInfo(user="ann"), bs).home is False
    with pytest.raises(ValueError):
        make_policy("random")


def test_canary_share_is_exact_and_pins_filter():
    v1, v2 = _backends(2), [Backend("http://10.0.1.1:8000", version="v2", healthy=True)]
    rules = VersionRules()
    rules.set_canary(parse_canary(["v2=0.1"]))
    picked = [rules.candidates(v1 + v2, None)[1] for _ in range(100)]
    assert picked.count("v2") == 10 and picked.count(None) == 90
    assert rules.candidates(v1 + v2, "v1")[0] == v1
    assert rules.candidates(v1 + v2, "v3")[0] == []
    assert rules.candidates(v2, None)[0] == v2  # only the canary is left: it takes everything
    for bad in (["v2"], ["v2=0"], ["v2=1.5"], ["a=0.6", "b=0.6"]):
        with pytest.raises(ValueError):
            parse_canary(bad)


def test_retry_rules_and_budget():
    assert retryable_response(503, {"error": {"code": "engine_dead"}, "retryable": True})
    assert retryable_response(429, None)
    for status in (400, 401, 404, 408, 500):
        assert not retryable_response(status, {"retryable": True})
    assert not retryable_response(503, {"retryable": False})
    budget = RetryBudget(ratio=0.5, min_retries=2)
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
    for _ in range(4):
        budget.record_request()
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
    assert budget.exhausted == 2


def test_prefix_keys_follow_the_shared_prefix():
    cfg = PrefixConfig(blocks=2, block_size=4)
    system = {"role": "system", "content": "You are a storyteller. " * 4}
    a = prefix_key({"messages": [system, {"role": "user", "content": "a cat"}]}, cfg)
    b = prefix_key({"messages": [system, {"role": "user", "content": "a dog"}]}, cfg)
    assert a == b
    assert prefix_key({"prompt": list(range(20))}, cfg) == prefix_key({"prompt": list(range(8)) + [99] * 12}, cfg)
    assert prefix_key({"prompt": [1] * 20}, cfg) != prefix_key({"prompt": [2] * 20}, cfg)
    parsed = parse_body(json.dumps({"prompt": [1] * 10, "max_tokens": 6, "user": "u", "model_version": "v2",
                                    "stream": True}).encode(), cfg)
    assert (parsed.info.est_tokens, parsed.info.user, parsed.pin, parsed.stream) == (16, "u", "v2", True)
    assert parse_body(b"not json", cfg).info.prefix_key is None


def _auth_app(**keys) -> TestClient:
    async def ok(request):
        return JSONResponse({"ok": True})
    app = Starlette(routes=[Route("/v1/models", ok), Route("/health", ok), Route("/admin/drain", ok, methods=["POST"])])
    app.add_middleware(ApiKeyMiddleware, **keys)
    return TestClient(app)


def test_api_keys():
    c = _auth_app(api_key="k", admin_api_key="adm")
    r = c.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["retryable"] is False
    assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert c.get("/health").status_code == 200
    assert c.post("/admin/drain", headers={"Authorization": "Bearer k"}).status_code == 401
    assert c.post("/admin/drain", headers={"Authorization": "Bearer adm"}).status_code == 200
    off = _auth_app(api_key="k")
    r = off.post("/admin/drain", headers={"Authorization": "Bearer k"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_model_version_hashes_config_and_weights(tmp_path):
    here = model_version(str(DEFAULT_MODEL_DIR))
    assert here == model_version(str(DEFAULT_MODEL_DIR)) and here.endswith("-llmrt" + __import__("llmrt").__version__)
    copy = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, copy)
    assert model_version(str(copy)) == here  # same files elsewhere: same version
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert model_version(str(copy)) != here


def test_stream_events_are_tagged_whole_and_the_rest_waits():
    from llmrt.router.proxy import _tag_body, _tag_events

    b = Backend("http://10.0.0.9:8000", version="v7")
    head = b'data: {"choices": []}\n\ndata: {"choices": [], "llmrt": {"ttft": 0.1}}\n\ndata: [DO'
    out, rest = _tag_events(head, b)
    events = out.split(b"\n\n")
    assert events[0] == b'data: {"choices": []}' and rest == b"data: [DO"
    assert json.loads(events[1][6:])["llmrt"] == {"ttft": 0.1, "instance": "10.0.0.9:8000", "model_version": "v7"}
    assert json.loads(_tag_body(b'{"llmrt": {}}', b))["llmrt"]["model_version"] == "v7"
    assert _tag_body(b'{"error": {}}', b) == b'{"error": {}}'  # no llmrt object: the bytes as sent


def test_bench_serve_shared_prefixes():
    from llmrt.bench.serve import LengthDist, Workload

    w = Workload(LengthDist("fixed:3", "fixed", 3, 3), LengthDist("fixed:2", "fixed", 2, 2), "tokens", (10, 500),
                 seed=4, shared_prefix_len=5, num_prefixes=2)
    r0, r1, r2 = (w.request(i) for i in range(3))
    assert r0.prompt[:5] == r2.prompt[:5] != r1.prompt[:5] and r0.prompt[5:] != r2.prompt[5:]
    assert (r0.prompt_len, len(r0.prompt)) == (8, 8)


def test_ray_replica_host_is_the_node_ip_only_on_a_joined_cluster():
    """--ray-replicas: a replica on a cluster the router joined binds its node's IP (other nodes' replicas must
    be reachable); in the router's own local Ray, loopback; --ray-replica-host wins. Nothing is bound here."""
    from llmrt.router.ray_replicas import replica_host

    asked: list[int] = []

    def node_ip() -> str:
        asked.append(1)
        return "10.0.0.7"

    assert replica_host(None, True, node_ip) == "10.0.0.7" and len(asked) == 1
    assert replica_host(None, False, node_ip) == "127.0.0.1" and len(asked) == 1  # not even asked
    assert replica_host("127.0.0.1", True, node_ip) == "127.0.0.1" and len(asked) == 1
    assert replica_host("::1", False, node_ip) == "::1"



def test_the_router_does_not_import_torch_or_fastapi():
    """`llmrt route` is a proxy: importing torch (~2-5 s, ~300 MB) or FastAPI would only slow its start."""
    import subprocess
    import sys
    code = ("import sys, llmrt.router.app, llmrt.router.launch, llmrt.router.instances; "
            "print(sorted(m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
