"""`llmrt bench peers`: best of rounds, ratios, floor fractions and the table, from recorded runs."""
from __future__ import annotations

from llmrt.bench.peers_report import best_of, floors_for, markdown, ratios
from llmrt.cli import build_parser

FLOORS = {"floor_fp32_GFLOPs": 100.0, "floor_bf16_GFLOPs": 20.0, "floor_bandwidth_GBps": 10.0,
          "W1_tokens": {"output": 8192}, "W1_flops_refined": 4e12,
          "W2_decode_floor_ms_bf16_streamed_params": 18.0}


def _run(w1, ttft, tpot, first16=(1, 2), r=0):
    return {"round": r, "load_before": 1.0, "W1": {"output_tok_s": w1} if w1 else None,
            "W2": {"ttft_ms": ttft, "tpot_ms": tpot, "first16": list(first16)}}


def test_best_of_rounds_takes_the_best_of_each_figure_and_skips_failed_runs():
    runs = [_run(100, 300, 30), _run(120, 350, 25, r=1), {"round": 2, "load_before": 9.0, "error": "exit 1: boom"}]
    b = best_of(runs)
    assert (b["runs_ok"], b["W1_output_tok_s"], b["W2_ttft_ms"], b["W2_tpot_ms"]) == (2, 120, 300, 25)
    hf = best_of([{"round": 0, "load_before": 1.0, "W1": {"bs8": {"output_tok_s": 50}, "bs32": {"output_tok_s": 70}},
                   "W2": {"ttft_ms": 400, "tpot_ms": 40, "first16": [1, 2]}}])
    assert hf["W1_output_tok_s"] == 70  # the best static batch
    assert best_of([{"error": "x", "round": 0, "load_before": 0}])["runs_ok"] == 0


def test_ratios_and_floor_fractions():
    best = {"float32": {"llmrt": best_of([_run(200, 300, 40)]), "llama.cpp": best_of([_run(50, 600, 20, (1, 3))])}}
    fl = floors_for(FLOORS, "float32")
    assert fl["W1_output_tok_s"] == 8192 / (4e12 / 100e9) and fl["W2_tpot_ms"] == 36.0  # fp32 reads twice bf16's bytes
    r = ratios(best, FLOORS)["float32"]
    peer = r["llmrt_over_peer"]["llama.cpp"]
    assert (peer["W1_output_tok_s"], peer["W2_ttft"], peer["W2_tpot"], peer["same_first16"]) == (4.0, 0.5, 2.0, False)
    assert r["fraction_of_floor"]["llmrt"]["W2_tpot"] == 36.0 / 40
    result = {"date": "d", "machine": {"cpu": "c", "cores": 2, "isa": ["avx2"], "torch": "t", "torch_threads": 2},
              "load_average_start": (1.0, 1, 1), "load_average_end": (2.0, 2, 2), "rounds": 1, "floors": FLOORS,
              "best": best, "ratios": ratios(best, FLOORS), "runs": {"float32": {"llmrt": [{}]}},
              "cold_start_s": {"python -c 'import torch'": [1.5, 1.2], "llmrt --help": [0.2]}}
    text = markdown(result)
    assert "| llama.cpp | 50.0 | 600 | 20.0 |" in text and "4.00, 0.50, 2.00 | no |" in text
    assert "| llmrt --help | 0.20 | -1.00 |" in text


def test_the_command_line_knows_the_peers_and_their_pythons():
    args = build_parser(["bench", "peers"]).parse_args(
        ["bench", "peers", "--hf-python", "/v/hf", "--only", "llmrt", "hf", "--skip-w1", "--rounds", "1"])
    assert (args.hf_python, args.only, args.skip_w1, args.rounds) == ("/v/hf", ["llmrt", "hf"], True, 1)
