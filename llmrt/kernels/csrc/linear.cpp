// Small-M matmuls y = x W^T + b: fp32 weights, and weights kept narrow (bf16, int8 per channel, int4 group-wise).
//
// Decode is memory-bound: each kernel streams the weights once, widens them to fp32 in registers and
// accumulates in fp32, computing up to MB activation rows per weight load. Every output row is computed with the
// same reduction order whatever M is, so a row's result does not depend on what else is in the batch.
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

// out[i][j] = sum_k x[i, k] * w[j, k] for mb activation rows and nb weight rows (both <= MB, NB).
template <typename WT, int mb, int nb>
inline void dot_tile(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float (*out)[NB]) {
  vf acc[mb][nb];
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vf wv[nb];
    for (int j = 0; j < nb; ++j) wv[j] = wload(w + j * ldw + k);
    for (int i = 0; i < mb; ++i) {
      vf xv = vload(x + i * ldx + k);
      for (int j = 0; j < nb; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {  // the tail as one more zero-padded vector step: the same arithmetic whatever WT is
    alignas(64) float wt[nb][VL] = {}, xt[VL] = {};
    for (int j = 0; j < nb; ++j)
      for (int64_t t = k; t < K; ++t) wt[j][t - k] = to_f(w[j * ldw + t]);
    for (int i = 0; i < mb; ++i) {
      for (int64_t t = k; t < K; ++t) xt[t - k] = x[i * ldx + t];
      const vf xv = vload(xt);
      for (int j = 0; j < nb; ++j) acc[i][j] = vfma(xv, vload(wt[j]), acc[i][j]);
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) out[i][j] = vsum(acc[i][j]);
}

// int4: K is a multiple of 32 (padded at load), gs a multiple of 32. Per 32-chunk, 16 bytes: byte c holds
// q[c] in its low nibble and q[c + 16] in its high one. sz: [N, K/gs, 2] bf16 (scale, zero); w = (q-8)*s + z,
// computed as q*s + (z - 8s) in registers.
template <int mb, int nb>
inline void int4_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const uint16_t* sz, int64_t G,
                      int64_t gs, float (*out)[NB]) {
  constexpr int C = 32 / VL;  // vectors per 32-chunk
  vf acc[mb][nb];
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    vf s[nb], b[nb], t[nb];
    for (int j = 0; j < nb; ++j) {
      float sc = to_f(sz[(j * G + g) * 2]), z = to_f(sz[(j * G + g) * 2 + 1]);
      s[j] = vset1(sc);
      b[j] = vset1(z - 8.0f * sc);
      t[j] = dq_table(s[j], b[j]);
    }
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
      vf wv[nb][C];
      for (int j = 0; j < nb; ++j) {
        dq_chunk(w + j * ldw + k / 2, s[j], b[j], t[j], wv[j]);
      }
      for (int i = 0; i < mb; ++i)
        for (int c = 0; c < C; ++c) {
          vf xv = vload(x + i * ldx + k + c * VL);
          for (int j = 0; j < nb; ++j) acc[i][j] = vfma(xv, wv[j][c], acc[i][j]);
        }
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) out[i][j] = vsum(acc[i][j]);
}

// Where results go: the output tensor's dtype, a per-row scale (int8) and a bias, applied once per element.
struct Sink {
  float* f32 = nullptr;
  c10::BFloat16* bf16 = nullptr;
  int64_t ld = 0;
  const float* scale = nullptr;  // [N] or null
  const float* bias = nullptr;   // [N] or null
  inline void put(int64_t m, int64_t n, float v) const {
    if (scale) v *= scale[n];
    if (bias) v += bias[n];
    if (f32) f32[m * ld + n] = v;
    else bf16[m * ld + n] = c10::BFloat16(v);
  }
};

template <int mb, int nb, typename Tile>
inline void run_tile(const Tile& tile, int64_t m0, int64_t n0, const Sink& sink) {
  float out[MB][NB];
  tile.template operator()<mb, nb>(m0, n0, out);
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) sink.put(m0 + i, n0 + j, out[i][j]);
}

// Dispatch the runtime remainder sizes (1..MB rows, 1..NB weight rows) to compile-time tiles.
template <int nb, typename Tile>
inline void rows_m(const Tile& tile, int64_t M, int64_t n0, const Sink& sink) {
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) run_tile<MB, nb>(tile, m0, n0, sink);
  const int64_t r = M - m0;
  if (r == 1) run_tile<1, nb>(tile, m0, n0, sink);
  if constexpr (MB > 2) {
    if (r == 2) run_tile<(MB > 2 ? 2 : 1), nb>(tile, m0, n0, sink);
    if (r == 3) run_tile<(MB > 3 ? 3 : 1), nb>(tile, m0, n0, sink);
  }
}

template <typename Tile>
inline void by_nb(const Tile& tile, int64_t M, int64_t n0, int64_t nb, const Sink& sink) {
  switch (nb) {
    case NB: rows_m<NB>(tile, M, n0, sink); break;
    case 3: rows_m<3>(tile, M, n0, sink); break;
    case 2: rows_m<2>(tile, M, n0, sink); break;
    default: rows_m<1>(tile, M, n0, sink); break;
  }
}

// Weight rows already widened to fp32 (one tile's rows, starting at output row n_base).
struct PanelTile {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t K, n_base;
  template <int mb, int nb>
  void operator()(int64_t m0, int64_t n0, float (*out)[NB]) const {
    dot_tile<float, mb, nb>(x + m0 * ldx, ldx, w + (n0 - n_base) * K, K, K, out);
  }
};

// All M rows times output rows in blocks of NB, the blocks split across torch's intra-op threads. With more
// activation rows than one tile holds, each block's weights are widened once into an fp32 panel and every
// row tile reads that: the same products in the same order as the streaming path, so results do not depend on M.
template <typename Tile>
void for_all_tiles(const Tile& tile, int64_t M, int64_t N, int64_t bytes_per_row, const Sink& sink) {
  const int64_t blocks = (N + NB - 1) / NB;
  // Enough weight bytes per task that a thread's start-up (a few microseconds) is paid back.
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(1, NB * bytes_per_row));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> panel;
    const bool widen = M > MB;
    if (widen) panel.resize(NB * tile.kd());
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nb = std::min<int64_t>(NB, N - n0);
      if (widen) {
        tile.panel(n0, nb, panel.data());
        by_nb(PanelTile{tile.x, tile.ldx, panel.data(), tile.kd(), n0}, M, n0, nb, sink);
      } else {
        by_nb(tile, M, n0, nb, sink);
      }
    }
  });
}

// x as contiguous fp32 [M, Kp] (zero-padded past K); a view of x itself where no copy is needed.
struct Activations {
  at::Tensor keep;
  const float* p;
  int64_t ld;
};

Activations activations(const at::Tensor& x, int64_t Kp) {
  TORCH_CHECK(x.dim() == 2, "llmrt kernels: x must be 2-D [rows, in_features], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "llmrt kernels: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "llmrt kernels: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(1);
  if (x.scalar_type() == at::kFloat && x.stride(1) == 1 && Kp == K) return {x, x.data_ptr<float>(), x.stride(0)};
  at::Tensor xf = at::empty({x.size(0), Kp}, x.options().dtype(at::kFloat));
  if (Kp > K) xf.narrow(1, K, Kp - K).zero_();
  xf.narrow(1, 0, K).copy_(x);
  return {xf, xf.data_ptr<float>(), Kp};
}

std::pair<at::Tensor, Sink> output(const at::Tensor& x, int64_t N) {
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  Sink s;
  s.ld = N;
  if (y.scalar_type() == at::kFloat) s.f32 = y.data_ptr<float>();
  else s.bf16 = y.data_ptr<c10::BFloat16>();
  return {y, s};
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N, "llmrt kernels: bias has ", bias->numel(), " values for ", N, " outputs");
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

template <typename WT>
struct DotTile {
  const float* x;
  int64_t ldx;
  const WT* w;
  int64_t K;
  int64_t kd() const { return K; }
  template <int mb, int nb>
  void operator()(int64_t m0, int64_t n0, float (*out)[NB]) const {
    dot_tile<WT, mb, nb>(x + m0 * ldx, ldx, w + n0 * K, K, K, out);
  }
  void panel(int64_t n0, int64_t nb, float* dst) const {
    for (int64_t j = 0; j < nb; ++j) {
      const WT* src = w + (n0 + j) * K;
      int64_t k = 0;
      for (; k + VL <= K; k += VL) vstore(dst + j * K + k, wload(src + k));
      for (; k < K; ++k) dst[j * K + k] = to_f(src[k]);
    }
  }
};

struct Int4Tile {
  const float* x;
  int64_t ldx;
  const uint8_t* w;
  int64_t Kp;
  const uint16_t* sz;
  int64_t G, gs;
  int64_t kd() const { return Kp; }
  template <int mb, int nb>
  void operator()(int64_t m0, int64_t n0, float (*out)[NB]) const {
    int4_tile<mb, nb>(x + m0 * ldx, ldx, w + n0 * (Kp / 2), Kp / 2, sz + n0 * G * 2, G, gs, out);
  }
  void panel(int64_t n0, int64_t nb, float* dst) const {  // the same fma(q, s, z - 8s) as int4_tile
    constexpr int C = 32 / VL;
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* src = w + (n0 + j) * (Kp / 2);
      const uint16_t* gz = sz + (n0 + j) * G * 2;
      for (int64_t g = 0; g < G; ++g) {
        const float sc = to_f(gz[2 * g]), z = to_f(gz[2 * g + 1]);
        const vf s = vset1(sc), bb = vset1(z - 8.0f * sc), t = dq_table(s, bb);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
          vf wv[C];
          dq_chunk(src + k / 2, s, bb, t, wv);
          for (int c = 0; c < C; ++c) vstore(dst + j * Kp + k + c * VL, wv[c]);
        }
      }
    }
  }
};

// Dense weights stored as WT (fp32, or bf16 as its raw 16 bits): one path, the loads differ.
template <typename WT>
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        at::ScalarType wtype, const char* what) {
  TORCH_CHECK(w.scalar_type() == wtype && w.dim() == 2 && w.is_contiguous(),
              "llmrt kernels: w must be a contiguous ", what, " [out, in] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "llmrt kernels: x ", x.sizes(), " does not match w ", w.sizes());
  Activations a = activations(x, K);
  auto [y, sink] = output(x, N);
  at::Tensor bkeep;
  sink.bias = bias_ptr(bias, N, bkeep);
  DotTile<WT> tile{a.p, a.ld, reinterpret_cast<const WT*>(w.data_ptr()), K};
  for_all_tiles(tile, x.size(0), N, int64_t(sizeof(WT)) * K, sink);
  return y;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return linear_dense<uint16_t>(x, w, bias, at::kBFloat16, "bfloat16");
}

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return linear_dense<float>(x, w, bias, at::kFloat, "float32");
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              "llmrt kernels: q must be a contiguous int8 [out, in] matrix");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "llmrt kernels: scale must be float32 [out]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "llmrt kernels: x ", x.sizes(), " does not match q ", q.sizes());
  Activations a = activations(x, K);
  auto [y, sink] = output(x, N);
  at::Tensor bkeep;
  sink.bias = bias_ptr(bias, N, bkeep);
  sink.scale = scale.data_ptr<float>();
  DotTile<int8_t> tile{a.p, a.ld, q.data_ptr<int8_t>(), K};
  for_all_tiles(tile, x.size(0), N, K, sink);
  return y;
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "llmrt kernels: packed must be a contiguous uint8 [out, in/2] matrix");
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0, "llmrt kernels: group size must be a multiple of 32");
  const int64_t N = packed.size(0), Kp = packed.size(1) * 2, G = Kp / group_size;
  TORCH_CHECK(Kp % group_size == 0, "llmrt kernels: padded in_features ", Kp, " is not a multiple of the group");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == N * G * 2,
              "llmrt kernels: sz must be contiguous bfloat16 [out, groups, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= Kp && x.size(1) > Kp - group_size,
              "llmrt kernels: x ", x.sizes(), " does not match in_features padded to ", Kp);
  Activations a = activations(x, Kp);
  auto [y, sink] = output(x, N);
  at::Tensor bkeep;
  sink.bias = bias_ptr(bias, N, bkeep);
  Int4Tile tile{a.p, a.ld, packed.data_ptr<uint8_t>(), Kp, reinterpret_cast<const uint16_t*>(sz.data_ptr()), G,
                group_size};
  for_all_tiles(tile, x.size(0), N, Kp / 2 + G * 4, sink);
  return y;
}

void dequantize_int4(const at::Tensor& packed, const at::Tensor& sz, int64_t group_size, at::Tensor out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
              sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && group_size % 32 == 0,
              "llmrt kernels: dequantize_int4 wants packed uint8 [out, in/2], bf16 sz, a group size multiple of 32");
  const int64_t N = packed.size(0), Kp = packed.size(1) * 2, G = Kp / group_size;
  TORCH_CHECK(out.is_contiguous() && out.size(0) == N && out.size(1) == Kp &&
              (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "llmrt kernels: out must be contiguous float32/bfloat16 [", N, ", ", Kp, "]");
  Int4Tile tile{nullptr, 0, packed.data_ptr<uint8_t>(), Kp, reinterpret_cast<const uint16_t*>(sz.data_ptr()), G,
                group_size};
  const bool f32 = out.scalar_type() == at::kFloat;
  float* of = f32 ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* ob = f32 ? nullptr : out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (N + NB - 1) / NB;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (int64_t(64) << 10) / (NB * Kp / 2)), [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> panel;
    panel.resize(NB * Kp);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nb = std::min<int64_t>(NB, N - n0);
      if (f32) {
        tile.panel(n0, nb, of + n0 * Kp);
        continue;
      }
      tile.panel(n0, nb, panel.data());
      for (int64_t t = 0; t < nb * Kp; ++t) ob[n0 * Kp + t] = c10::BFloat16(panel[t]);
    }
  });
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
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor", &linear_bf16);
  m.def("linear_fp32(Tensor x, Tensor w, Tensor? bias) -> Tensor", &linear_fp32);
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor", &linear_int8);
  m.def("linear_int4(Tensor x, Tensor packed, Tensor sz, int group_size, Tensor? bias) -> Tensor", &linear_int4);
  m.def("dequantize_int4(Tensor packed, Tensor sz, int group_size, Tensor(a!) out) -> ()", &dequantize_int4);
  m.def("isa() -> str", &isa);
}
