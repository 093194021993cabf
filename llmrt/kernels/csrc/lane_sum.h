// The sum of a 256-bit vector's 8 floats by one fixed tree (lane i adds lane i + 4, then i + 2, then i + 1), for the
// linear kernels (simd.h's AVX2 vsum, qdot.h's round_block) and the attention kernels' hsum alike.
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>

inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
