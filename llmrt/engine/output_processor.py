"""The text side of outputs: incremental detokenizing, stop strings, per-request timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from llmrt.engine.messages import EngineCoreOutput, FinishReason, StopReason
from llmrt.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SampleState:
    """One sample's text and tokens as the front end sees them."""

    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list[Logprobs]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: StopReason = None

    def to_output(self) -> CompletionOutput:
        """A snapshot as a CompletionOutput."""
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                list(self.logprobs) if self.logprobs is not None else None,
                                str(self.finish_reason) if self.finish_reason else None, self.stop_reason)


@dataclass
class RequestState:
    """Everything the front end tracks for one request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState]
    error: Optional[Exception] = None
    prompt_logprobs: Optional[list] = None

    @property
    def finished(self) -> bool:
        """True once every sample has finished."""
        return all(s.finish_reason is not None for s in self.samples)

    def to_output(self) -> RequestOutput:
        """A snapshot as a RequestOutput."""
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids),
                             [s.to_output() for s in self.samples], self.finished, self.metrics,
                             prompt_logprobs=self.prompt_logprobs, error=self.error)


class OutputProcessor:
    """Turns EngineCoreOutputs into text, applies stop strings, and keeps per-request metrics."""

    def __init__(self, tokenizer: Optional[Tokenizer]):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> RequestState:
        """Start tracking a request the engine core accepted."""
        samples = [SampleState(i, self._detokenizer(prompt_token_ids, params),
                               logprobs=[] if params.logprobs is not None else None,
                               cumulative_logprob=0.0 if params.logprobs is not None else None)
                   for i in range(params.n)]
        metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, metrics, samples)
        self.states[request_id] = state
        return state

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> Optional[IncrementalDetokenizer]:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[tuple[str, int]]]:
        """Apply one step's outputs; return the touched requests and the samples the core must stop."""
        touched: dict[str, RequestState] = {}
        to_stop: list[tuple[str, int]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            sample = state.samples[out.index]
            if sample.finish_reason is not None:
                continue
            touched[out.request_id] = state
            self._record_timing(state, out)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.new_token_ids:
                sample.token_ids.extend(out.new_token_ids)
                if out.new_logprobs is not None and sample.logprobs is not None:
                    for tok, lp in zip(out.new_token_ids, out.new_logprobs):
                        sample.logprobs.append(lp)
                        sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp.get(tok, 0.0)
                if sample.detokenizer is not None:
                    delta = sample.detokenizer.step(out.new_token_ids)
                    if out.finish_reason is not None:
                        delta += sample.detokenizer.flush()
                    if self._append_text(sample, delta, state.params):
                        to_stop.append((out.request_id, out.index))
                        continue
            if out.finish_reason is not None:
                sample.finish_reason = out.finish_reason
                if out.stop_reason is not None:
                    sample.stop_reason = out.stop_reason
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = state.metrics.finished_time or outputs[-1].timestamp
                self.states.pop(state.request_id, None)
        return list(touched.values()), to_stop

    def abort(self, request_id: str, error: Optional[Exception] = None) -> Optional[RequestState]:
        """Finish every open sample with 'abort' (and attach `error`, if any); stop tracking the request."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = FinishReason.ABORT
        state.error = error
        return state

    def _append_text(self, sample: SampleState, delta: str, params: SamplingParams) -> bool:
        """Add decoded text; on a stop string, cut the text there, finish the sample and return True."""
        if not delta:
            return False
        start = len(sample.text)
        sample.text += delta
        for stop in params.stop:
            idx = sample.text.find(stop, max(0, start - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                sample.text = sample.text[:end]
                sample.finish_reason, sample.stop_reason = FinishReason.STOP, stop
                return True
        return False

    @staticmethod
    def _record_timing(state: RequestState, out: EngineCoreOutput) -> None:
        m = state.metrics
        if m.first_scheduled_time is None and out.first_scheduled_time is not None:
            m.first_scheduled_time = out.first_scheduled_time
        m.num_preemptions = max(m.num_preemptions, out.num_preemptions)
        m.num_cached_tokens = max(m.num_cached_tokens, out.num_cached_tokens)
        m.spec_proposed = max(m.spec_proposed, out.spec_proposed)
        m.spec_accepted = max(m.spec_accepted, out.spec_accepted)
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = out.timestamp
            m.last_token_time = out.timestamp
            if out.index == 0:
                if m.sample0_last_token_time is not None:
                    m.inter_token_latencies.append(out.timestamp - m.sample0_last_token_time)
                m.sample0_last_token_time = out.timestamp
            m.num_output_tokens += len(out.new_token_ids)
            m.num_generation_steps = max(m.num_generation_steps, len(state.samples[out.index].token_ids) + len(out.new_token_ids))
