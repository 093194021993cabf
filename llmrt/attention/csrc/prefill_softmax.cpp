// The softmax of a prefill span's attention scores, for the cpu_paged backend's prefill: scores come from one
// batched float32 matmul (Q K^T of every query head against the span's context), this op masks them causally
// (and by the sliding window), scales, exponentiates and normalizes each row, and writes the probabilities in the
// dtype the second matmul (P V) takes. Masked entries are written as zeros, so P V needs no mask.
// Rows are [query head group, query] pairs: row r is query r % n of the span, at position q_offset + r % n.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../../kernels/csrc/vec_lanes.h"

namespace {

constexpr int64_t L = LANES;

inline void store(float* o, vf x) { std::memcpy(o, &x, sizeof(vf)); }
// float -> bf16, rounded to nearest even as c10::BFloat16 does, L lanes at once (probabilities: no NaN).
inline void store(c10::BFloat16* o, vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vh h = __builtin_convertvector(u, vh);
  std::memcpy(o, &h, sizeof(h));
}

// exp(x * scale - ms): ms is the row's largest score, scaled.
inline vf vexp_scaled(vf x, float scale, float ms) { return exp_poly<vf, vi>(x * scale - ms); }

// Lanes [0, m) of x from p, the others `fill`.
inline vf load_part(const float* p, int64_t m, float fill) {
  vf x = vf{} + fill;
  for (int64_t i = 0; i < m; ++i) x[i] = p[i];
  return x;
}

template <typename P>
void softmax_rows(const float* s, P* p, int64_t rows, int64_t n, int64_t ctx, int64_t q_offset, float scale,
                  int64_t window) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // the row's exps, normalized on the way out
    for (int64_t r = begin; r < end; ++r) {
      const int64_t pos = q_offset + r % n;
      const int64_t hi = std::min(ctx, pos + 1);  // keys [lo, hi) are visible
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
      const float* x = s + r * ctx;
      P* o = p + r * ctx;
      const int64_t len = hi - lo, full = len / L * L, rest = len - full;
      const float* xs = x + lo;
      vf mx = vf{} + std::numeric_limits<float>::lowest();
      for (int64_t t = 0; t < full; t += L) {
        const vf v = vload(xs + t);
        mx = v > mx ? v : mx;
      }
      if (rest) {
        const vf v = load_part(xs + full, rest, std::numeric_limits<float>::lowest());
        mx = v > mx ? v : mx;
      }
      float m = mx[0];
      for (int64_t i = 1; i < L; ++i) m = std::max(m, mx[i]);
      const float ms = m * scale;
      scratch.resize(full + L);
      float* e = scratch.data();
      vf sum{};
      for (int64_t t = 0; t < full; t += L) {
        const vf x = vexp_scaled(vload(xs + t), scale, ms);
        std::memcpy(e + t, &x, sizeof(vf));
        sum += x;
      }
      if (rest) {
        vf x = vexp_scaled(load_part(xs + full, rest, m), scale, ms);
        for (int64_t i = rest; i < L; ++i) x[i] = 0.f;
        std::memcpy(e + full, &x, sizeof(vf));
        sum += x;
      }
      float total = 0.f;
      for (int64_t i = 0; i < L; ++i) total += sum[i];
      const float inv = 1.f / total;
      std::memset(o, 0, lo * sizeof(P));  // zero bits: +0.0 in float32 and bfloat16
      for (int64_t t = 0; t < full; t += L) store(o + lo + t, vload(e + t) * inv);
      for (int64_t i = 0; i < rest; ++i) o[lo + full + i] = P(e[full + i] * inv);
      std::memset(o + hi, 0, (ctx - hi) * sizeof(P));
    }
  });
}

// s [rows, ctx] float32 scores (unscaled; row r is query r % n of the span, at position q_offset + r % n) ->
// probabilities [rows, ctx] as `dtype` (float32 or bfloat16), zero where masked (keys after the query, or
// window > 0 and more than window - 1 before it).
at::Tensor prefill_softmax(const at::Tensor& s, int64_t n, int64_t q_offset, double scale, int64_t window,
                           at::ScalarType dtype) {
  TORCH_CHECK(s.dim() == 2 && s.is_contiguous() && s.scalar_type() == at::kFloat, "scores: contiguous float32 2-d");
  TORCH_CHECK(n > 0 && s.size(0) % n == 0 && q_offset >= 0 && q_offset + n <= s.size(1),
              "rows must be whole spans of n queries inside the context");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "probabilities: float32 or bfloat16");
  auto p = at::empty(s.sizes(), s.options().dtype(dtype));
  const float sc = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    softmax_rows(s.data_ptr<float>(), p.data_ptr<float>(), s.size(0), n, s.size(1), q_offset, sc, window);
  } else {
    softmax_rows(s.data_ptr<float>(), p.data_ptr<c10::BFloat16>(), s.size(0), n, s.size(1), q_offset, sc, window);
  }
  return p;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_attn, m) {
  m.def("prefill_softmax(Tensor s, int n, int q_offset, float scale, int window, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_attn, CPU, m) { m.impl("prefill_softmax", &prefill_softmax); }
