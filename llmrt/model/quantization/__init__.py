"""Weight quantization formats by name; a new format is one file plus a line here."""
from __future__ import annotations

from typing import Any, Optional

from llmrt.errors import UnsupportedError
from llmrt.model.quantization.base import QuantizationConfig
from llmrt.model.quantization.fp8 import Fp8Config
from llmrt.model.quantization.gptq_awq import AwqConfig, GptqConfig
from llmrt.model.quantization.int4 import Int4Config
from llmrt.model.quantization.int8 import Int8Config

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {c.name: c for c in (Int8Config, Int4Config, Fp8Config, GptqConfig,
                                                                              AwqConfig)}


def get_quantization_config(name: Optional[str], options: Optional[dict[str, Any]] = None) -> Optional[QuantizationConfig]:
    """The config for `name` (None: unquantized); an unknown name is refused, listing the known ones."""
    if name is None:
        return None
    cls = QUANTIZATION_METHODS.get(name)
    if cls is None:
        known = ", ".join(sorted(QUANTIZATION_METHODS)) or "none yet"
        raise UnsupportedError(f"quantization {name!r} is not supported; supported: {known}", param="quantization")
    return cls.from_options(options or {})


LM_HEAD_CHOICES = ("auto", "int8", "none")


def resolve_lm_head(choice: str, quantization: Optional[str], gguf_path: Optional[str] = None) -> str:
    """The LM head's format, "int8" or "none", for --lm-head-quantization `choice`: auto quantizes it to int8 with
    --quantization int8/int4 (calibrated or not; from a GGUF file: only when the file's own output matrix is
    quantized) and leaves it in the model dtype otherwise, a GPTQ/AWQ checkpoint's included (its head is shipped
    unquantized); int8 needs one of those methods or such a checkpoint."""
    if choice not in LM_HEAD_CHOICES:
        raise UnsupportedError(f"lm_head_quantization {choice!r}: expected one of {', '.join(LM_HEAD_CHOICES)}",
                               param="lm_head_quantization")
    if quantization in ("gptq", "awq"):
        return "int8" if choice == "int8" else "none"
    if quantization not in ("int8", "int4"):
        if choice == "int8":
            raise UnsupportedError("--lm-head-quantization int8 goes with --quantization int8 or int4 (or a GPTQ/AWQ "
                                   "checkpoint)", param="lm_head_quantization")
        return "none"
    if choice != "auto":
        return choice
    if gguf_path is not None:
        from llmrt.model.gguf_file import gguf_output_quantized

        return "int8" if gguf_output_quantized(gguf_path) else "none"
    return "int8"


__all__ = ["LM_HEAD_CHOICES", "QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config",
           "resolve_lm_head"]
