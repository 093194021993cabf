// Decode attention that reads K/V blocks where they are in the paged cache (no per-layer gather copy).
// One query token per sequence; GQA (a group of query heads shares a KV head); optional sliding window.
// Per (sequence, KV head): scores for the group's heads over the context, softmax, weighted sum of V rows.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

inline void to_out(float* o, float x) { *o = x; }
inline void to_out(c10::BFloat16* o, float x) { *o = c10::BFloat16(x); }

// Q: the query and output type (float or bf16: converted here, so the caller makes no float copies).
template <typename KV, typename Q>
void decode_kernel(const Q* q_in, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lens,
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
  auto out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, kv_heads, scale, window);
  } else {
    run<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, kv_heads, scale, window);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(llmrt_attn, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_attn, CPU, m) { m.impl("paged_decode", &paged_decode); }
