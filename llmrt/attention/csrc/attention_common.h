// What both attention kernels (paged_decode.cpp, prefill_attention.cpp) read and write values with: the element
// conversions, bf16 vector loads and the lane reductions, and the switch for vdpbf16ps scores.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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
inline float hsum(vf v) {
  float part[L];
  std::memcpy(part, &v, sizeof(v));
  for (int64_t w = L / 2; w > 0; w /= 2) {
    for (int64_t i = 0; i < w; ++i) part[i] += part[i + w];
  }
  return part[0];
}

inline float hmax(vf v) {
  float m = v[0];
  for (int64_t i = 1; i < L; ++i) m = std::max(m, v[i]);
  return m;
}

}  // namespace llmrt_attn_common
