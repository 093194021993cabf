"""EngineClient: what the server uses of its engine (AsyncLLM, or the tests' in-process fake)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Mapping, Optional, Protocol, Union, runtime_checkable

from llmrt.outputs import RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP layer sees it; nothing in llmrt/server reaches past this."""

    tokenizer: Tokenizer  # the front end's tokenizer: prompts, chat templates, echo, logprob texts
    model_name: str  # the name the engine was loaded under
    max_model_len: int  # longest prompt + completion in tokens

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: [0, vocab_size)."""
        ...

    @property
    def device(self) -> str:
        """Where the model runs ("cpu", "cuda:0", ...), for /metrics."""
        ...

    def generate(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str, *,
                 priority: int = 0, timeout: Optional[float] = None, user: Optional[str] = None,
                 stream: bool = True) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs until it finishes (only the finished one unless `stream`); closing
        the iterator early aborts it."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks."""
        ...

    def health(self) -> tuple[bool, str]:
        """(healthy, reason)."""
        ...

    def stats(self) -> Mapping[str, Any]:
        """The latest engine figures (queue, KV blocks, steps): /metrics, the dashboard, /debug/stats."""
        ...

    async def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Debug endpoints only: stall, crash or fail the next step with out-of-memory."""
        ...
