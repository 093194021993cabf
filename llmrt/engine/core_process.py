"""The engine core in its own process: requests in, step outputs out, so a slow or dead step never blocks HTTP.

The messages both ways are the dataclasses of `llmrt.engine.messages`.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import time
import traceback
from typing import Any

from llmrt.config import EngineConfig
from llmrt.engine.messages import (AbortRequest, AddRequest, CoreFailed, CoreReady, FinishSequence, InjectFault,
                                   RequestRejected, Shutdown, StepResult)
from llmrt.errors import LLMRTError

logger = logging.getLogger(__name__)


def run_engine_core(config: EngineConfig, inbox: Any, outbox: Any, log_level: int = logging.WARNING,
                    tokenizer: Any = None) -> None:
    """Process entry point: build the EngineCore, then loop: take messages, step while there is work.

    `tokenizer` is the tokenizer directory (default: the model's); the core reads it only to compile grammars.
    """
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s[core]: %(message)s")
    from llmrt.engine.core import EngineCore
    from llmrt.executor import create_executor

    try:
        core = EngineCore(config, create_executor(config), tokenizer)
    except BaseException as e:  # the front end re-raises it; nothing else can be done here
        outbox.put(CoreFailed(e if isinstance(e, LLMRTError) else RuntimeError(f"{type(e).__name__}: {e}")))
        outbox.flush()  # sent before the process exits
        return
    outbox.put(CoreReady(core.limits(), core.memory))
    stall = 0.0
    step_delay = 0.0  # the "slow" fault: a persistent extra delay per step (latency-regression tests)
    parent = os.getppid()
    while True:
        msgs = []
        try:
            if not core.has_unfinished_requests():
                msgs.append(inbox.get(timeout=1.0))  # idle: wait for work
            while True:
                msgs.append(inbox.get_nowait())
        except queue.Empty:
            if os.getppid() != parent:
                return  # the server is gone
        except EOFError:
            return  # the server is gone (its end of the pipe closed)
        outputs = []
        acknowledged: list[str] = []
        for msg in msgs:
            if isinstance(msg, Shutdown):
                core.executor.shutdown()
                outbox.flush()
                sys.stdout.flush()
                sys.stderr.flush()
                logging.shutdown()
                # The interpreter's teardown of torch and the model has nothing left to do and took 0.4 s of
                # the server's stop; multiprocessing's own exit would run it.
                os._exit(0)
            if isinstance(msg, AddRequest):
                try:
                    core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time,
                                     msg.priority, msg.deadline, msg.user)
                    acknowledged.append(msg.request_id)
                except LLMRTError as e:
                    outbox.put(RequestRejected(msg.request_id, e))  # an acknowledgement too
            elif isinstance(msg, AbortRequest):
                outputs += core.abort_request(msg.request_id)
            elif isinstance(msg, FinishSequence):
                core.finish_sequence(msg.request_id, msg.index)
            elif isinstance(msg, InjectFault):
                if msg.kind == "crash":
                    logger.error("fault injection: engine core exits now")
                    os._exit(17)
                if msg.kind == "stall":
                    stall = msg.seconds
                if msg.kind == "slow":
                    step_delay = msg.seconds
                if msg.kind == "oom":
                    core.inject_oom_steps = 1
        if not core.has_unfinished_requests():
            if outputs or acknowledged:
                outbox.put(StepResult(outputs, core.stats(), time.monotonic(), acknowledged))
            continue
        if stall:
            logger.warning("fault injection: stalling a step for %.1f s", stall)
            time.sleep(stall)
            stall = 0.0
            if outputs or acknowledged:  # like a long step: what arrives meanwhile joins the next one
                outbox.put(StepResult(outputs, core.stats(), time.monotonic(), acknowledged))
            continue
        if step_delay:
            time.sleep(step_delay)
        try:
            outputs += core.step()
        except Exception:
            logger.error("engine core step failed:\n%s", traceback.format_exc())
            os._exit(18)  # the front end sees the process die and fails in-flight requests as engine_dead
        outbox.put(StepResult(outputs, core.stats(), time.monotonic(), acknowledged))
