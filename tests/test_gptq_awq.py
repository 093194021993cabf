"""GPTQ and AWQ checkpoints: packed here from random HF checkpoints by code written from the formats' specs, then
loaded through llmrt's int4 method and checked against the dequantized reference, weights and greedy tokens."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmrt.config import EngineConfig, ModelConfig
from llmrt.errors import UnsupportedError
from llmrt.model.layers.linear import Linear
from llmrt.model.loader import load_model
from llmrt.model.quantization.int4 import Int4LinearMethod
from tests.conftest import ARCH_CONFIGS, build_checkpoint
from tests.quant_reference import assert_greedy_near_reference

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_PACK_ORDER[i]
PROMPTS = [[1, 300, 301, 302], [1, 5, 77, 400, 12, 9]]


def rtn_quantize(w: torch.Tensor, gs: int, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest 4-bit, w ~= s * (q - z) per group: (q [N, K], z [N, G], fp16 s [N, G])."""
    n, k = w.shape
    g = w.view(n, k // gs, gs)
    if sym:
        s = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).half().float()
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        z = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, 15)
    return q.view(n, k).int().numpy(), z.int().numpy(), s.half().numpy()


def pack_words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values in [0, 15] -> int32 [...]: value i at bits 4i."""
    word = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        word |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return word.view(np.int32)


def pack_gptq(q: np.ndarray, z: np.ndarray, s: np.ndarray, gs: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [K/8, N] (input dim packed), qzeros [G, N/8] holding z - 1, scales [G, N]."""
    n, k = q.shape
    qweight = pack_words(q.T.reshape(k // 8, 8, n).transpose(0, 2, 1))
    qzeros = pack_words((z.T - 1).reshape(-1, n // 8, 8))
    g_idx = np.arange(k, dtype=np.int32) // gs
    return {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
            "scales": torch.from_numpy(np.ascontiguousarray(s.T)), "g_idx": torch.from_numpy(g_idx)}


def pack_awq(q: np.ndarray, z: np.ndarray, s: np.ndarray, gs: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [G, N/8] packed along the output dim, interleaved."""
    def cols(a: np.ndarray) -> np.ndarray:  # [R, C] -> [R, C/8] words
        return pack_words(a.reshape(a.shape[0], -1, 8)[..., AWQ_PACK_ORDER])
    return {"qweight": torch.from_numpy(cols(q.T)), "qzeros": torch.from_numpy(cols(z.T)),
            "scales": torch.from_numpy(np.ascontiguousarray(s.T))}


def quantize_checkpoint(src: Path, out: Path, method: str, gs: int, sym: bool) -> dict[str, torch.Tensor]:
    """Write `src` as a `method` checkpoint to `out`; return the dequantized weights (HF names, float32)."""
    tensors = load_file(str(src / "model.safetensors"))
    saved, reference = {}, {}
    for name, t in tensors.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and base.rsplit(".", 1)[-1] in PROJ:
            g = t.shape[1] if gs == -1 else gs  # -1: one group per row
            q, z, s = rtn_quantize(t.float(), g, sym)
            packed = (pack_gptq if method == "gptq" else pack_awq)(q, z, s, g)
            saved.update({f"{base}.{k}": v for k, v in packed.items()})
            deq = (q - np.repeat(z, g, axis=1)) * np.repeat(s.astype(np.float32), g, axis=1)
            reference[name] = torch.from_numpy(deq.astype(np.float32))
        else:
            saved[name] = t.half() if name.endswith(".bias") else t
            reference[name] = saved[name].float()
    out.mkdir(parents=True)
    save_file(saved, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": False,
                                   "sym": sym, "checkpoint_format": "gptq"} if method == "gptq" else
                                  {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True,
                                   "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg))
    return reference


def reference_model(src: Path, reference: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Transformers' model of `src` with the dequantized weights (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    return model


CASES = [("llama2", "gptq", 32, False), ("qwen2", "gptq", 64, True), ("llama2", "awq", 32, True),
         ("qwen2", "awq", 32, True), ("llama3", "gptq", -1, True), ("mistral", "awq", 64, True),
         ("qwen3", "gptq", 32, False)]


@pytest.mark.parametrize("arch,method,gs,sym", CASES, ids=[f"{a}-{m}-g{g}-{'sym' if s else 'asym'}"
                                                             for a, m, g, s in CASES])
def test_checkpoint_loads_as_the_dequantized_reference(arch, method, gs, sym, tmp_path, monkeypatch):
    src = build_checkpoint(arch, tmp_path / "src")  # qwen2 has q/k/v biases
    reference = quantize_checkpoint(src, tmp_path / method, method, gs, sym)
    stored: dict[int, torch.Tensor] = {}
    real_store = Int4LinearMethod.store_quantized

    def keep(self, layer, q, scale, zero):  # the real store, with what it was handed noted down
        n, k = q.shape
        stored[id(layer)] = ((q.view(n, -1, self.group_size).float() - 8) * scale[..., None] + zero[..., None]
                             ).view(n, k)
        real_store(self, layer, q, scale, zero)

    monkeypatch.setattr(Int4LinearMethod, "store_quantized", keep)
    cfg = ModelConfig(str(tmp_path / method), dtype="float32")
    assert cfg.quantization == method
    model = load_model(cfg, torch.device("cpu"))
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or name.endswith("lm_head"):
            continue
        hf = [f"{name.rsplit('.', 1)[0]}.{p}.weight" for p in
              {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(
                  name.rsplit(".", 1)[1], (name.rsplit(".", 1)[1],))]
        want = torch.cat([reference[n] for n in hf])
        torch.testing.assert_close(stored[id(layer)], want, rtol=0, atol=1e-6)  # the conversion is exact
        eye = torch.eye(layer.in_features)
        got = layer.method.apply(layer, eye).t()
        if layer.bias is not None:
            got = got - layer.bias[:, None]
        # What the kernel computes with: its scales and activations may be bf16 (8 significant bits).
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        checked += 1
    assert checked == 4 * ARCH_CONFIGS[arch]["num_hidden_layers"]

    from llmrt.engine.llm import LLM
    from llmrt.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM(str(tmp_path / method), dtype="float32").generate(PROMPTS, greedy)]
    assert_greedy_near_reference(reference_model(src, reference), PROMPTS, got)


def _gptq_dir(tmp_path: Path, **qc_overrides) -> Path:
    src = build_checkpoint("llama2", tmp_path / "src")
    quantize_checkpoint(src, tmp_path / "q", "gptq", 32, False)
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"].update(qc_overrides)
    cfg_path.write_text(json.dumps(cfg))
    return tmp_path / "q"


def test_refusals_are_clear_and_early(tmp_path):
    path = _gptq_dir(tmp_path)
    with pytest.raises(UnsupportedError, match="GPTQ checkpoint.*--quantization int8"):
        EngineConfig.create(model=str(path), quantization="int8", device="cpu")
    cfg = json.loads((path / "config.json").read_text())
    for qc, msg in [({"bits": 8}, "8-bit"), ({"quant_method": "awq", "version": "gemv"}, "gemv"),
                    ({"quant_method": "bitsandbytes"}, "bitsandbytes")]:
        (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"],
                                                                                     **qc}}))
        with pytest.raises(UnsupportedError, match=msg):
            EngineConfig.create(model=str(path), device="cpu")


def test_act_order_is_refused(tmp_path):
    path = _gptq_dir(tmp_path, desc_act=True)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = torch.flip(tensors[name], [0]).contiguous()  # groups visited in another order
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedError, match="act-order"):
        load_model(ModelConfig(str(path), dtype="float32"), torch.device("cpu"))


def test_act_order_flag_with_trivial_g_idx_loads(tmp_path):
    path = _gptq_dir(tmp_path, desc_act=True)
    load_model(ModelConfig(str(path), dtype="float32"), torch.device("cpu"))


def test_plan_counts_a_gptq_config_as_int4(tmp_path):
    from llmrt.engine.memory_plan import plan_memory

    path = _gptq_dir(tmp_path)
    hf = json.loads((path / "config.json").read_text())
    plain = {k: v for k, v in hf.items() if k != "quantization_config"}
    kw = dict(memory_bytes=1 << 30, dtype=torch.float32)
    gptq, full = plan_memory(hf, **kw), plan_memory(plain, **kw)
    int4 = plan_memory(plain, quantization="int4", lm_head_quantization="none", **kw)  # GPTQ heads are not quantized
    assert gptq.weights_bytes == int4.weights_bytes < full.weights_bytes


def test_int8_lm_head_on_request(tmp_path):
    """A GPTQ checkpoint's head is shipped unquantized and kept so by default; --lm-head-quantization int8
    quantizes it at load (as for --quantization int4), and the plan counts the smaller head."""
    from llmrt.engine.memory_plan import plan_memory
    from llmrt.model.quantization.int8 import Int8LinearMethod

    path = _gptq_dir(tmp_path)
    default = ModelConfig(str(path), dtype="float32")
    int8 = ModelConfig(str(path), dtype="float32", lm_head_quantization="int8")
    assert (default.lm_head_quantization, int8.lm_head_quantization) == ("none", "int8")
    plain_head = load_model(default, torch.device("cpu")).lm_head
    int8_head = load_model(int8, torch.device("cpu")).lm_head
    assert not isinstance(plain_head.method, Int8LinearMethod) and isinstance(int8_head.method, Int8LinearMethod)
    x = torch.randn(3, plain_head.in_features)
    want, got = plain_head.method.apply(plain_head, x), int8_head.method.apply(int8_head, x)
    assert not torch.equal(want, got) and (got - want).abs().max() <= 0.02 * want.abs().max()
    hf = json.loads((path / "config.json").read_text())
    kw = dict(memory_bytes=1 << 30, dtype=torch.float32)
    assert plan_memory(hf, lm_head_quantization="int8", **kw).weights_bytes < plan_memory(hf, **kw).weights_bytes


def test_plan_of_a_gptq_checkpoint(tmp_path, capsys):
    """`llmrt plan` takes what `serve` takes for a GPTQ directory (an int8 head on request) and refuses what it
    refuses, with the same error."""
    from llmrt.cli import main

    path = _gptq_dir(tmp_path)
    assert main(["plan", str(path), "--memory", "1GiB", "--lm-head-quantization", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lm_head_quantization"] == "int8"
    assert main(["plan", str(path), "--memory", "1GiB", "--quantization", "int4", "--quant-calibration", "builtin"]) == 2
    assert "error (unsupported)" in capsys.readouterr().err
