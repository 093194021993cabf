"""llmrt bench: random checkpoints, workload generation, reporting, and an end-to-end --quick run."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from llmrt.bench import hf_baseline, report, throughput, timing
from llmrt.bench import prompts as bench_prompts
from llmrt.bench.random_model import build_random_llama, cached_random_llama
from llmrt.table import format_table


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama, built once for this module."""
    return build_random_llama("tiny", str(tmp_path_factory.mktemp("models") / "tiny-float32"))


def parse(*argv: str) -> argparse.Namespace:
    """The bench flags as the CLI would parse them."""
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    return p.parse_args(list(argv))


def test_random_tiny_loads_in_hf(tiny: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 1000
    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == 1000
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok("w5 w999").input_ids == [1, 5, 999]
    assert tok.decode([5, 6]) == "w5 w6"
    out = model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         pad_token_id=2)
    assert out.shape == (1, 6)


def test_random_model_is_cached(tmp_path: Path) -> None:
    a = cached_random_llama("tiny", "bfloat16", str(tmp_path))
    stamp = (Path(a) / "model.safetensors").stat().st_mtime_ns
    b = cached_random_llama("tiny", "bfloat16", str(tmp_path))
    assert a == b == str(tmp_path / "tiny-bfloat16")
    assert (Path(b) / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((Path(a) / "config.json").read_text())["dtype"] == "bfloat16"


def test_unknown_size_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown random model size"):
        build_random_llama("7b", str(tmp_path / "x"))


def test_prompts_reproducible_and_avoid_special_tokens(tiny: str) -> None:
    pool = bench_prompts.vocab_pool(tiny)
    assert not {0, 1, 2} & set(pool.tolist()) and pool.numel() == 997
    a = bench_prompts.make_prompts(pool, 20, 5, 9, seed=3)
    assert a == bench_prompts.make_prompts(pool, 20, 5, 9, seed=3)
    assert a != bench_prompts.make_prompts(pool, 20, 5, 9, seed=4)
    assert all(5 <= len(p) <= 9 for p in a)
    assert all(3 <= t < 1000 for p in a for t in p)


def test_count_params_matches_hf(tiny: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert bench_prompts.count_params(tiny) == sum(p.numel() for p in model.parameters())


def test_workload_quick_and_overrides() -> None:
    w = throughput.resolve_workload(parse("--quick"))
    assert (w.num_prompts, w.min_prompt_len, w.max_prompt_len, w.output_len) == (8, 16, 64, 16)
    w = throughput.resolve_workload(parse("--quick", "--num-prompts", "3"))
    assert w.num_prompts == 3 and w.output_len == 16
    w = throughput.resolve_workload(parse())
    assert (w.num_prompts, w.min_prompt_len, w.max_prompt_len, w.output_len) == (64, 64, 512, 128)
    assert (w.single_prompt_len, w.single_output_len) == (256, 128)
    with pytest.raises(SystemExit):
        throughput.resolve_workload(parse("--min-prompt-len", "100", "--max-prompt-len", "10"))


def test_flag_defaults() -> None:
    a = parse("some/dir")
    assert a.model == "some/dir" and a.hf_baseline and a.single_stream and a.output_dir == "benchmarks"
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.block_size, a.dtype) == (64, 2048, 16, "auto")
    assert throughput.parse_sizes(a.hf_batch_sizes) == [8, 32]
    b = parse("--random-model", "tiny", "--no-hf-baseline", "--no-single-stream")
    assert b.random_model == "tiny" and not b.hf_baseline and not b.single_stream


def test_left_pad() -> None:
    ids, mask = hf_baseline.left_pad([[5, 6, 7], [8]], pad=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hf_half_on_tiny(tiny: str) -> None:
    w = throughput.Workload(num_prompts=5, min_prompt_len=4, max_prompt_len=12, output_len=6,
                            single_prompt_len=8, single_output_len=5)
    pool = bench_prompts.vocab_pool(tiny)
    prompts = bench_prompts.make_prompts(pool, w.num_prompts, w.min_prompt_len, w.max_prompt_len, 0)
    model = hf_baseline.load_hf(tiny, "float32", "cpu")
    res = hf_baseline.bench_hf(model, prompts, [2, 32], w, "cpu")
    assert [r["batch_size"] for r in res["runs"]] == [2, 5]
    for r in res["runs"]:
        assert r["output_tokens"] == 5 * 6 and r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > 0
    assert res["best_batch_size"] in (2, 5)
    single = hf_baseline.single_hf(model, prompts[0], w, "cpu")
    assert single["t_generate_n_s"] > 0 and single["t_generate_1_s"] > 0


def test_compute_floor_positive(tiny: str) -> None:
    cfg = bench_prompts.model_config(tiny)
    floor = timing.compute_floor(cfg, "float32", "cpu", bench_prompts.count_params(tiny))
    assert floor["gemm_shape"] == [2048, 64, 128]
    assert floor["flops_per_s"] > 0 and floor["floor_tokens_per_s"] > 0


def test_format_table() -> None:
    text = format_table([{"a": "x", "b": 1.23456}, {"a": "long name", "b": None}], ["a", ("b", "B col")])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "B", "col"] and len(lines) == 4
    assert "1.235" in lines[2] and lines[3].rstrip().endswith("-")
    assert len({len(ln) for ln in lines}) == 1


def test_write_results_appends_and_refreshes(tmp_path: Path) -> None:
    def write(model: str, value: float) -> Path:
        result = {"dtype": "float32", "machine": report.machine_info(), "value": value}
        j, md = report.write_results("demo", result, str(tmp_path), summary={"model": model, "tok/s": value},
                                     key=["model"])
        assert json.loads(j.read_text())["value"] == value
        return md

    write("a", 1.0)
    write("b", 2.0)
    md = write("a", 3.0).read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "float32" in ln]
    assert len(rows) == 2
    assert "| b | 2 |" in rows[0] and "| a | 3 |" in rows[1]
    assert "cpu" in md.splitlines()[4] and "torch" in md.splitlines()[4]


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    args = parse("--random-model", "tiny", "--cache-dir", str(tmp_path / "cache"), "--quick",
                 "--output-dir", str(tmp_path / "out"), "--dtype", "float32")
    result = throughput.run(args)
    for side in ("llmrt", "hf"):
        assert result[side]["output_tokens_per_s"] > 0 and result[side]["total_tokens_per_s"] > 0
        assert result[side]["requests_per_s"] > 0
    assert result["llmrt"]["output_tokens"] == 8 * 16
    assert result["llmrt_vs_hf_output_tokens_per_s"] > 0
    assert result["floor"]["floor_tokens_per_s"] > 0 and result["n_params"] > 0
    assert result["single_stream"]["llmrt_tpot_s"] > 0 and result["single_stream"]["hf_tpot_s"] is not None
    name = result["name"]
    assert json.loads((tmp_path / "out" / f"{name}.json").read_text())["llmrt"]["output_tokens"] == 128
    assert "random-tiny" in (tmp_path / "out" / f"{name}.md").read_text()
