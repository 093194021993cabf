// Small-M matmuls y = x W^T + b: fp32 weights, and weights kept narrow (bf16, int8 per channel, int4 group-wise).
//
// Decode is memory-bound: each kernel streams the weights once, widens them to fp32 in registers and
// accumulates in fp32, computing up to MB activation rows per weight load. The weights are pre-packed at load
// (llmrt/kernels/packed.py) into blocks of NB = 4 output rows whose chunks of KC inputs (32; 16 for fp32: at
// most 64 bytes) are interleaved: block b holds chunk 0 of rows 4b..4b+3, then chunk 1 of the same rows, ... so
// one block is one linear stream and a thread's share of the matrix is one contiguous range (the hardware
// prefetcher sees a single sequential stream instead of 4 short rows: 1.5-2.5x the bandwidth of the old
// row-major kernels, benchmarks/gemv-bandwidth*.md). Rows are padded to a multiple of 4 and inputs to a whole chunk (group, for
// int4) with zero weights. Every output row is computed with the same reduction order whatever M is, so a row's
// result does not depend on what else is in the batch. The AVX2 build's int8/int4 kernels multiply the same
// packed weights by int16-rounded activations instead of widening them to fp32 (int_i16.h).
// One source, compiled once per ISA (LLMRT_AVX512 or AVX2+FMA); the op namespace is LLMRT_NS so that both
// builds can be loaded into one process (tests compare them).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "simd.h"

#ifndef LLMRT_NS
#error "LLMRT_NS (the torch op namespace) must be defined"
#endif

namespace {

using namespace llmrt_simd;

// A chunk is KC weights of one row (32, or 16 fp32: 64 bytes at most), CV = KC / VL vectors once widened.
template <typename WT>
struct Dense {
  static constexpr int KC = sizeof(WT) == 4 ? 16 : 32;
  static constexpr int CV = KC / VL;
  // bf16 on AVX2: each 16 weights widen as even k then odd k (simd.h), and the activations come in that order
  static constexpr bool kPairs = PAIR_ORDER && std::is_same_v<WT, uint16_t>;
  // AVX2 bf16: steps of 1-2 rows ask for each chunk's 256 bytes 4 KB ahead (W2 bf16 0.963x / 0.976x / 0.982x by the
  // median of 14 / 12 / 10 in-process pairs, benchmarks/kernel_step_ab.py); fp32's faster stream got slower with it
  // (1.12x), the panels' widening (3+ rows) did at 16 rows (1.04-1.08x); on AVX-512 bf16 1.10x, fp32 1.01x (simd.h).
  static constexpr bool kPrefetch = BF16_PREFETCH && std::is_same_v<WT, uint16_t>;
  const WT* w;  // packed [Np/4][Kp/KC][4][KC]
  int64_t Kp;
  // Walks one block chunk by chunk: row(j) widens row j's part of the current chunk, next() moves on.
  struct Cursor {
    const WT* p;
    inline void row(int j, vf* wv) const {
      if constexpr (kPairs) {
        for (int v = 0; v < CV; v += 2) wload_pairs(reinterpret_cast<const uint16_t*>(p + j * KC + v * VL), wv[v],
                                                     wv[v + 1]);
      } else {
        for (int v = 0; v < CV; ++v) wv[v] = wload(p + j * KC + v * VL);
      }
    }
    inline void start() {}
    inline void prefetch() const {  // block_tile's steps of 1-2 rows only, not the panels' widening
      if constexpr (kPrefetch) {
        const char* ahead = reinterpret_cast<const char*>(p) + PREFETCH_AHEAD;
        for (int l = 0; l < NB * KC * int(sizeof(WT)); l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      }
    }
    inline void next() { p += NB * KC; }
  };
  Cursor cursor(int64_t b) const { return {w + b * Kp * NB}; }
};

// int4: chunks of 32 weights, 16 bytes per row (byte c = q[c] | q[c + 16] << 4), so a block's chunk is 64
// bytes too. sz packed [Np/4][G][4][2] bf16 (scale, zero); w = (q-8)*s + z, computed as q*s + (z - 8s). Its cursor
// now serves `dequantize_int4` (unpack_blocks) only: every build's int4 GEMV is int_i16.h's.
struct Int4 {
  static constexpr int KC = 32;
  static constexpr int CV = KC / VL;
  static constexpr bool kPairs = false;
  const uint8_t* w;
  const uint16_t* sz;
  int64_t Kp, gs;
  struct Cursor {
    const uint8_t* p;
    const uint16_t* g;
    int64_t per_group, left = 0;  // chunks per group, chunks left in this one
    vf s[NB], bb[NB], t[NB];
    inline void prefetch() const {}
    inline void start() {  // at a group's first chunk: its scales, offsets and 16-entry value tables
      if (left) return;
      for (int j = 0; j < NB; ++j) {
        const float sc = to_f(g[2 * j]), z = to_f(g[2 * j + 1]);
        s[j] = vset1(sc);
        bb[j] = vset1(z - 8.0f * sc);
        t[j] = dq_table(s[j], bb[j]);
      }
      left = per_group;
    }
    inline void row(int j, vf* wv) const { dq_chunk(p + j * 16, s[j], bb[j], t[j], wv); }
    inline void next() {
      p += NB * 16;
      if (--left == 0) g += 2 * NB;
    }
  };
  Cursor cursor(int64_t b) const { return {w + b * Kp * NB / 2, sz + b * (Kp / gs) * NB * 2, gs / KC}; }
};

// out[i][j] = sum_k x[i, k] * w[4b + j, k] for mb activation rows: one pass over block b.
template <typename L, int mb>
inline void block_tile(const L& l, int64_t b, const float* x, int64_t ldx, float (*out)[NB]) {
  vf acc[mb][NB];
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vzero();
  auto cur = l.cursor(b);
  for (int64_t k = 0; k < l.Kp; k += L::KC, cur.next()) {
    cur.start();
    cur.prefetch();
    if constexpr (NB * L::CV <= 8) {  // the chunk's weights fit in registers: each x vector is loaded once
      vf wv[NB][L::CV];
      for (int j = 0; j < NB; ++j) cur.row(j, wv[j]);
      for (int v = 0; v < L::CV; ++v)
        for (int i = 0; i < mb; ++i) {
          const vf xv = vload(x + i * ldx + k + v * VL);
          for (int j = 0; j < NB; ++j) acc[i][j] = vfma(xv, wv[j][v], acc[i][j]);
        }
    } else {  // AVX2's 16 registers: one row at a time (the same products in the same order per output)
      for (int j = 0; j < NB; ++j) {
        vf wv[L::CV];
        cur.row(j, wv);
        for (int v = 0; v < L::CV; ++v)
          for (int i = 0; i < mb; ++i) acc[i][j] = vfma(vload(x + i * ldx + k + v * VL), wv[v], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < NB; ++j) out[i][j] = vsum(acc[i][j]);
}

// One block widened to fp32 in the same chunk order: block_tile over it does the same products in the same
// order as over the narrow weights (rows beyond a tile re-read it from L1/L2 instead of re-widening).
template <int CV_>
struct Panel {
  static constexpr int KC = CV_ * VL;
  static constexpr int CV = CV_;
  const float* w;
  int64_t Kp;
  struct Cursor {
    const float* p;
    inline void row(int j, vf* wv) const {
      for (int v = 0; v < CV; ++v) wv[v] = vload(p + j * KC + v * VL);
    }
    inline void start() {}
    inline void prefetch() const {}  // the widened block is in cache
    inline void next() { p += NB * KC; }
  };
  Cursor cursor(int64_t) const { return {w}; }
};

template <typename L>
void widen_block(const L& l, int64_t b, float* dst) {
  auto cur = l.cursor(b);
  for (int64_t k = 0; k < l.Kp; k += L::KC, cur.next()) {
    cur.start();
    for (int j = 0; j < NB; ++j) {
      vf wv[L::CV];
      cur.row(j, wv);
      for (int v = 0; v < L::CV; ++v) vstore(dst + (k * NB + j * L::KC + v * VL), wv[v]);
    }
  }
}

// Where results go: the output tensor's dtype, a per-row scale (int8) and a bias, applied once per element.
struct Sink {
  float* f32 = nullptr;
  c10::BFloat16* bf16 = nullptr;
  int64_t ld = 0, N = 0;
  const float* scale = nullptr;  // [Np] or null
  const float* bias = nullptr;   // [N] or null
  inline void put(int64_t m0, int mb, int64_t b, const float (*out)[NB]) const {
    for (int i = 0; i < mb; ++i)
      for (int j = 0; j < NB && b * NB + j < N; ++j) {
        const int64_t n = b * NB + j;
        float v = out[i][j];
        if (scale) v *= scale[n];
        if (bias) v += bias[n];
        if (f32) f32[(m0 + i) * ld + n] = v;
        else bf16[(m0 + i) * ld + n] = c10::BFloat16(v);
      }
  }
};

// Block lb of l times M rows, the results stored as output block b.
template <typename L>
inline void rows_of_block(const L& l, int64_t lb, int64_t b, const float* x, int64_t ldx, int64_t M,
                          const Sink& sink) {
  float out[MB][NB];
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) {
    block_tile<L, MB>(l, lb, x + m0 * ldx, ldx, out);
    sink.put(m0, MB, b, out);
  }
  const int r = int(M - m0);
  if (r == 1) block_tile<L, 1>(l, lb, x + m0 * ldx, ldx, out);
  if constexpr (MB > 2) {
    if (r == 2) block_tile<L, (MB > 2 ? 2 : 1)>(l, lb, x + m0 * ldx, ldx, out);
    if (r == 3) block_tile<L, (MB > 3 ? 3 : 1)>(l, lb, x + m0 * ldx, ldx, out);
  }
  if (r) sink.put(m0, r, b, out);
}

// Blocks per parallel task: enough weight bytes that a thread's start-up (a few microseconds) is paid back.
inline int64_t block_grain(int64_t block_bytes) {
  return std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(1, block_bytes));
}

// All M rows times every block, the blocks split into one contiguous range per intra-op thread.
template <typename L>
void for_all_blocks(const L& l, int64_t M, int64_t blocks, int64_t block_bytes, const float* x, int64_t ldx,
                    const Sink& sink) {
  at::parallel_for(0, blocks, block_grain(block_bytes), [&](int64_t b0, int64_t b1) {
    if (M <= MB) {
      for (int64_t b = b0; b < b1; ++b) rows_of_block(l, b, b, x, ldx, M, sink);
      return;
    }
    thread_local std::vector<float> panel;
    panel.resize(NB * l.Kp);
    for (int64_t b = b0; b < b1; ++b) {
      widen_block(l, b, panel.data());
      rows_of_block(Panel<L::CV>{panel.data(), l.Kp}, 0, b, x, ldx, M, sink);
    }
  });
}

// x as contiguous fp32 [M, Kp] (zero-padded past K); a view of x itself where no copy is needed. `pairs`: each 16
// inputs in the order Dense::kPairs weights widen to (AVX2 bf16), always a copy.
struct Activations {
  at::Tensor keep;
  const float* p;
  int64_t ld;
};

Activations activations(const at::Tensor& x, int64_t Kp, bool pairs) {
  TORCH_CHECK(x.dim() == 2, "llmrt kernels: x must be 2-D [rows, in_features], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "llmrt kernels: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "llmrt kernels: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(1);
  if (!pairs && x.scalar_type() == at::kFloat && x.stride(1) == 1 && Kp == K) {
    return {x, x.data_ptr<float>(), x.stride(0)};
  }
  at::Tensor xf = at::empty({x.size(0), Kp}, x.options().dtype(at::kFloat));
#if !defined(LLMRT_AVX512)
  if (pairs) {  // each 16 inputs as the even k, then the odd k (zero past K): Dense::kPairs weights' order
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    const int64_t M = xc.size(0), ld = xc.stride(0);
    float* dst = xf.data_ptr<float>();
    const bool bf16 = xc.scalar_type() == at::kBFloat16;
    const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr()) : nullptr;
    const float* xs = bf16 ? nullptr : xc.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i)
      for (int64_t g = 0; g < Kp; g += 16) {
        float* d = dst + i * Kp + g;
        if (bf16 && g + 16 <= K) {  // the weights' own widening (simd.h)
          vf even, odd;
          wload_pairs(xb + i * ld + g, even, odd);
          vstore(d, even);
          vstore(d + 8, odd);
          continue;
        }
        for (int t = 0; t < 16; ++t) {
          const int64_t k = g + t;
          d[pair_slot(t)] = k >= K ? 0.f : bf16 ? to_f(xb[i * ld + k]) : xs[i * ld + k];
        }
      }
    return {xf, dst, Kp};
  }
#endif
  if (Kp > K) xf.narrow(1, K, Kp - K).zero_();
  xf.narrow(1, 0, K).copy_(x);
  return {xf, xf.data_ptr<float>(), Kp};
}

// Where y [M, n] (float32 or bfloat16) and the bias go: the bias float32 [n], converted once at load (packed.py).
Sink sink_for(const at::Tensor& y, const c10::optional<at::Tensor>& bias) {
  Sink sink;
  const int64_t n = y.size(1);
  sink.ld = sink.N = n;
  if (y.scalar_type() == at::kFloat) sink.f32 = y.data_ptr<float>();
  else sink.bf16 = y.data_ptr<c10::BFloat16>();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "llmrt kernels: bias must be contiguous float32 [", n, "]");
    sink.bias = bias->data_ptr<float>();
  }
  return sink;
}

// The packed matrix's shape checks; returns (blocks, Kp) and the output with its sink.
struct Call {
  Activations a;
  at::Tensor y;
  Sink sink;
  int64_t blocks, Kp;
};

Call prepare_call(const at::Tensor& x, const at::Tensor& wp, int64_t elems_per_row_unit, int64_t kc, int64_t n,
                  const c10::optional<at::Tensor>& bias, const char* what, bool pairs = false) {
  TORCH_CHECK(wp.dim() == 2 && wp.is_contiguous(), "llmrt kernels: ", what, " must be a contiguous packed matrix");
  const int64_t blocks = wp.size(0), Kp = wp.size(1) * elems_per_row_unit / NB;
  TORCH_CHECK(n > 0 && (n + NB - 1) / NB == blocks && Kp % kc == 0, "llmrt kernels: packed ", what, " ",
              wp.sizes(), " does not hold ", n, " rows");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= Kp && x.size(1) > Kp - kc, "llmrt kernels: x ", x.sizes(),
              " does not match in_features padded to ", Kp);
  Call c{activations(x, Kp, pairs), at::empty({x.size(0), n}, x.options()), {}, blocks, Kp};
  c.sink = sink_for(c.y, bias);
  return c;
}

template <typename WT>
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias,
                        at::ScalarType wtype, const float* scale, const char* what) {
  TORCH_CHECK(wp.scalar_type() == wtype, "llmrt kernels: packed weights must be ", what);
  Call c = prepare_call(x, wp, 1, Dense<WT>::KC, n, bias, what, Dense<WT>::kPairs);
  c.sink.scale = scale;
  Dense<WT> l{reinterpret_cast<const WT*>(wp.data_ptr()), c.Kp};
  for_all_blocks(l, x.size(0), c.blocks, NB * c.Kp * int64_t(sizeof(WT)), c.a.p, c.a.ld, c.sink);
  return c.y;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias) {
  return linear_dense<uint16_t>(x, wp, n, bias, at::kBFloat16, nullptr, "bfloat16");
}

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias) {
  return linear_dense<float>(x, wp, n, bias, at::kFloat, nullptr, "float32");
}

Int4 int4_layout(const at::Tensor& wp, const at::Tensor& sz, int64_t gs) {
  TORCH_CHECK(wp.scalar_type() == at::kByte && wp.dim() == 2 && wp.is_contiguous(),
              "llmrt kernels: packed int4 weights must be a contiguous uint8 matrix");
  TORCH_CHECK(gs > 0 && gs % 32 == 0, "llmrt kernels: group size must be a multiple of 32");
  const int64_t Kp = wp.size(1) * 2 / NB;
  TORCH_CHECK(Kp % gs == 0, "llmrt kernels: padded in_features ", Kp, " is not a multiple of the group ", gs);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == wp.size(0) * NB * Kp / gs * 2,
              "llmrt kernels: sz must be contiguous bfloat16 [blocks, groups, 4, 2]");
  return {wp.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sz.data_ptr()), Kp, gs};
}

}  // namespace

#include "qlinear.h"  // int8/int4 weights times int8-quantized activations (integer dot products)
#include "int_i16.h"  // int8/int4 weights times int16-quantized activations (AVX2 builds)
#include "int4_bf16dot.h"  // int4 weights times bf16 activations by vdpbf16ps (AVX-512 builds, AVX512-BF16 CPUs)
#include "int8_i16dot.h"  // int8 weights times int16 activations by vpdpwssd (the VNNI build)
#include "amx.h"  // int8/int4 weights times bf16 activations on AMX tiles (AVX-512 builds, AMX-BF16 CPUs)
#include "bf16_gemm.h"  // the same by vdpbf16ps for several rows (AVX-512 builds, AVX512-BF16 CPUs)

namespace {

// int8/int4 weights times float32/bfloat16 activations: int4 times int16-quantized activations in every build
// (int_i16.h); int8 the same on AVX2 and widened to fp32 in registers on AVX-512. On an AVX-512 Zen 4 EPYC the
// widened int4 kernel (a 16-entry permute per 16 weights and the group's tables rebuilt every chunk) took 1.46-1.52x
// the int16 kernel's time at 1-2 rows and 1.11-1.35x at 3-16 (the 124.7M model's 48 decoder linears, cold, fp32 and
// bf16 activations; benchmarks/int4-i16-rows-avx512-2026-12-07.md). int8 keeps its widened kernel there: the int16
// one (register tiles to 16 rows) took 1.04-1.07x its time at 1 row, 0.92-1.04x at 2-4 and 0.65-0.78x at 8-12, and
// decode's single rows matter most.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() >= n,
              "llmrt kernels: scale must be float32 [out]");
#if defined(LLMRT_AVX512) && defined(LLMRT_VNNI)
  TORCH_CHECK(wp.scalar_type() == at::kChar, "llmrt kernels: packed weights must be int8");
  Call c = prepare_call(x, wp, 1, 32, n, bias, "int8");
  c.sink.scale = scale.data_ptr<float>();
  return linear_int8_i16dot(c, wp.data_ptr<int8_t>(), x.size(0));
#elif defined(LLMRT_AVX512)
  return linear_dense<int8_t>(x, wp, n, bias, at::kChar, scale.data_ptr<float>(), "int8");
#else
  TORCH_CHECK(wp.scalar_type() == at::kChar, "llmrt kernels: packed weights must be int8");
  Call c = prepare_call(x, wp, 1, 32, n, bias, "int8");
  c.sink.scale = scale.data_ptr<float>();
  return linear_i16<false>(wp.data_ptr<int8_t>(), NB * c.Kp, nullptr, 0, NB * c.Kp, c, x.size(0));
#endif
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sz, int64_t group_size, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  Int4 l = int4_layout(wp, sz, group_size);
  Call c = prepare_call(x, wp, 2, group_size, n, bias, "int4");
  const int64_t block_bytes = NB * (c.Kp / 2 + c.Kp / group_size * 4);
  return linear_i16<true>(l.w, NB * c.Kp / 2, l.sz, group_size, block_bytes, c, x.size(0));
}

// The packed weights back as a dense [N, K] float32/bfloat16 matrix (int8: times its row scales), for steps too
// large for the kernels (torch's GEMM runs them); the same fp32 values the kernels compute with.
template <typename L>
void unpack_blocks(const L& l, int64_t blocks, const float* scale, at::Tensor out) {
  const int64_t N = out.size(0), K = out.size(1);
  const bool f32 = out.scalar_type() == at::kFloat;
  float* of = f32 ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* ob = f32 ? nullptr : out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> panel;
    panel.resize(NB * l.Kp);
    for (int64_t b = b0; b < b1; ++b) {
      widen_block(l, b, panel.data());
      for (int j = 0; j < NB && b * NB + j < N; ++j) {
        const int64_t n = b * NB + j;
        const float s = scale ? scale[n] : 1.0f;
        for (int64_t k0 = 0; k0 < K; k0 += L::KC) {  // one chunk: KC contiguous values of row n
          const float* src = panel.data() + k0 * NB + j * L::KC;
          const int64_t len = std::min<int64_t>(L::KC, K - k0);
          auto at = [&](int64_t t) {  // the panel's value for input k0 + t
            if constexpr (L::kPairs) return src[t / 16 * 16 + pair_slot(int(t % 16))];
            else return src[t];
          };
          if (f32) {
            float* dst = of + n * K + k0;
            for (int64_t t = 0; t < len; ++t) dst[t] = at(t) * s;
          } else {
            c10::BFloat16* dst = ob + n * K + k0;
            for (int64_t t = 0; t < len; ++t) dst[t] = c10::BFloat16(at(t) * s);
          }
        }
      }
    }
  });
}

void check_out(const at::Tensor& out, int64_t blocks, int64_t Kp) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && (out.size(0) + NB - 1) / NB == blocks && out.size(1) <= Kp &&
              (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "llmrt kernels: out must be contiguous float32/bfloat16 [out_features, <= ", Kp, "]");
}

void unpack(const at::Tensor& wp, const c10::optional<at::Tensor>& scale, at::Tensor out) {
  TORCH_CHECK(wp.dim() == 2 && wp.is_contiguous(), "llmrt kernels: unpack wants a contiguous packed matrix");
  const int64_t blocks = wp.size(0), Kp = wp.size(1) / NB;
  check_out(out, blocks, Kp);
  const float* s = scale.has_value() && scale->defined() ? scale->data_ptr<float>() : nullptr;
  switch (wp.scalar_type()) {
    case at::kFloat: unpack_blocks(Dense<float>{wp.data_ptr<float>(), Kp}, blocks, s, out); break;
    case at::kBFloat16:
      unpack_blocks(Dense<uint16_t>{reinterpret_cast<const uint16_t*>(wp.data_ptr()), Kp}, blocks, s, out);
      break;
    case at::kChar: unpack_blocks(Dense<int8_t>{wp.data_ptr<int8_t>(), Kp}, blocks, s, out); break;
    default: TORCH_CHECK(false, "llmrt kernels: unpack: unsupported weight type ", wp.scalar_type());
  }
}

void dequantize_int4(const at::Tensor& wp, const at::Tensor& sz, int64_t group_size, at::Tensor out) {
  Int4 l = int4_layout(wp, sz, group_size);
  check_out(out, wp.size(0), l.Kp);
  unpack_blocks(l, wp.size(0), nullptr, out);
}

std::string isa() {
#if defined(LLMRT_AVX512)
  return "avx512";
#else
  return "avx2";
#endif
}

}  // namespace

#define LLMRT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
LLMRT_LIBRARY(LLMRT_NS, m) {
  m.def("linear_bf16(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor", &linear_bf16);
  m.def("linear_fp32(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor", &linear_fp32);
  m.def("linear_int8(Tensor x, Tensor wp, Tensor scale, int n, Tensor? bias) -> Tensor", &linear_int8);
  m.def("linear_int4(Tensor x, Tensor wp, Tensor sz, int group_size, int n, Tensor? bias) -> Tensor", &linear_int4);
  m.def("linear_int8_q8(Tensor x, Tensor wp, Tensor scale, int n, Tensor? bias) -> Tensor", &linear_int8_q8);
  m.def("linear_int4_q8(Tensor x, Tensor wp, Tensor sz, int group_size, int n, Tensor? bias) -> Tensor",
        &linear_int4_q8);
  m.def("int_dot() -> str", &int_dot);
#if defined(LLMRT_AVX512)
  m.def("linear_int4_bf16dot(Tensor x, Tensor wp, Tensor sz, int group_size, int n, Tensor? bias) -> Tensor",
        &linear_int4_bf16dot);
  m.def("linear_int4_bf16gemm(Tensor x, Tensor wp, Tensor sz, int group_size, int n, Tensor? bias) -> Tensor",
        &linear_int4_bf16gemm);
  m.def("linear_int8_bf16gemm(Tensor x, Tensor wp, Tensor scale, int n, Tensor? bias) -> Tensor",
        &linear_int8_bf16gemm);
#endif
#if defined(LLMRT_AMX)
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("linear_int4_amx(Tensor x, Tensor wp, Tensor sz, int group_size, int n, Tensor? bias) -> Tensor",
        &linear_int4_amx);
  m.def("linear_int8_amx(Tensor x, Tensor wp, Tensor scale, int n, Tensor? bias) -> Tensor", &linear_int8_amx);
#endif
  m.def("unpack(Tensor wp, Tensor? scale, Tensor(a!) out) -> ()", &unpack);
  m.def("dequantize_int4(Tensor wp, Tensor sz, int group_size, Tensor(a!) out) -> ()", &dequantize_int4);
  m.def("isa() -> str", &isa);
}
