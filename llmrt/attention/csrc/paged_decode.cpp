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
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t L = 16;
#elif defined(__AVX2__)
constexpr int64_t L = 8;
#else
constexpr int64_t L = 4;
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef uint16_t vh __attribute__((vector_size(2 * L)));

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline void to_out(float* o, float x) { *o = x; }
inline void to_out(c10::BFloat16* o, float x) { *o = c10::BFloat16(x); }

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf vload(const c10::BFloat16* p) {  // bf16 bits are the high half of the fp32
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
// Horizontal sum as a tree (halve, add, repeat): a serial sum over the lanes is a chain of L dependent adds,
// which made the per-token dot products latency-bound.
template <int N>
inline float tree_sum(const float* p) {
  if constexpr (N == 4) {
    return (p[0] + p[2]) + (p[1] + p[3]);
  } else {
    typedef float vh_t __attribute__((vector_size(2 * N)));
    vh_t a, b;
    std::memcpy(&a, p, sizeof(a));
    std::memcpy(&b, p + N / 2, sizeof(b));
    const vh_t c = a + b;
    return tree_sum<N / 2>(reinterpret_cast<const float*>(&c));
  }
}
inline float hsum(vf v) { return tree_sum<L>(reinterpret_cast<const float*>(&v)); }
// exp over a register (Cephes' single-precision polynomial, ~1 ulp): softmax's exps vectorize with the rest.
inline vf vexp(vf x) {
  x = x < -87.3f ? vf{} - 87.3f : x;
  x = x > 88.37f ? vf{} + 88.37f : x;
  const vf t = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  n = n > t ? n - 1.f : n;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(vf));
  return p * scale;
}

// dot(q, row) over dim = nc * L elements; q is fp32.
template <typename KV>
inline float dot(const float* q, const KV* row, int64_t nc) {
  vf acc = vload(q) * vload(row);
  for (int64_t c = 1; c < nc; ++c) acc += vload(q + c * L) * vload(row + c * L);
  return hsum(acc);
}

// Ask for the next block's rows of this pass's heads while the current block is computed: blocks are scattered
// in the cache, so the hardware prefetchers lose the stream at every block boundary.
template <typename KV>
inline void prefetch_block(const KV* base, int64_t tokens, int64_t row, int64_t elems) {
  const int64_t line = 64 / int64_t(sizeof(KV));
  for (int64_t j = 0; j < tokens; ++j)
    for (int64_t e = 0; e < elems; e += line) __builtin_prefetch(base + j * row + e);
}

// Q: the query and output type (float or bf16: converted here, so the caller makes no float copies).
// A task takes a range of (sequence, KV head) items and does a sequence's consecutive KV heads in one pass over
// its blocks: with one thread, every head of a token row (kv_heads * dim contiguous elements) is read together, so
// a block of the cache streams sequentially instead of once per head at a stride.
template <typename KV, typename Q>
void decode_kernel(const Q* q_in, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lens,
                   Q* out, int64_t num_seqs, int64_t table_width, int64_t block_size, int64_t heads,
                   int64_t kv_heads, int64_t dim, double scale, int64_t window, int64_t q_stride) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;  // elements per cached token
  const bool vec = dim % L == 0;
  const int64_t nc = dim / L;
  const float sc = static_cast<float>(scale);
  // About 64 KiB of K/V per task (a sequence x KV head reads 2 * len * dim elements): short contexts stay on
  // the calling thread, where a parallel region would cost more than the work.
  int64_t avg_len = 1;
  for (int64_t s = 0; s < num_seqs; ++s) avg_len += lens[s];
  avg_len /= std::max<int64_t>(1, num_seqs);
  const int64_t grain = std::max<int64_t>(1, 65536 / (2 * avg_len * dim * int64_t(sizeof(KV))));
  at::parallel_for(0, num_seqs * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv(heads), qf(heads * dim);  // per thread, reused
    std::vector<vf> acc(heads * std::max<int64_t>(nc, 1));
    std::vector<float> acc_s(vec ? 0 : heads * dim);
    for (int64_t work = begin; work < end;) {
      const int64_t s = work / kv_heads, h0 = work % kv_heads;
      const int64_t h1 = std::min(kv_heads, h0 + (end - work));
      work += h1 - h0;
      const int64_t rows = (h1 - h0) * group;  // query heads of this pass: h0 * group .. h1 * group
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(rows * n + L);  // every entry below n is written before it is read; + L: vector tail
      const Q* qin = q_in + s * q_stride + h0 * group * dim;
      for (int64_t i = 0; i < rows * dim; ++i) qf[i] = to_float(qin[i]);
      const int64_t* table = tables + s * table_width;
      // Scores, walking the blocks in order (no division per token).
      for (int64_t pos = first, t = 0; pos < len;) {
        const int64_t off = pos % block_size, take = std::min(block_size - off, len - pos);
        const KV* k = k_cache + (table[pos / block_size] * block_size + off) * row + h0 * dim;
        if (pos + take < len) {
          prefetch_block(k_cache + table[(pos + take) / block_size] * block_size * row + h0 * dim,
                         std::min(block_size, len - pos - take), row, (h1 - h0) * dim);
        }
        for (int64_t j = 0; j < take; ++j, k += row) {
          for (int64_t r = 0; r < rows; ++r) {
            const KV* kh = k + (r / group) * dim;
            float d;
            if (vec) {
              d = dot(qf.data() + r * dim, kh, nc);
            } else {
              d = 0.f;
              for (int64_t e = 0; e < dim; ++e) d += qf[r * dim + e] * to_float(kh[e]);
            }
            scores[r * n + t + j] = d * sc;
          }
        }
        pos += take;
        t += take;
      }
      // Softmax per query head (unnormalized; 1/sum applied to the output).
      for (int64_t r = 0; r < rows; ++r) {
        float* sg = scores.data() + r * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        vf sum = vf{};
        int64_t t = 0;
        for (; t + L <= n; t += L) {
          const vf e = vexp(vload(sg + t) - mx);
          std::memcpy(sg + t, &e, sizeof(vf));
          sum += e;
        }
        float total = hsum(sum);
        if (t < n) {  // the tail through the same vector exp
          float tmp[L];
          for (int64_t i = 0; i < L; ++i) tmp[i] = t + i < n ? sg[t + i] - mx : -100.f;
          const vf e = vexp(vload(tmp));
          for (int64_t i = 0; t + i < n; ++i) {
            sg[t + i] = e[i];
            total += e[i];
          }
        }
        inv[r] = 1.f / total;
      }
      // Weighted sum of V rows.
      if (vec) {
        std::fill(acc.begin(), acc.begin() + rows * nc, vf{});
      } else {
        std::fill(acc_s.begin(), acc_s.begin() + rows * dim, 0.f);
      }
      for (int64_t pos = first, t = 0; pos < len;) {
        const int64_t off = pos % block_size, take = std::min(block_size - off, len - pos);
        const KV* v = v_cache + (table[pos / block_size] * block_size + off) * row + h0 * dim;
        if (pos + take < len) {
          prefetch_block(v_cache + table[(pos + take) / block_size] * block_size * row + h0 * dim,
                         std::min(block_size, len - pos - take), row, (h1 - h0) * dim);
        }
        for (int64_t j = 0; j < take; ++j, v += row) {
          for (int64_t hh = 0; hh < h1 - h0; ++hh) {
            const KV* vh_row = v + hh * dim;
            if (vec) {
              for (int64_t c = 0; c < nc; ++c) {
                const vf vv = vload(vh_row + c * L);
                for (int64_t g = 0; g < group; ++g) {
                  const int64_t r = hh * group + g;
                  acc[r * nc + c] += scores[r * n + t + j] * vv;
                }
              }
            } else {
              for (int64_t g = 0; g < group; ++g) {
                const int64_t r = hh * group + g;
                const float p = scores[r * n + t + j];
                for (int64_t e = 0; e < dim; ++e) acc_s[r * dim + e] += p * to_float(vh_row[e]);
              }
            }
          }
        }
        pos += take;
        t += take;
      }
      for (int64_t r = 0; r < rows; ++r) {
        Q* o = out + (s * heads + h0 * group + r) * dim;
        for (int64_t e = 0; e < dim; ++e) {
          const float a = vec ? acc[r * nc + e / L][e % L] : acc_s[r * dim + e];
          to_out(o + e, a * inv[r]);
        }
      }
    }
  });
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

}  // namespace

TORCH_LIBRARY(llmrt_attn, m) {
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
