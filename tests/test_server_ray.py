"""`llmrt serve --tensor-parallel-size 2 --distributed-executor-backend ray` end to end: a real server on loopback
joins a local Ray cluster the test starts (and alone stops), and answers a completion and a stream like one rank."""
from __future__ import annotations


import openai
import pytest
import ray  # a dev dependency (make test installs it): missing is a failure, not a skip

from llmrt import LLM
from llmrt.sampling_params import SamplingParams
from tests.conftest import build_checkpoint
from tests.ray_utils import local_ray_cluster
from tests.server_utils import run_server, wait_until


pytestmark = pytest.mark.slow

PROMPT = "Once upon a time there was a little girl who lived in a small house near the big forest"


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster("llmrt-serve") as address:
        yield address


def test_serve_tp2_on_ray_matches_one_rank(ray_address, tmp_path, monkeypatch):
    model = build_checkpoint("qwen2", tmp_path / "qwen2", num_key_value_heads=1)
    one = LLM(str(model), dtype="float32")
    ref = one.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    monkeypatch.setenv("RAY_ADDRESS", ray_address)  # the server joins this cluster, not one of its own
    with run_server(model, "--dtype", "float32", "--tensor-parallel-size", "2", "--distributed-executor-backend",
                    "ray", "--distributed-timeout", "10", startup_timeout=300.0) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
        name = client.models.list().data[0].id
        kw = dict(model=name, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == ref
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == ref
        # Rank 1 is an actor on the test's cluster: its placement-group bundle holds one of the two CPUs.
        assert wait_until(lambda: ray.available_resources().get("CPU", 0.0) <= 1.0, timeout=10)
