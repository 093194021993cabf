// int8 and int4 weights times int16-quantized activations: the AVX2 build's int8/int4 kernels, for every row count
// they take.
//
// AVX2 has no 16-entry permute, so widening int4 weights to fp32 costs a convert and an FMA per 8 weights (int8: a
// convert), and the float kernels ran at ~10 (int4) cycles per 32 weights (hot, one core) against ~3 here. Each
// activation row is quantized per block of 32 inputs to int16 (q = round(x / d), d = max|x| / 32767: an error of at
// most d / 2 an element, 256x finer than bf16's rounding of the block's largest element); a weight row's 32 values
// times the block are two vpmaddwd (exact int32 pair sums), and four rows' sums are folded by two vphaddd into one
// vector (each row's in two lanes), converted once and scaled by d (int8; the row scale is the sink's) or s * d
// (int4). int4 nibbles q are unsigned: the vector less 4 sum(xq) a lane makes the products xq (q - 8), so the
// rounding error meets the centred weight (half what q alone gives); the zero point's term, z sum_k x_k, uses the
// block's exact float sum X. Integer sums are exact in any order and the float steps are the same for every tile,
// so a row's result does not depend on the batch: steps of up to 2 rows widen the weights in registers, larger
// ones widen each weight block once into an int16 panel that every row tile reads.
#pragma once
#if !defined(LLMRT_AVX512)
#include <vector>

namespace {

// Activation rows per block of 32 inputs (round_block, qdot.h): q as int16 [M][Kp], d [M][nb]; int4: 4 sum(q)
// [M][nb] and (0, X) x 4 [M][nb][8].
struct I16Rows {
  std::vector<int16_t> q;
  std::vector<float> d, xp;
  std::vector<int32_t> sum4;
  int64_t Kp = 0, nb = 0;
};

// int4 also needs 4 sum(q) and (0, X) x 4 per block (the centring and the zero point's term); int8 does not.
template <bool int4>
I16Rows quantize_rows_i16(const float* x, int64_t ldx, int64_t M, int64_t Kp) {
  I16Rows r;
  r.Kp = Kp;
  r.nb = Kp / 32;
  r.q.resize(M * Kp);
  r.d.resize(M * r.nb);
  if (int4) {
    r.sum4.resize(M * r.nb);
    r.xp.resize(M * r.nb * 8);
  }
  const __m256 pattern = _mm256_setr_ps(0, 1, 0, 1, 0, 1, 0, 1);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < r.nb; ++c) {
      const RoundedBlock b = round_block(x + i * ldx + c * 32, 32767.0f);
      int16_t* dst = r.q.data() + i * Kp + c * 32;  // packs interleaves 128-bit lanes: the permute restores k order
      _mm256_storeu_si256((__m256i*)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(b.q[0], b.q[1]), 0xD8));
      _mm256_storeu_si256((__m256i*)(dst + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(b.q[2], b.q[3]), 0xD8));
      const int64_t at = i * r.nb + c;
      r.d[at] = b.d;
      if (int4) {
        r.sum4[at] = 4 * b.qsum;
        _mm256_storeu_ps(r.xp.data() + at * 8, _mm256_mul_ps(_mm256_set1_ps(b.xsum), pattern));
      }
    }
  return r;
}

// A weight block's rows as int16 vectors per chunk: lo = k 0..15, hi = k 16..31.
struct NibbleRows {  // int4, straight from the packed bytes
  const uint8_t* w;
  inline void row(int64_t c, int j, __m256i& lo, __m256i& hi) const {
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + (c * NB + j) * 16)));
    lo = _mm256_and_si256(q, _mm256_set1_epi16(0xF));
    hi = _mm256_srli_epi16(q, 4);
  }
};
struct Int8Rows {  // int8, straight from the packed bytes
  const int8_t* w;
  inline void row(int64_t c, int j, __m256i& lo, __m256i& hi) const {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (c * NB + j) * 32)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (c * NB + j) * 32 + 16)));
  }
};
struct PanelRows {  // from a block widened once (widen_i16)
  const int16_t* w;
  inline void row(int64_t c, int j, __m256i& lo, __m256i& hi) const {
    lo = _mm256_loadu_si256((const __m256i*)(w + (c * NB + j) * 32));
    hi = _mm256_loadu_si256((const __m256i*)(w + (c * NB + j) * 32 + 16));
  }
};

template <typename Src>
void widen_i16(const Src& src, int64_t nb, int16_t* dst) {
  for (int64_t c = 0; c < nb; ++c)
    for (int j = 0; j < NB; ++j) {
      __m256i lo, hi;
      src.row(c, j, lo, hi);
      _mm256_storeu_si256((__m256i*)(dst + (c * NB + j) * 32), lo);
      _mm256_storeu_si256((__m256i*)(dst + (c * NB + j) * 32 + 16), hi);
    }
}

// A block's int4 group scales as the tiles use them: sz = s0 z0 s1 z1 .. s3 z3, s4 = s0 s1 s2 s3 s0 s1 s2 s3.
struct PackedGroups {  // widened from the bf16 (s, z) pairs as each group starts
  const uint16_t* g;
  inline void next(__m256& sz, __m256& s4) {
    sz = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)g)), 16));
    s4 = _mm256_permutevar8x32_ps(sz, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    g += 2 * NB;
  }
};
struct WidenedGroups {  // read back from widen_groups (steps of 3+ rows: every row tile reads them)
  const float* f;
  inline void next(__m256& sz, __m256& s4) {
    sz = _mm256_loadu_ps(f);
    s4 = _mm256_loadu_ps(f + 8);
    f += 16;
  }
};

void widen_groups(const uint16_t* g, int64_t groups, float* dst) {
  PackedGroups src{g};
  for (int64_t i = 0; i < groups; ++i) {
    __m256 sz, s4;
    src.next(sz, s4);
    _mm256_storeu_ps(dst + i * 16, sz);
    _mm256_storeu_ps(dst + i * 16 + 8, s4);
  }
}

// out[i][j] = row m0 + i of x times row 4b + j of the block, for mb rows; int4: the block's group scales (int8:
// unused).
template <int mb, bool int4, typename Src, typename Groups>
inline void i16_tile(const Src& src, Groups groups, int64_t per_group, const I16Rows& x, int64_t m0,
                     float (*out)[NB]) {
  __m256 acc[mb], off[mb];
  const int16_t* xq[mb];  // this tile's rows, read at chunk c
  const float *d[mb], *xp[mb];
  const int32_t* sum4[mb];
  for (int i = 0; i < mb; ++i) {
    acc[i] = off[i] = _mm256_setzero_ps();
    xq[i] = x.q.data() + (m0 + i) * x.Kp;
    d[i] = x.d.data() + (m0 + i) * x.nb;
    sum4[i] = x.sum4.data() + (m0 + i) * x.nb;
    xp[i] = x.xp.data() + (m0 + i) * x.nb * 8;
  }
  __m256 sz = _mm256_setzero_ps(), s4 = sz;  // the current group's
  const int64_t nb = x.nb;
  for (int64_t c = 0, left = 0; c < nb; ++c, --left) {
    if (int4 && left == 0) {
      groups.next(sz, s4);
      left = per_group;
    }
    __m256i h[mb], pair[mb];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      __m256i lo, hi;
      src.row(c, j, lo, hi);
#pragma GCC unroll 2
      for (int i = 0; i < mb; ++i) {
        const __m256i* xc = (const __m256i*)(xq[i] + c * 32);
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(xc)),
                                             _mm256_madd_epi16(hi, _mm256_loadu_si256(xc + 1)));
        if (j % 2 == 0) pair[i] = dot;
        else if (j == 1) h[i] = _mm256_hadd_epi32(pair[i], dot);
        else h[i] = _mm256_hadd_epi32(h[i], _mm256_hadd_epi32(pair[i], dot));  // r0 r1 r2 r3 | r0 r1 r2 r3
      }
    }
#pragma GCC unroll 2
    for (int i = 0; i < mb; ++i) {
      if constexpr (int4) {
        // each lane: <= 16 * 32767 * 15 + 4 * 32 * 32767 < 2^24, so converted exactly
        const __m256i centred = _mm256_sub_epi32(h[i], _mm256_set1_epi32(sum4[i][c]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s4, _mm256_broadcast_ss(d[i] + c)), acc[i]);
        off[i] = _mm256_fmadd_ps(sz, _mm256_loadu_ps(xp[i] + c * 8), off[i]);
      } else {  // lanes up to 16 * 32767 * 127: the convert rounds to fp32 (the same for every tile)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[i]), _mm256_broadcast_ss(d[i] + c), acc[i]);
      }
    }
  }
  for (int i = 0; i < mb; ++i) {
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    if constexpr (int4) {
      const __m128 o = _mm_hadd_ps(_mm256_castps256_ps128(off[i]), _mm256_extractf128_ps(off[i], 1));
      _mm_storeu_ps(out[i], _mm_add_ps(a, o));
    } else {
      _mm_storeu_ps(out[i], a);
    }
  }
}

// All rows of c's activations times every block: Rows (NibbleRows or Int8Rows) reads block b's weights at
// w + b * stride; int4: sz, the blocks' (s, z) pairs per group of gs. block_bytes (scales included) sizes the tasks.
template <bool int4, typename Rows, typename W>
at::Tensor linear_i16(const W* w, int64_t stride, const uint16_t* sz, int64_t gs, int64_t block_bytes, const Call& c,
                      int64_t M) {
  if (M == 0) return c.y;
  const I16Rows x = quantize_rows_i16<int4>(c.a.p, c.a.ld, M, c.Kp);
  const int64_t nb = c.Kp / 32, groups = int4 ? c.Kp / gs : 0, per_group = int4 ? gs / 32 : 0;
  at::parallel_for(0, c.blocks, block_grain(block_bytes), [&](int64_t b0, int64_t b1) {
    float out[2][NB];
    for (int64_t b = b0; b < b1; ++b) {
      const Rows rows{w + b * stride};
      const PackedGroups g{int4 ? sz + b * groups * NB * 2 : nullptr};
      if (M <= 2) {
        if (M == 2) i16_tile<2, int4>(rows, g, per_group, x, 0, out);
        else i16_tile<1, int4>(rows, g, per_group, x, 0, out);
        c.sink.put(0, int(M), b, out);
        continue;
      }
      thread_local std::vector<int16_t> panel;
      thread_local std::vector<float> scales;
      panel.resize(nb * NB * 32);
      widen_i16(rows, nb, panel.data());
      const PanelRows src{panel.data()};
      if (int4) {
        scales.resize(groups * 16);
        widen_groups(g.g, groups, scales.data());
      }
      const WidenedGroups wg{scales.data()};
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2) {
        i16_tile<2, int4>(src, wg, per_group, x, m0, out);
        c.sink.put(m0, 2, b, out);
      }
      if (m0 < M) {
        i16_tile<1, int4>(src, wg, per_group, x, m0, out);
        c.sink.put(m0, 1, b, out);
      }
    }
  });
  return c.y;
}

}  // namespace
#endif
