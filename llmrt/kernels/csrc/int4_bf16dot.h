// int4 weights times bfloat16 activations with AVX512-BF16's vdpbf16ps, over linear.cpp's packed int4 layout as
// it is (4-row blocks of 32-input chunks, 16 bytes per row: byte c = q[c] | q[c + 16] << 4; a bf16 (scale, zero)
// per row and group). Included by linear.cpp in the AVX-512 builds only; compiled for AVX512-BF16 by a target
// pragma and called only where the CPU has it (Python checks the flag), so the builds still load on others.
//
// Why: the float kernel of the time (since replaced by int_i16.h's int16 one) widened every nibble to fp32 through
// two 16-entry permutes and a zero-extension per 32 weights; on a 2-core Zen 4 those shuffles, not memory, bound
// int4 decode (int4 GEMVs slower than int8's). Here a nibble becomes a bf16 with no table: 0x4300 | q is the bf16
// of 128 + q (bf16's unit step at 128 is 1), and a chunk's 64 bytes read as 16-bit lanes give all four rows'
// nibbles by shifts and masks alone (no widening or cross-lane shuffle: 0.83-0.88x the time of the earlier
// per-row-pair zero-extension on the 124.7M model's layers, 1-4 rows); the products x * (128 + q) are exact in
// fp32. Per group:
//   sum_k x_k w_k = s * sum_k x_k (128 + q_k) + (z - 136 s) * sum_k x_k      (w = (q - 8) s + z)
// The activations are bf16 already (bf16 models) and are used as they are (int_i16.h rounds them to int16). Every
// row is computed the same way whatever the number of rows (tiles of up to 4 re-read the block from L1), so a
// row's result does not depend on the batch.
#pragma once

#if defined(LLMRT_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512bw,avx512f,avx512vl,avx512dq")
#include <immintrin.h>

namespace {


// A chunk's 64 bytes (4 rows x 16) read as 32 uint16 lanes hold four nibbles each: lane j of row r (lanes
// 8r..8r+7, j' = j - 8r) has q[2j'] in bits 0-3, q[2j'+16] in 4-7, q[2j'+1] in 8-11 and q[2j'+17] in 12-15. So
// one load and a shift and a mask per "plane" give all four rows' weights as bf16 (0x4300 | q), no zero-extension
// or permute, and one vdpbf16ps per plane serves the 4 rows (fp32 lanes 4r..4r+3 sum row r's products). The
// activations each plane needs, x[0,2,..,14], x[16,18,..,30], x[1,3,..,15], x[17,19,..,31], are stored per chunk
// as 4 x 8 bf16 (the chunk's 64 bytes reordered) and broadcast to the 4 rows by the load. Also each group's sum of
// x (fp32), four times over (gsum[4g + r] for the 4 weight rows), in whole vectors of 4 groups (zeros past the
// last): the offset terms of 4 groups take one FMA per block (offsets()).
struct PlaneRows {
  std::vector<uint16_t> x;
  std::vector<float> gsum;
  int64_t chunks = 0, groups = 0, gvecs = 0;  // gvecs: 16-float vectors of group sums per row
};

PlaneRows plane_rows(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int64_t gs) {
  static constexpr int first[4] = {0, 16, 1, 17};
  PlaneRows d;
  d.chunks = Kp / 32;
  d.groups = Kp / gs;
  d.x.assign(M * d.chunks * 32, 0);
  d.gvecs = (d.groups + 3) / 4;
  d.gsum.assign(M * d.gvecs * 16, 0.0f);
  for (int64_t i = 0; i < M; ++i) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x + i * ldx);
    uint16_t* dst = d.x.data() + i * d.chunks * 32;
    for (int64_t c = 0; c < d.chunks; ++c)
      for (int pl = 0; pl < 4; ++pl)
        for (int t = 0; t < 8; ++t) {
          const int64_t k = c * 32 + first[pl] + 2 * t;
          dst[c * 32 + pl * 8 + t] = k < K ? src[k] : 0;
        }
    for (int64_t g = 0; g < d.groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * gs; k < std::min<int64_t>(K, (g + 1) * gs); ++k) s += to_f(src[k]);
      for (int r = 0; r < 4; ++r) d.gsum[(i * d.gvecs * 4 + g) * 4 + r] = s;
    }
  }
  return d;
}

// The offset term (z - 136 s) * sum_k x_k of every group of block b, summed per row: 4 groups' 16 (scale, zero)
// pairs are one 64-byte load (lane 4g + r: s in the low, z in the high half), their offsets one FMA, times the
// groups' sums one more. In the group loop these took 4 ops per group (12% of the 1-row GEMV at group 32).
// Returns per activation row a vector whose lanes 4r..4r+3 sum to row r's offset (lane 4r holds it, the others 0),
// to be added to the products' lanes.
template <int mb>
inline void offsets(const Int4& l, int64_t b, const PlaneRows& d, int64_t m0, __m512* off) {
  const uint16_t* g = l.sz + b * d.groups * NB * 2;
  const __m512 k136 = _mm512_set1_ps(136.0f);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 acc[mb];
  for (int i = 0; i < mb; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t v = 0; v < d.gvecs; ++v) {
    const int64_t left = d.groups - 4 * v;  // groups in this vector (the last may hold fewer)
    const __mmask16 m = left >= 4 ? __mmask16(0xFFFF) : __mmask16((1u << (4 * left)) - 1);
    const __m512i pairs = _mm512_maskz_loadu_epi32(m, g + 32 * v);
    const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
    const __m512 o = _mm512_fnmadd_ps(sv, k136, zv);  // z - 136 s
    for (int i = 0; i < mb; ++i)
      acc[i] = _mm512_fmadd_ps(o, _mm512_loadu_ps(d.gsum.data() + ((m0 + i) * d.gvecs + v) * 16), acc[i]);
  }
  // Lanes 4g + r -> the sum over g in every lane of row r, then row r's into lane 4r alone.
  const __m512i to_4r = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int i = 0; i < mb; ++i) {
    __m512 a = _mm512_add_ps(acc[i], _mm512_shuffle_f32x4(acc[i], acc[i], 0x4E));  // + the group 2 apart
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1));                         // + the neighbouring group
    off[i] = _mm512_maskz_permutexvar_ps(__mmask16(0x1111), to_4r, a);
  }
}

// A chunk's 64 bytes as the four planes' bf16 weights of its 4 rows: (v & 0xF) | 0x4300 per plane, one vpternlog
// (imm 0xEA = (A & B) | C) after the plane's shift.
inline void nibble_planes(const uint8_t* p, __m512bh q[4]) {
  const __m512i magic = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000F);
  const __m512i w = _mm512_loadu_si512(p);
  q[0] = (__m512bh)_mm512_ternarylogic_epi32(w, low, magic, 0xEA);
  q[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low, magic, 0xEA);
  q[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low, magic, 0xEA);
  q[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), magic);
}

// The four planes' activations of chunk c of a row (PlaneRows' order), each broadcast to the 4 weight rows.
inline void plane_x(const uint16_t* xrow, int64_t c, __m512bh x[4]) {
  for (int pl = 0; pl < 4; ++pl)
    x[pl] = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xrow + c * 32 + pl * 8)));
}

// A group's scales of the 4 rows, lanes 4r..4r+3 holding row r's, from its (s, z) pairs s0 z0 .. s3 z3 (bf16):
// broadcast to the 4 128-bit lanes, lane r picks s_r into the high half of each of its 4 fp32 lanes by an in-lane
// byte shuffle (-1: a zero byte). Cross-lane widening and permutes cost more than the group's products on Zen 4.
inline __m512 group_s(const uint16_t* g) {
  const __m512i pick_s = _mm512_set_epi8(
      13, 12, -1, -1, 13, 12, -1, -1, 13, 12, -1, -1, 13, 12, -1, -1, 9, 8, -1, -1, 9, 8, -1, -1, 9, 8, -1, -1, 9, 8, -1, -1,
      5, 4, -1, -1, 5, 4, -1, -1, 5, 4, -1, -1, 5, 4, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1);
  return _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)g)), pick_s));
}

// Block b of the int4 matrix times rows m0..m0+mb of d: out[i][j] = sum_k x[i, k] w[4b + j, k]. Each row gets
// the same operations in the same order whatever mb is (no per-tile restructuring: a row's result must not
// depend on the batch).
template <int mb>
inline void bd_tile(const Int4& l, int64_t b, const PlaneRows& d, int64_t m0, float (*out)[NB]) {
  const uint8_t* p = l.w + b * l.Kp * NB / 2;
  const uint16_t* g = l.sz + b * (l.Kp / l.gs) * NB * 2;
  const int64_t per_group = l.gs / 32;
  const uint16_t* xr[mb];
  for (int i = 0; i < mb; ++i) xr[i] = d.x.data() + (m0 + i) * d.chunks * 32;
  __m512 tot[mb];
  offsets<mb>(l, b, d, m0, tot);
  for (int64_t gi = 0; gi < d.groups; ++gi, g += 2 * NB) {
    __m512 acc[mb];
    for (int i = 0; i < mb; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = gi * per_group; c < (gi + 1) * per_group; ++c, p += NB * 16) {
      __m512bh q[4];
      nibble_planes(p, q);
      for (int i = 0; i < mb; ++i) {
        __m512bh x[4];
        plane_x(xr[i], c, x);
        for (int pl = 0; pl < 4; ++pl) acc[i] = _mm512_dpbf16_ps(acc[i], q[pl], x[pl]);
      }
    }
    const __m512 s = group_s(g);  // with a 32-weight group this runs per chunk
    for (int i = 0; i < mb; ++i) tot[i] = _mm512_fmadd_ps(acc[i], s, tot[i]);
  }
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < NB; ++j) out[i][j] = _mm512_mask_reduce_add_ps(__mmask16(0xF << (4 * j)), tot[i]);
}

// One activation row times 4 consecutive blocks (16 weight rows): a decode step's GEMV. Per block the operations
// of bd_tile<1> in its order (a row's result must not depend on the batch), interleaved over the blocks, so that
// a chunk's 4 activation broadcasts serve 4 blocks and 4 groups' dependent chains overlap: at one row bd_tile<1>
// took ~4.2 ns a 64-byte chunk on each core cache-hot (~11 cycles at the 2.6 GHz the VM reports) for ~16 vector
// ops, most of them 512-bit (two a cycle at best on Zen 4). Cache-hot, 0.83-0.88x bd_tile<1>'s time on the 124.7M
// model's shapes. The 4 blocks are 4 streams 2 Kp bytes apart, which the hardware prefetcher followed poorly from
// memory (1.4x slower than bd_tile<1> streamed); a software prefetch of the next tile's blocks in address order, a
// line per block and chunk, makes it 0.89x streamed (row1_blocks starts the first tile's).
inline void bd_row4(const Int4& l, int64_t b, const PlaneRows& d, float (*out)[NB]) {
  constexpr int nb = 4;
  const int64_t bstride = l.Kp * NB / 2, gstride = (l.Kp / l.gs) * NB * 2;
  const uint8_t* p = l.w + b * bstride;
  // The next tile's blocks, prefetched in address order (past the last block: a prefetch does not fault).
  const uintptr_t next = reinterpret_cast<uintptr_t>(p) + nb * bstride;
  const uint16_t* g = l.sz + b * gstride;
  const int64_t per_group = l.gs / 32;
  __m512 tot[nb];
  for (int k = 0; k < nb; ++k) offsets<1>(l, b + k, d, 0, &tot[k]);
  for (int64_t gi = 0; gi < d.groups; ++gi, g += 2 * NB) {
    __m512 acc[nb];
    for (int k = 0; k < nb; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t c = gi * per_group; c < (gi + 1) * per_group; ++c, p += NB * 16) {
      __m512bh x[4];
      plane_x(d.x.data(), c, x);
      for (int k = 0; k < nb; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(next + (c * nb + k) * 64), _MM_HINT_T0);
        __m512bh q[4];
        nibble_planes(p + k * bstride, q);
        for (int pl = 0; pl < 4; ++pl) acc[k] = _mm512_dpbf16_ps(acc[k], q[pl], x[pl]);
      }
    }
    for (int k = 0; k < nb; ++k) tot[k] = _mm512_fmadd_ps(acc[k], group_s(g + k * gstride), tot[k]);
  }
  // The 16 four-lane sums at once, added in _mm512_mask_reduce_add_ps's order ((l0 + l2) + (l1 + l3)): per 128-bit
  // lane j, [a0+a2, b0+b2, a1+a3, b1+b3] for blocks a, b, then for c, d, then lane 4j + k = block k's row j.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(tot[0], tot[1]), _mm512_unpackhi_ps(tot[0], tot[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(tot[2], tot[3]), _mm512_unpackhi_ps(tot[2], tot[3]));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  alignas(64) float v[16];
  _mm512_store_ps(v, r);
  for (int k = 0; k < nb; ++k)
    for (int j = 0; j < NB; ++j) out[k][j] = v[4 * j + k];
}

// Whether one row takes the 4-block tiles: not where the blocks lie a multiple of 4 KiB apart, where the 4 streams
// and their prefetches share one 8-way L1 set (down_proj at K = 2048 took 1.08x bd_tile<1>'s time).
inline bool row_tiles(const Int4& l) { return (l.Kp * NB / 2) % 4096 != 0; }

// One row times blocks b0..b1: 4-block tiles, the rest by bd_tile<1>. The first tile's lines are prefetched at
// once (each tile prefetches the next; the first one's 4 streams would start cold).
inline void row1_blocks(const Int4& l, const PlaneRows& d, int64_t b0, int64_t b1, const Sink& sink) {
  const int64_t bstride = l.Kp * NB / 2;
  const char* first = reinterpret_cast<const char*>(l.w + b0 * bstride);
  for (int64_t o = 0; o < std::min<int64_t>(4, b1 - b0) * bstride; o += 64) _mm_prefetch(first + o, _MM_HINT_T0);
  float out[4][NB];  // a row per block
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4) {
    bd_row4(l, b, d, out);
    for (int k = 0; k < 4; ++k) sink.put(0, 1, b + k, out + k);
  }
  for (; b < b1; ++b) {
    bd_tile<1>(l, b, d, 0, out);
    sink.put(0, 1, b, out);
  }
}

at::Tensor linear_int4_bf16dot(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sz, int64_t group_size,
                               int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "llmrt kernels: linear_int4_bf16dot wants bfloat16 [rows, in_features] with unit column stride");
  const Int4 l = int4_layout(wp, sz, group_size);
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0);
  TORCH_CHECK((n + NB - 1) / NB == blocks && K <= l.Kp && K > l.Kp - group_size, "llmrt kernels: x ", x.sizes(),
              " or n ", n, " does not match the packed int4 matrix ", wp.sizes());
  at::Tensor y = at::empty({M, n}, x.options());
  const Sink sink = sink_for(y, bias);
  const PlaneRows d = plane_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, l.Kp, group_size);
  const int64_t block_bytes = NB * (l.Kp / 2 + l.Kp / group_size * 4);
  if (M == 1 && row_tiles(l)) {
    at::parallel_for(0, blocks, block_grain(block_bytes),
                     [&](int64_t b0, int64_t b1) { row1_blocks(l, d, b0, b1, sink); });
  } else {
    q_all_blocks(M, blocks, block_bytes, sink, [&](auto mb, int64_t b, int64_t m0, float (*out)[NB]) {
      bd_tile<decltype(mb)::value>(l, b, d, m0, out);
    });
  }
  return y;
}

}  // namespace

#pragma GCC pop_options
#endif
