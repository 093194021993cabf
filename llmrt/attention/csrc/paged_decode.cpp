// Decode attention that reads K/V blocks where they are in the paged cache (no per-layer gather copy).
// One query token per sequence; GQA (a group of query heads shares a KV head); optional sliding window.
// Per (sequence, KV head): scores for the group's heads over the context, softmax, weighted sum of V rows.
// Vectorized over head_dim with GCC vector extensions (the lane count follows the build's ISA flags: AVX-512 16,
// AVX2 8, otherwise 4); a bf16 cache is widened in registers. `paged_decode_write` first stores the step's new
// K/V rows at their cache slots (one call per layer instead of two index_copy_ and their views), `cache_write`
// does only that (steps with prefill spans).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(LLMRT_AVX512)
#include <immintrin.h>
#endif

#include "attention_common.h"

namespace {

using namespace llmrt_attn_common;

// The reference loop, for head dimensions the vector path does not take.
// Q: the query and output type (float or bf16: converted here, so the caller makes no float copies).
template <typename KV, typename Q>
void decode_generic(const Q* q_in, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lens,
                   Q* out, int64_t num_seqs, int64_t table_width, int64_t block_size, int64_t heads,
                   int64_t kv_heads, int64_t dim, double scale, int64_t window, int64_t q_stride) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;  // elements per cached token
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim), inv(group), qf(group * dim);  // per thread, reused
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, h = work % kv_heads;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(group * n);  // every entry is written below before it is read
      const Q* qin = q_in + s * q_stride + h * group * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = to_float(qin[i]);
      const float* qs = qf.data();
      const int64_t* table = tables + s * table_width;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const KV* k = k_cache + (table[pos / block_size] * block_size + pos % block_size) * row + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qs + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qg[d] * to_float(k[d]);
          scores[g * n + t] = dot * static_cast<float>(scale);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        inv[g] = 1.f / sum;
      }
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const KV* v = v_cache + (table[pos / block_size] * block_size + pos % block_size) * row + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * to_float(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        Q* o = out + (s * heads + h * group + g) * dim;
        const float* a = acc.data() + g * dim;
        for (int64_t d = 0; d < dim; ++d) to_out(o + d, a[d] * inv[g]);
      }
    }
  });
}

inline vf vexp(vf x) { return exp_poly<vf, vi>(x); }

constexpr int LOG_L = L == 16 ? 4 : L == 8 ? 3 : 2;
// Shuffle masks for sum_rows: at level k a vector holds 2^k rows of L >> k lanes each; two such vectors become
// one of 2^(k+1) rows of half the lanes, the lower half of each row's lanes plus its upper half. Compile-time
// constants, so that each shuffle is one fixed-pattern instruction (masks held in registers became a vpermps per
// input and a blend: the K pass's largest cost after its FMAs).
constexpr int32_t row_src(int k, bool upper, int o) {
  const int m = static_cast<int>(L) >> k, half = m / 2, rows = 1 << k;
  const int row = o / half, e = o % half;
  return (row < rows ? row * m + e : static_cast<int>(L) + (row - rows) * m + e) + (upper ? half : 0);
}
template <int k, bool upper, int... o>
constexpr vi row_mask(std::integer_sequence<int, o...>) {
  return vi{row_src(k, upper, o)...};
}
template <int k, bool upper>
constexpr vi ROW_MASK = row_mask<k, upper>(std::make_integer_sequence<int, static_cast<int>(L)>{});

template <int k>
inline void sum_level(vf* v) {
  constexpr int n = static_cast<int>(L) >> k;
  for (int p = 0; p < n / 2; ++p) {
    v[p] = __builtin_shuffle(v[2 * p], v[2 * p + 1], ROW_MASK<k, false>) +
           __builtin_shuffle(v[2 * p], v[2 * p + 1], ROW_MASK<k, true>);
  }
  if constexpr (k + 1 < LOG_L) sum_level<k + 1>(v);
}
// v[0..L): lane i of the result is the sum of v[i]'s lanes, added in hsum's order (lane j + lane j + L/2 first).
// Overwrites v.
inline vf sum_rows(vf* v) {
  sum_level<0>(v);
  return v[0];
}

// Asks for a token's row of the unit's heads (`bytes` of it) to be brought into L2. V: while the K pass reads the
// same token's K row, so that the V pass finds it there. Measured (64 W1-like sequences, 12 layers, 2 threads,
// bf16): 18.7 -> 15.2 ms with the blocks in order, 22.4 -> 17.7 ms shuffled; into L1 (locality 3) only 0.91x.
// K: the row K_AHEAD tokens on, which crosses into the next block before the K pass gets there (blocks lie anywhere
// in a cache that has been in use a while, and the hardware prefetcher loses the stream at each block's start).
template <typename KV>
inline void prefetch_row(const KV* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}
// Measured on a Zen 4 (benchmarks/attention_decode_ab.py: 64 W1-like sequences, contexts 64-640 in shuffled blocks
// of 16, 12 layers, 2 threads, bf16, vdpbf16ps K pass, caches cold): 4 / 8 / 12 / 16 tokens ahead 0.81 / 0.71-0.74
// / 0.75 / 0.79x the time without; with each sequence's blocks in order (a fresh engine's prompts) level (0.94-1.07x
// between runs, either build). Prefetching only near a break in a run of rows measured the same as every row (3
// runs, AVX2 build: 0.93-1.14x in order, 0.96-1.05x shuffled), so every row it is.
constexpr int64_t K_AHEAD = 8;

// What both K passes ask for at token t of n: its V row now, the K row K_AHEAD tokens on (`bytes` of each row).
// Always inlined: a helper not inlined into the vdpbf16ps K pass (another target) spilled its registers every token.
template <typename KV>
__attribute__((always_inline)) inline void prefetch_at(const KV* k_cache, const KV* v_cache, const int64_t* offs,
                                                       int64_t t, int64_t n, int64_t bytes) {
  prefetch_row(v_cache + offs[t], bytes);
  if (t + K_AHEAD < n) prefetch_row(k_cache + offs[t + K_AHEAD], bytes);
}

}  // namespace

bool llmrt_attn_bf16dot = false;  // attention_common.h

namespace {

#if defined(LLMRT_AVX512)
// The K pass of a bf16 query over a bf16 cache with vdpbf16ps: each lane takes a pair of bf16 products straight
// from the loaded rows (no widening to fp32; products exact in fp32, sums rounded to nearest as the FMA path's,
// denormals flushed), 2 instructions a (token, query head) for head_dim 64 instead of 4 loads widened and 4 FMAs.
// The L-lane vectors then go through the same `sum_rows` tree. Scores differ from the FMA path in the last bits
// (pairs summed in another order), not from one batch to another.
template <int NC>
__attribute__((target("avx512bf16,avx512bw,avx512f,avx512vl,avx512dq"))) void k_pass_bf16dot_impl(
    const c10::BFloat16* qin, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* offs,
    int64_t n, int64_t per, int64_t group, float sc, float* scores, int64_t np, vf* dots) {
  constexpr int NP = NC / 2;  // 512-bit registers of 32 bf16 a head row
  constexpr int64_t dim = NC * L;
  const int64_t nh = per * group;
  __m512i qv[64 * NP];  // query heads x NP: nh <= 64 (checked by the caller)
  for (int64_t j = 0; j < nh; ++j)
    for (int p = 0; p < NP; ++p) qv[j * NP + p] = _mm512_loadu_si512(qin + j * dim + p * 32);
  for (int64_t t0 = 0; t0 < n; t0 += L) {
    const int64_t m = std::min<int64_t>(L, n - t0);
    for (int64_t i = 0; i < m; ++i) {
      prefetch_at(k_cache, v_cache, offs, t0 + i, n, per * dim * 2);
      const c10::BFloat16* krow = k_cache + offs[t0 + i];
      for (int64_t hh = 0; hh < per; ++hh) {
        __m512i kb[NP];
        for (int p = 0; p < NP; ++p) kb[p] = _mm512_loadu_si512(krow + hh * dim + p * 32);
        for (int64_t g = 0; g < group; ++g) {
          const __m512i* qj = qv + (hh * group + g) * NP;
          __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qj[0], (__m512bh)kb[0]);
          for (int p = 1; p < NP; ++p) d = _mm512_dpbf16_ps(d, (__m512bh)qj[p], (__m512bh)kb[p]);
          dots[(hh * group + g) * L + i] = (vf)d;
        }
      }
    }
    for (int64_t j = 0; j < nh; ++j) {
      for (int64_t i = m; i < L; ++i) dots[j * L + i] = vf{};
      const vf r = sum_rows(dots + j * L) * sc;
      std::memcpy(scores + j * np + t0, &r, sizeof(vf));
    }
  }
}
#endif

// Runs the vdpbf16ps K pass and returns true where it applies (AVX-512 build, bf16 query and cache, head_dim a
// multiple of 32, llmrt_attn_bf16dot set); false: the caller's FMA K pass.
template <int NC, typename KV, typename Q>
bool k_pass_bf16dot(const Q* qin, const KV* k_cache, const KV* v_cache, const int64_t* offs, int64_t n, int64_t per,
                    int64_t group, float sc, float* scores, int64_t np, vf* dots) {
#if defined(LLMRT_AVX512)
  if constexpr (std::is_same_v<KV, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16> && NC % 2 == 0 && L == 16) {
    if (llmrt_attn_bf16dot && per * group <= 64) {
      k_pass_bf16dot_impl<NC>(qin, k_cache, v_cache, offs, n, per, group, sc, scores, np, dots);
      return true;
    }
  }
#endif
  return false;
}

// The K pass by FMAs, L tokens at a time. For each query head the L tokens' products accumulate side by side, L
// independent chains of NC FMAs (one chain a score left the FMA unit waiting on its latency), each in the order
// the one-chain loop used, and `sum_rows` turns the L vectors into the L scores (3 vector ops a score instead of a
// scalar tree; hsum's order): the same bits as before. The L tokens' K rows are first copied (a bf16 cache's
// widened) into `kbuf` token by token, each token's KV heads as one contiguous read in cache order (reading one
// head of every token in turn, 128 of every 512 bytes, was slower on a 64-sequence step), up to k_heads_max()
// heads at a time so that kbuf stays in L1; each token's V row is prefetched meanwhile (prefetch_v_row). Lanes of
// tokens past the context get some row's score: the softmax overwrites them.
constexpr int64_t KBUF_BYTES = 16384;
template <int NC>
constexpr int64_t k_heads_max() {
  return std::max<int64_t>(1, KBUF_BYTES / (L * NC * static_cast<int64_t>(sizeof(vf))));
}
template <int NC, typename KV>
void k_pass_fma(const vf* q, const KV* k_cache, const KV* v_cache, const int64_t* offs, int64_t n, int64_t per,
                int64_t group, float sc, float* scores, int64_t np, vf* kbuf) {
  constexpr int64_t dim = NC * L, hmax = k_heads_max<NC>();
  const int64_t unit_bytes = per * dim * static_cast<int64_t>(sizeof(KV));
  for (int64_t t0 = 0; t0 < n; t0 += L) {
    const int64_t m = std::min<int64_t>(L, n - t0);
    for (int64_t h0 = 0; h0 < per; h0 += hmax) {
      const int64_t hn = std::min(hmax, per - h0);
      for (int64_t i = 0; i < L; ++i) {  // token i's hn heads: kbuf[(i * hn + hh) * NC + c]
        const int64_t off = offs[t0 + std::min(i, m - 1)];
        if (h0 == 0 && i < m) prefetch_at(k_cache, v_cache, offs, t0 + i, n, unit_bytes);
        const KV* row = k_cache + off + h0 * dim;
        vf* dst = kbuf + i * hn * NC;
        for (int64_t hh = 0; hh < hn; ++hh) {
          for (int c = 0; c < NC; ++c) dst[hh * NC + c] = vload(row + hh * dim + c * L);
        }
      }
      for (int64_t hh = 0; hh < hn; ++hh) {
        const vf* kr[L];
        for (int i = 0; i < L; ++i) kr[i] = kbuf + (i * hn + hh) * NC;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = (h0 + hh) * group + g;
          const vf* qj = q + j * NC;
          vf d[L];
          for (int i = 0; i < L; ++i) d[i] = qj[0] * kr[i][0];
          for (int c = 1; c < NC; ++c) {
            const vf qc = qj[c];
            for (int i = 0; i < L; ++i) d[i] += qc * kr[i][c];
          }
          const vf r = sum_rows(d) * sc;
          std::memcpy(scores + j * np + t0, &r, sizeof(vf));
        }
      }
    }
  }
}

// The V pass with a KV head's G query heads accumulating in registers (G x CC vectors: CC of the head's NC
// columns at a time, so that the accumulators and a V row's CC vectors fit AVX2's 16 registers) over L tokens at a
// time (one block's rows, re-read from L1 for each KV head and column chunk), instead of a load and a store of every
// accumulator for every token. Each accumulator sees the same FMAs in the same order as the token-major loop: the
// same bits.
template <int NC, int G, int CC, typename KV>
void v_pass(const KV* v_cache, const int64_t* offs, int64_t n, int64_t per, const float* scores, int64_t np,
            vf* acc) {
  constexpr int64_t dim = NC * L;
  for (int64_t t0 = 0; t0 < n; t0 += L) {
    const int64_t m = std::min<int64_t>(L, n - t0);
    for (int64_t hh = 0; hh < per; ++hh) {
      const float* p = scores + hh * G * np + t0;
      for (int c0 = 0; c0 < NC; c0 += CC) {
        vf a[G][CC];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < CC; ++c) a[g][c] = acc[(hh * G + g) * NC + c0 + c];
        for (int64_t i = 0; i < m; ++i) {
          const KV* vrow = v_cache + offs[t0 + i] + hh * dim + c0 * L;
          vf vv[CC];
          for (int c = 0; c < CC; ++c) vv[c] = vload(vrow + c * L);
          for (int g = 0; g < G; ++g) {
            const float pg = p[g * np + i];
            for (int c = 0; c < CC; ++c) a[g][c] += pg * vv[c];
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < CC; ++c) acc[(hh * G + g) * NC + c0 + c] = a[g][c];
      }
    }
  }
}

// The widest column chunk (a power of two dividing NC) whose G x CC accumulators and CC row vectors fit 16 registers
// (all NC where G x NC <= 16, as before the chunking).
template <int NC, int G>
constexpr int v_chunk() {
  if (G * NC <= 16) return NC;
  int cc = NC;
  while (cc > 1 && G * cc + cc > 16) cc /= 2;
  return cc;
}

// v_pass for the group sizes it is instantiated for; false: the caller's loop.
template <int NC, typename KV>
bool v_pass_grouped(int64_t group, const KV* v_cache, const int64_t* offs, int64_t n, int64_t per,
                    const float* scores, int64_t np, vf* acc) {
#define LLMRT_VG(g)                                                                 \
  case g:                                                                           \
    v_pass<NC, g, v_chunk<NC, g>(), KV>(v_cache, offs, n, per, scores, np, acc);    \
    return true;
  switch (group) {
    LLMRT_VG(1)
    LLMRT_VG(2)
    LLMRT_VG(3)
    LLMRT_VG(4)
    LLMRT_VG(6)
    LLMRT_VG(8)
    default:
      return false;
  }
#undef LLMRT_VG
}

// The same attention with the head dimension in NC registers of L lanes (dim == NC * L). A work unit is one
// sequence with all its KV heads when there are enough sequences to share out (W1's batched decode), else one
// (sequence, KV head): the K pass and the V pass walk the unit's tokens in cache order, reading each token's heads
// as one contiguous run (a whole block is one stream, which the hardware prefetcher follows; per-head walks read
// 128 of every 512 bytes and waited on memory), the scores' softmax runs L at a time (a vector exp), and the
// outputs accumulate in an L1-sized buffer.
template <int NC, typename KV, typename Q>
void decode_vec(const Q* q_in, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lens,
                Q* out, int64_t num_seqs, int64_t table_width, int64_t block_size, int64_t heads, int64_t kv_heads,
                double scale, int64_t window, int64_t q_stride) {
  constexpr int64_t dim = NC * L;
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;
  const float sc = static_cast<float>(scale);
  const int64_t split = num_seqs >= 4 * at::get_num_threads() ? 1 : kv_heads;  // units per sequence
  const int64_t per = kv_heads / split, nh = per * group;                      // KV / query heads per unit
  at::parallel_for(0, num_seqs * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv(nh);
    std::vector<vf> q(nh * NC), acc(nh * NC), dots(nh * L), kbuf(L * NC * std::min(per, k_heads_max<NC>()));
    std::vector<int64_t> offs;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / split, h0 = (work % split) * per;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first, np = (n + L - 1) / L * L;
      scores.resize(nh * np);
      offs.resize(n);
      const int64_t* table = tables + s * table_width;
      for (int64_t t = 0, blk = first / block_size, in = first % block_size; t < n; ++t) {  // no division a token
        offs[t] = (table[blk] * block_size + in) * row + h0 * dim;
        if (++in == block_size) in = 0, ++blk;
      }
      const Q* qin = q_in + s * q_stride + h0 * group * dim;
      for (int64_t j = 0; j < nh; ++j) {
        for (int c = 0; c < NC; ++c) {
          for (int64_t i = 0; i < L; ++i) q[j * NC + c][i] = static_cast<float>(qin[j * dim + c * L + i]);
        }
      }
      if (!k_pass_bf16dot<NC>(qin, k_cache, v_cache, offs.data(), n, per, group, sc, scores.data(), np,
                              dots.data())) {
        k_pass_fma<NC>(q.data(), k_cache, v_cache, offs.data(), n, per, group, sc, scores.data(), np, kbuf.data());
      }
      for (int64_t j = 0; j < nh; ++j) {
        float* sg = scores.data() + j * np;
        for (int64_t t = n; t < np; ++t) sg[t] = std::numeric_limits<float>::lowest();  // finite: -ffast-math
        vf mx = vf{} + std::numeric_limits<float>::lowest();
        for (int64_t t = 0; t < np; t += L) {
          const vf x = vload(sg + t);
          mx = x > mx ? x : mx;
        }
        float m = mx[0];
        for (int64_t i = 1; i < L; ++i) m = std::max(m, mx[i]);
        vf sum{};
        for (int64_t t = 0; t < np; t += L) {
          vf e = vexp(vload(sg + t) - m);
          if (t + L > n) {  // padding lanes: exp's clamp would leave ~1e-38, not 0
            for (int64_t i = n - t; i < L; ++i) e[i] = 0.f;
          }
          std::memcpy(sg + t, &e, sizeof(vf));
          sum += e;
        }
        inv[j] = 1.f / hsum(sum);
      }
      std::fill(acc.begin(), acc.end(), vf{});
      if (!v_pass_grouped<NC>(group, v_cache, offs.data(), n, per, scores.data(), np, acc.data())) {
        for (int64_t t = 0; t < n; ++t) {
          const KV* vrow = v_cache + offs[t];
          for (int64_t hh = 0; hh < per; ++hh) {
            vf vv[NC];
            for (int c = 0; c < NC; ++c) vv[c] = vload(vrow + hh * dim + c * L);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t j = hh * group + g;
              const float p = scores[j * np + t];
              vf* a = acc.data() + j * NC;
              for (int c = 0; c < NC; ++c) a[c] += p * vv[c];
            }
          }
        }
      }
      for (int64_t j = 0; j < nh; ++j) {
        Q* o = out + (s * heads + h0 * group + j) * dim;
        for (int c = 0; c < NC; ++c) {
          for (int64_t i = 0; i < L; ++i) to_out(o + c * L + i, acc[j * NC + c][i] * inv[j]);
        }
      }
    }
  });
}

template <typename KV, typename Q>
void decode_kernel(const Q* q_in, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lens,
                   Q* out, int64_t num_seqs, int64_t table_width, int64_t block_size, int64_t heads,
                   int64_t kv_heads, int64_t dim, double scale, int64_t window, int64_t q_stride) {
#define LLMRT_VEC(nc)                                                                                           \
  case nc:                                                                                                      \
    return decode_vec<nc, KV, Q>(q_in, k_cache, v_cache, tables, lens, out, num_seqs, table_width, block_size, \
                                 heads, kv_heads, scale, window, q_stride);
  if (dim % L == 0) {
    switch (dim / L) {
      LLMRT_VEC(1)
      LLMRT_VEC(2)
      LLMRT_VEC(4)
      LLMRT_VEC(8)
      LLMRT_VEC(16)
      default:
        break;
    }
  }
#undef LLMRT_VEC
  decode_generic<KV, Q>(q_in, k_cache, v_cache, tables, lens, out, num_seqs, table_width, block_size, heads,
                        kv_heads, dim, scale, window, q_stride);
}

template <typename Q>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
         const at::Tensor& lens, at::Tensor& out, int64_t block_size, int64_t kv_heads, double scale, int64_t window) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const Q* qp = static_cast<const Q*>(q.data_ptr());
  Q* op = static_cast<Q*>(out.data_ptr());
  if (k_cache.scalar_type() == at::kFloat) {
    decode_kernel<float, Q>(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), op, n, tables.size(1), block_size, heads, kv_heads, dim, scale,
                            window, q.stride(0));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "caches: float32 or bfloat16");
    decode_kernel<c10::BFloat16, Q>(qp, k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
                                    tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), op, n, tables.size(1),
                                    block_size, heads, kv_heads, dim, scale, window, q.stride(0));
  }
}

// q [num_seqs, heads, dim] float32 or bfloat16 (the output, contiguous, has q's dtype; the math is fp32);
// k_cache, v_cache [blocks, block_size, kv_heads, dim] float32 or bfloat16;
// block_tables [num_seqs, width] int64; seq_lens [num_seqs] int64 (context incl. the new token, already cached).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  // q may be a view into the step's fused qkv projection: each token's heads contiguous, tokens strided.
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q: float32 or bfloat16 [n, H, D] with contiguous heads per token");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: contiguous 4-d");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: int64");
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(block_tables.size(0) >= q.size(0) && seq_lens.size(0) >= q.size(0), "one table and length per query");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= block_tables.size(1) * block_size, "seq_lens[", s, "] = ", lens[s],
                " outside its block table");
  }
  auto out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, kv_heads, scale, window);
  } else {
    run<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, kv_heads, scale, window);
  }
  return out;
}

template <typename S, typename D>
void write_rows(const S* src, int64_t tok_stride, int64_t head_stride, D* dst, const int64_t* slots, int64_t tokens,
                int64_t kv_heads, int64_t dim) {
  for (int64_t t = 0; t < tokens; ++t) {
    D* d = dst + slots[t] * kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const S* s = src + t * tok_stride + h * head_stride;
      if constexpr (std::is_same_v<S, D>) {
        std::memcpy(d + h * dim, s, dim * sizeof(D));
      } else {
        for (int64_t e = 0; e < dim; ++e) to_out(d + h * dim + e, to_float(s[e]));
      }
    }
  }
}

// k, v [tokens, kv_heads, dim] (views with contiguous head_dim, e.g. into the qkv projection), float32 or bf16:
// stored (converted to the cache's dtype) at cache rows `slots` [tokens] int64 of k_cache / v_cache.
void cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor& k_cache,
                 at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "caches: contiguous 4-d float32 or bfloat16 of one shape");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots: int64 [tokens]");
  const int64_t tokens = slots.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " outside the cache (", capacity, " slots)");
  }
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(1) == kv_heads && x->size(2) == dim &&
                    x->stride(2) == 1 && (x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16),
                "k/v: float32 or bfloat16 [tokens, kv_heads, dim] with contiguous head_dim");
  }
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& src = i == 0 ? k : v;
    at::Tensor& dst = i == 0 ? k_cache : v_cache;
    const bool src_f = src.scalar_type() == at::kFloat, dst_f = dst.scalar_type() == at::kFloat;
    const auto ts = src.stride(0), hs = src.stride(1);
    if (src_f && dst_f) {
      write_rows(src.data_ptr<float>(), ts, hs, dst.data_ptr<float>(), sp, tokens, kv_heads, dim);
    } else if (src_f) {
      write_rows(src.data_ptr<float>(), ts, hs, dst.data_ptr<c10::BFloat16>(), sp, tokens, kv_heads, dim);
    } else if (dst_f) {
      write_rows(src.data_ptr<c10::BFloat16>(), ts, hs, dst.data_ptr<float>(), sp, tokens, kv_heads, dim);
    } else {
      write_rows(src.data_ptr<c10::BFloat16>(), ts, hs, dst.data_ptr<c10::BFloat16>(), sp, tokens, kv_heads, dim);
    }
  }
}

// cache_write(k, v, slots, ...) then paged_decode(q, ...): a decode-only step's whole attention in one call.
at::Tensor paged_decode_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                              at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, double scale, int64_t window) {
  cache_write(k, v, slots, k_cache, v_cache);
  return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
}

// Turns the vdpbf16ps K pass on or off (the loader: from the capability table); returns the previous setting.
bool set_bf16dot(bool on) {
  const bool before = llmrt_attn_bf16dot;
  llmrt_attn_bf16dot = on;
  return before;
}

}  // namespace

TORCH_LIBRARY(llmrt_attn, m) {
  m.def("set_bf16dot(bool on) -> bool");
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window) -> Tensor");
  m.def("cache_write(Tensor k, Tensor v, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache) -> ()");
  m.def("paged_decode_write(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_attn, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("cache_write", &cache_write);
  m.impl("paged_decode_write", &paged_decode_write);
}

TORCH_LIBRARY_IMPL(llmrt_attn, CatchAll, m) {
  m.impl("set_bf16dot", &set_bf16dot);
}
