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


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config"]
