// int8 weights times int16 activations with AVX512-VNNI's vpdpwssd, over linear.cpp's packed int8 layout as it
// is (4-row blocks of 32-input chunks, 32 bytes per row). Included by linear.cpp in the VNNI build only.
//
// Why: the float kernel (linear_dense<int8_t>) widens every 16 weights to fp32 (a sign extension and a convert)
// before its FMA, 12 vector ops a 64-byte chunk against 6 for bf16's 32 weights, and on a 2-core Zen 4 it streamed
// the 124.7M model's decoder layers at 36 GB/s where bf16 took 51 (the same process): int8 decode was bound by
// those ops, not by memory. Here 32 weights are one sign extension to int16 and one vpdpwssd (32 products, exact
// int32 pair sums): about 5 ops a 64-byte chunk with the per-block scaling below.
//
// Each activation row is rounded to int16 per block of XB chunks (256 inputs, llama.cpp's Q8_K block; at 32
// inputs, as the AVX2 kernel does, the per-block convert and scale cost as much as the products): q = round(x / d),
// d = max|x| / 32767 over the block, an error of at most d / 2 an element (2^-16 of the block's largest; bf16's
// own rounding of that element is 2^-9 of it). A block's int32 sums are exact (|q w| <= 32767 * 128, 16 a lane);
// its 4 weight rows' sums are folded into one vector, converted and scaled by d. A row's result does not depend on
// the batch: every row gets the same operations whatever the tile. A block with a NaN or an infinity gets a NaN
// scale, so all the row's outputs are non-finite, as a float matmul's would be.
#pragma once

#if defined(LLMRT_AVX512) && defined(LLMRT_VNNI)
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t XB = 8;   // chunks (of 32 inputs) per activation scale

// Activation rows as int16, [M][Kp] (zero past K), and each block's scale [M][nb].
struct I16Blocks {
  std::vector<int16_t> q;
  std::vector<float> d;
  int64_t nb = 0;
};

I16Blocks round_blocks_i16(const float* x, int64_t ldx, int64_t M, int64_t Kp) {
  I16Blocks r;
  const int64_t chunks = Kp / 32;
  r.nb = (chunks + XB - 1) / XB;
  r.q.resize(M * Kp);
  r.d.resize(M * r.nb);
  const __m512 sign = _mm512_set1_ps(-0.0f), inf = _mm512_set1_ps(INFINITY);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < r.nb; ++g) {
      const int64_t k0 = g * XB * 32, k1 = std::min(Kp, k0 + XB * 32);
      const float* xi = x + i * ldx;
      int16_t* q = r.q.data() + i * Kp;
      __m512 m = _mm512_setzero_ps();
      __mmask16 bad = 0;  // lanes that met a NaN or an infinity
      for (int64_t k = k0; k < k1; k += 16) {
        const __m512 a = _mm512_andnot_ps(sign, _mm512_loadu_ps(xi + k));
        bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // a >= inf, or unordered
        m = _mm512_max_ps(m, a);
      }
      const float amax = _mm512_reduce_max_ps(m), scale = 32767.0f / amax;
      float& d = r.d[i * r.nb + g];
      if (bad || !std::isfinite(scale)) {  // scale: inf for an all-zero block, or one below ~1e-34 (counted as 0)
        d = bad ? NAN : 0.0f;
        std::fill(q + k0, q + k1, int16_t(0));
        continue;
      }
      d = amax / 32767.0f;
      const __m512 inv = _mm512_set1_ps(scale);
      for (int64_t k = k0; k < k1; k += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xi + k), inv));  // nearest, ties even
        _mm256_storeu_si256((__m256i*)(q + k), _mm512_cvtsepi32_epi16(v));
      }
    }
  return r;
}

// The 4 weight rows' 16-lane sums as one vector: lane 4L + j holds row j's sum over lanes 4L..4L+3.
inline __m512i fold_rows(const __m512i* t) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(t[0], t[1]), _mm512_unpackhi_epi32(t[0], t[1]));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(t[2], t[3]), _mm512_unpackhi_epi32(t[2], t[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// Block b times rows m0..m0+mb: out[i][j] = sum_k x[i, k] w[4b + j, k] (the row scale is the sink's).
template <int mb>
inline void i8_tile(const int8_t* w, int64_t Kp, const I16Blocks& x, int64_t m0, float (*out)[NB]) {
  const int64_t chunks = Kp / 32;
  __m512 f[mb];
  for (int i = 0; i < mb; ++i) f[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.nb; ++g) {
    __m512i acc[mb][NB];
    for (int i = 0; i < mb; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t c = g * XB; c < std::min(chunks, (g + 1) * XB); ++c, w += NB * 32) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + j * 32)));
      for (int i = 0; i < mb; ++i) {
        const __m512i xv = _mm512_loadu_si512(x.q.data() + (m0 + i) * Kp + c * 32);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], wv[j], xv);
      }
    }
    for (int i = 0; i < mb; ++i)
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fold_rows(acc[i])), _mm512_set1_ps(x.d[(m0 + i) * x.nb + g]), f[i]);
  }
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < NB; ++j) out[i][j] = _mm512_mask_reduce_add_ps(__mmask16(0x1111 << j), f[i]);
}

// linear_int8 on the VNNI build: every block times every row (q_all_blocks' tiles and threads).
at::Tensor linear_int8_i16dot(const Call& c, const int8_t* w, int64_t M) {
  const I16Blocks x = round_blocks_i16(c.a.p, c.a.ld, M, c.Kp);
  const int64_t Kp = c.Kp;
  q_all_blocks(M, c.blocks, NB * Kp, c.sink, [&](auto mb, int64_t b, int64_t m0, float (*out)[NB]) {
    i8_tile<decltype(mb)::value>(w + b * NB * Kp, Kp, x, m0, out);
  });
  return c.y;
}

}  // namespace

#endif
