// GCC vector lanes at the build's ISA width (AVX-512: 16, AVX2: 8, else 4) and an exp over them, shared by the
// fused layer ops (SiLU) and the decode attention kernel (softmax).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#elif defined(__AVX2__)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4;
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf vload(const uint16_t* p) {  // bf16 bits -> fp32, exact: the bits shifted into the high half
#if defined(__AVX512F__)
  // one widening load and a shift (GCC lowers the generic form below to two half-width widenings and an insert)
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(u);
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vf>(u);
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// Cephes' single-precision exp polynomial (about 1 ulp), the same in every lane. V: float lanes, I: int32 lanes.
template <typename V, typename I>
inline V exp_poly(V x) {
  x = x < -87.3f ? V{} - 87.3f : x;
  x = x > 88.37f ? V{} + 88.37f : x;  // exp(88.37) < FLT_MAX: the exponent bits below stay finite
  const V t = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(t, I), V);  // truncation; floor below
  n = n > t ? n - 1.f : n;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  return p * scale;
}
