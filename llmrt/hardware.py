"""What the device is and can do: the one place capability checks live."""
from __future__ import annotations

import ctypes
import functools
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_native_fp16() -> bool:
    """True when the CPU has fp16 arithmetic (AVX512-FP16 or AMX-FP16)."""
    flags = cpu_flags()
    return "avx512_fp16" in flags or "amx_fp16" in flags


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in for weights stored as `dtype` on `device`.

    CPUs without bf16/fp16 instructions emulate those matmuls several times slower than fp32, so there the
    weights and KV cache stay in the narrow dtype (memory) and the arithmetic runs in fp32 (speed).
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    if os.environ.get("LLMRT_CPU_NATIVE_HALF") == "1":
        return dtype
    if dtype == torch.bfloat16 and cpu_has_native_bf16():
        return dtype
    if dtype == torch.float16 and cpu_has_native_fp16():
        return dtype
    return torch.float32


def native_half_max_rows(device: torch.device, dtype: torch.dtype) -> int:
    """Up to how many rows a matmul keeps its half-precision weights as they are, rather than upcasting them.

    Where `compute_dtype` upcasts (CPUs without bf16/fp16 arithmetic), a matmul of one or two rows is
    memory-bound: the emulated half kernel reads half the bytes and beats copying the weight to fp32 first
    (measured on a 110M Llama here: 37 ms vs 92 ms per single-stream token). From three rows on, the upcast wins.
    The cost: a sequence's numerics then depend on whether its step had <= 2 tokens. LLMRT_CPU_NATIVE_HALF=0
    upcasts always (batch-invariant), =1 never upcasts.
    """
    if compute_dtype(device, dtype) == dtype:
        return 1 << 62
    if os.environ.get("LLMRT_CPU_NATIVE_HALF") == "0":
        return 0
    return 2


def kernel_isa(flags: frozenset[str] | None = None) -> str | None:
    """Which build of llmrt's own matmul kernels (llmrt/kernels) this CPU runs: avx512, avx2, or None."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


@dataclass
class DeviceInfo:
    """A summary of the device for logs and benchmark reports."""

    device: str
    name: str
    total_memory: int
    capability: str

    @classmethod
    def probe(cls, device: torch.device) -> "DeviceInfo":
        """Describe `device`."""
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return cls(str(device), props.name, props.total_memory, f"sm_{props.major}{props.minor}")
        name = "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls("cpu", name, total, torch.backends.cpu.get_cpu_capability())


def device_memory_free_total(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of device memory; for CPU, available and total RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return avail, total


def measure_peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes of device memory `fn` allocates at its peak, over what was allocated before it ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    tracker = _LiveTensorBytes()
    with tracker:
        fn()
    return tracker.peak


class _LiveTensorBytes(TorchDispatchMode):
    """Tracks bytes of tensor storages that ops create and that are still alive (CPU has no allocator stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not t.is_mkldnn}  # oneDNN's opaque weights: no storage
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_mkldnn:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self.live or key in inputs:
                continue  # a view or an in-place result, not a new allocation
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out


def tune_cpu_allocator() -> bool:
    """Keep freed large blocks in the process heap (glibc) instead of returning them to the OS.

    By default glibc serves allocations over a few MiB with fresh mmaps and unmaps them on free, so every step
    page-faults its large activations and KV gathers anew; measured here, a 42 MB gather took 56 ms that way and
    8 ms from the heap. Returns False where it does not apply (not glibc).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1
    return ok and libc.mallopt(m_trim_threshold, 1 << 31) == 1


# -- formats the device computes (checked at configuration time, before any weight is read) -------------

NATIVE, EMULATED, UNSUPPORTED = "native", "emulated", "unsupported"
UNCHECKED = "unchecked"  # a registered format the table does not know (a plugin's): its own code decides


@dataclass(frozen=True)
class FormatSupport:
    """Whether `device` computes `format` natively, by emulation (slower), or not at all, and why."""

    format: str  # "bfloat16", "int8", "int4", "fp8", "kv:int8", ...
    device: str  # e.g. "cpu (avx512_bf16, avx512_vnni)" or "cuda sm_80"
    status: str  # NATIVE | EMULATED | UNSUPPORTED
    detail: str  # the kernel used, or the slowdown / what would work instead

    def as_dict(self) -> dict[str, str]:
        """For /version, `llmrt plan --json` and logs."""
        return {"format": self.format, "device": self.device, "status": self.status, "detail": self.detail}


_CPU_ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def describe_device(device: torch.device, flags: frozenset[str] | None = None,
                    capability: tuple[int, int] | None = None) -> str:
    """The device and the features that decide its formats, in words."""
    if device.type == "cuda":
        major, minor = capability or torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor}"
    isa = [f for f in _CPU_ISA if f in (cpu_flags() if flags is None else flags)]
    return f"cpu ({', '.join(isa) or 'no AVX2'})"


INT4_CHECKPOINT_FORMATS = ("gptq", "awq")  # 4-bit checkpoints converted to the int4 method at load


def format_support(device: torch.device, fmt: str, flags: frozenset[str] | None = None,
                   capability: tuple[int, int] | None = None) -> FormatSupport:
    """The capability table: CPUs by ISA flags, CUDA by compute capability (flags/capability: for tests)."""
    where = describe_device(device, flags, capability)
    computed_as = "int4" if fmt in INT4_CHECKPOINT_FORMATS else fmt
    if device.type == "cuda":
        cap = capability or torch.cuda.get_device_capability(device)
        status, detail = _cuda_support(computed_as, cap)
    else:
        status, detail = _cpu_support(computed_as, cpu_flags() if flags is None else flags)
    if computed_as != fmt:
        detail = f"{fmt} checkpoints run as int4: {detail}"
    return FormatSupport(fmt, where, status, detail)


def _cpu_support(fmt: str, flags: frozenset[str]) -> tuple[str, str]:
    avx2 = "avx2" in flags or "avx512f" in flags
    if fmt in ("bfloat16", "float16"):
        native = ("avx512_bf16" in flags or "amx_bf16" in flags) if fmt == "bfloat16" else \
            ("avx512_fp16" in flags or "amx_fp16" in flags)
        from llmrt.kernels import max_rows

        ours = kernel_isa(flags)
        if native:
            return NATIVE, f"{fmt} matmuls in hardware" + (
                f"; llmrt's {ours} kernel for steps of up to {max_rows(ours, 'bf16')} rows"
                if ours and fmt == "bfloat16" else "")
        if ours and fmt == "bfloat16":
            return EMULATED, (f"no {fmt} arithmetic on this CPU: weights stay {fmt} (half the bytes); steps of up "
                              f"to {max_rows(ours, 'bf16 upcast')} rows run llmrt's {ours} kernel (bf16 widened to float32 in registers), larger "
                              "ones upcast the weights and run float32 matmuls")
        return EMULATED, (f"no {fmt} arithmetic on this CPU: weights stay {fmt} (half the bytes) and matmuls of 3+ "
                          "rows run in float32 (emulated half matmuls are 3-5x slower than float32)")
    if fmt in ("int8", "int4"):
        from llmrt.kernels import build_for, has_amx, has_bf16_dot, int16_block, max_rows
        from llmrt.kernels.packed import AMX_ROWS, BF16_GEMM_MIN_ROWS

        ours = kernel_isa(flags)
        if ours:
            block = int16_block(build_for(flags), fmt)
            notes = [f"activations rounded to int16 per block of {block}" if block else "weights widened to float32"]
            if fmt == "int4" and has_bf16_dot(ours, flags):
                notes.append("int4 with bf16 activations: vdpbf16ps")
            how = f" ({'; '.join(notes)})"
            batched = (f"; bf16 steps of {AMX_ROWS[0]}-{AMX_ROWS[1]} rows on AMX tiles" if has_amx(ours, flags) else
                       f"; bf16 steps of {BF16_GEMM_MIN_ROWS[fmt]} rows or more by vdpbf16ps from bf16 panels"
                       if has_bf16_dot(ours, flags) else "")
            return NATIVE, (f"weight-only {fmt}: llmrt's {ours} kernel{how} (weights packed at load) for steps of "
                            f"up to {max_rows(ours, fmt)} rows{batched}; {'other ' if batched else ''}larger steps "
                            "dequantized to the compute dtype (torch's packed kernels where ours cannot be built); the "
                            "LM head int8 unless --lm-head-quantization none (docs/quantization.md)")
        if avx2 and fmt == "int8":
            return NATIVE, ("weight-only int8: torch's packed kernel (bf16 activations) for steps of up to 8 rows, "
                            "dequantized to the compute dtype above (docs/quantization.md)")
        if avx2:
            return NATIVE, ("weight-only int4: torch's packed kernel (bf16 activations) for every step "
                            "(docs/quantization.md)")
        return EMULATED, f"no AVX2: {fmt} weights are dequantized for every matmul (expect slower than float32)"
    if fmt == "fp8":
        return UNSUPPORTED, ("CPUs have no fp8 matmuls; use --quantization int8 (per-channel) or int4 (group-wise) "
                             "for weights; fp8 weights need CUDA sm_89+")
    if fmt == "kv:int8":
        return NATIVE, "int8 KV blocks with per-token, per-head scales; dequantized in attention"
    if fmt == "kv:fp8":
        return EMULATED, ("fp8 (e4m3) KV blocks with per-token, per-head scales, converted in software (CPUs have "
                          "no fp8 instructions): the same memory as int8 with 3 mantissa bits instead of 7, so "
                          "--kv-cache-dtype int8 is the better choice here")
    return UNCHECKED, f"{fmt!r} is not in the capability table"


def _cuda_support(fmt: str, cap: tuple[int, int]) -> tuple[str, str]:
    sm = cap[0] * 10 + cap[1]
    if fmt == "bfloat16":
        return (NATIVE, "bf16 tensor cores") if sm >= 80 else \
            (EMULATED, f"sm_{sm} has no bf16 tensor cores; use --dtype float16 (bf16 is several times slower)")
    if fmt == "float16":
        return NATIVE, "fp16 tensor cores"
    if fmt == "int8":
        return EMULATED, "weight-only int8 dequantized to the compute dtype per matmul (no int8 GEMM kernel used)"
    if fmt == "int4":
        return EMULATED, "weight-only int4 dequantized to the compute dtype per matmul (tinygemm not wired yet)"
    if fmt == "fp8":
        if sm >= 89:
            return NATIVE, ("e4m3 weights with per-channel scales and per-token e4m3 activations on the fp8 tensor "
                            "cores (torch._scaled_mm: scales in its epilogue on sm_90, applied after elsewhere); "
                            "the LM head stays in the model dtype")
        return UNSUPPORTED, (f"fp8 matmuls need sm_89+ (Ada/Hopper), this GPU is sm_{sm}; use --quantization int8 "
                             "or int4")
    if fmt == "kv:int8":
        return NATIVE, "int8 KV blocks with per-token, per-head scales; dequantized in attention"
    if fmt == "kv:fp8":
        if sm >= 89:
            return NATIVE, "fp8 (e4m3) KV blocks with per-token, per-head scales; dequantized in attention"
        return EMULATED, (f"sm_{sm} has no fp8 conversion instructions: fp8 KV blocks are converted in software; "
                          "--kv-cache-dtype int8 takes the same memory")
    return UNCHECKED, f"{fmt!r} is not in the capability table"


def check_formats(device: torch.device, dtype: torch.dtype, quantization: str | None,
                  kv_cache_dtype: str, flags: frozenset[str] | None = None,
                  capability: tuple[int, int] | None = None) -> list[FormatSupport]:
    """Every format this configuration computes in; refuses an unsupported one (naming device, format and what
    would work), warns once per emulated one. Runs before any weight is read."""
    from llmrt.errors import UnsupportedError

    fmts = []
    if dtype != torch.float32:
        fmts.append(str(dtype).replace("torch.", ""))
    if quantization:
        fmts.append(quantization)
    if kv_cache_dtype != "auto":
        fmts.append(f"kv:{kv_cache_dtype}")
    out = [format_support(device, f, flags, capability) for f in fmts]
    for s in out:
        if s.status == UNSUPPORTED:
            param = "kv_cache_dtype" if s.format.startswith("kv:") else \
                ("quantization" if s.format == quantization else "dtype")
            raise UnsupportedError(f"{s.format} is not supported on {s.device}: {s.detail}", param=param)
        if s.status == EMULATED:
            _warn_once(f"{s.format} on {s.device} is emulated: {s.detail}")
    return out


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    import logging

    logging.getLogger(__name__).warning(message)
