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
#include "vec_math.h"

namespace {

// s[t] <- e^(s[t] - max s) for t < L, the softmax's numerators; returns their sum
inline float exp_sum(float* s, int64_t L) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t t = 0; t < L; ++t) top = s[t] > top ? s[t] : top;
  float sum = 0.f;
  int64_t t = 0;
#ifdef __AVX512F__
  const __m512 m = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  return sum;
}

inline float to_f32(float x) { return x; }
inline float to_f32(double x) { return static_cast<float>(x); }
inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

#ifdef __AVX512F__
// 16 values of a row as float32 lanes (exact for every dtype here)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // round to nearest even, as c10::BFloat16's conversion
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::BFloat16>(x[i]);
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// the 16 lane sums of v[0..15] as one vector: lane i = sum of v[i]'s lanes (a transposing reduction:
// 45 shuffles and adds for 16 dot products, where one horizontal sum each would take ~10 apiece)
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: lanes 0, 2 hold v[2i]'s partials, 1, 3 v[2i + 1]'s
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: lane m holds v[4i + m]'s sum over that block
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// One decode row and KV head with G query heads of head_dim 16 * C, vectorized: scores 16 keys at a
// time (each key's row converted once into a float32 tile), softmax with a vector exp, the weighted
// sum in registers. Same numbers as the portable loop up to float32 summation order.
template <typename T, int G, int C>
void decode_item(const T* qb, const T* kh, const T* vh, const int64_t* table, int64_t L, int64_t block_tokens,
                 float scale, T* ob, std::vector<float>& scores) {
  constexpr int HD = 16 * C;
  __m512 qv[G][C];
  const __m512 sv = _mm512_set1_ps(scale);
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = _mm512_mul_ps(load16(qb + h * HD + c * 16), sv);
  const int64_t Lp = (L + 15) / 16 * 16;
  if (static_cast<int64_t>(scores.size()) < G * Lp) scores.resize(G * Lp);
  float* sc = scores.data();
  alignas(64) float tile[16][HD];
  int64_t block = 0, offset = 0;  // where key t0 lies: table[block], offset
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    for (int i = 0; i < n; ++i) {  // the keys' rows, converted once for every head
      const T* kt = kh + (table[block] * block_tokens + offset) * HD;
      for (int c = 0; c < C; ++c) _mm512_store_ps(tile[i] + c * 16, load16(kt + c * 16));
      if (++offset == block_tokens) offset = 0, ++block;
    }
    for (int h = 0; h < G; ++h) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        if (i >= n) {
          dots[i] = _mm512_setzero_ps();
          continue;
        }
        __m512 a = _mm512_mul_ps(qv[h][0], _mm512_load_ps(tile[i]));
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[h][c], _mm512_load_ps(tile[i] + c * 16), a);
        dots[i] = a;
      }
      _mm512_storeu_ps(sc + h * Lp + t0, hsum16(dots));
    }
  }
  float total[G];
  for (int h = 0; h < G; ++h) total[h] = exp_sum(sc + h * Lp, L);
  __m512 acc[G][C];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  block = 0, offset = 0;
  for (int64_t t = 0; t < L; ++t) {
    const T* vt = vh + (table[block] * block_tokens + offset) * HD;
    if (++offset == block_tokens) offset = 0, ++block;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vt + c * 16);
    for (int h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(sc[h * Lp + t]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < G; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / total[h]);
    for (int c = 0; c < C; ++c) store16(ob + h * HD + c * 16, _mm512_mul_ps(acc[h][c], inv));
  }
}

// the vectorized item for this (g, hd), or nullptr (the portable loop serves it)
template <typename T>
using Item = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, int64_t, float, T*, std::vector<float>&);

template <typename T, int C>
Item<T> item_for_g(int64_t g) {
  switch (g) {
    case 1: return decode_item<T, 1, C>;
    case 2: return decode_item<T, 2, C>;
    case 3: return decode_item<T, 3, C>;
    case 4: return decode_item<T, 4, C>;
    default: return nullptr;
  }
}

template <typename T>
Item<T> item_for(int64_t g, int64_t hd) {
  switch (hd) {
    case 32: return item_for_g<T, 2>(g);
    case 64: return item_for_g<T, 4>(g);
    case 128: return item_for_g<T, 8>(g);
    default: return nullptr;
  }
}
template <>
Item<double> item_for<double>(int64_t, int64_t) { return nullptr; }
#endif

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t B, int64_t H, int64_t n_kv, int64_t hd, int64_t slots, int64_t max_blocks,
            int64_t block_tokens, float scale) {
#ifdef __AVX512F__
  if (const Item<T> item = item_for<T>(H / n_kv, hd)) {
    const int64_t g = H / n_kv;
    at::parallel_for(0, B * n_kv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t it = begin; it < end; ++it) {
        const int64_t b = it / n_kv, j = it % n_kv;
        item(q + (b * H + j * g) * hd, k + j * slots * hd, v + j * slots * hd, tables + b * max_blocks, lengths[b],
             block_tokens, scale, out + (b * H + j * g) * hd, scores);
      }
    });
    return;
  }
#endif
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
      for (int64_t h = 0; h < g; ++h) total[h] = exp_sum(scores.data() + h * L, L);
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
