// int8 and int4 weights times int16-quantized activations: the AVX2 build's int8/int4 kernels and the AVX-512 builds'
// int4 kernel (256-bit code in both), for every row count they take.
//
// AVX2 has no 16-entry permute, so widening int4 weights to fp32 costs a convert and an FMA per 8 weights (int8: a
// convert), and the float kernels ran at ~10 (int4) cycles per 32 weights (hot, one core) against ~3 here. Each
// activation row is quantized per block of 32 inputs to int16 (q = round(x / d), d = max|x| / 32767: an error of at
// most d / 2 an element, 256x finer than bf16's rounding of the block's largest element).
// int8: a weight row's 32 values times the block are two vpmaddwd (exact int32 pair sums), and four rows' sums are
// folded by two vphaddd into one vector (each row's in two lanes), converted once and scaled by d (the row scale is
// the sink's).
// int4: one 256-bit load holds two rows' 32 nibbles; read as 16-bit lanes, each lane holds 4 nibbles (k = 2l,
// 2l + 16, 2l + 1, 2l + 17 of the row, from the packing's byte i = k i | k i+16), so a shift and a mask give four
// vectors of 16-bit weights with no shuffle, the first row in the low 128 bits and the second in the high. The
// activations are stored in that order (8 values a vector, both halves read by one broadcast load), four vpmaddwd
// per two rows, and one vphaddd folds four rows into one vector (r0 r0 r2 r2 | r1 r1 r3 r3), scaled by s * d with
// the group scales permuted to match. Nibbles q are unsigned: the vector less 4 sum(xq) a lane makes the products
// xq (q - 8), so the rounding error meets the centred weight (half what q alone gives); the zero point's term,
// z sum_k x_k, uses the block's exact float sum X. Integer sums are exact in any order and the float steps are the
// same for every tile, so a row's result does not depend on the batch: steps of up to TILE_ROWS rows widen the
// weights in registers, larger ones widen each weight block once into an int16 panel that every row tile reads.
#pragma once
#include <type_traits>
#include <vector>

namespace {

// Activation rows per block of 32 inputs (round_block, qdot.h): q as int16 [M][Kp] (int4: in nibble order, above),
// d [M][nb]; int4: 4 sum(q) and the block's float sum X [M][nb].
struct I16Rows {
  std::vector<int16_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> sum4;
  int64_t Kp = 0, nb = 0;
};

// int4 also needs 4 sum(q) and X per block (the centring and the zero point's term); int8 does not. int4 steps of
// more than TILE_ROWS rows (`panel`) store each block as the panel tiles read it instead: (k 0 2 4 6 16 18 20 22 |
// 8 10 12 14 24 26 28 30) then the same with k + 1, which gives each of a row's two lanes the same inputs as in
// nibble_tile.
template <bool int4>
I16Rows quantize_rows_i16(const float* x, int64_t ldx, int64_t M, int64_t Kp, bool panel) {
  I16Rows r;
  r.Kp = Kp;
  r.nb = Kp / 32;
  r.q.resize(M * Kp);
  r.d.resize(M * r.nb);
  if (int4) {
    r.sum4.resize(M * r.nb);
    r.xsum.resize(M * r.nb);
  }
  const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // per 8 inputs: even k, then odd k
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < r.nb; ++c) {
      const RoundedBlock b = round_block(x + i * ldx + c * 32, 32767.0f);
      int16_t* dst = r.q.data() + i * Kp + c * 32;
      const int64_t at = i * r.nb + c;
      r.d[at] = b.d;
      if (int4) {
        __m256i e[4];
        for (int j = 0; j < 4; ++j) e[j] = _mm256_permutevar8x32_epi32(b.q[j], evens_first);
        // packs works per 128-bit half: (e0, e1) gives (evens of k 0-15 | odds), (e0, e2) (evens of k 0-7 and
        // 16-23 | odds of them)
        const __m256i lo = _mm256_packs_epi32(e[0], panel ? e[2] : e[1]);
        const __m256i hi = _mm256_packs_epi32(panel ? e[1] : e[2], e[3]);
        _mm256_storeu_si256((__m256i*)dst, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i*)(dst + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        r.sum4[at] = 4 * b.qsum;
        r.xsum[at] = b.xsum;
      } else {  // packs interleaves 128-bit lanes: the permute restores k order
        _mm256_storeu_si256((__m256i*)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(b.q[0], b.q[1]), 0xD8));
        _mm256_storeu_si256((__m256i*)(dst + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(b.q[2], b.q[3]), 0xD8));
      }
    }
  return r;
}

// Steps of 1-2 rows read each weight chunk once, straight from memory, and ask for the bytes 4 KB ahead as they go:
// with that, a W2 decode step took 0.92x the time on an AVX2 EPYC, int4 and int8 alike (benchmarks/kernel_step_ab.py:
// median of 12 in-process pairs each, every pair below 1). The bf16 kernel does the same (linear.cpp, Dense), the
// fp32 one does not (1.12x with it). The distance: PREFETCH_AHEAD (simd.h).

// int4: rows 2p and 2p + 1 of a weight block's chunk c as four int16 vectors in nibble order (header), straight
// from the packed bytes: v[t] holds 8 values of row 2p (low half) and the same 8 of row 2p + 1 (high half).
struct NibblePairs {
  const uint8_t* w;
  // Asks for the chunk's 64 bytes 4 KB ahead (this block's later chunks or the next blocks'), as Int8Rows does.
  inline void prefetch(int64_t c) const {
    _mm_prefetch(reinterpret_cast<const char*>(w + c * NB * 16 + PREFETCH_AHEAD), _MM_HINT_T0);
  }
  inline void pair(int64_t c, int p, __m256i v[4]) const {
    const __m256i m = _mm256_set1_epi16(0xF);
    const __m256i q = _mm256_loadu_si256((const __m256i*)(w + (c * NB + 2 * p) * 16));
    v[0] = _mm256_and_si256(q, m);
    v[1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(q, 8), m);
    v[3] = _mm256_srli_epi16(q, 12);
  }
};

// int4 steps of 3+ rows: the block widened once into PanelRows' layout (lo, hi a row and chunk), each half of a
// row's vectors holding the inputs of one of nibble_tile's two lanes for that row (quantize_rows_i16's `panel`).
inline void widen_nibble_rows(const NibblePairs& src, int64_t nb, int16_t* dst) {
  for (int64_t c = 0; c < nb; ++c)
    for (int p = 0; p < 2; ++p) {
      __m256i v[4];
      src.pair(c, p, v);
      __m256i* row0 = (__m256i*)(dst + (c * NB + 2 * p) * 32);
      __m256i* row1 = (__m256i*)(dst + (c * NB + 2 * p + 1) * 32);
      for (int h = 0; h < 2; ++h) {  // v0, v1 -> lo; v2, v3 -> hi
        const __m256i a = _mm256_unpacklo_epi64(v[2 * h], v[2 * h + 1]), b = _mm256_unpackhi_epi64(v[2 * h], v[2 * h + 1]);
        _mm256_storeu_si256(row0 + h, _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256(row1 + h, _mm256_permute2x128_si256(a, b, 0x31));
      }
    }
}

// A block's int4 group scales from its bf16 pairs s0 z0 s1 z1 .. s3 z3, each pair a 32-bit lane: z is its high
// half, s its low one shifted up; both halves of s and z hold s0 s1 s2 s3 and z0 z1 z2 z3 (i16_tile's lanes).
inline void group_scales(const uint16_t* g, __m256& s, __m256& z) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)g));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// nibble_tile's: s permuted within each half to s0 s0 s2 s2 | s1 s1 s3 s3, the rows' lanes after its fold.
struct PackedGroups {  // from the bf16 pairs as each group starts
  const uint16_t* g;
  inline void next(__m256& s, __m256& z) {
    group_scales(g, s, z);
    s = _mm256_permutevar_ps(s, _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3));
    g += 2 * NB;
  }
};
struct WidenedGroups {  // i16_tile's (steps of 3+ rows): group_scales' s and z, widened once a block (widen_groups)
  const float* f;
  inline void next(__m256& s, __m256& z) {
    s = _mm256_loadu_ps(f);
    z = _mm256_loadu_ps(f + 8);
    f += 16;
  }
};

void widen_groups(const uint16_t* g, int64_t groups, float* dst) {
  for (int64_t i = 0; i < groups; ++i, g += 2 * NB) {
    __m256 s, z;
    group_scales(g, s, z);
    _mm256_storeu_ps(dst + i * 16, s);
    _mm256_storeu_ps(dst + i * 16 + 8, z);
  }
}

// int4, steps of up to TILE_ROWS rows: out[i][j] = row m0 + i of x times row 4b + j of the block, the weights
// widened in registers (for each pair of rows again: the block is in L1 after the first).
template <int mb>
inline void nibble_tile(const NibblePairs& src, PackedGroups groups, int64_t per_group, const I16Rows& x, int64_t m0,
                        float (*out)[NB]) {
  __m256 acc[mb], off[mb];
  for (int i = 0; i < mb; ++i) acc[i] = off[i] = _mm256_setzero_ps();
  __m256 s = _mm256_setzero_ps(), z = s;  // the current group's
  const int64_t nb = x.nb;
  for (int64_t c = 0, left = 0; c < nb; ++c, --left) {
    if (left == 0) {
      groups.next(s, z);
      left = per_group;
    }
    __m256i two[2][mb];  // per pair of rows: (first row x4 | second row x4) partial sums
    src.prefetch(c);
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
      __m256i v[4];
      src.pair(c, p, v);
#pragma GCC unroll 2
      for (int i = 0; i < mb; ++i) {  // activation vectors re-read per pair: fewer live registers at 2 rows
        const __m128i* xc = (const __m128i*)(x.q.data() + (m0 + i) * x.Kp + c * 32);
        __m256i prod[4];
        for (int t = 0; t < 4; ++t) prod[t] = _mm256_madd_epi16(v[t], _mm256_broadcastsi128_si256(_mm_loadu_si128(xc + t)));
        two[p][i] = _mm256_add_epi32(_mm256_add_epi32(prod[0], prod[1]), _mm256_add_epi32(prod[2], prod[3]));
      }
    }
#pragma GCC unroll 2
    for (int i = 0; i < mb; ++i) {
      // r0 r0 r2 r2 | r1 r1 r3 r3 (k 0-7 and 16-23, then 8-15 and 24-31, of each row), each lane
      // <= 16 * 32767 * 15 + 4 * 32 * 32767 < 2^24, so converted exactly
      const __m256i h = _mm256_hadd_epi32(two[0][i], two[1][i]);
      const int64_t at = (m0 + i) * x.nb + c;
      const __m256i centred = _mm256_sub_epi32(h, _mm256_set1_epi32(x.sum4[at]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(x.d[at])), acc[i]);
      off[i] = _mm256_fmadd_ps(z, _mm256_set1_ps(x.xsum[at]), off[i]);
    }
  }
  for (int i = 0; i < mb; ++i) {
    const __m128 r = _mm_hadd_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));  // r0 r2 r1 r3
    const __m128 a = _mm_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_ps(out[i], _mm_add_ps(a, _mm256_castps256_ps128(off[i])));  // off's halves are equal
  }
}

// int8: a weight block's rows as int16 vectors per chunk: lo = k 0..15, hi = k 16..31.
struct Int8Rows {  // straight from the packed bytes
  const int8_t* w;
  inline void prefetch(int64_t c) const {  // the chunk's 128 bytes 4 KB ahead
    _mm_prefetch(reinterpret_cast<const char*>(w + c * NB * 32 + PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + c * NB * 32 + PREFETCH_AHEAD + 64), _MM_HINT_T0);
  }
  inline void row(int64_t c, int j, __m256i& lo, __m256i& hi) const {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (c * NB + j) * 32)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (c * NB + j) * 32 + 16)));
  }
};
struct PanelRows {  // from a block widened once (widen_i16)
  const int16_t* w;
  inline void prefetch(int64_t) const {}  // the panel is in cache
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

// out[i][j] = row m0 + i of x times row 4b + j of the block, for mb rows; int4 (steps of 3+ rows, widened by
// widen_nibble_rows): with the block's group scales, each lane the same FMAs as its lane in nibble_tile.
template <int mb, bool int4, typename Src>
inline void i16_tile(const Src& src, WidenedGroups groups, int64_t per_group, const I16Rows& x, int64_t m0,
                     float (*out)[NB]) {
  __m256 acc[mb], off[mb];
  const int16_t* xq[mb];  // this tile's rows, read at chunk c
  for (int i = 0; i < mb; ++i) {
    acc[i] = off[i] = _mm256_setzero_ps();
    xq[i] = x.q.data() + (m0 + i) * x.Kp;
  }
  __m256 s = _mm256_setzero_ps(), z = s;  // int4: the current group's
  const int64_t nb = x.nb;
  for (int64_t c = 0, left = 0; c < nb; ++c, --left) {
    if (int4 && left == 0) {
      groups.next(s, z);
      left = per_group;
    }
    __m256i h[mb], pair[mb];
    src.prefetch(c);
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
      const int64_t at = (m0 + i) * x.nb + c;
      if constexpr (int4) {
        const __m256i centred = _mm256_sub_epi32(h[i], _mm256_set1_epi32(x.sum4[at]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(x.d[at])), acc[i]);
        off[i] = _mm256_fmadd_ps(z, _mm256_set1_ps(x.xsum[at]), off[i]);
      } else {  // lanes up to 16 * 32767 * 127: the convert rounds to fp32 (the same for every tile)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[i]), _mm256_set1_ps(x.d[at]), acc[i]);
      }
    }
  }
  for (int i = 0; i < mb; ++i) {
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    _mm_storeu_ps(out[i], int4 ? _mm_add_ps(a, _mm256_castps256_ps128(off[i])) : a);
  }
}

// Steps of up to TILE_ROWS rows widen the weights in registers for every pair of rows (nibble_tile, i16_tile over
// Int8Rows; the block is in L1 after the first pair), larger ones widen each block once into an int16 panel
// (i16_tile over PanelRows). The 48 decoder linears of the 124.7M model, cold, against panels from 3 rows (Zen 4
// EPYC, AVX2 build, fp32 / bf16 activations): int4 3 rows 0.66x / 0.70x the time, 4 rows 0.70x / 0.73x, 8 rows
// 0.85x / 0.85x, 16 rows 0.98x / 1.01x, 32 rows 0.99x / 1.02x, 64 rows 1.09x / 1.07x; int8 3 rows 0.72x / 0.73x,
// 8 rows 0.75x / 0.75x, 16 rows 0.85x / 0.86x, 24 rows 0.94x / 0.96x, 32 rows 0.98x, 64 rows 1.03x.
constexpr int64_t TILE_ROWS = 16;

// Rows [0, M) of block b by tiles of two rows and one for an odd last row: tile(mb, m0) writes out, the sink stores
// it. `tile` takes mb as a std::integral_constant, so each tile size is its own instantiation.
template <typename Tile>
inline void by_row_pairs(int64_t M, int64_t b, const Sink& sink, float (*out)[NB], Tile tile) {
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) {
    tile(std::integral_constant<int, 2>{}, m0);
    sink.put(m0, 2, b, out);
  }
  if (m0 < M) {
    tile(std::integral_constant<int, 1>{}, m0);
    sink.put(m0, 1, b, out);
  }
}

// All rows of c's activations times every block: block b's weights at w + b * stride (int4: nibbles with sz, the
// blocks' (s, z) pairs per group of gs; int8: bytes). block_bytes (scales included) sizes the tasks.
template <bool int4, typename W>
at::Tensor linear_i16(const W* w, int64_t stride, const uint16_t* sz, int64_t gs, int64_t block_bytes, const Call& c,
                      int64_t M) {
  if (M == 0) return c.y;
  const bool tiles = M <= TILE_ROWS;
  const I16Rows x = quantize_rows_i16<int4>(c.a.p, c.a.ld, M, c.Kp, !tiles);
  const int64_t nb = c.Kp / 32, groups = int4 ? c.Kp / gs : 0, per_group = int4 ? gs / 32 : 0;
  at::parallel_for(0, c.blocks, block_grain(block_bytes), [&](int64_t b0, int64_t b1) {
    float out[2][NB];
    thread_local std::vector<int16_t> panel;
    thread_local std::vector<float> scales;
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* g = int4 ? sz + b * groups * NB * 2 : nullptr;
      if constexpr (int4) {
        const NibblePairs rows{reinterpret_cast<const uint8_t*>(w) + b * stride};
        if (tiles) {
          by_row_pairs(M, b, c.sink, out, [&](auto mb, int64_t m0) {
            nibble_tile<decltype(mb)::value>(rows, PackedGroups{g}, per_group, x, m0, out);
          });
          continue;
        }
        panel.resize(nb * NB * 32);
        widen_nibble_rows(rows, nb, panel.data());
        scales.resize(groups * 16);
        widen_groups(g, groups, scales.data());
      } else {
        const Int8Rows rows{reinterpret_cast<const int8_t*>(w) + b * stride};
        if (tiles) {
          by_row_pairs(M, b, c.sink, out, [&](auto mb, int64_t m0) {
            i16_tile<decltype(mb)::value, false>(rows, WidenedGroups{nullptr}, 0, x, m0, out);
          });
          continue;
        }
        panel.resize(nb * NB * 32);
        widen_i16(rows, nb, panel.data());
      }
      const PanelRows src{panel.data()};
      const WidenedGroups wg{scales.data()};
      by_row_pairs(M, b, c.sink, out, [&](auto mb, int64_t m0) {
        i16_tile<decltype(mb)::value, int4>(src, wg, per_group, x, m0, out);
      });
    }
  });
  return c.y;
}

}  // namespace
