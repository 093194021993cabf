"""`--quantization int4 --quant-calibration builtin|FILE`: GPTQ calibration at load, cached like a compiled kernel.

The first load calibrates the float checkpoint as `llmrt quantize` does (asymmetric groups of --quant-group-size,
its defaults otherwise), writes the GPTQ checkpoint into `<root>/<key>` (root: $LLMRT_GPTQ_CACHE_DIR, else
`gptq/` under llmrt's cache, $LLMRT_CACHE_DIR or ~/.cache/llmrt) and serves it through the GPTQ loader
(`gptq_awq.py`); later loads with the same model files and options read the cached checkpoint. The key covers
the model directory's files by name, size and mtime_ns (not their content: hashing a multi-GB checkpoint would
cost more than loading it), the options, the calibration file's content hash and CACHE_VERSION. A checkpoint is
written into a temporary directory and renamed into place under a lock file, so a crash never leaves half of one
and processes loading the same model at once calibrate it once (the others wait and read it).
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from llmrt.errors import InvalidRequestError, ModelLoadError, UnsupportedError

if TYPE_CHECKING:
    from llmrt.config import ModelConfig
    from llmrt.model.quantization.gptq_calibrate import CalibrationOptions

CACHE_VERSION = 1  # bump when the calibration or the written format changes what a key's checkpoint holds
MARKER = "llmrt_calibration.json"  # the last file written into an entry
_TMP = ".tmp-"

logger = logging.getLogger(__name__)


def gptq_cache_root() -> Path:
    """$LLMRT_GPTQ_CACHE_DIR, else `gptq` under llmrt's cache root (where compiled kernels also live)."""
    from llmrt.kernels.build import cache_root

    return Path(os.environ.get("LLMRT_GPTQ_CACHE_DIR") or cache_root() / "gptq")


def check_calibration(calibration: str, quantization: Optional[str], model: str, hf_config: dict[str, Any],
                      samples: int) -> str:
    """Refuse, before any weight is read, a calibration the load cannot do; returns it normalized ("none",
    "builtin" or the file's absolute path)."""
    from llmrt.model.gguf_file import is_gguf

    if calibration in ("none", "", None):
        return "none"
    if quantization != "int4":
        raise UnsupportedError(f"--quant-calibration calibrates int4 weights (GPTQ); it needs --quantization int4, "
                               f"not {quantization or 'none'}", param="quant_calibration")
    if is_gguf(str(model)):
        raise UnsupportedError("--quant-calibration reads a float safetensors checkpoint, not a GGUF file",
                               param="quant_calibration")
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "quantized")
        raise UnsupportedError(f"{model} is already quantized ({method}); --quant-calibration needs a float "
                               "checkpoint (serve this one as it is, without --quantization)", param="quant_calibration")
    if samples < 1:
        raise InvalidRequestError("quant_calibration_samples must be >= 1", param="quant_calibration_samples")
    if calibration == "builtin":
        return calibration
    path = Path(calibration)
    if not path.is_file():
        raise InvalidRequestError(f"calibration file {path} does not exist or is not a file", param="quant_calibration")
    return str(path.resolve())


def calibration_source(calibration: str) -> str:
    """How reports name a (normalized) calibration: "none", "builtin", or "file:NAME" (not the server's path)."""
    return calibration if calibration in ("none", "builtin") else "file:" + Path(calibration).name


def calibration_options(model_cfg: "ModelConfig", device: str = "cpu") -> "CalibrationOptions":
    """What the load calibrates with: GPTQ, asymmetric groups of the configured size, `llmrt quantize`'s defaults."""
    from llmrt.model.quantization.gptq_calibrate import CalibrationOptions
    from llmrt.model.quantization.gptq_solver import QuantSpec

    return CalibrationOptions(method="gptq", spec=QuantSpec(model_cfg.quant_group_size, sym=False),
                              calibration=model_cfg.quant_calibration, samples=model_cfg.quant_calibration_samples,
                              device=device)


def cache_key(model_dir: str, opts: "CalibrationOptions") -> str:
    """The cache entry's name: a hash of the model files' names, sizes and mtimes, the options and CACHE_VERSION."""
    h = hashlib.sha256(f"llmrt-gptq-v{CACHE_VERSION}\n{Path(model_dir).resolve()}\n".encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    fields = {k: v for k, v in asdict(opts).items() if k not in ("device", "calibration")}
    h.update(json.dumps(fields, sort_keys=True).encode())
    source = opts.calibration
    if source != "builtin":
        source = "file:" + hashlib.sha256(Path(source).read_bytes()).hexdigest()
    h.update(source.encode())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class CalibratedCheckpoint:
    """Where the GPTQ checkpoint is, whether it came from the cache, and the seconds calibrating (or finding) took."""

    path: Path
    cached: bool
    seconds: float


def calibrated_checkpoint(model_dir: str, opts: "CalibrationOptions",
                          root: Optional[Path] = None) -> CalibratedCheckpoint:
    """The cached GPTQ checkpoint of `model_dir` under `opts`, calibrated and written atomically first if absent."""
    from llmrt.model.quantization.gptq_calibrate import quantize_checkpoint

    t = time.perf_counter()
    root = Path(root) if root is not None else gptq_cache_root()
    final = root / cache_key(model_dir, opts)
    if _complete(final):
        return CalibratedCheckpoint(final, True, time.perf_counter() - t)
    tmp = root / f"{_TMP}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _entry_lock(root / f"{final.name}.lock"):
            if _complete(final):  # another process calibrated it while this one waited
                logger.info("another process cached %s; using its checkpoint", final)
                return CalibratedCheckpoint(final, True, time.perf_counter() - t)
            logger.warning("calibrating %s to int4 g%d (GPTQ, %s, %d samples): once per model files and options, "
                           "cached in %s", model_dir, opts.spec.group_size, opts.calibration, opts.samples, final)
            _remove_abandoned(root)
            report = quantize_checkpoint(model_dir, str(tmp), opts)
            # Written last: an entry holding it is whole.
            (tmp / MARKER).write_text(json.dumps(
                {"source_model": str(Path(model_dir).resolve()), "cache_version": CACHE_VERSION,
                 "seconds": report.seconds, "calibration_tokens": report.calibration_tokens}, indent=2))
            if final.exists():  # a damaged entry (part of it deleted): replaced
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    except OSError as e:
        raise ModelLoadError(f"cannot write the calibrated checkpoint under {root}: {e}; set $LLMRT_GPTQ_CACHE_DIR to "
                             "a writable directory") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()  # the float model and the sampling engine's reference cycles, before the KV cache is sized
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return CalibratedCheckpoint(final, False, time.perf_counter() - t)


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """Held while an entry is calibrated: a second process loading the same model and options waits for the first
    and reads its checkpoint (replicas started together calibrate once). Released by the kernel if the holder dies."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _complete(entry: Path) -> bool:
    return (entry / MARKER).is_file() and (entry / "config.json").is_file() and (entry / "model.safetensors").is_file()


def _remove_abandoned(root: Path) -> None:
    """Temporary directories of processes that died calibrating (killed, out of memory)."""
    for d in root.glob(f"{_TMP}*"):
        try:
            pid = int(d.name.rsplit("-", 2)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):  # not ours, or another user's live process
            continue


def calibrated_model_config(model_cfg: "ModelConfig", device: str = "cpu") -> "ModelConfig":
    """The configuration that serves `model_cfg`'s calibrated checkpoint (from the cache, calibrated if absent)."""
    opts = calibration_options(model_cfg, device)
    ckpt = calibrated_checkpoint(model_cfg.model, opts)
    how = "loaded from cache" if ckpt.cached else f"calibrated in {ckpt.seconds:.1f} s and cached"
    logger.info("int4 g%d GPTQ (--quant-calibration %s, %d samples): %s %s", opts.spec.group_size,
                model_cfg.quant_calibration, opts.samples, how, ckpt.path)
    # The checkpoint's own quantization_config makes it a GPTQ load; `replace` keeps the LM head as resolved for
    # int4 (int8 unless --lm-head-quantization none), quantized at load like any GPTQ checkpoint's.
    return replace(model_cfg, model=str(ckpt.path), quantization=None, quant_calibration="none")
