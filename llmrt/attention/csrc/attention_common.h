// What both attention kernels (paged_decode.cpp, prefill_attention.cpp) read and write values with: the element
// conversions, bf16 vector loads and the lane reductions, and the switch for vdpbf16ps scores.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../kernels/csrc/lane_sum.h"
#include "../../kernels/csrc/vec_lanes.h"

// Whether bf16 x bf16 scores (decode's K pass, prefill's Q K^T) use AVX512-BF16's vdpbf16ps: set once by the
// loader from the capability table (set_bf16dot, defined in paged_decode.cpp), and by tests to cover both branches.
extern bool llmrt_attn_bf16dot;

namespace llmrt_attn_common {

constexpr int64_t L = LANES;  // vector lanes (vec_lanes.h)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

inline void to_out(float* o, float x) { *o = x; }
inline void to_out(c10::BFloat16* o, float x) { *o = c10::BFloat16(x); }  // round to nearest even

using ::vload;  // vec_lanes.h's float and uint16 overloads beside the bf16 one
inline vf vload(const c10::BFloat16* p) { return vload(reinterpret_cast<const uint16_t*>(p)); }

// A fixed tree over the lanes (no -ffast-math: the order must not depend on the loop around it, so that a
// sequence's result is the same whether its step has many sequences or few).
// Lane i adds lane i + w for w = L/2, ..., 1; with AVX2/AVX-512 as vector adds of halves (the same sums: GCC had
// lowered the loop to a chain of scalar adds through memory, ~20% of the prefill kernel's samples on a Zen 4).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof(z));
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
  return sum8(_mm256_add_ps(_mm512_castps512_ps256(z), hi));
#elif defined(__AVX2__)
  __m256 y;
  std::memcpy(&y, &v, sizeof(y));
  return sum8(y);
#else
  float part[L];
  std::memcpy(part, &v, sizeof(v));
  for (int64_t w = L / 2; w > 0; w /= 2) {
    for (int64_t i = 0; i < w; ++i) part[i] += part[i + w];
  }
  return part[0];
#endif
}

inline float hmax(vf v) {
  float m = v[0];
  for (int64_t i = 1; i < L; ++i) m = std::max(m, v[i]);
  return m;
}

}  // namespace llmrt_attn_common
