// Fused CPU layer ops: residual-add + RMSNorm, rotary embedding in place on q/k, SiLU-and-mul, and the greedy
// sampler's argmax over a step's logits.
// Each replaces 4-10 small torch ops (and their temporaries) per call with one pass over the rows; fp32 or bf16
// tensors, computed in fp32 like the torch path in llmrt/model/layers. Plain loops the compiler vectorizes for the
// ISA flags of the build (llmrt/model/layers/fused.py); built with -ffp-contract=off so that a*b - c*d rounds each
// product as torch's separate ops do (rotary is then bitwise equal to the torch path).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../../kernels/csrc/vec_lanes.h"

#ifndef LLMRT_FUSED_NS
#error "LLMRT_FUSED_NS (the torch op namespace) must be defined"
#endif

namespace {

using ::vload;  // vec_lanes.h's float overload beside this file's own

// bf16 <-> fp32 as c10::BFloat16 does it (round to nearest even, NaN -> 0x7FC0), written so that loops vectorize.
inline float load(float x) { return x; }
inline float load(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float f) { *p = f; }
inline void store(uint16_t* p, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  *p = uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}
// The value a T store would keep (fp32: itself; bf16: rounded), for math that torch does in T between ops.
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const uint16_t*) {
  uint16_t b;
  store(&b, f);
  return load(b);
}

// SiLU (below) runs over registers of lanes (vec_lanes.h: AVX-512 16, AVX2 8, generic 4), so the exp
// vectorizes whatever the build's ISA. exp is Cephes' single-precision polynomial (about 1 ulp), computed the same
// way in every lane and for the scalar tail (glibc's vector expf is only offered under -ffast-math, avoided here).
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
// Each lane's bf16 (round to nearest even, NaN -> 0x7FC0, as store()) in the high half of its 32 bits; the low
// half is left over from the rounding (vstore shifts it out, vround_to clears it).
inline vu bf16_high(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? vu{} + 0x7FC00000u : u + 0x7FFFu + ((u >> 16) & 1u);
}
inline void vstore(uint16_t* p, vf v) {
  const vh h = __builtin_convertvector(bf16_high(v) >> 16, vh);
  std::memcpy(p, &h, sizeof(h));
}
inline vf vround_to(vf v, const float*) { return v; }
inline vf vround_to(vf v, const uint16_t*) {  // vstore then vload, in registers
  const vu b = bf16_high(v) & 0xFFFF0000u;
  vf r;
  std::memcpy(&r, &b, sizeof(r));
  return r;
}

// Rows per parallel task: about 64K elements (~15-30 us of work). A decode step of up to 64 sequences of the
// 124.7M model (norms 64 x 768, rotary 64 x 16 heads x 64; fp32 SiLU up to 16 x 2 x 2048, while bf16 SiLU takes
// every size and splits from 32 rows) then stays on the calling thread:
// a parallel region costs more than such work on an idle machine, and on a loaded one each region can wait
// milliseconds for a descheduled OpenMP thread (docs/performance.md). With 256K (before 2026-12-06) a 256-token
// prefill's norms ran on one thread: 106 us for add_rms_norm_ at 256 x 768 against 111 us at 512 rows on two.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elems)); }

template <typename T>
void rms_rows(const T* x, int64_t x_stride, T* out, int64_t out_stride, T* residual, int64_t res_stride,
              const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float* b = buf.data();
      if (residual != nullptr) {  // the sum is rounded to T (torch adds in T), kept as the new residual
        T* rr = residual + r * res_stride;
        for (int64_t d = 0; d < dim; ++d) {
          const float s = round_to(load(xr[d]) + load(rr[d]), xr);
          b[d] = s;
          store(rr + d, s);
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) b[d] = load(xr[d]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < dim; ++d) ss += b[d] * b[d];
      const float inv = 1.f / std::sqrt(ss / float(dim) + eps);
      T* o = out + r * out_stride;
      // As torch: fp32 weight * (x * inv); bf16 rounds x * inv to bf16, then weight * it, rounded again.
      for (int64_t d = 0; d < dim; ++d) store(o + d, load(w[d]) * round_to(b[d] * inv, xr));
    }
  });
}

template <typename T>
void rotary_rows(T* x, int64_t tokens, int64_t heads, int64_t tok_stride, int64_t head_stride, int64_t half,
                 const int64_t* pos, const float* cos, const float* sin) {
  at::parallel_for(0, tokens, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * tok_stride + h * head_stride;
        T* x2 = x1 + half;
        for (int64_t d = 0; d < half; ++d) {
          const float a = load(x1[d]), b = load(x2[d]);
          const float lo = a * c[d] - b * s[d];
          const float hi = b * c[d] + a * s[d];
          store(x1 + d, lo);
          store(x2 + d, hi);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, grain(inner * 2), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + inner;
      T* o = out + r * inner;
      // As torch: silu(gate) in T (rounded for bf16), then * up in T.
      int64_t d = 0;
      for (; d + LANES <= inner; d += LANES) {
        const vf a = vload(g + d);
        const vf act = vround_to(a / (1.f + exp_poly<vf, vi>(-a)), g);
        vstore(o + d, act * vload(u + d));
      }
      if (d < inner) {  // the tail through the same vector code, so every element rounds the same way
        T gt[LANES] = {}, ut[LANES] = {}, ot[LANES];
        std::memcpy(gt, g + d, (inner - d) * sizeof(T));
        std::memcpy(ut, u + d, (inner - d) * sizeof(T));
        const vf a = vload(gt);
        vstore(ot, vround_to(a / (1.f + exp_poly<vf, vi>(-a)), gt) * vload(ut));
        std::memcpy(o + d, ot, (inner - d) * sizeof(T));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensor expected");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-d with contiguous rows expected");
}

template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<uint16_t*>(nullptr));
  }
}

// x [rows, dim] -> RMSNorm(x) * weight, a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "weight: contiguous [dim] of x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_rows<T>(static_cast<const T*>(x.data_ptr()), x.stride(0), static_cast<T*>(out.data_ptr()), out.stride(0),
                nullptr, 0, static_cast<const T*>(weight.data_ptr()), x.size(0), x.size(1), float(eps));
  });
  return out;
}

// In place: residual <- x + residual; x <- RMSNorm(residual) * weight (vLLM's fused_add_rms_norm).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "x and residual differ");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "weight: contiguous [dim] of x's dtype");
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = static_cast<T*>(x.data_ptr());
    rms_rows<T>(xp, x.stride(0), xp, x.stride(0), static_cast<T*>(residual.data_ptr()), residual.stride(0),
                static_cast<const T*>(weight.data_ptr()), x.size(0), x.size(1), float(eps));
  });
}

// In place on q [tokens, heads, D] and k [tokens, kv_heads, D] (views with contiguous head_dim): rotate-half RoPE
// at `positions` from fp32 tables cos/sin [max_positions, D / 2].
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
              "positions: contiguous int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2,
              "cos/sin: contiguous float32 [max_positions, D/2]");
  const int64_t tokens = positions.size(0), half = cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary table (",
                cos.size(0), " positions)");
  }
  for (at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->size(0) == tokens && x->size(2) == 2 * half &&
                    x->stride(2) == 1, "q/k: [tokens, heads, 2 * (D/2)] with contiguous head_dim");
    TORCH_CHECK(x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16, "q/k: float32 or bfloat16");
    dispatch(*x, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      rotary_rows<T>(static_cast<T*>(x->data_ptr()), tokens, x->size(1), x->stride(0), x->stride(1), half, pos,
                     cos.data_ptr<float>(), sin.data_ptr<float>());
    });
  }
}

// gate_up [rows, 2 * I] -> silu(gate) * up [rows, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: even last dimension expected");
  const int64_t inner = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inner}, gate_up.options());
  dispatch(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<T>(static_cast<const T*>(gate_up.data_ptr()), gate_up.stride(0), static_cast<T*>(out.data_ptr()),
                     gate_up.size(0), inner);
  });
  return out;
}

// The index of a row's largest value, as torch.argmax: the first of equal maxima, and the first NaN if the row
// has one (torch orders NaN above every number). One pass over lanes: each lane keeps its first NaN or else its
// first maximum (a later value replaces it only if strictly greater), then the lanes and the tail are merged by
// the same rule with the lower index winning ties. torch's CPU argmax ran at ~0.5 element/ns (58-92 us for a
// 32000-token vocabulary, 2.9 ms for 64 rows of it); this takes ~6 us a row (17 us for one row, call included).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  vf best = vf{} - INFINITY;
  vi at = vi{} - 1, lane = vi{};
  for (int l = 0; l < LANES; ++l) lane[l] = l;
  vi idx = lane;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES, idx += int32_t(LANES)) {
    const vf v = vload(x + i);
    // a lane takes v if v > best, or v is NaN and best is not (NaN lanes never change again)
    const vi take = (v > best) | ((v != v) & (best == best)) | (at < 0);
    best = take ? v : best;
    at = take ? idx : at;
  }
  float b = 0.f;
  int64_t b_at = -1;
  auto merge = [&](float v, int64_t j) {
    const bool b_nan = b != b, v_nan = v != v;
    if (b_at < 0 || (v_nan && !b_nan) || (!b_nan && !v_nan && v > b) ||
        ((v_nan == b_nan) && (v_nan || v == b) && j < b_at)) {
      b = v;
      b_at = j;
    }
  };
  for (int l = 0; l < LANES; ++l)
    if (at[l] >= 0) merge(best[l], at[l]);
  for (; i < n; ++i) merge(load(x[i]), i);
  return b_at;
}

// logits [rows, vocab] (float32 or bfloat16) -> int64 [rows]: torch.argmax(logits, -1).
at::Tensor argmax(const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31), "logits: 1 to 2^31 - 1 columns");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  dispatch(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(logits.data_ptr());
    const int64_t ld = logits.stride(0), n = logits.size(1);
    at::parallel_for(0, logits.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * ld, n);
    });
  });
  return out;
}

}  // namespace

#define LLMRT_FUSED_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMRT_FUSED_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
LLMRT_FUSED_LIBRARY(LLMRT_FUSED_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
}

LLMRT_FUSED_IMPL(LLMRT_FUSED_NS, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax", &argmax);
}
