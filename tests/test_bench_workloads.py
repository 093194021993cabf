"""llmrt bench mixed | prefix | context: lean end-to-end runs on the tiny random model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmrt.bench.random_model import cached_random_llama
from llmrt.bench.workloads import pct
from llmrt.cli import main


def test_percentiles() -> None:
    assert pct([], 0.5) is None
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert pct([0.0, 10.0], 0.99) == pytest.approx(9.9)


def test_random_model_with_a_longer_context(tmp_path: Path) -> None:
    path = cached_random_llama("tiny", cache_dir=str(tmp_path), max_positions=2048)
    assert Path(path).name == "tiny-float32-ctx2048"
    assert json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"] == 2048


@pytest.mark.slow
def test_mixed_and_prefix_benchmarks_end_to_end(tmp_path: Path) -> None:
    model = cached_random_llama("tiny", cache_dir=str(tmp_path / "models"))
    out = str(tmp_path / "out")
    assert main(["bench", "mixed", model, "--policies", "fcfs,short-first", "--num-long", "2", "--long-prompt", "200",
                 "--long-output", "8", "--num-short", "3", "--short-prompt", "8", "--short-output", "4",
                 "--short-start", "0.05", "--short-interval", "0.1", "--max-num-batched-tokens", "32",
                 "--output-dir", out]) == 0
    mixed = json.loads((Path(out) / "sched-mixed.json").read_text())
    assert [r["policy"] for r in mixed["rows"]] == ["fcfs", "short-first"]
    assert all(r["failed"] == 0 and r["short_ttft_p99_s"] > 0 for r in mixed["rows"])
    assert main(["bench", "prefix", model, "--num-requests", "4", "--prefix-len", "64", "--suffix-len", "4",
                 "--output-len", "2", "--interval", "0.05", "--output-dir", out]) == 0
    prefix = json.loads((Path(out) / "prefix-cache.json").read_text())
    on, off = prefix["rows"]
    assert on["prefix_caching"] == "on" and on["cached_tokens_mean"] > 0 and off["cached_tokens_mean"] == 0
