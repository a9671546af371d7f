// Paged decode attention on the CPU: every decode row's one query against its own blocks of the
// KV pool, read where they lie (no gather), all rows and KV heads in one call per layer.
// Built and loaded by consumer/engine/paged_attention.py (torch.utils.cpp_extension); the
// reference it is tested against is torch's SDPA over the same keys (tests/test_paged_attention.py).
//
// Layout (KVPool's head-major storage, one layer): k, v [n_kv, slots, hd] contiguous, a slot being
// block * block_tokens + offset; q [B, H, hd] contiguous, the H query heads of KV head j being
// j * g .. j * g + g - 1 (GQA, g = H / n_kv); tables [B, max_blocks] int64 (a row's blocks, padded);
// lengths [B] int64 (keys each row attends over, its new token's included). Out [B, H, hd] in q's
// dtype. Scores, softmax and the weighted sum in float32, as SDPA's CPU kernels accumulate.
// Every table entry and length a row uses is checked against the pool before anything is read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(double x) { return static_cast<float>(x); }
inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t B, int64_t H, int64_t n_kv, int64_t hd, int64_t slots, int64_t max_blocks,
            int64_t block_tokens, float scale) {
  const int64_t g = H / n_kv;
  at::parallel_for(0, B * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * hd), acc(g * hd), scores, kf(hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_kv, j = item % n_kv, L = lengths[b];
      const T* qb = q + (b * H + j * g) * hd;
      for (int64_t i = 0; i < g * hd; ++i) qf[i] = to_f32(qb[i]) * scale;
      scores.assign(g * L, 0.f);
      const T* kh = k + j * slots * hd;
      const T* vh = v + j * slots * hd;
      const int64_t* table = tables + b * max_blocks;
      // scores[h][t] = q_h . k_t
      for (int64_t t = 0; t < L; ++t) {
        const T* kt = kh + (table[t / block_tokens] * block_tokens + t % block_tokens) * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) kf[d] = to_f32(kt[d]);
        for (int64_t h = 0; h < g; ++h) {
          const float* qh = qf.data() + h * hd;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < hd; ++d) s += qh[d] * kf[d];
          scores[h * L + t] = s;
        }
      }
      std::vector<float> total(g);
      for (int64_t h = 0; h < g; ++h) {
        float* sh = scores.data() + h * L;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) top = sh[t] > top ? sh[t] : top;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
          sh[t] = std::exp(sh[t] - top);
          sum += sh[t];
        }
        total[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vt = vh + (table[t / block_tokens] * block_tokens + t % block_tokens) * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) kf[d] = to_f32(vt[d]);
        for (int64_t h = 0; h < g; ++h) {
          const float p = scores[h * L + t];
          float* ah = acc.data() + h * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) ah[d] += p * kf[d];
        }
      }
      T* ob = out + (b * H + j * g) * hd;
      for (int64_t h = 0; h < g; ++h)
        for (int64_t d = 0; d < hd; ++d) ob[h * hd + d] = static_cast<T>(acc[h * hd + d] / total[h]);
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& tables, const torch::Tensor& lengths, int64_t block_tokens,
                               double scale) {
  // every check before any read: a hostile table or length raises (ValueError / TypeError), never reads
  // outside the pool
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && tables.device().is_cpu() &&
                        lengths.device().is_cpu(),
                    "decode_attention: q, k, v, tables, lengths must be CPU tensors");
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q must be [B, H, hd] and k / v ",
                    "[n_kv, slots, hd]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
                    "decode_attention: q, k, v must be contiguous");
  const auto dtype = q.scalar_type();
  TORCH_CHECK_TYPE((dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                       dtype == k.scalar_type() && dtype == v.scalar_type(),
                   "decode_attention: q, k, v must share one dtype of float32, float64, bfloat16, float16; got ",
                   dtype, ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "decode_attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK_VALUE(q.size(2) == k.size(2), "decode_attention: q's head_dim ", q.size(2), " != k's ", k.size(2));
  TORCH_CHECK_VALUE(k.size(0) > 0 && q.size(1) % k.size(0) == 0, "decode_attention: q's ", q.size(1),
                    " heads are not a multiple of k's ", k.size(0), " KV heads");
  TORCH_CHECK_VALUE(block_tokens > 0, "decode_attention: block_tokens must be >= 1, got ", block_tokens);
  TORCH_CHECK_TYPE(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
                   "decode_attention: tables and lengths must be int64; got ", tables.scalar_type(), ", ",
                   lengths.scalar_type());
  TORCH_CHECK_VALUE(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.is_contiguous(),
                    "decode_attention: tables must be contiguous [B = ", q.size(0), ", max_blocks]; got ", tables.sizes());
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.is_contiguous(),
                    "decode_attention: lengths must be contiguous [B = ", q.size(0), "]; got ", lengths.sizes());
  const int64_t B = q.size(0), max_blocks = tables.size(1), slots = k.size(1);
  const int64_t pool_blocks = slots / block_tokens;  // whole blocks in the pool
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // every key a row reads lies in its table and in the pool
    TORCH_CHECK_VALUE(len[b] >= 1 && (len[b] - 1) / block_tokens < max_blocks, "decode_attention: row ", b,
                      ": length ", len[b], " outside 1 .. ", max_blocks, " blocks x ", block_tokens, " tokens");
    for (int64_t i = 0; i <= (len[b] - 1) / block_tokens; ++i)
      TORCH_CHECK_VALUE(tab[b * max_blocks + i] >= 0 && tab[b * max_blocks + i] < pool_blocks, "decode_attention: row ",
                        b, ": block ", tab[b * max_blocks + i], " outside the pool's 0 .. ", pool_blocks - 1);
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), tab, len,
                     out.data_ptr<scalar_t>(), B, q.size(1), k.size(0), q.size(2), slots, max_blocks, block_tokens,
                     static_cast<float>(scale));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over a KV pool (CPU)");
}
