// int8/int4 weights times bfloat16 activations on AMX tiles (TDPBF16PS), for steps of several rows: batched decode
// and prefill. Included by linear.cpp in the AVX-512 builds; compiled for AMX by a target pragma and called only
// where the CPU has AMX-BF16 and the kernel granted this process its tile state (amx_ready; Python checks both).
//
// Why: without it, steps above the vector kernels' few rows dequantized every layer into a shared bf16 buffer
// (a write and a read of the whole layer) and handed it to oneDNN, which also reorders plain weights on every call;
// on an AMX CPU oneDNN's bf16 GEMM on prepacked weights is memory-bound up to ~64 rows, so quantized batches were
// slower than bf16 ones despite reading 2-4x fewer weight bytes. Here 16 weight rows at a time are dequantized
// into a small L1/L2-resident panel (bf16: int4 the values the dequantize+GEMM path computed, fp32 q*s + (z - 8s)
// rounded to nearest; int8 q itself, exact, its row scale applied to the results) and multiplied against every
// activation row by the tile unit, so the packed weights are read once per step whatever the number of rows.
//
// The product is computed transposed, C[n][m] = sum_k W[n][k] x[m][k]: the weight panel is the A operand as it
// is (16 rows of 32 inputs, 64 bytes each) and the activations, packed once per call, are the B operand (16
// rows k' of 16 (x[m][2k'], x[m][2k'+1]) pairs, AMX's pair-interleaved layout). A row's result is the same
// sequence of tile products whatever else is in the batch.
#pragma once

#if defined(LLMRT_AVX512) && defined(__GNUC__) && __GNUC__ >= 11
#define LLMRT_AMX 1
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16,avx512bw,avx512f,avx512vl,avx512dq")
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace {

constexpr int AT_N = 16;  // weight rows per A tile (4 packed blocks)
constexpr int AT_K = 32;  // inputs per tile product (64 bytes of bf16 a row)
constexpr int AT_M = 16;  // activation rows per B / C tile
constexpr int AT_NT = 4;  // weight panels per pass: C tiles tmm0-3, B in tmm4, A in tmm5-7

// Linux hands out the tile state per process on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {  // every tile 16 rows of 64 bytes: C fp32 [16 n][16 m], A, B
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] bf16 as B tiles: [Mt][Kt][16 k'][16 m] pairs (uint32), rows past M and inputs past K zero.
std::vector<uint32_t> vnni_activations(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp) {
  const int64_t Mt = (M + AT_M - 1) / AT_M, Kt = Kp / AT_K;
  std::vector<uint32_t> xb(Mt * Kt * AT_M * 16, 0u);
  at::parallel_for(0, Mt * Kt, 16, [&](int64_t t0, int64_t t1) {
    uint16_t tail[AT_K];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mt = t / Kt, kt = t % Kt;
      uint32_t* dst = xb.data() + t * AT_M * 16;
      for (int64_t m = 0; m < AT_M && mt * AT_M + m < M; ++m) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x + (mt * AT_M + m) * ldx) + kt * AT_K;
        if ((kt + 1) * AT_K > K) {  // the last, partial chunk: zero past K
          const int64_t have = std::max<int64_t>(0, K - kt * AT_K);
          std::memset(tail, 0, sizeof tail);
          std::memcpy(tail, row, have * sizeof(uint16_t));
          row = tail;
        }
        uint32_t pairs[16];
        std::memcpy(pairs, row, sizeof pairs);
        for (int k = 0; k < 16; ++k) dst[k * AT_M + m] = pairs[k];
      }
    }
  });
  return xb;
}

// Weight panels: 16 rows (blocks b0..b0+3, missing ones zero) as bf16 A tiles [Kp/32][16 rows][32], each tile one
// contiguous KB (a strided panel put 16 rows of a K = 2048 layer 4 KB apart, in one L1 set).
inline uint16_t* a_row(uint16_t* a, int64_t c, int row) { return a + (c * AT_N + row) * AT_K; }

struct Int4Panel {
  const Int4& l;
  const float* row_scale() const { return nullptr; }
  void fill(int64_t b0, int64_t blocks, uint16_t* a) const {
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
  int64_t Kp;
  const float* row_scale() const { return scale; }
  void fill(int64_t b0, int64_t blocks, uint16_t* a) const {
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

// C tiles 0..nt-1 = panels 0..nt-1 (each 16 weight rows x Kp) times activation tile row xm, over all Kp. The
// panels are separate accumulation chains (a tile product's latency is several times its issue interval, so one
// chain alone leaves the unit idle); each output is one chain over k in order, whatever M and nt are.
template <int nt>
inline void amx_group(const uint16_t* a, int64_t Kp, const uint32_t* xm, float* c) {
  const int64_t Kt = Kp / AT_K, tile = AT_N * AT_K, panel = AT_N * Kp;
  _tile_zero(0);
  if constexpr (nt > 1) _tile_zero(1);
  if constexpr (nt > 2) _tile_zero(2);
  if constexpr (nt > 3) _tile_zero(3);
  for (int64_t kt = 0; kt < Kt; ++kt) {  // B in tmm4; A rotates through tmm5-7
    _tile_loadd(4, xm + kt * AT_M * 16, 64);
    _tile_loadd(5, a + kt * tile, 64);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (nt > 1) {
      _tile_loadd(6, a + panel + kt * tile, 64);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (nt > 2) {
      _tile_loadd(7, a + 2 * panel + kt * tile, 64);
      _tile_dpbf16ps(2, 7, 4);
    }
    if constexpr (nt > 3) {
      _tile_loadd(5, a + 3 * panel + kt * tile, 64);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (nt > 1) _tile_stored(1, c + 1 * AT_N * AT_M, 64);
  if constexpr (nt > 2) _tile_stored(2, c + 2 * AT_N * AT_M, 64);
  if constexpr (nt > 3) _tile_stored(3, c + 3 * AT_N * AT_M, 64);
}

// Rows m0.. of y (bf16, [M, n]) from a C tile [16 n][16 m]: each row is a column of the tile, gathered (stride 16
// floats), times the row scales (int8) plus the bias, rounded to bf16 and stored with a mask past n.
inline void store_columns(const float* c, int64_t m0, int64_t M, int64_t n0, int64_t n, const float* scale,
                          const Sink& sink) {
  const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(AT_M));
  const __mmask16 valid = __mmask16((1u << std::min<int64_t>(AT_N, n - n0)) - 1u);
  const __m512 b = sink.bias ? _mm512_maskz_loadu_ps(valid, sink.bias + n0) : _mm512_setzero_ps();
  const __m512 s = scale ? _mm512_maskz_loadu_ps(valid, scale + n0) : _mm512_set1_ps(1.0f);
  for (int64_t m = m0; m < std::min<int64_t>(M, m0 + AT_M); ++m) {
    const __m512 v = _mm512_fmadd_ps(_mm512_i32gather_ps(stride, c + (m - m0), 4), s, b);
    _mm256_mask_storeu_epi16(sink.bf16 + m * n + n0, valid, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// y [M, n] (bf16) = x W^T + b, 16 weight rows at a time split over the intra-op threads.
template <typename Panel>
at::Tensor amx_linear(const at::Tensor& x, const Panel& panel, int64_t blocks, int64_t Kp, int64_t n,
                      int64_t tile_bytes, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "llmrt kernels: this process was not granted AMX tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) <= Kp &&
              x.size(1) > Kp - AT_K, "llmrt kernels: AMX linear wants bfloat16 [rows, in_features <= ", Kp,
              "] with unit column stride, got ", x.sizes());
  TORCH_CHECK((n + NB - 1) / NB == blocks, "llmrt kernels: ", n, " rows do not match ", blocks, " packed blocks");
  const int64_t M = x.size(0), Mt = (M + AT_M - 1) / AT_M, ntiles = (blocks + 3) / 4;
  at::Tensor y = at::empty({M, n}, x.options());
  const Sink sink = sink_for(y, bias);
  const std::vector<uint32_t> xb = vnni_activations(x.data_ptr<c10::BFloat16>(), x.stride(0), M, x.size(1), Kp);
  const int64_t groups = (ntiles + AT_NT - 1) / AT_NT, Kt = Kp / AT_K;
  at::parallel_for(0, groups, block_grain(AT_NT * tile_bytes), [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> a;
    a.resize(AT_NT * AT_N * Kp);
    alignas(64) float c[AT_NT][AT_N][AT_M];
    configure_tiles();
    for (int64_t g = g0; g < g1; ++g) {
      const int nt = int(std::min<int64_t>(AT_NT, ntiles - g * AT_NT));
      for (int i = 0; i < nt; ++i) panel.fill(4 * (g * AT_NT + i), blocks, a.data() + i * AT_N * Kp);
      for (int64_t mt = 0; mt < Mt; ++mt) {
        const uint32_t* xm = xb.data() + mt * Kt * AT_M * 16;
        if (nt == 4) amx_group<4>(a.data(), Kp, xm, &c[0][0][0]);
        else if (nt == 3) amx_group<3>(a.data(), Kp, xm, &c[0][0][0]);
        else if (nt == 2) amx_group<2>(a.data(), Kp, xm, &c[0][0][0]);
        else amx_group<1>(a.data(), Kp, xm, &c[0][0][0]);
        for (int i = 0; i < nt; ++i)
          store_columns(&c[i][0][0], mt * AT_M, M, AT_N * (g * AT_NT + i), n, panel.row_scale(), sink);
      }
    }
    _tile_release();
  });
  return y;
}

at::Tensor linear_int4_amx(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sz, int64_t group_size,
                           int64_t n, const c10::optional<at::Tensor>& bias) {
  const Int4 l = int4_layout(wp, sz, group_size);
  return amx_linear(x, Int4Panel{l}, wp.size(0), l.Kp, n, AT_N * (l.Kp / 2 + l.Kp / group_size * 4), bias);
}

at::Tensor linear_int8_amx(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, int64_t n,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.dim() == 2 && wp.is_contiguous(),
              "llmrt kernels: packed int8 weights must be a contiguous int8 matrix");
  const int64_t Kp = wp.size(1) / NB;
  TORCH_CHECK(Kp % AT_K == 0 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.numel() >= wp.size(0) * NB, "llmrt kernels: int8 AMX linear: bad packed weights or scales");
  return amx_linear(x, Int8Panel{wp.data_ptr<int8_t>(), scale.data_ptr<float>(), Kp}, wp.size(0), Kp, n,
                    AT_N * (Kp + 4), bias);
}

}  // namespace

#pragma GCC pop_options
#endif
