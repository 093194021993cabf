// Causal attention of one prefill span, fused: each query row's scores, online softmax and probability-weighted
// sum of values are computed block by block of LANES keys, in registers, without materializing the scores.
//
// Why not two matmuls around a softmax: the spans of a batched prefill are short (64-512 queries), and torch's
// float32 bmm ran their [group * n, D] x [D, ctx] shapes at 30-55 GFLOP/s on 2 cores (and its flash SDPA at
// 30-80); here every (query, key) pair costs 2 x D fused multiply-adds on data in L1/L2.
//
// Layout: K and V of the span's context are first converted to float32 per KV head, K transposed in blocks of
// LANES keys (kt[h][block][d][lane]) so a block's scores are D broadcast-FMAs per query row, V row-major. Work
// units are (KV head, chunk of query positions); a unit walks its rows (position-major, the group's query heads
// minor) in register tiles of R rows, each tile over the key blocks its rows can see. Softmax is the online
// (flash) form in float32: running max m, sum l, accumulator O rescaled by exp(m_old - m_new).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention_common.h"

namespace {

using namespace llmrt_attn_common;
constexpr int64_t POS_CHUNK = 32;  // query positions per work unit (x the group's heads = rows)
// Query rows per register tile: the scores' R accumulators, then one output vector of each row at a time, so R
// does not grow with the head dim. Measured (2 threads, D 64): R 4 / 6 / 8 at 111 / 132 / 131 GFLOP/s with
// AVX-512, 90 / 106 / 110 with the AVX2 build.
constexpr int64_t R = 8;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();


// [ctx, KVH, D] (row stride `rs`) -> kt [KVH][blocks][D][L] and vf [KVH][blocks * L][D], float32, zero-padded.
// (kt == nullptr: V only.)
template <typename T>
void convert_kv(const T* k, const T* v, int64_t k_rs, int64_t v_rs, int64_t ctx, int64_t kv_heads, int64_t d,
                float* kt, float* vv) {
  const int64_t blocks = (ctx + L - 1) / L;
  at::parallel_for(0, kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h = u / blocks, b = u % blocks;
      float* kb = kt != nullptr ? kt + (h * blocks + b) * d * L : nullptr;
      float* vb = vv + (h * blocks + b) * L * d;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t t = b * L + j;
        if (t < ctx) {
          const T* kr = k + t * k_rs + h * d;
          const T* vr = v + t * v_rs + h * d;
          if (kb != nullptr) {
            for (int64_t i = 0; i < d; ++i) kb[i * L + j] = to_float(kr[i]);
          }
          for (int64_t i = 0; i < d; ++i) vb[j * d + i] = to_float(vr[i]);
        } else {
          if (kb != nullptr) {
            for (int64_t i = 0; i < d; ++i) kb[i * L + j] = 0.f;
          }
          std::memset(vb + j * d, 0, d * sizeof(float));
        }
      }
    }
  });
}

#if defined(LLMRT_AVX512)
// bf16 K as vdpbf16ps takes it: kp [KVH][blocks][D/2][L][2], the pair (d, d+1) of each of a block's L keys.
void convert_k_pairs(const c10::BFloat16* k, int64_t k_rs, int64_t ctx, int64_t kv_heads, int64_t d, uint16_t* kp) {
  const int64_t blocks = (ctx + L - 1) / L;
  at::parallel_for(0, kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h = u / blocks, b = u % blocks;
      uint16_t* kb = kp + (h * blocks + b) * d * L;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t t = b * L + j;
        const uint16_t* kr = reinterpret_cast<const uint16_t*>(k + t * k_rs + h * d);
        for (int64_t i = 0; i < d / 2; ++i) {
          kb[(i * L + j) * 2] = t < ctx ? kr[2 * i] : 0;
          kb[(i * L + j) * 2 + 1] = t < ctx ? kr[2 * i + 1] : 0;
        }
      }
    }
  });
}

// A block's scores of R bf16 query rows (q: R x D/2 pairs as uint32) by vdpbf16ps: products exact in float32,
// half the instructions of the FMA path over float32 K.
template <int64_t NDV, int64_t R>
__attribute__((target("avx512bf16,avx512bw,avx512f,avx512vl,avx512dq"))) void scores_bf16dot(
    const uint32_t* q, const uint16_t* kb, vf* s) {
  constexpr int64_t DP = NDV * L / 2;
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < DP; ++i) {
    const __m512i kv = _mm512_loadu_si512(kb + i * 2 * L);
    for (int64_t r = 0; r < R; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * DP + i])), (__m512bh)kv);
    }
  }
  for (int64_t r = 0; r < R; ++r) s[r] = (vf)acc[r];
}
#endif

// One register tile of R query rows (NDV = D / L vectors each) against keys [0, hi_max) of one KV head.
// q: R rows of D floats, already scaled; pos/lo/hi per row: visible keys [lo, hi). Writes O / l to out.
// bf16 pairs (qp, kp: the bf16dot path, scores scaled after) when qp is set, else q pre-scaled against kt.
template <int64_t NDV, int64_t R>
void tile(const float* q, const uint32_t* qp, float scale, const int64_t* lo, const int64_t* hi, const float* kt,
          const uint16_t* kp, const float* vv, float* out) {
  constexpr int64_t D = NDV * L;
  vf acc[R][NDV];
  float m[R], l[R];
  for (int64_t r = 0; r < R; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.f;
    for (int64_t x = 0; x < NDV; ++x) acc[r][x] = vf{};
  }
  int64_t lo_min = lo[0], hi_max = hi[0];
  for (int64_t r = 1; r < R; ++r) lo_min = std::min(lo_min, lo[r]), hi_max = std::max(hi_max, hi[r]);
  vi lane;
  for (int64_t j = 0; j < L; ++j) lane[j] = static_cast<int32_t>(j);
  alignas(64) float p[R][L];
  for (int64_t b = lo_min / L; b * L < hi_max; ++b) {
    vf s[R];
#if defined(LLMRT_AVX512)
    if (qp != nullptr) {
      scores_bf16dot<NDV, R>(qp, kp + b * D * L, s);
      for (int64_t r = 0; r < R; ++r) s[r] *= scale;
    } else
#endif
    {
      const float* kb = kt + b * D * L;
      for (int64_t r = 0; r < R; ++r) s[r] = vf{};
      for (int64_t i = 0; i < D; ++i) {
        const vf kv = vload(kb + i * L);
        for (int64_t r = 0; r < R; ++r) s[r] += q[r * D + i] * kv;
      }
    }
    const int64_t k0 = b * L;
    for (int64_t r = 0; r < R; ++r) {
      const bool whole = k0 >= lo[r] && k0 + L <= hi[r];
      vi keep{};
      if (!whole) {
        const vi idx = lane + static_cast<int32_t>(k0);
        keep = (idx >= static_cast<int32_t>(lo[r])) & (idx < static_cast<int32_t>(hi[r]));
        s[r] = keep ? s[r] : vf{} + NEG_INF;
      }
      const float bm = hmax(s[r]);
      if (bm == NEG_INF) {  // nothing visible in this block for this row
        std::memset(p[r], 0, sizeof(p[r]));
        continue;
      }
      if (bm > m[r]) {
        const float alpha = std::exp(m[r] - bm);  // 0 on the row's first visible block
        l[r] *= alpha;
        for (int64_t x = 0; x < NDV; ++x) acc[r][x] *= alpha;
        m[r] = bm;
      }
      vf e = exp_poly<vf, vi>(s[r] - m[r]);
      if (!whole) e = keep ? e : vf{};
      l[r] += hsum(e);
      std::memcpy(p[r], &e, sizeof(vf));
    }
    const float* vb = vv + k0 * D;
    for (int64_t x = 0; x < NDV; ++x) {  // one vector of the R rows' outputs at a time: R accumulators live
      for (int64_t j = 0; j < L; ++j) {
        const vf v = vload(vb + j * D + x * L);
        for (int64_t r = 0; r < R; ++r) acc[r][x] += p[r][j] * v;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];
    for (int64_t x = 0; x < NDV; ++x) {
      const vf o = acc[r][x] * inv;
      std::memcpy(out + r * D + x * L, &o, sizeof(vf));
    }
  }
}

template <int64_t NDV, typename T>
void attend(const T* q, int64_t q_rs, T* out, const float* kt, const uint16_t* kp, const float* vv, int64_t n,
            int64_t ctx, int64_t heads, int64_t kv_heads, float scale, int64_t window) {
  constexpr int64_t D = NDV * L;
  const int64_t group = heads / kv_heads, offset = ctx - n, blocks = (ctx + L - 1) / L;
  const int64_t chunks = (n + POS_CHUNK - 1) / POS_CHUNK, units = chunks * kv_heads;
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(units)));
  // Later chunks see more keys: hand them out first, one unit at a time.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t chunk = chunks - 1 - u / kv_heads, h = u % kv_heads;
    const int64_t i0 = chunk * POS_CHUNK, i1 = std::min(n, i0 + POS_CHUNK);
    const int64_t rows = (i1 - i0) * group;
    const float* kth = kt + h * blocks * D * L;
    const uint16_t* kph = kp != nullptr ? kp + h * blocks * D * L : nullptr;
    alignas(64) uint32_t qpt[R * D / 2];
    const float* vh_ = vv + h * blocks * L * D;
    alignas(64) float qt[R * D];
    alignas(64) float ot[R * D];
    int64_t lo[R], hi[R];
    for (int64_t t = 0; t < rows; t += R) {
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = std::min(t + r, rows - 1);  // a short last tile repeats its last row
        const int64_t i = i0 + row / group, head = h * group + row % group;
        const T* qr = q + i * q_rs + head * D;
        if (kph != nullptr) {
          std::memcpy(qpt + r * D / 2, qr, D * sizeof(T));  // bf16: D/2 pairs, unscaled (bf16dot path)
        } else {
          for (int64_t x = 0; x < D; ++x) qt[r * D + x] = to_float(qr[x]) * scale;
        }
        const int64_t pos = offset + i;
        hi[r] = pos + 1;
        lo[r] = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
      }
      tile<NDV, R>(qt, kph != nullptr ? qpt : nullptr, scale, lo, hi, kth, kph, vh_, ot);
      for (int64_t r = 0; r < R && t + r < rows; ++r) {
        const int64_t row = t + r;
        const int64_t i = i0 + row / group, head = h * group + row % group;
        T* o = out + (i * heads + head) * D;
        for (int64_t x = 0; x < D; ++x) to_out(o + x, ot[r * D + x]);
      }
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, float* kt, float* vv,
         float scale, int64_t window) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), ctx = k.size(0), kv_heads = k.size(1);
  const uint16_t* kp = nullptr;
#if defined(LLMRT_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (llmrt_attn_bf16dot && (d / L) % 2 == 0) {  // a whole number of 512-bit pair vectors per row: D % 32 == 0
      // no float32 K on this path: kt's space holds the pairs
      convert_k_pairs(k.data_ptr<c10::BFloat16>(), k.stride(0), ctx, kv_heads, d, reinterpret_cast<uint16_t*>(kt));
      kp = reinterpret_cast<const uint16_t*>(kt);
    }
  }
#endif
  convert_kv(k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), v.stride(0), ctx, kv_heads, d, kp ? nullptr : kt, vv);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  switch (d / L) {
#define LLMRT_ATTEND(NDV) \
  case NDV: attend<NDV, T>(qp, q.stride(0), op, kt, kp, vv, n, ctx, heads, kv_heads, scale, window); break;
    LLMRT_ATTEND(1) LLMRT_ATTEND(2) LLMRT_ATTEND(4) LLMRT_ATTEND(8) LLMRT_ATTEND(16)
#undef LLMRT_ATTEND
    default: TORCH_CHECK(false, "prefill_attention: head dim ", d, " is not supported");
  }
}

// q [n, H, D] (the span's queries, at the last n of its ctx positions), k, v [ctx, KVH, D]; float32 or bfloat16,
// all the same dtype, heads contiguous within a row (any row stride). Returns [n, H, D] in q's dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prefill_attention: q, k, v must share a dtype, float32 or bfloat16");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), ctx = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(v.size(0) == ctx && v.size(1) == kv_heads && k.size(2) == d && v.size(2) == d && n <= ctx && n > 0 &&
                  heads % kv_heads == 0,
              "prefill_attention: shapes q [n, H, D], k, v [ctx >= n, KVH, D] with H a multiple of KVH");
  TORCH_CHECK(d % L == 0 && d / L <= 16 && ((d / L) & (d / L - 1)) == 0,
              "prefill_attention: head dim ", d, " must be ", L, " x a power of two up to ", 16 * L,
              " in this build (prefill_supports)");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "prefill_attention: heads must be contiguous in a row");
  }
  auto out = at::empty({n, heads, d}, q.options());
  const int64_t padded = (ctx + L - 1) / L * L;
  auto scratch = at::empty({2, kv_heads, padded, d}, q.options().dtype(at::kFloat));
  float* kt = scratch.data_ptr<float>();
  float* vv = kt + kv_heads * padded * d;
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, out, kt, vv, static_cast<float>(scale), window);
  } else {
    run<c10::BFloat16>(q, k, v, out, kt, vv, static_cast<float>(scale), window);
  }
  return out;
}

// Whether prefill_attention takes this head dim in this build (LANES x a power of two, up to 16 x LANES).
bool prefill_supports(int64_t head_dim) {
  const int64_t v = head_dim / L;
  return head_dim > 0 && head_dim % L == 0 && v <= 16 && (v & (v - 1)) == 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_attn, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window) -> Tensor");
  m.def("prefill_supports(int head_dim) -> bool");
}

TORCH_LIBRARY_IMPL(llmrt_attn, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
TORCH_LIBRARY_IMPL(llmrt_attn, CatchAll, m) { m.impl("prefill_supports", &prefill_supports); }
