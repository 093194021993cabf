"""`llmrt serve --tensor-parallel-size 2`: the same answers as one rank through the OpenAI API (streaming,
structured output, prefix caching), collective metrics, and a killed rank turns into engine_dead."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from llmrt import LLM
from llmrt.sampling_params import SamplingParams
from tests.conftest import build_checkpoint
from tests.server_utils import run_server, wait_until

PROMPT = "Once upon a time there was a little girl who lived in a small house near the big forest with her dog"
pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


@contextlib.contextmanager
def two_rank_server(model: Path, split: str) -> Iterator[tuple[str, openai.OpenAI, dict[str, Any]]]:
    """`llmrt serve` with `split` ("--tensor-parallel-size" or "--pipeline-parallel-size") 2; yields (base URL,
    client, completion arguments) once a plain and a streamed greedy completion equal one rank's offline text."""
    one = LLM(str(model), dtype="float32")
    ref = one.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    with run_server(model, "--dtype", "float32", split, "2", "--distributed-timeout", "5",
                    "--block-size", "4", "--enable-debug-endpoints") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        name = client.models.list().data[0].id
        kw = dict(model=name, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == ref
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        assert streamed == ref
        yield base, client, kw


def assert_killed_rank_is_engine_dead(base: str, client: openai.OpenAI, kw: dict[str, Any]) -> None:
    """SIGKILL the engine core's one child rank: the next request is engine_dead and /health turns 503 within
    the distributed timeout (5 s) plus slack."""
    (rank1,) = _children(httpx.get(f"{base}/debug/stats", timeout=5).json()["engine_pid"])
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        client.completions.create(**kw)
    assert e.value.code == "engine_dead"
    assert wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, timeout=10)
    assert time.monotonic() - start < 5 + 10


def test_tp2_server_matches_one_rank_then_dies_cleanly(tmp_path):
    with two_rank_server(build_checkpoint("llama3", tmp_path / "llama3"), "--tensor-parallel-size") as (base, client,
                                                                                                       kw):
        stats = httpx.get(f"{base}/debug/stats", timeout=5).json()
        assert stats["prefix_cache_hit_tokens"] > 0  # the repeated prompt's full blocks came from the cache
        r = client.completions.create(model=kw["model"], prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-c]{2}"}})
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", r.choices[0].text)
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        count = re.search(r'llmrt_collective_seconds_count\{model="[^"]+"\} (\S+)', metrics)
        assert count and float(count.group(1)) >= 3
        share = re.search(r'llmrt_collective_step_share\{model="[^"]+"\} (\S+)', metrics)
        assert share and 0.0 < float(share.group(1)) < 1.0
        per_token = re.search(r'llmrt_collective_bytes_per_token\{model="[^"]+"\} (\S+)', metrics)
        assert per_token and float(per_token.group(1)) > 0
        assert_killed_rank_is_engine_dead(base, client, kw)
