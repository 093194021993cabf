"""AsyncLLM: the asyncio front of an engine core running in its own process."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import time
from dataclasses import asdict
from typing import Any, AsyncIterator, Optional, Union

from llmrt.config import EngineConfig, ServerConfig
from llmrt.engine.admission import AdmissionController
from llmrt.engine.channel import channel
from llmrt.engine.core import validate_request
from llmrt.engine.core_process import run_engine_core
from llmrt.engine.messages import (FAULT_KINDS, AbortRequest, AddRequest, CoreFailed, CoreMessage, CoreReady,
                                   EngineCoreOutput, EngineLimits, EngineStats, FinishReason, FinishSequence,
                                   InjectFault, RequestRejected, Shutdown, StepResult)
from llmrt.engine.output_processor import OutputProcessor
from llmrt.errors import (CancelledError, DeadlineExceededError, EngineDeadError, InvalidRequestError, LLMRTError,
                          OutOfMemoryError, UnsupportedError)
from llmrt.outputs import RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.structured.backend import validate_structured
from llmrt.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class _Stream:
    """The latest cumulative output of one request, and a flag that a newer one (or an error) is there."""

    def __init__(self, final_only: bool = False) -> None:
        self.latest: Union[None, RequestOutput, Exception] = None
        self.event = asyncio.Event()
        self.final_only = final_only  # the consumer wants the finished output only (or an error)

    def put(self, item: Union[RequestOutput, Exception]) -> None:
        if not isinstance(self.latest, Exception):  # an error is final
            self.latest = item
        self.event.set()


class AsyncLLM:
    """Submit requests and stream their outputs with asyncio; the engine core steps in a child process."""

    def __init__(self, config: EngineConfig, *, tokenizer: Optional[str] = None, chat_template: Optional[str] = None,
                 max_waiting_requests: Optional[int] = None, max_queue_delay_ms: Optional[float] = None,
                 health_step_timeout: float = ServerConfig.health_step_timeout,
                 default_timeout: Optional[float] = None,
                 enable_fault_injection: bool = False):
        self.config = config
        self.tokenizer_path = tokenizer or config.model.model
        self.tokenizer: Tokenizer = load_tokenizer(self.tokenizer_path, chat_template)
        self.model_name = str(config.model.served_model_name)
        self.max_model_len = int(config.model.max_model_len)
        self.health_step_timeout = health_step_timeout
        self.default_timeout = default_timeout
        self.enable_fault_injection = enable_fault_injection
        self.admission = AdmissionController(max_waiting_requests, max_queue_delay_ms)
        self.processor = OutputProcessor(self.tokenizer)
        self.limits: Optional[EngineLimits] = None
        self.memory: Any = None
        self._streams: dict[str, _Stream] = {}
        self._stats: Optional[EngineStats] = None
        self._dead: Optional[EngineDeadError] = None
        self._last_progress = time.monotonic()
        self._proc: Any = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reading = False  # the event loop watches the core's pipe

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: [0, vocab_size) (the model's, once the core has started)."""
        return self.limits.vocab_size if self.limits is not None else self.tokenizer.vocab_size

    @property
    def device(self) -> str:
        """The device the engine core runs the model on."""
        return str(self.config.device)

    # -- life cycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine-core process and wait until its model is loaded and its KV cache sized."""
        ctx = mp.get_context("spawn")
        core_inbox, self._inbox = channel(ctx, background=True)  # the event loop's puts never block on the pipe
        self._outbox, core_outbox = channel(ctx, background=True)  # the core's step loop never waits on it
        # A daemonic process may not start children: with several ranks the core spawns them, so it is not
        # daemonic (it still exits when the server goes: it watches its parent, and its ranks watch it).
        self._proc = ctx.Process(target=run_engine_core, name="llmrt-engine-core",
                                 daemon=self.config.parallel.world_size == 1,
                                 args=(self.config, core_inbox, core_outbox, logging.getLogger().getEffectiveLevel(),
                                       self.tokenizer_path))
        self._proc.start()
        core_inbox.close()  # the child has its own copies; without ours, its death reads as EOF here
        core_outbox.close()
        self._loop = asyncio.get_running_loop()
        waiting = self._loop.run_in_executor(None, self._wait_ready)
        if self.tokenizer.has_chat_template:
            # Chat templates render through transformers: build it now, not inside the first chat request,
            # and while the core loads its model (importing transformers takes seconds of its own).
            await self._loop.run_in_executor(None, lambda: self.tokenizer.hf)
        msg = await waiting
        if isinstance(msg, CoreFailed):
            raise msg.error
        self.limits, self.memory = msg.limits, msg.memory
        # The core's outputs are read in the event loop when its pipe is readable. A reader thread handing each
        # message over took a blocking wake-up of its own per token: ~0.1 ms of CPU a token on a 2-core VM
        # (API process 0.72-0.84 -> 0.56-0.65 ms a streamed token), from the cores the engine decodes on.
        self._loop.add_reader(self._outbox.fileno(), self._read_outputs)
        self._reading = True

    def _wait_ready(self) -> Union[CoreReady, CoreFailed]:
        while True:
            try:
                return self._outbox.get(timeout=0.5)
            except EOFError:
                self._proc.join(5.0)
                return CoreFailed(EngineDeadError(f"engine core exited during start-up (code {self._proc.exitcode})"))
            except queue.Empty:
                if not self._proc.is_alive():
                    return CoreFailed(EngineDeadError(f"engine core exited during start-up (code {self._proc.exitcode})"))

    async def shutdown(self) -> None:
        """Stop the engine-core process."""
        if self._proc is None:
            return
        self._stop_reading()
        if self._proc.is_alive():
            self._inbox.put(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 5.0)
            if self._proc.is_alive():
                self._proc.kill()
        self._dead = self._dead or EngineDeadError("the engine was shut down")

    # -- requests --------------------------------------------------------------------------------------
    async def generate(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str, *,
                       priority: int = 0, timeout: Optional[float] = None, user: Optional[str] = None,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step that changed it, until it finishes; with
        `stream` False only the finished one (the text is still decoded, and stop strings found, step by step)."""
        if self._dead is not None:
            raise self._dead
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, ids = self.tokenizer.encode_prompt(prompt)
        validate_request(ids, params, self.limits)
        if params.structured is not None:
            validate_structured(params.structured)  # a grammar that cannot compile is refused before queueing
        self.admission.admit(self._stats, len(ids))
        timeout = timeout if timeout is not None else self.default_timeout
        if timeout is not None and timeout <= 0:
            raise InvalidRequestError("timeout must be positive", param="timeout")
        arrival = time.monotonic()
        deadline = arrival + timeout if timeout is not None else None
        out_stream = _Stream(final_only=not stream)
        if not self._streams:
            self._last_progress = arrival  # idle until now is not a hang
        self._streams[request_id] = out_stream
        self.processor.add_request(request_id, text, ids, params, arrival)
        self._inbox.put(AddRequest(request_id, ids, params, arrival, priority, deadline, user))
        self.admission.submitted(request_id, len(ids))
        finished = False
        try:
            while True:
                await out_stream.event.wait()
                out_stream.event.clear()
                item = out_stream.latest
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away: free the request's blocks
                self.processor.abort(request_id)
                if self._dead is None:
                    self._inbox.put(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with CancelledError."""
        if self._dead is None:
            self._inbox.put(AbortRequest(request_id))
        self.processor.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(CancelledError(f"request {request_id} was aborted"))

    # -- health and stats ------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        """(healthy, reason): alive, and stepping when there is work."""
        if self._dead is not None:
            return False, self._dead.message
        if self._proc is None or not self._proc.is_alive():
            return False, "the engine core process is not running"
        idle_for = time.monotonic() - self._last_progress
        if self._streams and idle_for > self.health_step_timeout:
            return False, (f"no engine step completed for {idle_for:.1f} s while {len(self._streams)} requests "
                           f"are pending (health step timeout {self.health_step_timeout} s)")
        return True, "ok"

    def stats(self) -> dict[str, Any]:
        """The latest engine figures, for debugging and tests."""
        # Before the first step: an idle engine with every block free.
        out: dict[str, Any] = asdict(self._stats or EngineStats.idle(self.limits.num_blocks if self.limits else 0))
        out["kv_usage"] = 1.0 - out["kv_blocks_free"] / max(out["kv_blocks_total"], 1)
        out["engine_pid"] = self._proc.pid if self._proc else None
        out["num_streams"] = len(self._streams)
        out["drain_tokens_per_s"] = self.admission.drain_tokens_per_s
        return out

    async def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Test hook: stall the next step, slow every later step, crash the core, or fail the next step with out-of-memory."""
        if not self.enable_fault_injection:
            raise UnsupportedError("fault injection is off (start the server with --enable-debug-endpoints)")
        if kind not in FAULT_KINDS:
            raise InvalidRequestError(f"fault kind must be one of {', '.join(FAULT_KINDS)}", param="kind")
        self._inbox.put(InjectFault(kind, float(seconds)))

    # -- the output side (read in the event loop) -------------------------------------------------------
    def _read_outputs(self) -> None:
        """Handle every message the core's pipe holds now (called by the event loop when it is readable)."""
        try:
            msgs = self._outbox.read_ready()
        except (EOFError, OSError):  # the core's end closed: it died (or exited)
            self._core_gone()
            return
        for msg in msgs:
            self._on_message(msg)

    def _core_gone(self) -> None:
        if not self._stop_reading():
            return
        # Reap it off the loop, so that the error names its exit code.
        try:
            reaped = self._loop.run_in_executor(None, self._proc.join, 2.0)
        except RuntimeError:  # the loop's executor is shutting down with the loop: no time to reap
            self._on_dead(self._proc.exitcode)
            return
        reaped.add_done_callback(lambda _: self._on_dead(self._proc.exitcode))

    def _stop_reading(self) -> bool:
        """Stop watching the core's pipe; False if that was done already."""
        if not self._reading:
            return False
        self._reading = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._outbox.fileno())
        return True

    def _on_message(self, msg: CoreMessage) -> None:
        if isinstance(msg, RequestRejected):
            self.admission.acknowledged([msg.request_id])
            self.processor.abort(msg.request_id, msg.error)
            if msg.request_id in self._streams:
                self._streams[msg.request_id].put(msg.error)
            return
        if not isinstance(msg, StepResult):
            return
        self._stats = msg.stats
        self._last_progress = time.monotonic()
        self.admission.acknowledged(msg.acknowledged)
        self.admission.observe_step(msg.stats, msg.core_time)
        normal: list[EngineCoreOutput] = []
        for out in msg.outputs:
            error = _finish_error(out)
            if error is None:
                normal.append(out)
                continue
            self.processor.abort(out.request_id, error)
            if out.request_id in self._streams:
                self._streams[out.request_id].put(error)
        states, to_stop = self.processor.process(normal)
        for request_id, index in to_stop:
            self._inbox.put(FinishSequence(request_id, index))
        for state in states:
            stream = self._streams.get(state.request_id)
            # A snapshot per step only for streamed requests: it copies every token id so far, and waking the
            # consumer costs more per token than the engine step's own outputs on a small CPU.
            if stream is not None and (state.finished or not stream.final_only):
                stream.put(state.to_output())

    def _on_dead(self, exitcode: Optional[int]) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(f"the engine core process died (exit code {exitcode}); retry on another instance")
        logger.error("engine core died with exit code %s; failing %d in-flight requests", exitcode, len(self._streams))
        for stream in list(self._streams.values()):
            stream.put(self._dead)


def _finish_error(out: EngineCoreOutput) -> Optional[LLMRTError]:
    if out.finish_reason is FinishReason.DEADLINE:
        where = "while it was still queued (no compute was spent on it)" if out.first_scheduled_time is None \
            else "while it was running"
        return DeadlineExceededError(f"the request's timeout passed {where}; nothing it generated is kept")
    if out.finish_reason is FinishReason.ERROR:
        return OutOfMemoryError("the device ran out of memory even with this request running alone")
    return None
