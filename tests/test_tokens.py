"""`llmrt tokens`: counts equal each fixture tokenizer's own, a planted shared system prompt is found, a planted
cache-unfriendly ordering is flagged, costs follow the model config, and the access log is summarized."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from llmrt.cli import main
from llmrt.tools.tokens import ModelCost, TokenModel, count_request
from llmrt.tools.tokens_report import access_summary, audit, read_access_log
from server_utils import run_server

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
EMBEDDED = Path(__file__).resolve().parents[1] / "llmrt" / "data" / "stories260K"
TOKENIZER_DIRS = [EMBEDDED] + [FIXTURES / n for n in ("gpt2", "llama2", "llama3", "mistral", "phi3")]
SYSTEM = ("You are a careful assistant for a small shop that sells bread, cakes and pastries. Answer in short "
          "sentences, name prices in euros, and never promise a delivery time you cannot keep.")
ITEM = {"type": "object", "properties": {"item": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "price", "description": "The price of an item", "parameters": ITEM}}]
BODIES = [
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How much is a baguette?"}]},
    {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! What can I do?"},
                  {"role": "user", "content": "Two croissants, please."}], "tools": TOOLS, "max_tokens": 64},
    {"prompt": "Once upon a time, a little bakery", "max_tokens": 8},
    {"prompt": [1, 2, 3, 4]},
]


@pytest.mark.parametrize("directory", TOKENIZER_DIRS, ids=lambda p: p.name)
def test_counts_equal_the_tokenizers_own(directory):
    model = TokenModel.load(str(directory))
    hf = model.tokenizer.hf
    for i, body in enumerate(BODIES):
        rec = count_request(model, i, body)
        if "prompt" in body:
            own = len(body["prompt"]) if isinstance(body["prompt"], list) else len(hf(body["prompt"])["input_ids"])
            assert rec.error is None and rec.total == own
            continue
        try:
            own = hf.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
        except Exception:  # this template refuses these messages (or there is none): so must we
            assert rec.error is not None
            continue
        assert rec.error is None and rec.total == len(own), directory.name
        for m, row in zip(body["messages"], rec.messages):
            assert row["content_tokens"] == len(hf(m["content"], add_special_tokens=False)["input_ids"])
        assert sum(rec.parts.values()) == rec.total
        if body is BODIES[0]:
            assert rec.parts["system"] == len(hf(SYSTEM, add_special_tokens=False)["input_ids"])


def _chat(*messages):
    return {"messages": [{"role": r, "content": c} for r, c in messages]}


def test_planted_shared_system_prompt_is_found_and_cacheable():
    model = TokenModel.load(None)
    questions = ["Is the rye bread fresh?", "Do you sell gluten-free cake?", "When do you open on Sunday?",
                 "How much are six eclairs?", "Can I order a birthday cake?"]
    report = audit(model, [_chat(("system", SYSTEM), ("user", q)) for q in questions], 3, 16, False)
    [found] = report["repeated"]
    assert found["requests"] == 5 and found["cacheable"] and not found["flagged_requests"]
    assert found["content"].startswith("You are a careful assistant")
    assert all(r["prefix_cacheable"] >= 16 for r in report["requests"][1:])
    assert report["requests"][0]["prefix_cacheable"] == 0


def test_planted_cache_unfriendly_ordering_is_flagged():
    model = TokenModel.load(None)
    bodies = [_chat(("system", f"Today is day {d}."), ("system", SYSTEM), ("user", "Hi")) for d in range(4)]
    report = audit(model, bodies, 3, 16, False)
    [found] = report["repeated"]
    assert not found["cacheable"] and found["flagged_requests"] == [1, 2, 3]
    assert all(n > 0 for n in found["varying_tokens_before"].values())
    assert found["tokens_recomputed"] == 3 * found["tokens"]


def test_cost_follows_the_config(checkpoints):
    cost = ModelCost.from_config(json.loads((checkpoints["llama3"] / "config.json").read_text()))
    # 2 layers x (qkv 64x128 + o 64x64 + gate_up 64x256 + down 128x64); KV: 2 x 2 layers x 2 heads x 16 x 4 B
    assert cost.linear_params == 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    n = 100
    assert cost.prefill_flops(n) == 2 * cost.linear_params * n + 4 * 2 * 64 * n * (n + 1) // 2 + 2 * 512 * 64
    assert cost.prefill_flops(n, cached=64) < cost.prefill_flops(n)
    assert cost.attention_share(4 * n) > cost.attention_share(n)


def test_cli_json_and_plot(tmp_path, checkpoints, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(b) for b in BODIES) + "\n")
    rc = main(["tokens", str(path), "--model", str(checkpoints["llama3"]), "--model", str(FIXTURES / "gpt2"),
               "--json", "--plot", str(tmp_path / "t.png"), "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and [a["model"] for a in report["models"]] == ["llama3", "gpt2"]
    assert report["models"][0]["growth"] and "growth" not in report["models"][1]  # gpt2 dir: tokenizer only
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.slow
def test_access_log_routes_cached_share_and_oversized_max_tokens(tmp_path):
    with run_server(None) as url:
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon a time, there was a little girl "
                                                                     "named Lily who loved to play outside",
                                                          "max_tokens": 200, "stop": ["."], "temperature": 0})
            assert r.status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
        # The access-log line is written as the response completes, so it can trail the client's read by a moment.
        deadline = time.monotonic() + 10
        while '"/v1/chat/completions"' not in (log := url.log()) and time.monotonic() < deadline:
            time.sleep(0.05)
    (tmp_path / "server.log").write_text(log)
    summary = access_summary(read_access_log(str(tmp_path / "server.log")), ratio=4.0)
    routes = {r["route"]: r for r in summary["routes"]}
    assert routes["/v1/completions"]["requests"] == 2 and routes["/v1/chat/completions"]["output_tokens"] == 4
    assert routes["/v1/completions"]["cached_share"] > 0  # the second identical prompt hit the prefix cache
    assert [o["route"] for o in summary["oversized_max_tokens"]] == ["/v1/completions"] * 2

