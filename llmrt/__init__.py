"""llmrt: an LLM inference runtime and OpenAI-compatible server you can read, trust and measure."""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "RequestMetrics"]

_EXPORTS = {
    "LLM": "llmrt.engine.llm", "SamplingParams": "llmrt.sampling_params", "RequestOutput": "llmrt.outputs",
    "CompletionOutput": "llmrt.outputs", "RequestMetrics": "llmrt.outputs",
    "StructuredOutputs": "llmrt.structured.spec",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import llmrt.errors` (and the CLI's --help) do not pay for torch and transformers.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmrt' has no attribute {name!r}")
