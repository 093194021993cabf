"""`llmrt serve --pipeline-parallel-size 2`: the same answers as one rank through the OpenAI API, the bubble
metrics, and a killed stage turns into engine_dead."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest

from llmrt import LLM
from llmrt.sampling_params import SamplingParams
from tests.conftest import build_checkpoint
from tests.server_utils import run_server, wait_until
from tests.test_server_parallel import PROMPT, _children

pytestmark = pytest.mark.slow


def test_pp2_server_matches_one_rank_reports_the_bubble_then_dies_cleanly(tmp_path):
    model = build_checkpoint("gpt2", tmp_path / "gpt2")
    one = LLM(str(model), dtype="float32")
    ref = one.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    with run_server(model, "--dtype", "float32", "--pipeline-parallel-size", "2", "--distributed-timeout", "5",
                    "--block-size", "4", "--enable-debug-endpoints") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        name = client.models.list().data[0].id
        kw = dict(model=name, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == ref
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        assert streamed == ref
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        share = re.search(r'llmrt_pipeline_bubble_share\{model="[^"]+"\} (\S+)', metrics)
        assert share and 0.0 < float(share.group(1)) < 1.0
        for stage in ("0", "1"):
            waited = re.search(r'llmrt_pipeline_bubble_seconds_total\{model="[^"]+",stage="%s"\} (\S+)' % stage,
                               metrics)
            assert waited and float(waited.group(1)) > 0, metrics

        stats = httpx.get(f"{base}/debug/stats", timeout=5).json()
        (stage1,) = _children(stats["engine_pid"])
        os.kill(stage1, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            client.completions.create(**kw)
        assert e.value.code == "engine_dead"
        assert wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, timeout=10)
        assert time.monotonic() - start < 5 + 10
