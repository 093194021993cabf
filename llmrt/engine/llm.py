"""LLM: the offline API, driving an EngineCore synchronously in this process."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Iterator, Optional, Sequence, Union

from llmrt.config import EngineConfig
from llmrt.engine.core import EngineCore
from llmrt.engine.output_processor import OutputProcessor, RequestState
from llmrt.errors import InvalidRequestError
from llmrt.executor import create_executor
from llmrt.outputs import RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.startup import StartupTimer
from llmrt.tokenizer import Tokenizer, load_tokenizer

Prompt = Union[str, list[int]]
logger = logging.getLogger(__name__)


class LLM:
    """Generate from prompts (strings or token ids) with a local HF checkpoint, or the embedded model."""

    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto", tokenizer: Optional[str] = None,
                 chat_template: Optional[str] = None, **engine_options: Any):
        timer = StartupTimer()
        self.config = EngineConfig.create(model, dtype=dtype, **engine_options)
        timer.mark("config")
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer or self.config.model.model, chat_template)
        timer.mark("tokenizer")
        executor = create_executor(self.config)
        timer.mark("model")
        self.engine = EngineCore(self.config, executor, self.tokenizer)
        timer.mark("KV cache and scheduler")
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.startup = timer
        logger.info(timer.describe())

    def shutdown(self) -> None:
        """Stop the executor's other ranks (a no-op with one rank)."""
        self.engine.executor.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are encoded with."""
        return self.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None,
                 user: Optional[Sequence[Optional[str]]] = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        `priority` and `user` (one per prompt) matter to the priority and fair scheduling policies.
        """
        batch = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(batch))
        for name, values in (("priority", priority), ("user", user)):
            if values is not None and len(values) != len(batch):
                raise InvalidRequestError(f"got {len(values)} {name} values for {len(batch)} prompts", param=name)
        ids = self._submit(batch, params, priority, user)
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        while len(finished) < len(ids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine went idle with requests unfinished")  # a bug, never a hang
            for state in self._step():
                if state.finished:
                    finished[state.request_id] = state.to_output()
                    bar.update(1) if bar else None
        if bar:
            bar.close()
        return [finished[i] for i in ids]

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             add_generation_prompt: bool = True, tools: Optional[list[dict]] = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise InvalidRequestError("messages must not be empty", param="messages")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, tools) for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[str]:
        """Yield the text of sample 0 piece by piece as it is generated."""
        (request_id,) = self._submit([prompt], self._params_list(sampling_params, 1))
        sent = 0
        while True:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine went idle with the request unfinished")  # a bug, never a hang
            for state in self._step():
                if state.request_id != request_id:
                    continue
                text = state.samples[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if state.finished:
                    return

    def _submit(self, prompts: list[Prompt], params: list[SamplingParams], priority: Optional[Sequence[int]] = None,
                user: Optional[Sequence[Optional[str]]] = None) -> list[str]:
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                text, token_ids = self.tokenizer.encode_prompt(prompt)
                request_id = str(next(self._ids))
                arrival = time.monotonic()
                self.engine.add_request(request_id, token_ids, p, arrival, priority[i] if priority else 0,
                                        user=user[i] if user else None)
                self.processor.add_request(request_id, text, token_ids, p, arrival)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no half-submitted batch behind
                self.engine.abort_request(request_id)
                self.processor.abort(request_id)
            raise
        return ids

    def _step(self) -> list[RequestState]:
        outputs = self.engine.step()
        states, to_stop = self.processor.process(outputs)
        for request_id, index in to_stop:
            self.engine.finish_sequence(request_id, index)
        return states

    @staticmethod
    def _params_list(params: Union[None, SamplingParams, Sequence[SamplingParams]], n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {n} prompts", param="sampling_params")
        return list(params)


def _as_prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise InvalidRequestError("no prompts given", param="prompt")
    return prompts


def _progress(total: int, enabled: bool):  # type: ignore[no-untyped-def]
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
