"""`llmrt quantize` (GPTQ calibration): the solver against round-to-nearest on held-out inputs, the packing
round trip through the GPTQ loader, checkpoints of every architecture, and the embedded model's quality."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from llmrt.bench.quality import DEFAULT_TEXT, quality_of, teacher_forced_logits
from llmrt.config import ModelConfig
from llmrt.model.layers.linear import Linear
from llmrt.model.loader import load_model
from llmrt.model.quantization.gptq_awq import CheckpointInt4Method, gptq_unpack
from llmrt.model.quantization.gptq_calibrate import CalibrationOptions, quantize_checkpoint
from llmrt.model.quantization.gptq_solver import (QuantSpec, dequantize, gptq_quantize, output_error, pack_gptq,
                                                  rtn_quantize)
from llmrt.model.quantization.int4 import Int4LinearMethod
from tests.conftest import ARCH_CONFIGS, build_checkpoint


@pytest.fixture
def one_thread():
    """Calibration runs many small forwards: two OpenMP threads on this shared machine make them erratic."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with a few dominant, correlated directions, as activations have (a fixed mixing, fresh draws)."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -1.5, k)
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) @ mix


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, 128])
def test_gptq_beats_round_to_nearest_on_held_out_inputs(sym, gs):
    torch.manual_seed(1)
    w = torch.randn(48, 256)
    calib, held_out = correlated_inputs(1024, 256, 1), correlated_inputs(1024, 256, 2)
    spec = QuantSpec(gs, sym)
    h = calib.T.double() @ calib.double()
    h_test = held_out.T.double() @ held_out.double()
    gptq, rtn = gptq_quantize(w, h, spec), rtn_quantize(w, spec)
    e_gptq = output_error(w, dequantize(*gptq, gs), h_test)
    e_rtn = output_error(w, dequantize(*rtn, gs), h_test)
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)  # measured 0.33-0.35x
    # Same integer grid: the error compensation moves roundings, it does not widen the format.
    q, z, s = gptq
    assert q.min() >= 0 and q.max() <= 15 and z.min() >= 1 and z.max() <= 15 and s.dtype == torch.float16
    if sym:
        assert (z == 8).all()


def test_identity_hessian_reduces_to_round_to_nearest():
    """With uncorrelated inputs of equal scale no column can compensate another: GPTQ is RTN, except where a
    group's range follows weights already moved within it (none, with one column per group's first entry)."""
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    spec = QuantSpec(32, False)
    q, z, s = gptq_quantize(w, torch.eye(64, dtype=torch.float64) * 1e6, spec, damp=1e-9)
    rq, rz, rs = rtn_quantize(w, spec)
    assert torch.equal(q, rq) and torch.equal(z, rz) and torch.equal(s, rs)


@pytest.mark.parametrize("n,k,gs", [(24, 64, 32), (12, 172, 32), (16, 200, 64)])
def test_packing_round_trip(n, k, gs):
    torch.manual_seed(3)
    groups = -(-k // gs)
    q = torch.randint(0, 16, (n, groups * gs), dtype=torch.int32)
    z = torch.randint(1, 16, (n, groups), dtype=torch.int32)
    s = torch.rand(n, groups).half()
    p = pack_gptq(q, z, s, gs, k)
    assert p["qweight"].shape == (-(-k // 8), n) and p["qzeros"].shape == (groups, -(-n // 8))
    assert torch.equal(p["g_idx"], torch.arange(k, dtype=torch.int32) // gs)
    uq, uz = gptq_unpack(p["qweight"], p["qzeros"], 1)  # the loader's own unpacking
    kw = -(-k // 8) * 8
    assert torch.equal(uq[:, :kw], q[:, :kw]) and torch.equal(uz[:n], z) and torch.equal(p["scales"], s.t())


def _calibration_file(path: Path, seed: int) -> Path:
    """Text in the embedded tokenizer's vocabulary: random words, a different draw per seed."""
    rng = random.Random(seed)
    words = ["the", "girl", "dog", "ran", "big", "red", "ball", "park", "happy", "said", "tree", "mom", "sun"]
    path.write_text(" ".join(rng.choice(words) for _ in range(4000)))
    return path


def _stored_weights(model_dir: Path, monkeypatch) -> dict[str, torch.Tensor]:
    """The dequantized weights the GPTQ loader hands the int4 storage, by our layer name."""
    stored: dict[int, torch.Tensor] = {}
    real = Int4LinearMethod.store_quantized

    def keep(self, layer, q, scale, zero):
        n, k = q.shape
        stored[id(layer)] = ((q.view(n, -1, self.group_size).float() - 8) * scale[..., None] + zero[..., None]
                             ).view(n, k)[:, :layer.in_features]
        real(self, layer, q, scale, zero)

    monkeypatch.setattr(Int4LinearMethod, "store_quantized", keep)
    cfg = ModelConfig(str(model_dir), dtype="float32")
    assert cfg.quantization == "gptq"
    model = load_model(cfg, torch.device("cpu"))
    monkeypatch.undo()
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, Linear) and not name.endswith("lm_head"):
            assert isinstance(layer.method, CheckpointInt4Method), name
            out[name] = stored[id(layer)]
    return out


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_checkpoint_of_every_architecture(arch, tmp_path, monkeypatch, one_thread):
    src = build_checkpoint(arch, tmp_path / "src")
    calib = _calibration_file(tmp_path / "calib.txt", 0)
    kept: dict[str, dict[str, torch.Tensor]] = {}
    reports = {}
    for method in ("gptq", "rtn"):
        opts = CalibrationOptions(method=method, spec=QuantSpec(32, False), calibration=str(calib), samples=12,
                                  seq_len=64)
        reports[method] = quantize_checkpoint(str(src), str(tmp_path / method), opts)
        kept[method] = _stored_weights(tmp_path / method, monkeypatch)
    layers = reports["gptq"].layers
    assert len(layers) == 4 * 2 and [r.name for r in layers] == [r.name for r in reports["rtn"].layers]
    # On its calibration inputs every layer's output error is below round-to-nearest's (sequential inputs).
    for r in layers:
        assert r.error < r.rtn_error, r
    # What the loader serves is each projection's own weights, rounded (rows under the wrong HF name, a wrong
    # nibble order or zero offset would be far off).
    float_model = load_model(ModelConfig(str(src), dtype="float32", quantization="none"), torch.device("cpu"))
    for name, layer in float_model.named_modules():
        if isinstance(layer, Linear) and not name.endswith("lm_head"):
            w = _dense(layer)
            for method in ("gptq", "rtn"):
                for rows in (layer.shard_slice(i) for i in range(len(layer.output_sizes))):
                    err = (kept[method][name][rows] - w[rows]).norm() / w[rows].norm()
                    assert err < 0.2, (name, method, float(err))  # int4 g32 on Gaussian rows: ~0.08
    # On held-out text of the same kind, the logits are closer to the float model's than RTN's are.
    tokens = _held_out_tokens(_calibration_file(tmp_path / "held.txt", 1), src)
    ref, _ = teacher_forced_logits(ModelConfig(str(src), dtype="float32", quantization="none"), tokens)
    kl = {m: quality_of(str(tmp_path / m), tokens, None, ref=ref, as_stored=True).mean_kl
          for m in ("gptq", "rtn")}
    assert kl["gptq"] < kl["rtn"], kl
    assert any(not torch.equal(kept["gptq"][n], kept["rtn"][n]) for n in kept["gptq"])


def _held_out_tokens(path: Path, model_dir: Path) -> list[int]:
    from llmrt.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir)).encode(path.read_text())[:160]


def _dense(layer: Linear) -> torch.Tensor:
    """A float layer's [out, in] weights, whether kept plain or packed for the kernels."""
    if layer.packed is None:
        return layer.weight.data
    return layer.packed.unpack_into(torch.empty(layer.packed.n, layer.packed.k))


def test_embedded_model_meets_the_quality_target(tmp_path, one_thread):
    """Calibrated on text the float model samples itself (never the evaluation text), int4 g32 stays within the
    issue's +5% perplexity and is closer to the float model than the load-time int4 fit."""
    from llmrt.bench.quality import perplexity
    from llmrt.tokenizer import load_tokenizer
    from tests.conftest import EMBEDDED

    opts = CalibrationOptions(method="gptq", spec=QuantSpec(32, False), calibration="builtin", samples=32,
                              seq_len=128)
    quantize_checkpoint(str(EMBEDDED), str(tmp_path / "q"), opts)
    tokens = load_tokenizer(str(EMBEDDED)).encode(DEFAULT_TEXT)
    ref, _ = teacher_forced_logits(ModelConfig(str(EMBEDDED), dtype="float32", quantization="none"), tokens)
    gptq = quality_of(str(tmp_path / "q"), tokens, None, ref=ref, as_stored=True)
    int4 = quality_of(str(EMBEDDED), tokens, "int4", group_size=32, ref=ref)
    assert gptq.perplexity <= 1.05 * perplexity(ref, tokens), gptq  # measured +2.4-3.3% (int4 at load: +5.5%)
    assert gptq.mean_kl < int4.mean_kl, (gptq, int4)


def test_cli_quantize_and_bench_against_the_reference(tmp_path, one_thread, capsys):
    from llmrt.cli import main

    src = build_checkpoint("llama2", tmp_path / "src")
    calib = _calibration_file(tmp_path / "calib.txt", 0)
    out = tmp_path / "q"
    assert main(["quantize", str(src), "--out", str(out), "--calibration", str(calib), "--samples", "4",
                 "--seq-len", "32", "--group-size", "64", "--sym", "--report", str(tmp_path / "r.json")]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["group_size"] == 64 and qc["sym"] and not qc["desc_act"]
    assert len(json.loads((tmp_path / "r.json").read_text())["layers"]) == 8
    assert main(["bench", "quality", str(out), "--reference", str(src), "--quantization", "int4",
                 "--output", str(tmp_path / "b.json")]) == 0
    labels = [r["label"] for r in json.loads((tmp_path / "b.json").read_text())["reports"]]
    assert labels == ["unquantized", "q (gptq g64 sym)", "int4 g32"]
    # Bad input: clear errors, no traceback.
    assert main(["quantize", str(out), "--out", str(tmp_path / "again")]) == 2
    assert main(["quantize", str(src), "--out", str(tmp_path / "x"), "--calibration", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "already quantized" in err and "does not exist" in err


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_replayed_inputs_are_those_of_full_forwards(arch, tmp_path, monkeypatch, one_thread):
    """quantize_layers replays finished layers' outputs; each Hessian must equal the one a full forward over the
    already-quantized layers gives (the reference below re-runs the model prefix for every linear, as the
    calibration did before the replay), bitwise, and no module may be left replaying."""
    from llmrt.bench.quality import prefill
    from llmrt.model.quantization import gptq_calibrate as gc

    src = build_checkpoint(arch, tmp_path / "src")
    samples = [[(7 * i + 3 * j) % 200 + 1 for j in range(20 + 9 * i)] for i in range(3)]  # different lengths
    opts = CalibrationOptions(spec=QuantSpec(32, False), samples=3, seq_len=64)

    def fresh():
        return gc._float_model(ModelConfig(str(src), dtype="float32"), "cpu")

    seen: dict[str, torch.Tensor] = {}
    real = gc._quantize_one

    def keep(name, layer, h, opts):
        seen[name] = h.clone()
        return real(name, layer, h, opts)

    monkeypatch.setattr(gc, "_quantize_one", keep)
    model = fresh()
    with torch.inference_mode():
        gc.quantize_layers(model, samples, opts)
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]  # every replay undone
    monkeypatch.undo()

    class Stop(Exception):
        pass

    reference = fresh()
    with torch.inference_mode():
        for name in seen:
            layer = reference.get_submodule(name)
            h = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64)

            def hook(mod, args):
                x = args[0].reshape(-1, layer.in_features).float()
                h.add_((x.t() @ x).double())
                raise Stop

            handle = layer.register_forward_pre_hook(hook)
            for tokens in samples:
                try:
                    prefill(reference, torch.float32, tokens, block_size=16, chunk=len(tokens))
                except Stop:
                    pass
            handle.remove()
            assert torch.equal(h, seen[name]), name
            real(name, layer, h, opts)  # quantized as the calibration did, for the layers after it
