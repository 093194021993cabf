"""`--quant-calibration`: GPTQ calibration at load. The embedded model's quality, the on-disk cache (a hit loads
the same checkpoint without recalibrating; a changed option or model file is a new key), the clear errors at
configuration time, and the flags of the engine, `llmrt plan` and `llmrt bench quality`."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from llmrt.bench.quality import DEFAULT_TEXT, perplexity, quality_of, teacher_forced_logits
from llmrt.config import EngineConfig, ModelConfig
from llmrt.errors import InvalidRequestError, ModelLoadError, UnsupportedError
from llmrt.model.quantization import gptq_calibrate
from llmrt.model.quantization.gptq_at_load import MARKER, cache_key, calibrated_checkpoint, calibration_options
from llmrt.tokenizer import load_tokenizer
from tests.conftest import EMBEDDED

SAMPLES = 32  # the default 128 in 4x the time; 32 already meets the target (as tests/test_gptq_calibrate.py)


@pytest.fixture(scope="module")
def gptq_cache(tmp_path_factory) -> Path:
    """One calibration cache for this module's tests (never the user's; kernels keep $LLMRT_CACHE_DIR)."""
    return tmp_path_factory.mktemp("gptq-cache")


@pytest.fixture
def cache_env(gptq_cache, monkeypatch) -> Path:
    monkeypatch.setenv("LLMRT_GPTQ_CACHE_DIR", str(gptq_cache))
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # many small forwards: two threads on a shared machine make them erratic
    yield gptq_cache
    torch.set_num_threads(n)


def calibrated(model: Path = EMBEDDED, **kw) -> ModelConfig:
    kw = {"quant_calibration": "builtin", "quant_calibration_samples": SAMPLES, **kw}
    return ModelConfig(str(model), dtype="float32", quantization="int4", **kw)


def test_calibration_at_load_meets_the_target_and_is_cached(cache_env, monkeypatch):
    tokens = load_tokenizer(str(EMBEDDED)).encode(DEFAULT_TEXT)
    ref, _ = teacher_forced_logits(ModelConfig(str(EMBEDDED), dtype="float32", quantization="none"), tokens)
    gptq = quality_of(str(EMBEDDED), tokens, "int4", ref=ref, quant_calibration="builtin",
                      quant_calibration_samples=SAMPLES)
    int4 = quality_of(str(EMBEDDED), tokens, "int4", ref=ref)
    assert gptq.perplexity <= 1.05 * perplexity(ref, tokens), gptq  # measured +2.0% (data-free int4: +5.5%)
    assert gptq.mean_kl < int4.mean_kl, (gptq, int4)  # 0.028 vs 0.037
    entries = [p for p in cache_env.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) == 1 and not list(cache_env.glob(".tmp-*"))  # written once, no temporary left
    ckpt = entries[0]
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["group_size"] == 32 and not qc["sym"]
    assert qc["llmrt_calibration"]["samples"] == SAMPLES
    stamp = (ckpt / "model.safetensors").stat().st_mtime_ns

    def no_recalibration(*args, **kwargs):
        raise AssertionError("a cached configuration was calibrated again")

    monkeypatch.setattr(gptq_calibrate, "quantize_checkpoint", no_recalibration)
    hit = calibrated_checkpoint(str(EMBEDDED), calibration_options(calibrated()))
    assert hit.cached and hit.path == ckpt
    again, _ = teacher_forced_logits(calibrated(), tokens)
    first, _ = teacher_forced_logits(ModelConfig(str(ckpt), dtype="float32", lm_head_quantization="int8"), tokens)
    assert torch.equal(again, first)  # the same weights as the checkpoint the first load wrote, the head in int8
    plain, _ = teacher_forced_logits(ModelConfig(str(ckpt), dtype="float32"), tokens)
    assert not torch.equal(plain, first)  # the GPTQ checkpoint's own head is unquantized; int8 changes the logits
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_changed_option_or_model_file_is_a_new_key(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    base = calibration_options(calibrated(model))
    key = cache_key(str(model), base)
    assert cache_key(str(model), calibration_options(calibrated(model))) == key
    for field, value in (("samples", 16), ("seq_len", 128), ("seed", 1), ("damp", 0.02)):
        assert cache_key(str(model), base.__class__(**{**base.__dict__, field: value})) != key, field
    assert cache_key(str(model), calibration_options(calibrated(model, quant_group_size=64))) != key
    text = tmp_path / "calib.txt"
    text.write_text(DEFAULT_TEXT)
    file_key = cache_key(str(model), calibration_options(calibrated(model, quant_calibration=str(text))))
    text.write_text(DEFAULT_TEXT + " The end.")
    assert cache_key(str(model), calibration_options(calibrated(model, quant_calibration=str(text)))) != file_key
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert cache_key(str(model), base) != key


def test_clear_errors_at_configuration_time(tmp_path, monkeypatch):
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated instead of refusing")

    monkeypatch.setattr(gptq_calibrate, "quantize_checkpoint", no_calibration)
    for quantization in ("int8", None, "none"):
        with pytest.raises(UnsupportedError, match="needs --quantization int4"):
            ModelConfig(str(EMBEDDED), quantization=quantization, quant_calibration="builtin")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        calibrated(quant_calibration=str(tmp_path / "missing.txt"))
    assert calibrated().lm_head_quantization == "int8"  # as with --quantization int4
    assert calibrated(lm_head_quantization="none").lm_head_quantization == "none"
    if (os.cpu_count() or 1) >= 2:  # gloo ranks need a core each
        for split in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 5}):
            with pytest.raises(UnsupportedError, match="quant-calibration"):
                EngineConfig.create(str(EMBEDDED), quantization="int4", quant_calibration="builtin", **split)
    quantized = tmp_path / "gptq"
    shutil.copytree(EMBEDDED, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="already quantized"):
        calibrated(quantized)
    pytest.importorskip("gguf")
    gguf = Path(__file__).parent / "fixtures" / "gguf" / "stories260K.gguf"
    with pytest.raises(UnsupportedError, match="not a GGUF"):
        calibrated(gguf)


def test_flags_and_reports(tmp_path, cache_env, capsys):
    from llmrt.cli import main
    from llmrt.engine_args import add_engine_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kw = engine_kwargs(p.parse_args(["--quantization", "int4", "--quant-calibration", "builtin",
                                     "--quant-calibration-samples", "16"]))
    assert kw["quant_calibration"] == "builtin" and kw["quant_calibration_samples"] == 16
    assert engine_kwargs(p.parse_args([]))["quant_calibration"] == "none"
    assert "--quant-calibration" in p.format_help()
    config = EngineConfig.create(str(EMBEDDED), **kw)  # no weight is read to configure
    report = config.formats_report()  # what GET /version shows
    assert report["quant_calibration"] == "builtin" and report["quant_calibration_samples"] == 16
    assert report["lm_head_quantization"] == "int8"
    text = tmp_path / "calibration text.txt"
    text.write_text("Once upon a time " * 20)
    with_file = EngineConfig.create(str(EMBEDDED), **{**kw, "quant_calibration": str(text)}).formats_report()
    assert with_file["quant_calibration"] == "file:calibration text.txt"  # not the server's path
    assert main(["plan", str(EMBEDDED), "--memory", "1GiB", "--quantization", "int4", "--quant-calibration",
                 "builtin", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["quant_calibration"] == "builtin" and plan["lm_head_quantization"] == "int8"
    out = tmp_path / "q.json"
    assert main(["bench", "quality", "--quantization", "int4", "--quant-calibration", "builtin",
                 "--quant-calibration-samples", str(SAMPLES), "--output", str(out)]) == 0
    labels = [r["label"] for r in json.loads(out.read_text())["reports"]]
    assert labels == ["unquantized", f"int4 g32 gptq (builtin calibration, {SAMPLES} samples)"]


def test_a_damaged_entry_is_replaced_and_abandoned_work_removed(tmp_path, monkeypatch):
    """An entry without its marker (written last) is calibrated again and replaced; a dead process's temporary
    directory is removed; a cache that cannot be written is a model_load_error naming the variable to set."""
    import subprocess
    import sys

    calls = []

    def fake_quantize(model_dir, out_dir, opts):  # the files an entry needs; the real calibration is tested above
        calls.append(out_dir)
        out = Path(out_dir)
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (out / name).write_text("{}")
        return gptq_calibrate.QuantizeReport(out_dir, 1, [], 0.0)

    monkeypatch.setattr(gptq_calibrate, "quantize_checkpoint", fake_quantize)
    opts = calibration_options(calibrated())
    final = tmp_path / cache_key(str(EMBEDDED), opts)
    final.mkdir()
    (final / "config.json").write_text("{}")  # what an interrupted `rm -r` or copy can leave
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = tmp_path / f".tmp-{final.name}-{dead.pid}-0123abcd"
    abandoned.mkdir()
    got = calibrated_checkpoint(str(EMBEDDED), opts, root=tmp_path)
    assert not got.cached and got.path == final and len(calls) == 1
    assert (final / MARKER).is_file() and (final / "model.safetensors").is_file()
    assert not abandoned.exists() and not list(tmp_path.glob(".tmp-*"))
    assert calibrated_checkpoint(str(EMBEDDED), opts, root=tmp_path).cached and len(calls) == 1
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(ModelLoadError, match="LLMRT_GPTQ_CACHE_DIR"):
        calibrated_checkpoint(str(EMBEDDED), opts, root=blocked / "gptq")


def test_a_second_load_waits_for_the_first_calibration(tmp_path, monkeypatch):
    """Replicas started together: while one process holds an entry's lock, another loading the same model and
    options waits, then reads the entry the first wrote instead of calibrating again."""
    import threading

    from llmrt.model.quantization.gptq_at_load import _entry_lock

    def must_not_calibrate(*args, **kwargs):
        raise AssertionError("calibrated although another load was writing the entry")

    monkeypatch.setattr(gptq_calibrate, "quantize_checkpoint", must_not_calibrate)
    opts = calibration_options(calibrated())
    final = tmp_path / cache_key(str(EMBEDDED), opts)
    got = []
    with _entry_lock(tmp_path / f"{final.name}.lock"):  # the first "process" (another open file: flock blocks)
        waiter = threading.Thread(target=lambda: got.append(calibrated_checkpoint(str(EMBEDDED), opts, root=tmp_path)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got  # waiting on the lock
        final.mkdir()
        for name in ("config.json", "model.safetensors", MARKER):
            (final / name).write_text("{}")
    waiter.join(30)
    assert got and got[0].cached and got[0].path == final
