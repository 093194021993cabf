// int8/int4 weights times int8-quantized activations (qdot.h says how and why), over linear.cpp's packed
// layouts as they are: int8 chunks of 4 rows x 32 bytes, int4 chunks of 4 rows x 16 bytes (byte c = q[c] |
// q[c + 16] << 4) with a bf16 (scale, zero) per row and group. Included by linear.cpp after Sink and Call.
// Every output row is computed with the same operations in the same order whatever the number of rows, so a
// row's result does not depend on the batch; rows beyond a tile re-read the block from cache (no widening).
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "qdot.h"

namespace {

using namespace llmrt_simd;

constexpr int QB = 32;  // activation inputs per quantization block

// Activation rows quantized per block of QB: xq [M][Kp], and per block d (scale), sum(xq), sum(x) in fp32.
struct QRows {
  std::vector<int8_t> q;
  std::vector<float> d, sumf;
  std::vector<int32_t> sum;
  int64_t Kp = 0, nb = 0;
};

QRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t Kp) {
  QRows r;
  r.Kp = Kp;
  r.nb = Kp / QB;
  r.q.resize(M * Kp);
  r.d.resize(M * r.nb);
  r.sumf.resize(M * r.nb);
  r.sum.resize(M * r.nb);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < r.nb; ++b) {
      const int64_t at = i * r.nb + b;
      quantize_block(x + i * ldx + b * QB, r.q.data() + i * Kp + b * QB, r.d[at], r.sum[at], r.sumf[at]);
    }
  return r;
}

// int8 block b times mb quantized rows starting at row m0: out[i][j] = sum_k x[i,k] q[4b+j,k] (unscaled).
template <int mb>
inline void q8_tile(const int8_t* w, int64_t Kp, const QRows& x, int64_t m0, float (*out)[NB]) {
  constexpr int R = VB / QB, NV = NB / R;  // rows per vector, vectors per chunk
  vf acc[mb][NV];
  for (int i = 0; i < mb; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  const int64_t nb = Kp / QB;
  for (int64_t c = 0; c < nb; ++c, w += NB * QB) {
    vi wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = iload(w + v * VB);
    for (int i = 0; i < mb; ++i) {
      const int64_t at = (m0 + i) * nb + c;
      const vi xv = bcast32(x.q.data() + (m0 + i) * Kp + c * QB);
      const vi init = s8_init(x.sum[at]);
      const vf d = vset1(x.d[at]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(icvt(dot_s8s8(init, wv[v], xv)), d, acc[i][v]);
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int v = 0; v < NV; ++v) slot_sums<R>(acc[i][v], out[i] + v * R);
}

// int4 block b (groups of gs) times mb quantized rows: w = q * s + (z - 8 s) per row and group.
template <int mb>
inline void q4_tile(const uint8_t* w, const uint16_t* g, int64_t Kp, int64_t gs, const QRows& x, int64_t m0,
                    float (*out)[NB]) {
  constexpr int R = VB / 16, NV = NB / R;  // rows per vector (16 bytes each), vectors per chunk
  vf acc[mb][NV], off[mb][NV], s[NV], bo[NV];  // off: the offset terms, a second chain of FMAs
  for (int i = 0; i < mb; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = off[i][v] = vzero();
  const int64_t nb = Kp / QB, per_group = gs / QB;
  for (int64_t c = 0; c < nb; ++c, w += NB * 16) {
    if (c % per_group == 0) {
      int4_scales(g, s, bo);
      g += 2 * NB;
    }
    vi lo[NV], hi[NV];
    for (int v = 0; v < NV; ++v) {
      const vi bytes = iload(w + v * VB);
      lo[v] = lo_nibbles(bytes);
      hi[v] = hi_nibbles(bytes);
    }
    for (int i = 0; i < mb; ++i) {
      const int64_t at = (m0 + i) * nb + c;
      const int8_t* xq = x.q.data() + (m0 + i) * Kp + c * QB;
      const vi xlo = bcast16(xq), xhi = bcast16(xq + 16);
      const vf d = vset1(x.d[at]), sf = vset1(x.sumf[at]);
      for (int v = 0; v < NV; ++v) {
        const vi dot = dot_u8s8(dot_u8s8(izero(), lo[v], xlo), hi[v], xhi);
        acc[i][v] = vfma(icvt(dot), vmul(s[v], d), acc[i][v]);
        off[i][v] = vfma(bo[v], sf, off[i][v]);
      }
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int v = 0; v < NV; ++v) slot_sums<R>(vadd(acc[i][v], off[i][v]), out[i] + v * R);
}

// All rows of x times every block, in tiles of MB rows, the blocks split into contiguous ranges per thread:
// tile(std::integral_constant<int, mb>, b, m0, out) fills out[0..mb) for block b and rows m0... Every row-tiled
// kernel's driver (int8/int4 x int8, int4 x bf16, int8 x int16).
template <typename Tile>
void q_all_blocks(int64_t M, int64_t blocks, int64_t block_bytes, const Sink& sink, const Tile& tile) {
  at::parallel_for(0, blocks, block_grain(block_bytes), [&](int64_t b0, int64_t b1) {
    float out[MB][NB];
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) {
        tile(std::integral_constant<int, MB>{}, b, m0, out);
        sink.put(m0, MB, b, out);
      }
      const int r = int(M - m0);
      if (r == 1) tile(std::integral_constant<int, 1>{}, b, m0, out);
      if constexpr (MB > 2) {
        if (r == 2) tile(std::integral_constant<int, (MB > 2 ? 2 : 1)>{}, b, m0, out);
        if (r == 3) tile(std::integral_constant<int, (MB > 3 ? 3 : 1)>{}, b, m0, out);
      }
      if (r) sink.put(m0, r, b, out);
    }
  });
}

at::Tensor linear_int8_q8(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(wp.scalar_type() == at::kChar, "llmrt kernels: packed weights must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() >= n,
              "llmrt kernels: scale must be float32 [out]");
  Call c = prepare_call(x, wp, 1, QB, n, bias, "int8");
  c.sink.scale = scale.data_ptr<float>();
  const QRows q = quantize_rows(c.a.p, c.a.ld, x.size(0), c.Kp);
  const int8_t* w = wp.data_ptr<int8_t>();
  const int64_t Kp = c.Kp;
  q_all_blocks(x.size(0), c.blocks, NB * Kp, c.sink, [&](auto mb, int64_t b, int64_t m0, float (*out)[NB]) {
    q8_tile<decltype(mb)::value>(w + b * NB * Kp, Kp, q, m0, out);
  });
  return c.y;
}

at::Tensor linear_int4_q8(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sz, int64_t group_size,
                          int64_t n, const c10::optional<at::Tensor>& bias) {
  const Int4 l = int4_layout(wp, sz, group_size);
  Call c = prepare_call(x, wp, 2, group_size, n, bias, "int4");
  const QRows q = quantize_rows(c.a.p, c.a.ld, x.size(0), c.Kp);
  const int64_t Kp = c.Kp, groups = Kp / group_size;
  q_all_blocks(x.size(0), c.blocks, NB * (Kp / 2 + groups * 4), c.sink,
               [&](auto mb, int64_t b, int64_t m0, float (*out)[NB]) {
                 q4_tile<decltype(mb)::value>(l.w + b * NB * Kp / 2, l.sz + b * groups * NB * 2, Kp, group_size,
                                              q, m0, out);
               });
  return c.y;
}

std::string int_dot() { return int_dot_name(); }

}  // namespace
