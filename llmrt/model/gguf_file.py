"""GGUF checkpoints (llama.cpp's format) through the `gguf` package: config, tokenizer and weights from one file.

Served as int4 (the default for a file of mostly Q4_0/Q4_1/Q4_K decoder weights), those 4-bit tensors keep their
integers (gguf_int4.py); every other tensor is dequantized to float32 at load: Q8_0, Q4_0, Q4_K, Q5_K and Q6_K by
our own torch code (gguf_quants.py, bit-identical to gguf's reference), every other type gguf can dequantize (F32,
F16, BF16, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ*) by `gguf.quants.dequantize`, and the decoder layers are then
quantized into the configured method (int8 by default for a mostly-Q8_0 file). Llama-family architectures only
(llama, mistral, qwen2, qwen3).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import torch

from llmrt.errors import ModelLoadError, UnsupportedError
from llmrt.model.gguf_quants import DEQUANTIZERS, INT4_ROWS

if TYPE_CHECKING:
    from llmrt.model.quantization.gguf_int4 import Int4Rows

# GGUF general.architecture -> the HF architecture our model classes implement.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# GGUF tensor-name parts -> HF's (Llama layout).
_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def is_gguf(path: str) -> bool:
    """True for a .gguf file."""
    return str(path).endswith(".gguf") and Path(path).is_file()


def _reader(path: str) -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("GGUF checkpoints need the gguf package: pip install 'llmrt[gguf]'")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # a truncated or foreign file
        raise ModelLoadError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}")


def _fields(reader: Any) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items()}


def gguf_hf_config(path: str) -> dict[str, Any]:
    """An HF-style config.json dict from the file's metadata; an unsupported architecture is refused."""
    reader = _reader(path)
    md = _fields(reader)
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}",
                               param="model")
    p = f"{arch}."
    heads = int(md[p + "attention.head_count"])
    hidden = int(md[p + "embedding_length"])
    names = {t.name for t in reader.tensors}
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_size": hidden,
        "intermediate_size": int(md[p + "feed_forward_length"]), "num_hidden_layers": int(md[p + "block_count"]),
        "num_attention_heads": heads, "num_key_value_heads": int(md.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(md.get(p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(md.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(md.get(p + "context_length", 2048)),
        "vocab_size": len(md["tokenizer.ggml.tokens"]), "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": _float_dtype(reader),
    }
    if p + "attention.sliding_window" in md:
        cfg["sliding_window"] = int(md[p + "attention.sliding_window"])
    for key in ("bos", "eos"):
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= int(tid) < cfg["vocab_size"]:
            cfg[f"{key}_token_id"] = int(tid)
    return cfg


def _float_dtype(reader: Any) -> str:
    """The dtype `--dtype auto` computes in: bfloat16 where the file keeps its unquantized matrices (the token
    embedding, the LM head) in BF16, as llama.cpp's converter writes a bf16 model; float32 otherwise (F32 and F16
    files: float16 arithmetic on a CPU is emulated)."""
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return "bfloat16" if types.get("token_embd.weight") == "BF16" or types.get("output.weight") == "BF16" else "float32"


def _hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_NAMES.get(parts[2], parts[2])}.{'.'.join(parts[3:])}"
    return f"{_NAMES.get(parts[0], parts[0])}.{'.'.join(parts[1:])}"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its RoPE pairs adjacent dims; HF's rotates halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _is_layer_matrix(t: Any) -> bool:
    """A decoder layer's projection weight (what our Linear layers hold)."""
    return t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2


def gguf_default_quantization(path: str) -> Optional[str]:
    """The weight method that keeps most decoder-layer matrices of the file as they are: int4 when most are
    Q4_0/Q4_1/Q4_K, int8 when most are Q8_0 (re-quantized per channel), else None (dequantized)."""
    types = [t.tensor_type.name for t in _reader(path).tensors if _is_layer_matrix(t)]
    for method, kinds in (("int4", INT4_ROWS), ("int8", ("Q8_0",))):
        if types and sum(k in kinds for k in types) * 2 > len(types):
            return method
    return None


def gguf_output_quantized(path: str) -> bool:
    """Whether the file's LM head (output.weight, or token_embd.weight when tied) is stored in a quantized type."""
    types = {t.name: t.tensor_type.name for t in _reader(path).tensors}
    kind = types.get("output.weight", types.get("token_embd.weight", "F32"))
    return kind not in ("F32", "F16", "BF16")


def gguf_tensors(path: str, hf_config: dict[str, Any],
                 int4_rows: bool = False) -> Iterator[tuple[str, "torch.Tensor | Int4Rows"]]:
    """(HF tensor name, float32 tensor) for every tensor, dequantized by gguf's reference code; with
    `int4_rows`, decoder-layer matrices of a 4-bit type come as Int4Rows (their integers, scale, zero)."""
    import gguf

    from llmrt.model.quantization.gguf_int4 import GGUF_GROUP, Int4Rows

    reader = _reader(path)
    arch = hf_config["model_type"]
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        ours = DEQUANTIZERS.get(t.tensor_type.name)
        rows = INT4_ROWS.get(t.tensor_type.name) if int4_rows and _is_layer_matrix(t) else None
        if rows is not None:
            q, scale, zero = rows(torch.from_numpy(np.array(t.data, dtype=np.uint8)))
            n, k = shape
            w = Int4Rows(q.reshape(n, k), scale.reshape(n, k // GGUF_GROUP), zero.reshape(n, k // GGUF_GROUP))
        elif ours is not None:
            w = ours(torch.from_numpy(np.array(t.data, dtype=np.uint8))).reshape(shape)
        else:
            try:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise UnsupportedError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                                       "dequantized here", param="model")
            w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        name = _hf_name(t.name)
        heads = None
        if arch in ("llama", "mistral") and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = hf_config["num_attention_heads"]
        elif arch in ("llama", "mistral") and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = hf_config["num_key_value_heads"]
        if heads is not None:
            w = w.map_rows(lambda r: _unpermute(r, heads)) if isinstance(w, Int4Rows) else _unpermute(w, heads)
        yield name, w


def gguf_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer built from the file's tokenizer metadata (llama SPM or gpt2 BPE)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    md = _fields(_reader(path))
    tok = {name: md[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
           if f"tokenizer.{key}" in md}
    backend, _ = convert_gguf_tokenizer(md["general.architecture"], tok)
    tokens = md["tokenizer.ggml.tokens"]
    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= int(tid) < len(tokens):  # 2**32 - 1 means "none"
            special[name] = tokens[int(tid)]
    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", tok.get("tokenizer_type") == "llama"))
    if add_bos and "bos_token" in special:
        from tokenizers.processors import TemplateProcessing

        bos = special["bos_token"]
        backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                    special_tokens=[(bos, tokens.index(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    if md.get("tokenizer.chat_template"):
        hf.chat_template = md["tokenizer.chat_template"]
    return hf
