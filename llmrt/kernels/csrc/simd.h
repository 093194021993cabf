// The ISA layer of llmrt's linear kernels: fp32 vectors of VL lanes and the loads that widen weights into them.
// AVX-512 (LLMRT_AVX512) or AVX2+FMA; everything else in linear.cpp is written against these few functions.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "lane_sum.h"

namespace llmrt_simd {

#if defined(LLMRT_AVX512)
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf wload(const uint16_t* p) {  // bf16 -> fp32: the bf16 bits are the high half of the fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf wload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// 16 packed bytes -> the 32 nibble values of one int4 chunk as fp32: lo = k 0..15, hi = k 16..31.
inline void nibbles(const uint8_t* p, vf* out) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
  out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
// One group's 16 possible weights, t[q] = q*s + b; a chunk's 32 weights are then one permute per 16 lanes
// (the permute reads only the low 4 bits of each index), the same values as fma(float(q), s, b).
inline vf dq_table(vf s, vf b) {
  return _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s, b);
}
inline void dq_chunk(const uint8_t* p, vf, vf, vf table, vf* out) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  out[0] = _mm512_permutexvar_ps(b, table);
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
constexpr int MB = 4;  // activation rows per tile (32 zmm registers: 16 accumulators)
constexpr bool PAIR_ORDER = false;  // bf16 weights widen in k order (one shift of a widening load)
// No software prefetch on AVX-512 (linear.cpp, Dense): measured on an AVX512-BF16 EPYC, W2 in one process, 8
// pairs: bf16 1.10x the time with it, fp32 1.01x (docs/performance.md, tenth session).
constexpr bool BF16_PREFETCH = false;
void wload_pairs(const uint16_t*, vf&, vf&);  // AVX2 only: declared for Dense's discarded branch, never defined
#else
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return sum8(a); }
inline vf wload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf wload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline void nibbles(const uint8_t* p, vf* out) {  // out: k 0..7, 8..15, 16..23, 24..31
  const __m256i m = _mm256_set1_epi32(0xF);
  __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, m));
  out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, m));
  out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline vf dq_table(vf, vf) { return _mm256_setzero_ps(); }  // no 16-entry permute in AVX2: fma per chunk
inline void dq_chunk(const uint8_t* p, vf s, vf b, vf, vf* out) {
  nibbles(p, out);
  for (int c = 0; c < 4; ++c) out[c] = _mm256_fmadd_ps(out[c], s, b);
}
constexpr int MB = 2;  // 16 ymm registers: 8 accumulators, 4 weight vectors, 1 activation
// bf16 weights widen 16 at a time as their even k (lane i: k = 2i) and their odd k: a shift and a mask of one
// 256-bit load, where wload's widening load is a cross-lane shuffle per 8 weights (64-row steps 0.76x the time,
// 1 row 0.97x: docs/performance.md). The activations are laid out to match (`activations(x, Kp, pairs)` in
// linear.cpp); the products and their order per lane are the same for every row count, so results stay independent
// of the batch.
constexpr bool PAIR_ORDER = true;
constexpr bool BF16_PREFETCH = true;  // bf16 weight chunks ask for the bytes PREFETCH_AHEAD on (linear.cpp, Dense)
inline void wload_pairs(const uint16_t* p, vf& even, vf& odd) {
  const __m256i w = _mm256_loadu_si256((const __m256i*)p);
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}
#endif
constexpr int NB = 4;  // weight rows per tile
// Where input t (0-15) of a 16-input group sits in PAIR_ORDER: even t in the first 8 slots, odd t in the last 8.
constexpr int pair_slot(int t) { return t % 2 * 8 + t / 2; }
constexpr int64_t PREFETCH_AHEAD = 4096;  // how far ahead the AVX2 1-2-row kernels prefetch weights (bf16, int_i16.h)

inline float to_f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f(int8_t v) { return float(v); }
inline float to_f(float v) { return v; }
inline vf wload(const float* p) { return vload(p); }
inline void vstore(float* p, vf v) {
#if defined(LLMRT_AVX512)
  _mm512_storeu_ps(p, v);
#else
  _mm256_storeu_ps(p, v);
#endif
}

}  // namespace llmrt_simd
