"""Prefix caching and scheduling fields through a real `llmrt serve`: cached_tokens in usage, user and priority."""
from __future__ import annotations

import openai
import pytest

from server_utils import all_blocks_free, run_server, wait_until

pytestmark = pytest.mark.slow

SYSTEM = [5 + (i * 37) % 400 for i in range(40)]  # 40 token ids: two full blocks of 16 are reusable


def test_cached_tokens_in_usage_user_and_priority():
    with run_server(None, "--scheduling-policy", "fair", "--enable-debug-endpoints") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        first = client.completions.create(model="stories260K", prompt=SYSTEM + [7], max_tokens=4, user="alice")
        second = client.completions.create(model="stories260K", prompt=SYSTEM + [8], max_tokens=4, user="bob",
                                           extra_body={"priority": 3})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 32
        stream = client.completions.create(model="stories260K", prompt=SYSTEM + [9], max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}, user="alice")
        usage = [c.usage for c in stream if c.usage is not None]
        assert usage and usage[-1].prompt_tokens_details.cached_tokens == 32
        messages = [{"role": "system", "content": "You tell stories about a cat named Tom who lives in a big "
                                                  "house with a garden and many friends."},
                    {"role": "user", "content": "Once upon a time"}]
        client.chat.completions.create(model="stories260K", messages=messages, max_tokens=4)
        chat = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=4, user="carol")
        assert chat.usage.prompt_tokens_details.cached_tokens >= 16
        assert chat.usage.prompt_tokens_details.cached_tokens < chat.usage.prompt_tokens
        assert wait_until(lambda: all_blocks_free(base), timeout=10)
    with run_server(None, "--no-prefix-caching") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        client.completions.create(model="stories260K", prompt=SYSTEM + [7], max_tokens=4)
        again = client.completions.create(model="stories260K", prompt=SYSTEM + [8], max_tokens=4)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
