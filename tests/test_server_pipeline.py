"""`llmrt serve --pipeline-parallel-size 2`: the same answers as one rank through the OpenAI API, the bubble
metrics, and a killed stage turns into engine_dead."""
from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import build_checkpoint
from tests.test_server_parallel import assert_killed_rank_is_engine_dead, two_rank_server

pytestmark = pytest.mark.slow


def test_pp2_server_matches_one_rank_reports_the_bubble_then_dies_cleanly(tmp_path):
    with two_rank_server(build_checkpoint("gpt2", tmp_path / "gpt2"), "--pipeline-parallel-size") as (base, client,
                                                                                                     kw):
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        share = re.search(r'llmrt_pipeline_bubble_share\{model="[^"]+"\} (\S+)', metrics)
        assert share and 0.0 < float(share.group(1)) < 1.0
        for stage in ("0", "1"):
            waited = re.search(r'llmrt_pipeline_bubble_seconds_total\{model="[^"]+",stage="%s"\} (\S+)' % stage,
                               metrics)
            assert waited and float(waited.group(1)) > 0, metrics
        assert_killed_rank_is_engine_dead(base, client, kw)
