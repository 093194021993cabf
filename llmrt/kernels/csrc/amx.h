// int8/int4 weights times bfloat16 activations on AMX tiles (TDPBF16PS), for steps of several rows: batched decode
// and prefill. Included by linear.cpp in the AVX-512 builds; compiled for AMX by a target pragma and called only
// where the CPU has AMX-BF16 and the kernel granted this process its tile state (amx_ready; Python checks both).
//
// Why: without it, steps above the vector kernels' few rows dequantized every layer into a shared bf16 buffer
// (a write and a read of the whole layer) and handed it to oneDNN, which also reorders plain weights on every call;
// on an AMX CPU oneDNN's bf16 GEMM on prepacked weights is memory-bound up to ~64 rows, so quantized batches were
// slower than bf16 ones despite reading 2-4x fewer weight bytes. Here 16 weight rows at a time are dequantized
// into a small L1/L2-resident bf16 panel (bf16_panel.h) and multiplied against every activation row by the tile
// unit, so the packed weights are read once per step whatever the number of rows.
//
// The product is computed transposed, C[n][m] = sum_k W[n][k] x[m][k]: the weight panel is the A operand as it
// is (16 rows of 32 inputs, 64 bytes each) and the activations, packed once per call, are the B operand (16
// rows k' of 16 (x[m][2k'], x[m][2k'+1]) pairs, AMX's pair-interleaved layout). A row's result is the same
// sequence of tile products whatever else is in the batch.
#pragma once

#include "bf16_panel.h"

#if defined(LLMRT_AVX512) && defined(__GNUC__) && __GNUC__ >= 11
#define LLMRT_AMX 1
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16,avx512bw,avx512f,avx512vl,avx512dq")
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace {

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

// y [M, n] (bf16) = x W^T + b, 16 weight rows at a time split over the intra-op threads.
template <typename Panel>
at::Tensor amx_linear(const at::Tensor& x, const Panel& panel, int64_t n,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "llmrt kernels: this process was not granted AMX tile state");
  check_panel_call(x, panel, n, "AMX linear");
  const int64_t Kp = panel.kp(), M = x.size(0), Mt = (M + AT_M - 1) / AT_M, ntiles = (panel.blocks + 3) / 4;
  at::Tensor y = at::empty({M, n}, x.options());
  const Sink sink = sink_for(y, bias);
  const std::unique_ptr<uint32_t[]> xb =
      vnni_activations(x.data_ptr<c10::BFloat16>(), x.stride(0), M, x.size(1), Kp);
  const int64_t groups = (ntiles + AT_NT - 1) / AT_NT, Kt = Kp / AT_K;
  at::parallel_for(0, groups, block_grain(AT_NT * panel.bytes()), [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> a;
    a.resize(AT_NT * AT_N * Kp);
    alignas(64) float c[AT_NT][AT_N][AT_M];
    configure_tiles();
    for (int64_t g = g0; g < g1; ++g) {
      const int nt = int(std::min<int64_t>(AT_NT, ntiles - g * AT_NT));
      for (int i = 0; i < nt; ++i) panel.fill(4 * (g * AT_NT + i), a.data() + i * AT_N * Kp);
      for (int64_t mt = 0; mt < Mt; ++mt) {
        const uint32_t* xm = xb.get() + mt * Kt * AT_M * 16;
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
  return amx_linear(x, int4_panel(wp, sz, group_size), n, bias);
}

at::Tensor linear_int8_amx(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, int64_t n,
                           const c10::optional<at::Tensor>& bias) {
  return amx_linear(x, int8_panel(wp, scale, "AMX linear"), n, bias);
}

}  // namespace

#pragma GCC pop_options
#endif
