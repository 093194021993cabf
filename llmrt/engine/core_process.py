"""The engine core in its own process: requests in, step outputs out, so a slow or dead step never blocks HTTP."""
from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from typing import Any

from llmrt.config import EngineConfig
from llmrt.errors import LLMRTError

logger = logging.getLogger(__name__)

# Messages in:  ("add", request_id, prompt_ids, params, arrival, priority, deadline, user) | ("abort", request_id)
#               ("finish", request_id, index) | ("fault", kind, seconds) | ("shutdown",)
# Messages out: ("ready", EngineLimits, MemoryPlan) | ("failed", error) | ("step", outputs, EngineStats, time)
#               ("reject", request_id, error)


def run_engine_core(config: EngineConfig, inbox: Any, outbox: Any, log_level: int = logging.WARNING,
                    tokenizer: Any = None) -> None:
    """Process entry point: build the EngineCore, then loop: take messages, step while there is work.

    `tokenizer` is the tokenizer directory (default: the model's); the core reads it only to compile grammars.
    """
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s[core]: %(message)s")
    from llmrt.engine.core import EngineCore

    try:
        core = EngineCore(config, tokenizer)
    except BaseException as e:  # the front end re-raises it; nothing else can be done here
        outbox.put(("failed", e if isinstance(e, LLMRTError) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    outbox.put(("ready", core.limits(), core.memory))
    stall = 0.0
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
        outputs = []
        for msg in msgs:
            kind = msg[0]
            if kind == "shutdown":
                return
            if kind == "add":
                _, request_id, prompt, params, arrival, priority, deadline, user = msg
                try:
                    core.add_request(request_id, prompt, params, arrival, priority, deadline, user)
                except LLMRTError as e:
                    outbox.put(("reject", request_id, e))
            elif kind == "abort":
                outputs += core.abort_request(msg[1])
            elif kind == "finish":
                core.finish_sequence(msg[1], msg[2])
            elif kind == "fault":
                _, fault, seconds = msg
                if fault == "crash":
                    logger.error("fault injection: engine core exits now")
                    os._exit(17)
                if fault == "stall":
                    stall = seconds
                if fault == "oom":
                    core.inject_oom_steps = 1
        if not core.has_unfinished_requests():
            if outputs:
                outbox.put(("step", outputs, core.stats(), time.monotonic()))
            continue
        if stall:
            logger.warning("fault injection: stalling a step for %.1f s", stall)
            time.sleep(stall)
            stall = 0.0
            continue  # like a long step: what arrived meanwhile joins the next one
        try:
            outputs += core.step()
        except Exception:
            logger.error("engine core step failed:\n%s", traceback.format_exc())
            os._exit(18)  # the front end sees the process die and fails in-flight requests as engine_dead
        outbox.put(("step", outputs, core.stats(), time.monotonic()))
