"""The benchmark streaming client against a live server: token times, usage and errors are recorded."""
import asyncio

import httpx
import pytest

from llmrt.bench.client import stream_completion
from server_utils import run_server

pytestmark = pytest.mark.slow


def test_stream_completion_records_tokens_and_errors() -> None:
    with run_server() as url:
        async def go():
            async with httpx.AsyncClient() as client:
                good = await stream_completion(client, url + "/v1", "stories260K", "Once upon a time", 12)
                bad = await stream_completion(client, url + "/v1", "stories260K", "x", -3)
                return good, bad
        good, bad = asyncio.run(go())
    assert good.ok and good.error is None and good.finish_reason == "length"
    assert good.output_tokens == 12 and good.prompt_tokens > 0
    assert 1 <= len(good.token_times) <= 12 and good.ttft > 0 and good.e2e >= good.ttft
    assert good.tpot is not None and len(good.itls) == len(good.token_times) - 1
    assert not bad.ok and bad.status == 400 and "max_tokens" in bad.error
