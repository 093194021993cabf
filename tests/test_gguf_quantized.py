"""GGUF tensors kept quantized: 4-bit types keep their integers in the int4 method, Q8_0 files default to int8;
checked on random blocks against gguf's dequantizer and end to end against transformers on gguf's weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf  # a dev dependency (make test installs it): missing is a failure, not a skip

from llmrt.config import ModelConfig  # noqa: E402
from llmrt.engine.llm import LLM  # noqa: E402
from llmrt.model.layers.linear import Linear  # noqa: E402
from llmrt.model.loader import load_model  # noqa: E402
from llmrt.model.quantization.int4 import Int4LinearMethod  # noqa: E402
from llmrt.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import build_checkpoint  # noqa: E402
from tests.quant_reference import assert_greedy_near_reference  # noqa: E402
from tests.test_gguf import write_gguf  # noqa: E402

PROMPTS = [[1, 300, 301, 302], [1, 5, 77, 400, 12, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_rows_dequantize_like_gguf_on_random_blocks(qname):
    """(q - 8) * scale + zero of our rows equals gguf's dequantization (float32 rounding apart)."""
    from llmrt.model.gguf_quants import INT4_ROWS

    qtype = getattr(gguf.GGMLQuantizationType, qname)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(4, size * 2), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for offset in {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}[qname]:  # finite f16 scales and mins
        blocks[:, offset:offset + 2] = np.frombuffer(
            rng.uniform(-2, 2, blocks.shape[0]).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(-1, 32))
    q, scale, zero = INT4_ROWS[qname](torch.from_numpy(raw.copy()))
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    got = (q.float() - 8) * scale[:, None] + zero[:, None]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return build_checkpoint("llama2", tmp_path_factory.mktemp("ggufq") / "llama2")


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1"])
def test_4bit_gguf_keeps_its_integers_and_generates_like_its_weights(qname, llama_ckpt, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    path, ref_dir = write_gguf(llama_ckpt, tmp_path / f"m-{qname}.gguf", getattr(gguf.GGMLQuantizationType, qname))
    cfg = ModelConfig(str(path))
    assert cfg.quantization == "int4" and ModelConfig(str(path), quantization="none").quantization is None
    handed: list[torch.Tensor] = []
    real_store = Int4LinearMethod.store_quantized

    def keep(self, layer, q, scale, zero):  # the real store, noting what it was handed
        n, k = q.shape
        handed.append(((q.view(n, -1, 32).float() - 8) * scale[..., None] + zero[..., None]).view(n, k))
        real_store(self, layer, q, scale, zero)

    monkeypatch.setattr(Int4LinearMethod, "store_quantized", keep)
    load_model(cfg, torch.device("cpu"))
    reference = load_model(ModelConfig(str(ref_dir), dtype="float32"), torch.device("cpu"))
    want = [m.dense_weight() for m in reference.modules() if isinstance(m, Linear) and m.in_features % 32 == 0
            and m is not getattr(reference, "lm_head", None)]
    assert len(handed) == len(want) == 8
    for got, w in zip(handed, want):  # the file's own values, not a second rounding
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    monkeypatch.undo()
    out = [o.outputs[0].token_ids for o in LLM(str(path)).generate(PROMPTS, GREEDY)]
    hf = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    assert_greedy_near_reference(hf, PROMPTS, out)


def test_q8_0_gguf_defaults_to_int8(llama_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    path, ref_dir = write_gguf(llama_ckpt, tmp_path / "m-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(str(path))
    assert llm.config.model.quantization == "int8"
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_greedy_near_reference(AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32),
                                 PROMPTS, out)


def test_f32_gguf_stays_unquantized_and_int4_groups_other_than_32_requantize():
    from tests.test_gguf import SHARED_GGUF

    assert ModelConfig(str(SHARED_GGUF)).quantization is None  # llama.cpp's stories260K is all F32
    cfg = ModelConfig(str(SHARED_GGUF), quantization="int4", quant_group_size=64)
    assert cfg.quantization == "int4"
    # Loaded as int4 with groups of 64: each layer holds quantize_int4's groups of 64 of the file's F32 weights
    # (within bf16 rounding of the stored scales and zeros), not the 32-value blocks of a 4-bit GGUF.
    from llmrt.model.quantization.int4 import quantize_int4

    cpu = torch.device("cpu")
    q64, ref = load_model(cfg, cpu), load_model(ModelConfig(str(SHARED_GGUF)), cpu)
    pairs = [(a, b) for a, b in zip(q64.modules(), ref.modules())
             if isinstance(a, Linear) and isinstance(a.method, Int4LinearMethod)]
    assert len(pairs) == 4 * len(q64.model.layers) and all(a.method.group_size == 64 for a, _ in pairs)
    for a, b in pairs:
        w = b.dense_weight().float()
        n, k = w.shape
        q, sc, z = quantize_int4(torch.nn.functional.pad(w, (0, -k % 64)), 64)
        want = ((q.view(n, -1, 64).float() - 8) * sc[..., None] + z[..., None]).view(n, -1)[:, :k]
        with torch.inference_mode():
            got = a(torch.eye(k)).T  # row i of the identity picks input i: the layer's dequantized weights
        assert torch.allclose(got, want, rtol=0, atol=2 ** -8 * float(want.abs().max())), a
