"""GGUF checkpoints: files written by the gguf package's own writer and quantizer load and generate like the
weights gguf's reference code dequantizes; llama.cpp's own stories260K conversion tells the embedded story."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gguf  # a dev dependency (make test installs it): missing is a failure, not a skip

from llmrt.engine.llm import LLM  # noqa: E402
from llmrt.errors import LLMRTError  # noqa: E402
from llmrt.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import EMBEDDED, build_checkpoint  # noqa: E402

SHARED_GGUF = Path(__file__).parent / "fixtures" / "gguf" / "stories260K.gguf"  # llama.cpp's conversion
HF_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _tokenizer_fields() -> dict:
    """The stories260K vocabulary (512 tokens, the one the random checkpoints use) from llama.cpp's file."""
    r = gguf.GGUFReader(str(SHARED_GGUF))
    return {k: r.fields[k].contents() for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                "tokenizer.ggml.token_type")}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (HF rotate-half -> adjacent-pair RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf.split(".")
    mod = rest[-2]
    return f"blk.{layer}.{HF_TO_GGUF[mod]}.{rest[-1]}"


def write_gguf(ckpt: Path, out: Path, qtype, arch: str = "llama") -> tuple[Path, Path]:
    """(the .gguf file with 2-D weights quantized to `qtype`, an HF checkpoint of gguf's dequantized weights)."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    tok = _tokenizer_fields()
    w.add_tokenizer_model("llama")
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_scores(tok["tokenizer.ggml.scores"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    reference = {}
    for name, t in tensors.items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = _permute(a, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            a = _permute(a, cfg["num_key_value_heads"])
        if a.ndim == 2:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(_gguf_name(name), q, raw_dtype=qtype)
            deq = gguf.quants.dequantize(q, qtype).reshape(a.shape)
        else:
            w.add_tensor(_gguf_name(name), a)
            deq = a
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):  # back to HF order for the reference
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        reference[name] = torch.from_numpy(np.ascontiguousarray(deq))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref_dir = out.with_suffix(".ref")
    ref_dir.mkdir()
    save_file(reference, str(ref_dir / "model.safetensors"))
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (ref_dir / f.name).write_bytes(f.read_bytes())
    return out, ref_dir


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    return build_checkpoint("llama2", tmp_path_factory.mktemp("gguf") / "llama2")


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0"])
def test_gguf_writer_files_generate_like_ggufs_dequantized_weights(qname, llama_ckpt, tmp_path):
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    path, ref_dir = write_gguf(llama_ckpt, tmp_path / f"model-{qname}.gguf", qtype)
    prompts = [[1, 300, 301, 302], [1, 5, 77, 400, 12, 9]]
    got = [o.outputs[0].token_ids for o in LLM(str(path), quantization="none").generate(prompts, GREEDY)]
    want = [o.outputs[0].token_ids for o in LLM(str(ref_dir), dtype="float32").generate(prompts, GREEDY)]
    assert got == want


def test_a_bf16_gguf_computes_in_bfloat16_like_its_weights_loaded_as_bfloat16(llama_ckpt, tmp_path):
    path, ref_dir = write_gguf(llama_ckpt, tmp_path / "model-BF16.gguf", gguf.GGMLQuantizationType.BF16)
    llm = LLM(str(path))
    assert llm.config.model.torch_dtype == torch.bfloat16  # from the file's BF16 embedding, not float32
    prompts = [[1, 300, 301, 302], [1, 5, 77, 400, 12, 9]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    want = [o.outputs[0].token_ids for o in LLM(str(ref_dir), dtype="bfloat16").generate(prompts, GREEDY)]
    assert got == want
    f32, _ = write_gguf(llama_ckpt, tmp_path / "model-F32.gguf", gguf.GGMLQuantizationType.F32)
    assert LLM(str(f32)).config.model.torch_dtype == torch.float32


def test_llama_cpp_stories260k_tells_the_embedded_story():
    gg = LLM(str(SHARED_GGUF))
    ref = LLM(str(EMBEDDED))
    prompt = "Once upon a time"
    assert gg.get_tokenizer().encode(prompt) == ref.get_tokenizer().encode(prompt)
    params = SamplingParams(max_tokens=60, temperature=0)
    assert gg.generate([prompt], params)[0].outputs[0].text == ref.generate([prompt], params)[0].outputs[0].text
    assert gg.config.model.hf_config["num_key_value_heads"] == 4 and gg.config.model.served_model_name == "stories260K"


def test_unsupported_architecture_and_tensor_type_are_clear_errors(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(LLMRTError, match="GGUF architecture 'mamba' is not supported"):
        LLM(str(tmp_path / "mamba.gguf"))
    from llmrt.model.gguf_file import gguf_tensors

    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    q8k = gguf.GGMLQuantizationType.Q8_K  # llama.cpp's intermediate type: gguf has no dequantizer for it
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[q8k][1]), dtype=np.uint8)
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=q8k)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(LLMRTError, match="Q8_K"):
        list(gguf_tensors(str(tmp_path / "odd.gguf"), {"model_type": "llama", "num_attention_heads": 4,
                                                       "num_key_value_heads": 4}))


def test_not_a_gguf_file_is_a_load_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(LLMRTError, match="not a readable GGUF"):
        LLM(str(bad))


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_our_block_dequantizers_match_gguf_on_random_blocks(qname):
    """K-quants have no Python quantizer: random bytes (with finite f16 scales) are valid blocks of any type."""
    from llmrt.model.gguf_quants import DEQUANTIZERS

    qtype = getattr(gguf.GGMLQuantizationType, qname)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(5, size * 3), dtype=np.uint8)
    blocks = raw.reshape(-1, size)

    def f16() -> np.ndarray:
        return np.frombuffer(rng.uniform(-2, 2, blocks.shape[0]).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)

    for offset in {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[qname]:
        blocks[:, offset:offset + 2] = f16()
    ref = gguf.quants.dequantize(raw, qtype)
    ours = DEQUANTIZERS[qname](torch.from_numpy(raw.copy())).reshape(ref.shape).numpy()
    assert np.array_equal(ref, ours)
