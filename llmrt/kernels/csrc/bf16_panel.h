// What the batched int8/int4 x bf16 kernels share (AMX tiles in amx.h, AVX512-BF16's vdpbf16ps in bf16_gemm.h): the
// activations packed once per call in bf16 pairs, 16 weight rows at a time dequantized into a small L1/L2-resident
// bf16 panel, and the results written back from [16 n][16 m] blocks. Included by linear.cpp in the AVX-512 builds
// only; compiled for AVX512-BF16 by a target pragma and called only where the CPU has it (Python checks the flags).
//
// Panels: int4 the values the dequantize+GEMM path computes (fp32 q*s + (z - 8s) rounded to nearest bf16); int8
// q itself (exact in bf16), its row scale applied to the results. So the packed weights are read once per step
// whatever the number of rows, and a row's result is the same sequence of products whatever else is in the batch.
#pragma once

#include <memory>

#if defined(LLMRT_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512bw,avx512f,avx512vl,avx512dq")
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int AT_N = 16;  // weight rows per A tile (4 packed blocks)
constexpr int AT_K = 32;  // inputs per tile product (64 bytes of bf16 a row)
constexpr int AT_M = 16;  // activation rows per B / C tile

// r[0..15] as the rows of a 16 x 16 matrix of 32-bit elements -> r[j] = its column j (four shuffle stages).
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16], c[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      c[8 * h + j] = _mm512_shuffle_i32x4(b[8 * h + j], b[8 * h + j + 4], 0x88);
      c[8 * h + j + 4] = _mm512_shuffle_i32x4(b[8 * h + j], b[8 * h + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(c[j], c[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(c[j], c[j + 8], 0xdd);
  }
}

// x [M, K] bf16 as B tiles: [Mt][Kt][16 k'][16 m] pairs (uint32), rows past M and inputs past K zero, each tile
// row (16 rows x Kp) followed by pad uint32s (never read, left unset). Each tile is 16 rows' 64-byte chunks
// (masked loads past K) transposed as 32-bit pairs. Not zero-filled first: every word read is written here, and
// zero-filling the whole buffer on the calling thread (a std::vector) was ~4% of a 768 x 768 layer's samples at
// 1024 rows on 2 threads (perf), with the other thread waiting in libgomp as long.
std::unique_ptr<uint32_t[]> vnni_activations(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp,
                                             int64_t pad = 0) {
  const int64_t Mt = (M + AT_M - 1) / AT_M, Kt = Kp / AT_K, tstride = Kt * AT_M * 16 + pad;
  std::unique_ptr<uint32_t[]> xb(new uint32_t[Mt * tstride]);
  at::parallel_for(0, Mt * Kt, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mt = t / Kt, kt = t % Kt, have = std::min<int64_t>(AT_K, std::max<int64_t>(0, K - kt * AT_K));
      const __mmask32 cols = have == AT_K ? ~__mmask32(0) : __mmask32((1ull << have) - 1);
      __m512i r[16];
      for (int m = 0; m < AT_M; ++m)
        r[m] = mt * AT_M + m < M ? _mm512_maskz_loadu_epi16(cols, x + (mt * AT_M + m) * ldx + kt * AT_K)
                                 : _mm512_setzero_si512();
      transpose16(r);
      uint32_t* dst = xb.get() + mt * tstride + kt * AT_M * 16;
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(dst + k * AT_M, r[k]);
    }
  });
  return xb;
}

// Weight panels: 16 rows (blocks b0..b0+3, missing ones zero) as bf16 A tiles [Kp/32][16 rows][32], each tile one
// contiguous KB (a strided panel put 16 rows of a K = 2048 layer 4 KB apart, in one L1 set).
inline uint16_t* a_row(uint16_t* a, int64_t c, int row) { return a + (c * AT_N + row) * AT_K; }
inline const uint16_t* a_row(const uint16_t* a, int64_t c, int row) { return a + (c * AT_N + row) * AT_K; }

// A panel source says its padded inputs (kp), its packed 4-row blocks, where a panel's packed bytes are, and fills a
// panel: the batched drivers (amx.h, bf16_gemm.h) take everything else from it.
struct Int4Panel {
  Int4 l;
  int64_t blocks;
  int64_t kp() const { return l.Kp; }
  const float* row_scale() const { return nullptr; }
  // the packed bytes of the panel at block b0 (its weights are contiguous; the scales are ~1/16 of them)
  const char* packed(int64_t b0) const { return reinterpret_cast<const char*>(l.w + b0 * l.Kp * NB / 2); }
  int64_t packed_bytes() const { return AT_N * l.Kp / 2; }
  int64_t bytes() const { return AT_N * (l.Kp / 2 + l.Kp / l.gs * 4); }  // with the scales and zeros
  void fill(int64_t b0, uint16_t* a) const {
    const __m512i low = _mm512_set1_epi32(0xF);
    const int64_t groups = l.Kp / l.gs, per_group = l.gs / AT_K;
    for (int bi = 0; bi < 4; ++bi) {
      if (b0 + bi >= blocks) {
        for (int64_t c = 0; c < l.Kp / AT_K; ++c) std::memset(a_row(a, c, bi * NB), 0, NB * AT_K * sizeof(uint16_t));
        continue;
      }
      const uint8_t* p = l.w + (b0 + bi) * l.Kp * NB / 2;
      const uint16_t* g = l.sz + (b0 + bi) * groups * NB * 2;
      for (int64_t gi = 0; gi < groups; ++gi, g += 2 * NB) {
        // the 4 rows' (scale, zero) bf16 pairs as fp32 lanes 0..7, each broadcast by a permute (scalar loads
        // and broadcasts per row cost as much as the group's dequantization)
        const __m512 sz = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)g))), 16));
        __m512 s[NB], o[NB];
        for (int j = 0; j < NB; ++j) {
          s[j] = _mm512_permutexvar_ps(_mm512_set1_epi32(2 * j), sz);
          o[j] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[j], _mm512_permutexvar_ps(_mm512_set1_epi32(2 * j + 1), sz));
        }
        for (int64_t c = gi * per_group; c < (gi + 1) * per_group; ++c, p += NB * 16)
          for (int j = 0; j < NB; ++j) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + j * 16)));
            const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s[j], o[j]);
            const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s[j], o[j]);
            _mm512_storeu_si512(a_row(a, c, bi * NB + j), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
      }
    }
  }
};

// int8: the panel holds q itself (exact in bf16: |q| <= 127 fits its 8-bit significand) and the row scales are
// applied to the fp32 results, so the fill is a widening and one conversion (and the product is exact in q).
struct Int8Panel {
  const int8_t* w;  // Dense<int8_t>'s packed layout
  const float* scale;
  int64_t Kp, blocks;
  int64_t kp() const { return Kp; }
  const float* row_scale() const { return scale; }
  const char* packed(int64_t b0) const { return reinterpret_cast<const char*>(w + b0 * Kp * NB); }
  int64_t packed_bytes() const { return AT_N * Kp; }
  int64_t bytes() const { return AT_N * (Kp + 4); }  // with the row scales
  void fill(int64_t b0, uint16_t* a) const {
    for (int bi = 0; bi < 4; ++bi) {
      if (b0 + bi >= blocks) {
        for (int64_t c = 0; c < Kp / AT_K; ++c) std::memset(a_row(a, c, bi * NB), 0, NB * AT_K * sizeof(uint16_t));
        continue;
      }
      const int8_t* p = w + (b0 + bi) * Kp * NB;
      for (int64_t c = 0; c < Kp / AT_K; ++c, p += NB * AT_K)
        for (int j = 0; j < NB; ++j) {
          const __m128i* r = reinterpret_cast<const __m128i*>(p + j * AT_K);
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(r)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(r + 1)));
          _mm512_storeu_si512(a_row(a, c, bi * NB + j), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
  }
};

// Dense<int8_t>'s packed weights and float32 row scales as a panel source, checked (`what` names the caller).
inline Int8Panel int8_panel(const at::Tensor& wp, const at::Tensor& scale, const char* what) {
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.dim() == 2 && wp.is_contiguous(),
              "llmrt kernels: packed int8 weights must be a contiguous int8 matrix");
  const int64_t Kp = wp.size(1) / NB;
  TORCH_CHECK(Kp % AT_K == 0 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.numel() >= wp.size(0) * NB, "llmrt kernels: int8 ", what, ": bad packed weights or scales");
  return {wp.data_ptr<int8_t>(), scale.data_ptr<float>(), Kp, wp.size(0)};
}

// The int4 packed weights and their (scale, zero) pairs as a panel source (int4_layout checks them).
inline Int4Panel int4_panel(const at::Tensor& wp, const at::Tensor& sz, int64_t group_size) {
  return {int4_layout(wp, sz, group_size), wp.size(0)};
}

// The checks both batched drivers make of a call: x bf16 [rows, in_features] with unit column stride, in_features
// padded to the panel's kp, and n outputs in its packed blocks.
template <typename Panel>
void check_panel_call(const at::Tensor& x, const Panel& panel, int64_t n, const char* what) {
  const int64_t Kp = panel.kp();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) <= Kp &&
              x.size(1) > Kp - AT_K, "llmrt kernels: ", what, " wants bfloat16 [rows, in_features <= ", Kp,
              "] with unit column stride, got ", x.sizes());
  TORCH_CHECK((n + NB - 1) / NB == panel.blocks, "llmrt kernels: ", n, " rows do not match ", panel.blocks,
              " packed blocks");
}

// rows rows of out (bf16, row stride ld) from a C tile [16 n][16 m] of outputs n0..n0+15: the tile transposed,
// each row times the row scales (int8) plus the bias, rounded to bf16 and stored with a mask past n.
inline void store_tile(const float* c, int64_t rows, int64_t n0, int64_t n, const float* scale, const float* bias,
                       c10::BFloat16* out, int64_t ld) {
  const __mmask16 valid = __mmask16((1u << std::min<int64_t>(AT_N, n - n0)) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  const __m512 s = scale ? _mm512_maskz_loadu_ps(valid, scale + n0) : _mm512_set1_ps(1.0f);
  __m512i r[16];
  for (int j = 0; j < AT_N; ++j) r[j] = _mm512_loadu_si512(c + j * AT_M);
  transpose16(r);
  for (int64_t m = 0; m < std::min<int64_t>(rows, AT_M); ++m) {
    const __m512 v = _mm512_fmadd_ps(_mm512_castsi512_ps(r[m]), s, b);
    _mm256_mask_storeu_epi16(out + m * ld, valid, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows m0.. of y (bf16, [M, n]) from a C tile [16 n][16 m], as store_tile.
inline void store_columns(const float* c, int64_t m0, int64_t M, int64_t n0, int64_t n, const float* scale,
                          const Sink& sink) {
  store_tile(c, M - m0, n0, n, scale, sink.bias, sink.bf16 + m0 * n + n0, n);
}

}  // namespace

#pragma GCC pop_options
#endif
