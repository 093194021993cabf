"""`llmrt regress`: record a server, compare the same server (exact, exit 0), another dtype or model (mismatches
with positions, exit 1), and a slowed server (latency regression reported)."""
from __future__ import annotations

import json

import httpx
import pytest

from llmrt.cli import main
from llmrt.tools.regress import load_workload, prepare, sample_workload
from llmrt.tools.regress_compare import compare_request
from server_utils import run_server


def _rec(tokens, lps, tops, finish="length"):
    return {"index": 0, "mode": "greedy", "ok": True, "error": None, "tokens": tokens, "token_ids": None,
            "text": "".join(tokens), "logprobs": lps, "top_logprobs": tops, "finish_reason": finish,
            "ttft_s": 0.01, "tpot_s": 0.001, "e2e_s": 0.02}


def test_compare_request_finds_the_divergence_and_its_margins():
    old = _rec(["a", "b", "c"], [-0.1, -0.5, -0.2], [{"a": -0.1}, {"b": -0.5, "x": -0.52}, {"c": -0.2}])
    new = _rec(["a", "x", "y"], [-0.1, -0.49, -0.3], [{"a": -0.1}, {"x": -0.49, "b": -0.51}, {"y": -0.3}])
    row = compare_request(old, new)
    assert not row["match"] and row["first_diff"] == 1 and (row["old_token"], row["new_token"]) == ("b", "x")
    assert row["margin_old"] == pytest.approx(0.02) and row["margin_new"] == pytest.approx(0.02)
    same = compare_request(old, old)
    assert same["match"] and same["first_diff"] is None
    shorter = compare_request(old, _rec(["a", "b"], [-0.1, -0.5], [{}, {}], finish="stop"))
    assert not shorter["match"] and shorter["first_diff"] == 2 and shorter["new_finish"] == "stop"


def test_compare_uses_ids_when_both_runs_have_them_else_texts_else_characters():
    """Token ids when both endpoints honoured return_tokens_as_token_ids; token texts when neither did; the text's
    characters when one did not (an id and a text cannot be compared), and the report says which and why."""
    from llmrt.tools.regress_compare import compare_runs

    def ids(tokens):
        rec = _rec([f"token_id:{t}" for t in tokens], [-0.1] * len(tokens),
                   [{f"token_id:{t}": -0.1, "token_id:99": -0.3} for t in tokens])
        rec["token_ids"], rec["text"] = tokens, "ab"
        return rec

    row = compare_request(ids([5, 6]), ids([5, 7]))
    assert row["basis"] == "ids" and (row["first_diff"], row["old_token"], row["new_token"]) == (1, 6, 7)
    assert row["margin_old"] == pytest.approx(0.2)  # 7 was not listed: the least likely alternative stands in
    texts = _rec(["a", "b"], [-0.1, -0.1], [{}, {}])
    assert compare_request(texts, texts)["basis"] == "texts"
    mixed = compare_request(ids([5, 6]), texts)
    assert mixed["basis"] == "chars" and mixed["match"] and mixed["margin_old"] is None
    run = {"base_url": "http://a/v1", "model": "m", "date": "d", "token_ids": True,
           "server": {"before": {"version": None, "memory": {}}, "after": {"memory": {}}}}
    other = {**run, "base_url": "http://b/v1", "token_ids": False}
    report = compare_runs({**run, "requests": [ids([5, 6])]}, {**other, "requests": [texts]}, 0.05)
    assert report["compared_on"] == ("characters of the text (1 requests); no token ids from http://b/v1 "
                                     "(return_tokens_as_token_ids ignored there)")
    report = compare_runs({**run, "requests": [ids([5, 6])]}, {**run, "requests": [ids([5, 6])]}, 0.05)
    assert report["compared_on"] == "token ids (1 requests)" and report["exact_match_rate"] == 1.0


def test_prepare_forces_greedy_unless_seeded(tmp_path):
    greedy, mode = prepare({"prompt": "hi", "temperature": 0.7}, "m", 3)
    assert mode == "greedy" and greedy["temperature"] == 0.0 and greedy["logprobs"] == 3 and greedy["stream"]
    seeded, mode = prepare({"messages": [{"role": "user", "content": "x"}], "temperature": 0.7, "seed": 5}, None, 2)
    assert mode == "sampled" and seeded["seed"] == 5 and seeded["top_logprobs"] == 2 and seeded["logprobs"] is True
    assert sum(1 for b in sample_workload(8, 0, 4) if "seed" in b) == 2
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": []}\n')
    assert len(load_workload(str(path), 0, 0, 0)) == 2
    path.write_text('{"prompt": "a", "messages": []}\n')
    from llmrt.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError):
        load_workload(str(path), 0, 0, 0)


def _compare(golden, url, *extra) -> tuple[int, dict]:
    out = golden.parent / "report.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["regress", "compare", str(golden), "--base-url", url + "/v1", "--no-progress", "--json", *extra])
    out.write_text(buf.getvalue())
    return rc, json.loads(buf.getvalue())


@pytest.mark.slow
def test_regress_same_server_other_dtype_other_model_and_slowdown(tmp_path, checkpoints):
    golden = tmp_path / "golden.json"
    # --deterministic: four requests share steps, and the rerun must not flip a near-tie on batch composition.
    with run_server(None, "--enable-debug-endpoints", "--deterministic") as url:
        assert main(["regress", "record", "--base-url", url + "/v1", "-o", str(golden), "--num-requests", "8",
                     "--max-tokens", "16", "--concurrency", "4", "--warmup", "1", "--no-progress"]) == 0
        rec = json.loads(golden.read_text())
        assert len(rec["requests"]) == 8 and all(len(r["token_ids"]) == 16 for r in rec["requests"])
        assert rec["token_ids"] and all(t == f"token_id:{i}" for r in rec["requests"]
                                        for t, i in zip(r["tokens"], r["token_ids"]))
        assert [r["mode"] for r in rec["requests"]].count("sampled") == 2
        assert rec["server"]["before"]["version"]["version"] and rec["server"]["after"]["memory"]
        rc, report = _compare(golden, url, "--plot", str(tmp_path / "lat.png"))
        assert rc == 0 and report["exact_match_rate"] == 1.0 and not report["violations"]
        assert report["compared_on"] == "token ids (8 requests)"
        assert (tmp_path / "lat.png").stat().st_size > 0
        # Every engine step now sleeps 0.15 s: over 10x a step of this model even on a loaded machine.
        assert httpx.post(url + "/debug/fault", json={"kind": "slow", "seconds": 0.15}).status_code == 200
        rc, report = _compare(golden, url, "--max-latency-regression", "10%")
        assert rc == 1 and report["exact_match_rate"] == 1.0
        assert any(v.startswith("tpot p50 regressed") for v in report["violations"])
    with run_server(None, "--dtype", "bfloat16") as url:
        rc, report = _compare(golden, url)
        assert rc == 1 and report["num_mismatches"] >= 1
        assert all(isinstance(m["first_diff"], int) for m in report["mismatches"])
    with run_server(checkpoints["llama3"], "--served-model-name", "other") as url:
        rc, report = _compare(golden, url)
        assert rc == 1 and report["new"]["model"] == "other" and report["num_mismatches"] >= 6
        assert min(m["first_diff"] for m in report["mismatches"]) == 0
