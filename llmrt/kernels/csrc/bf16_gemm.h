// int8/int4 weights times bfloat16 activations by AVX512-BF16's vdpbf16ps, for steps of several rows (batched
// decode, prefill chunks) on CPUs without AMX. Included by linear.cpp in the AVX-512 builds only; compiled for
// AVX512-BF16 by a target pragma and called only where the CPU has it (Python checks the flag).
//
// Why: above the vector kernels' few rows (they widen to fp32 and are FMA-bound from ~16 rows) a step dequantized
// every layer into a shared bf16 buffer (a write and a read of the whole layer) and handed it to oneDNN, which
// also reorders plain weights on every call, so quantized batches ran slower than bf16's prepacked ones. Here, as
// on AMX tiles (amx.h), 16 weight rows at a time are dequantized into a bf16 panel that stays in L1/L2
// (bf16_panel.h) and multiplied against every activation row, so the packed weights are read once per step.
//
// The product is computed transposed, C[n][m] = sum_k W[n][k] x[m][k], from the activations in bf16 pairs
// (16 rows m a vector, one vector per pair of inputs): each weight pair (W[n][2k'], W[n][2k'+1]) is broadcast
// and one vdpbf16ps adds both products for 16 rows. A register tile is nr weight rows by mv vectors of 16 rows,
// so a broadcast serves mv vectors and an activation load nr weight rows. Each output is one chain over
// k in order, whatever M is, so a row's result does not depend on the batch.
#pragma once

#include "bf16_panel.h"

#if defined(LLMRT_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512bw,avx512f,avx512vl,avx512dq")
#include <immintrin.h>

namespace {

constexpr int DP_MV = 4;  // activation tiles of 16 rows per register tile, at most
// Panels filled per pass, each multiplied in turn by the same activation tiles: large steps (prefill) read their
// activations from L3 once per group of panels instead of once per panel. Above 128 rows as many as fit ~512 KB
// of L2 (at most 16; 4 for K = 4096), then evened out so that every intra-op thread gets as many groups (768
// outputs in 3 groups ran at 0.70 of the vdpbf16ps peak on 2 threads, in 4 at 0.9+); up to 128 rows, 4 (8 took
// 1.04x the time of 4 at 4-64 rows, 1 or 2 the same).
inline int dp_group(int64_t M, int64_t Kp, int64_t panels) {
  if (M <= 128) return 4;
  const int64_t fit = std::clamp<int64_t>((512 << 10) / (AT_N * Kp * 2), 1, 16), threads = at::get_num_threads();
  const int64_t groups = (panels + fit - 1) / fit, even = (groups + threads - 1) / threads * threads;
  return int(std::max<int64_t>(1, (panels + even - 1) / even));
}

// Weight rows per register tile for mv activation tiles: enough independent accumulators (nr * mv = 16 or 24)
// to cover vdpbf16ps's latency at two issues a cycle (a panel's last pass takes the AT_N % nr rows left; 4 x 4,
// 6 x 4 and 8 x 3 tiles all reach 8.2-8.6 G vdpbf16ps a second on one core, from L1/L2)
constexpr int dp_rows(int mv) { return mv == 1 ? 16 : mv == 4 ? 6 : 8; }

// c[i][r0 + r][m] = panel rows r0..r0+nr-1 times the mv activation tiles at xm (i-th at xm + i * tstride), over
// all Kp inputs.
// pf: pf_lines cache lines to prefetch per chunk (the next panel's packed weights, so that reading them from
// memory overlaps this panel's products instead of following them), or null.
template <int nr, int mv>
inline void dp_tile(const uint16_t* a, int64_t Kt, int r0, const uint32_t* xm, int64_t tstride, float* c,
                    const char* pf, int pf_lines) {
  __m512 acc[nr][mv];
  for (int r = 0; r < nr; ++r)
    for (int i = 0; i < mv; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t kt = 0; kt < Kt; ++kt) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(a_row(a, kt, r0));
    const uint32_t* x = xm + kt * AT_M * 16;
    if (pf)
      for (int j = 0; j < pf_lines; ++j) _mm_prefetch(pf + (kt * pf_lines + j) * 64, _MM_HINT_T1);
    for (int r = 0; r < nr; ++r)  // this tile's panel rows two chunks ahead (4096 x 768: 0.82 -> 0.84 of peak, 1 run)
      _mm_prefetch(reinterpret_cast<const char*>(a_row(a, kt + 2, r0 + r)), _MM_HINT_T0);
    for (int k = 0; k < 16; ++k) {  // k: the pair (2k, 2k+1) of this chunk's 32 inputs
      __m512bh xv[mv];
      for (int i = 0; i < mv; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * tstride + k * AT_M);
      for (int r = 0; r < nr; ++r) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(int(w[r * AT_K / 2 + k]));
        for (int i = 0; i < mv; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv[i], wb);
      }
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int i = 0; i < mv; ++i) _mm512_storeu_ps(c + (i * AT_N + r0 + r) * AT_M, acc[r][i]);
}

// All AT_N panel rows times mv activation tiles; pf (or null): pf_bytes to prefetch over the passes.
template <int mv>
inline void dp_panel(const uint16_t* a, int64_t Kt, const uint32_t* xm, int64_t tstride, float* c, const char* pf,
                     int64_t pf_bytes) {
  constexpr int nr = dp_rows(mv), full = AT_N / nr, rest = AT_N % nr, passes = full + (rest ? 1 : 0);
  const int lines = int((pf_bytes + passes * Kt * 64 - 1) / (passes * Kt * 64));
  int pass = 0;
  for (; pass < full; ++pass)
    dp_tile<nr, mv>(a, Kt, pass * nr, xm, tstride, c, pf ? pf + pass * Kt * lines * 64 : nullptr, lines);
  if constexpr (rest > 0)
    dp_tile<rest, mv>(a, Kt, full * nr, xm, tstride, c, pf ? pf + pass * Kt * lines * 64 : nullptr, lines);
}

// y [M, n] (bf16) = x W^T + b, G 16-row panels at a time (dp_group) split over the intra-op threads.
template <typename Panel>
at::Tensor dp_linear(const at::Tensor& x, const Panel& panel, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  check_panel_call(x, panel, n, "bf16 GEMM");
  const int64_t Kp = panel.kp(), M = x.size(0), Mt = (M + AT_M - 1) / AT_M, panels = (panel.blocks + 3) / 4,
                Kt = Kp / AT_K;
  const int G = dp_group(M, Kp, panels);
  const int64_t groups = (panels + G - 1) / G, pb = panel.packed_bytes();
  at::Tensor y = at::empty({M, n}, x.options());
  const Sink sink = sink_for(y, bias);
  // one activation tile row (16 rows x Kp) of xb, plus a cache line: the DP_MV rows a register tile reads are
  // then not a power of two apart (with K = 4096, 128 KB: all in the same L1 sets)
  const int64_t tstride = Kt * AT_M * 16 + 16;
  const std::unique_ptr<uint32_t[]> xb =
      vnni_activations(x.data_ptr<c10::BFloat16>(), x.stride(0), M, x.size(1), Kp, tstride - Kt * AT_M * 16);
  // register tiles' worth of activations (DP_MV tiles each) multiplied by one panel before the next: the panel
  // stays in L1/L2 and up to ~384 KB of activations in L2
  const int64_t mblock = std::clamp<int64_t>((384 << 10) / (DP_MV * tstride * 4), 1, 8);
  at::parallel_for(0, groups, block_grain(G * panel.bytes()), [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> a_buf;
    a_buf.resize(G * AT_N * Kp);
    uint16_t* a = a_buf.data();  // (thread_local access is a call in a shared library: once per task)
    // a block's results, [rows][G * 16], copied to y a row at a time: storing 16-output pieces straight into y's
    // rows put them n apart, with rows a multiple of 4 KB long all in the same L1 sets (a 4096 x 768 layer at
    // 2048 rows ran at 0.83 of the vdpbf16ps peak, 0.93 staged, where a 768 x 768 one ran at 0.95)
    thread_local std::vector<c10::BFloat16> ys_buf;
    ys_buf.resize(DP_MV * mblock * AT_M * G * AT_N);
    c10::BFloat16* ys = ys_buf.data();
    const int64_t ldy = G * AT_N;
    alignas(64) float c[DP_MV][AT_N][AT_M];
    for (int64_t g = g0; g < g1; ++g) {
      const int np = int(std::min<int64_t>(G, panels - g * G));
      const int64_t n0 = g * G * AT_N, ncols = std::min<int64_t>(np * AT_N, n - n0);
      for (int i = 0; i < np; ++i) panel.fill(4 * (g * G + i), a + i * AT_N * Kp);
      for (int64_t mb = 0; mb < Mt; mb += DP_MV * mblock) {  // activation rows that stay in L2 across panels
        for (int i = 0; i < np; ++i) {
          const uint16_t* ai = a + i * AT_N * Kp;
          for (int64_t mt = mb; mt < std::min<int64_t>(Mt, mb + DP_MV * mblock); mt += DP_MV) {
            const int mv = int(std::min<int64_t>(DP_MV, Mt - mt));
            const uint32_t* xm = xb.get() + mt * tstride;
            // while the first activation tiles are multiplied, the next group of this thread's range is fetched
            const int64_t next = (g + 1) * G + i;
            const char* pf = mt == 0 && g + 1 < g1 && next < panels ? panel.packed(4 * next) : nullptr;
            if (mv == 4) dp_panel<4>(ai, Kt, xm, tstride, &c[0][0][0], pf, pb);
            else if (mv == 3) dp_panel<3>(ai, Kt, xm, tstride, &c[0][0][0], pf, pb);
            else if (mv == 2) dp_panel<2>(ai, Kt, xm, tstride, &c[0][0][0], pf, pb);
            else dp_panel<1>(ai, Kt, xm, tstride, &c[0][0][0], pf, pb);
            for (int t = 0; t < mv; ++t)
              store_tile(&c[t][0][0], M - (mt + t) * AT_M, n0 + i * AT_N, n, panel.row_scale(), sink.bias,
                         ys + (mt - mb + t) * AT_M * ldy + i * AT_N, ldy);
          }
        }
        for (int64_t m = mb * AT_M; m < std::min<int64_t>(M, (mb + DP_MV * mblock) * AT_M); ++m)
          std::memcpy(sink.bf16 + m * n + n0, ys + (m - mb * AT_M) * ldy, ncols * sizeof(c10::BFloat16));
      }
    }
  });
  return y;
}

at::Tensor linear_int4_bf16gemm(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sz,
                                int64_t group_size, int64_t n, const c10::optional<at::Tensor>& bias) {
  return dp_linear(x, int4_panel(wp, sz, group_size), n, bias);
}

at::Tensor linear_int8_bf16gemm(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, int64_t n,
                                const c10::optional<at::Tensor>& bias) {
  return dp_linear(x, int8_panel(wp, scale, "bf16 GEMM"), n, bias);
}

}  // namespace

#pragma GCC pop_options
#endif
