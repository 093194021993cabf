// int4 weights times bfloat16 activations with AVX512-BF16's vdpbf16ps, over linear.cpp's packed int4 layout as
// it is (4-row blocks of 32-input chunks, 16 bytes per row: byte c = q[c] | q[c + 16] << 4; a bf16 (scale, zero)
// per row and group). Included by linear.cpp in the AVX-512 builds only; compiled for AVX512-BF16 by a target
// pragma and called only where the CPU has it (Python checks the flag), so the builds still load on others.
//
// Why: the float kernel widens every nibble to fp32 through two 16-entry permutes and a zero-extension per 32
// weights; on a 2-core Zen 4 those shuffles, not memory, bound int4 decode (int4 GEMVs slower than int8's). Here
// a nibble becomes a bf16 with no table: 0x4300 | q is the bf16 of 128 + q (bf16's unit step at 128 is 1), so
// one zero-extension serves two rows' chunks and the products x * (128 + q) are exact in fp32. Per group:
//   sum_k x_k w_k = s * sum_k x_k (128 + q_k) + (z - 136 s) * sum_k x_k      (w = (q - 8) s + z)
// The activations are bf16 already (bf16 models), so nothing is rounded that the float kernel does not round;
// only the summation order differs. Every row is computed the same way whatever the number of rows (tiles of up
// to 4 re-read the block from L1), so a row's result does not depend on the batch.
#pragma once

#if defined(LLMRT_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512bw,avx512f,avx512vl,avx512dq")
#include <immintrin.h>

namespace {

constexpr int BD_MB = 4;  // activation rows per tile: 2 x 4 group accumulators + 2 x 4 totals

// x (bf16 [M, K]) as each chunk's halves duplicated: per row and chunk, [x0..15, x0..15, x16..31, x16..31]
// (64 bf16), so one load gives the activations for two weight rows' lanes; inputs past K are zero. Also each
// group's sum of x (fp32, the same for every weight row), divided by 8: it is added to 8 lanes per row.
struct DupRows {
  std::vector<uint16_t> x;
  std::vector<float> gsum8;
  int64_t chunks = 0, groups = 0;
};

DupRows dup_rows(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int64_t gs) {
  DupRows d;
  d.chunks = Kp / 32;
  d.groups = Kp / gs;
  d.x.assign(M * d.chunks * 64, 0);
  d.gsum8.assign(M * d.groups, 0.0f);
  for (int64_t i = 0; i < M; ++i) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x + i * ldx);
    uint16_t* dst = d.x.data() + i * d.chunks * 64;
    for (int64_t c = 0; c < d.chunks; ++c)
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 16; ++t) {
          const int64_t k = c * 32 + h * 16 + t;
          const uint16_t v = k < K ? src[k] : 0;
          dst[c * 64 + h * 32 + t] = v;
          dst[c * 64 + h * 32 + 16 + t] = v;
        }
    for (int64_t g = 0; g < d.groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * gs; k < std::min<int64_t>(K, (g + 1) * gs); ++k) s += to_f(src[k]);
      d.gsum8[i * d.groups + g] = s * 0.125f;
    }
  }
  return d;
}

// Block b of the int4 matrix times rows m0..m0+mb of d: out[i][j] = sum_k x[i, k] w[4b + j, k]. Each row gets
// the same operations in the same order whatever mb is (no per-tile restructuring: a row's result must not
// depend on the batch).
template <int mb>
inline void bd_tile(const Int4& l, int64_t b, const DupRows& d, int64_t m0, float (*out)[NB]) {
  const uint8_t* p = l.w + b * l.Kp * NB / 2;
  const uint16_t* g = l.sz + b * (l.Kp / l.gs) * NB * 2;
  const int64_t per_group = l.gs / 32;
  const __m512i magic = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000F);
  // sz lanes: s0 z0 s1 z1 s2 z2 s3 z3 (rows 0..3); a pair's vector wants row 2 pr in lanes 0..7, 2 pr + 1 above
  const __m512i idx_s0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i idx_z0 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i idx_s1 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
  const __m512i idx_z1 = _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7);
  const __m512 k136 = _mm512_set1_ps(136.0f);
  __m512 tot[mb][2];
  for (int i = 0; i < mb; ++i) tot[i][0] = tot[i][1] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < d.groups; ++gi, g += 2 * NB) {
    __m512 acc[mb][2];
    for (int i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t c = gi * per_group; c < (gi + 1) * per_group; ++c, p += NB * 16) {
      for (int pr = 0; pr < 2; ++pr) {  // rows (0, 1), then (2, 3): 32 bytes, one zero-extension
        const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(p + pr * 32)));
        const __m512bh lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(w16, low), magic);
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w16, 4), magic);
        for (int i = 0; i < mb; ++i) {
          const uint16_t* xc = d.x.data() + ((m0 + i) * d.chunks + c) * 64;
          acc[i][pr] = _mm512_dpbf16_ps(acc[i][pr], lo, (__m512bh)_mm512_loadu_si512(xc));
          acc[i][pr] = _mm512_dpbf16_ps(acc[i][pr], hi, (__m512bh)_mm512_loadu_si512(xc + 32));
        }
      }
    }
    // The group's (scale, zero) of the 4 rows, 8 bf16 in one load, widened to fp32 lanes 0..7; each half of
    // a pair's vectors then takes its row's value by one permute (with a 32-weight group this runs per chunk).
    const __m512 sz = _mm512_castps256_ps512(_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)g)), 16)));
    for (int pr = 0; pr < 2; ++pr) {  // lanes 0..7 belong to row 2 pr, lanes 8..15 to row 2 pr + 1
      const __m512 s = _mm512_permutexvar_ps(pr ? idx_s1 : idx_s0, sz);
      const __m512 o = _mm512_fnmadd_ps(s, k136, _mm512_permutexvar_ps(pr ? idx_z1 : idx_z0, sz));  // z - 136 s
      for (int i = 0; i < mb; ++i) {
        tot[i][pr] = _mm512_fmadd_ps(acc[i][pr], s, tot[i][pr]);
        tot[i][pr] = _mm512_fmadd_ps(o, _mm512_set1_ps(d.gsum8[(m0 + i) * d.groups + gi]), tot[i][pr]);
      }
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int pr = 0; pr < 2; ++pr) {
      out[i][2 * pr] = _mm512_mask_reduce_add_ps(0x00FF, tot[i][pr]);
      out[i][2 * pr + 1] = _mm512_mask_reduce_add_ps(0xFF00, tot[i][pr]);
    }
}

at::Tensor linear_int4_bf16dot(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sz, int64_t group_size,
                               int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "llmrt kernels: linear_int4_bf16dot wants bfloat16 [rows, in_features] with unit column stride");
  const Int4 l = int4_layout(wp, sz, group_size);
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0);
  TORCH_CHECK((n + NB - 1) / NB == blocks && K <= l.Kp && K > l.Kp - group_size, "llmrt kernels: x ", x.sizes(),
              " or n ", n, " does not match the packed int4 matrix ", wp.sizes());
  at::Tensor y = at::empty({M, n}, x.options());
  const Sink sink = sink_for(y, bias);
  const DupRows d = dup_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, l.Kp, group_size);
  at::parallel_for(0, blocks, block_grain(NB * (l.Kp / 2 + l.Kp / group_size * 4)), [&](int64_t b0, int64_t b1) {
    float out[BD_MB][NB];
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m0 = 0;
      for (; m0 + BD_MB <= M; m0 += BD_MB) {
        bd_tile<BD_MB>(l, b, d, m0, out);
        sink.put(m0, BD_MB, b, out);
      }
      const int r = int(M - m0);
      if (r == 1) bd_tile<1>(l, b, d, m0, out);
      if (r == 2) bd_tile<2>(l, b, d, m0, out);
      if (r == 3) bd_tile<3>(l, b, d, m0, out);
      if (r) sink.put(m0, r, b, out);
    }
  });
  return y;
}

}  // namespace

#pragma GCC pop_options
#endif
