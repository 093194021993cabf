// Integer dot products for int8/int4 weights times int8-quantized activations (llama.cpp's Q8_0 scheme):
// each activation row is quantized per block of 32 inputs (xq = round(x / d), d = max|x| / 127), and a block's
// 32 products are summed exactly in int32 before one fp32 multiply-add by d. With AVX512-VNNI (LLMRT_VNNI) one
// vpdpbusd does 64 multiply-adds; without it, vpmaddubsw + vpmaddwd do the same in two (no saturation: one side
// is at most 127 or 15 in magnitude). Widening the weights to fp32 (linear.cpp's float path) costs 3+ ops per
// 16 weights and made the int8/int4 GEMVs compute-bound; this reads them as they are stored.
#pragma once
#include <cmath>
#include "simd.h"

namespace llmrt_simd {

// One block of 32 activations rounded to integers of at most `levels` (127: int8, 32767: int16; to nearest even):
// the integers (4 x 8 int32, in order), their sum, the scale d = max|x| / levels and the block's float sum.
// 256-bit code in every build: int_i16.h's kernels run in the AVX-512 builds too.
struct RoundedBlock {
  __m256i q[4];
  int32_t qsum;
  float d, xsum;
};
inline RoundedBlock round_block(const float* x, float levels) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    s = _mm256_add_ps(s, v[i]);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  RoundedBlock r;
  r.xsum = sum8(s);
  r.d = std::isnan(r.xsum) ? r.xsum : amax / levels;  // max drops NaN: the sum keeps a NaN input's row NaN
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
  for (int i = 0; i < 4; ++i) r.q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(r.q[0], r.q[1]), _mm256_add_epi32(r.q[2], r.q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  r.qsum = _mm_cvtsi128_si32(t);
  return r;
}

#if defined(LLMRT_AVX512)
using vi = __m512i;
constexpr int VB = 64;  // bytes per integer vector
inline vi iload(const void* p) { return _mm512_loadu_si512(p); }
inline vi izero() { return _mm512_setzero_si512(); }
inline vi bcast32(const int8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)); }
inline vi bcast16(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)); }
inline vi lo_nibbles(vi b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
inline vi hi_nibbles(vi b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F)); }
inline vf icvt(vi a) { return _mm512_cvtepi32_ps(a); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
#if defined(LLMRT_VNNI)
inline vi dot_u8s8(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
// signed x signed: w + 128 is unsigned, so a row's sum is 128 * sum(x) too large; s8_init starts each 32-byte
// row slot's first lane at -128 * sum(x) instead of 0.
inline vi s8_init(int32_t xsum) { return _mm512_maskz_set1_epi32(0x0101, -128 * xsum); }
inline vi dot_s8s8(vi acc, vi w, vi x) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), x);
}
#else
inline vi dot_u8s8(vi acc, vi u, vi s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
inline vi s8_init(int32_t) { return izero(); }
inline vi dot_s8s8(vi acc, vi w, vi x) {  // |w| * (x with w's sign): pairs stay within int16
  const vi sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return dot_u8s8(acc, _mm512_abs_epi8(w), sx);
}
#endif
// One group's (scale, offset) for the 4 rows of a block as vectors over int4 vector v's lanes (4 lanes per row):
// s on every lane of its row, b = zero - 8 * scale only on the row's first lane (the row's lanes are summed).
inline void int4_scales(const uint16_t* g, vf* s, vf* b) {
  const vf f = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)g))), 16));
  s[0] = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), f);
  const vf z = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), f);
  b[0] = _mm512_maskz_mov_ps(0x1111, _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[0], z));
}
// One block of 32 activations: q = round(x * 127 / max|x|) (to nearest even), d = max|x| / 127, and the sums
// of q and of x.
inline void quantize_block(const float* x, int8_t* q, float& d, int32_t& qsum, float& xsum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  xsum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  d = std::isnan(xsum) ? xsum : amax / 127.0f;  // max drops NaN: the sum keeps a NaN input's row NaN
  const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
  qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#else
using vi = __m256i;
constexpr int VB = 32;
inline vi iload(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vi izero() { return _mm256_setzero_si256(); }
inline vi bcast32(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vi bcast16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)); }
inline vi lo_nibbles(vi b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
inline vi hi_nibbles(vi b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }
inline vf icvt(vi a) { return _mm256_cvtepi32_ps(a); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vi dot_u8s8(vi acc, vi u, vi s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline vi s8_init(int32_t) { return izero(); }
inline vi dot_s8s8(vi acc, vi w, vi x) { return dot_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
inline void int4_scales(const uint16_t* g, vf* s, vf* b) {  // two vectors of 2 rows each
  const vf f = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)g)), 16));
  const vf eight = _mm256_set1_ps(8.0f);
  for (int v = 0; v < 2; ++v) {
    s[v] = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(4 * v, 4 * v, 4 * v, 4 * v, 4 * v + 2, 4 * v + 2,
                                                          4 * v + 2, 4 * v + 2));
    const vf z = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(4 * v + 1, 4 * v + 1, 4 * v + 1, 4 * v + 1,
                                                                4 * v + 3, 4 * v + 3, 4 * v + 3, 4 * v + 3));
    b[v] = _mm256_blend_ps(_mm256_setzero_ps(), _mm256_fnmadd_ps(eight, s[v], z), 0x11);
  }
}
inline void quantize_block(const float* x, int8_t* q, float& d, int32_t& qsum, float& xsum) {
  const RoundedBlock r = round_block(x, 127.0f);
  d = r.d;
  qsum = r.qsum;
  xsum = r.xsum;
  // packs work per 128-bit lane: the 8 dwords come out in order 0 4 1 5 2 6 3 7
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r.q[0], r.q[1]), _mm256_packs_epi32(r.q[2], r.q[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

inline const char* int_dot_name() {
#if defined(LLMRT_VNNI)
  return "avx512-vnni vpdpbusd";
#elif defined(LLMRT_AVX512)
  return "avx512bw vpmaddubsw";
#else
  return "avx2 vpmaddubsw";
#endif
}

// The sum of each slot of R consecutive lane groups (VL / R lanes each) of a, in lane order.
template <int R>
inline void slot_sums(vf a, float* out) {
  alignas(64) float t[VL];
  vstore(t, a);
  for (int r = 0; r < R; ++r) {
    float s = 0.0f;
    for (int l = 0; l < VL / R; ++l) s += t[r * (VL / R) + l];
    out[r] = s;
  }
}

}  // namespace llmrt_simd
