"""The engine requests of one API request: one stream per prompt, iterated together, closed when the client leaves."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Optional, TypeVar

import anyio
from fastapi import Request

from llmrt.errors import CancelledError, DeadlineExceededError, LLMRTError
from llmrt.outputs import RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.server import protocol as P
from llmrt.server.engine_client import EngineClient
from llmrt.server.requests import Prompt

logger = logging.getLogger("llmrt.server")
T = TypeVar("T")

# The engine enforces a request's timeout at step boundaries; the server enforces it too, this much later, so
# that a hung engine cannot hold a request past its deadline.
_DEADLINE_GRACE_S = 0.25
_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+; 3.10 keeps the general path


def _deadline_exceeded() -> DeadlineExceededError:
    return DeadlineExceededError("the request's timeout passed before it finished (the engine did not answer in "
                                 "time); nothing it generated is kept")


class Generation:
    """The engine requests of one API request (one per prompt), iterated together."""

    def __init__(self, engine: EngineClient, prompts: list[Prompt], params: SamplingParams, base_id: str, *,
                 priority: int = 0, timeout: Optional[float] = None, default_timeout: Optional[float] = None,
                 prompt_param: str = "prompt", user: Optional[str] = None, stream: bool = True):
        """`timeout` goes to the engine (None: the engine's default); `default_timeout` is that default.

        `prompt_param` is the API field the prompt came from: engine errors about the prompt name it. `stream`
        False: each prompt's finished output only (a plain JSON response needs no other).
        """
        self.prompt_param = prompt_param
        self.request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.gens = [engine.generate(p, params, rid, priority=priority, timeout=timeout, user=user, stream=stream)
                     for p, rid in zip(prompts, self.request_ids)]
        self.params = params
        limit = timeout if timeout is not None else default_timeout
        self.deadline = time.monotonic() + limit + _DEADLINE_GRACE_S if limit is not None else None
        self.latest: list[Optional[RequestOutput]] = [None] * len(prompts)
        self.done = [False] * len(prompts)
        self._pending: dict[asyncio.Future, int] = {}

    @property
    def finished(self) -> bool:
        return all(self.done)

    async def next(self) -> list[int]:
        """Wait for new outputs; return which prompts got one. Raises the first engine error."""
        if len(self.gens) == 1 and not self._pending and _TIMEOUT is not None:
            return await self._next_one()
        waiting = set(self._pending.values())
        for i, gen in enumerate(self.gens):
            if not self.done[i] and i not in waiting:
                self._pending[asyncio.ensure_future(gen.__anext__())] = i
        if not self._pending:
            return []
        done, _ = await asyncio.wait(self._pending, timeout=self._time_left(), return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise _deadline_exceeded()
        updated: list[int] = []
        error: Optional[BaseException] = None
        for fut in done:  # every result is recorded before the first error is raised
            i = self._pending.pop(fut)
            try:
                outcome: Any = fut.result()
            except BaseException as e:  # noqa: BLE001 - recorded, raised below
                outcome = e
            got, err = self._record(i, outcome)
            updated += [i] if got else []
            error = error or err
        if error is not None:
            raise error
        return sorted(updated)

    async def _next_one(self) -> list[int]:
        """`next` for a single prompt: the stream awaited in place, without a task and `asyncio.wait` per token
        (the API process runs cache-cold at every token while the engine decodes, so each hop costs)."""
        if self.done[0]:
            return []
        try:
            async with _TIMEOUT(self._time_left()):
                outcome: Any = await self.gens[0].__anext__()
        except TimeoutError:
            raise _deadline_exceeded() from None
        except Exception as e:  # noqa: BLE001 - recorded, raised below; cancellation passes through
            outcome = e
        got, err = self._record(0, outcome)
        if err is not None:
            raise err
        return [0] if got else []

    def _time_left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _record(self, i: int, outcome: Any) -> tuple[bool, Optional[BaseException]]:
        """Keep prompt i's next output, or its end or error: (whether it got an output, the error to raise)."""
        if isinstance(outcome, StopAsyncIteration):
            self.done[i] = True
            return False, None
        if isinstance(outcome, BaseException):
            if isinstance(outcome, LLMRTError) and outcome.param == "prompt":
                outcome.param = self.prompt_param
            self.done[i] = True
            return False, outcome
        self.latest[i] = outcome
        if outcome.finished:
            self.done[i] = True
            return True, outcome.error
        return True, None

    async def started(self) -> None:
        """Wait until every prompt has its first output: validation and admission errors come before it."""
        while any(self.latest[i] is None and not self.done[i] for i in range(len(self.gens))):
            await self.next()

    async def run(self) -> list[RequestOutput]:
        """Run every prompt to its end; the final outputs."""
        while not self.finished:
            await self.next()
        return [out for out in self.latest if out is not None]

    async def close(self) -> None:
        """Stop whatever is still running (the engine aborts those requests and frees their blocks)."""
        with anyio.CancelScope(shield=True):
            pending = list(self._pending)
            self._pending.clear()
            for fut in pending:
                fut.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for gen in self.gens:
                try:
                    await gen.aclose()
                except Exception:  # noqa: BLE001 - closing must not fail the response
                    logger.debug("closing an engine stream failed", exc_info=True)

    def usage(self) -> P.UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in self.latest if o is not None)
        completion = sum(len(c.token_ids) for o in self.latest if o is not None for c in o.outputs)
        cached = sum(o.metrics.num_cached_tokens for o in self.latest if o is not None)
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    def log_into(self, record: dict[str, Any]) -> None:
        usage = self.usage()
        record["prompt_tokens"], record["completion_tokens"] = usage.prompt_tokens, usage.completion_tokens
        metrics = [o.metrics.as_dict() for o in self.latest if o is not None]
        if len(metrics) == 1:
            record["metrics"] = metrics[0]
        elif metrics:
            record["metrics"] = metrics


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, but cancel it if the client disconnects first (then raise CancelledError, 499)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise CancelledError("the client disconnected before the response was ready")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
