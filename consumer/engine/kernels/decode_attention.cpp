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
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (int i = 0; i < 8; ++i) sum += lanes[i];
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

// The vector layer the vectorized item is written against: W float32 lanes (16 on AVX-512, 8 on
// AVX2 + FMA), a row's values loaded as float32 (exact for every dtype here) and stored back in it.
#ifdef __AVX512F__
using vec = __m512;
constexpr int W = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vec vload(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vstore(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline void vstore(c10::BFloat16* p, vec x) {  // round to nearest even, as c10::BFloat16's conversion
  for (int i = 0; i < W; ++i) p[i] = static_cast<c10::BFloat16>(x[i]);
}
inline void vstore(c10::Half* p, vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vec vtile(const float* p) { return _mm512_load_ps(p); }  // an aligned float32 tile row
inline void vtile(float* p, vec x) { _mm512_store_ps(p, x); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }

// the 16 lane sums of v[0..15] as one vector: lane i = sum of v[i]'s lanes (a transposing reduction:
// 45 shuffles and adds for 16 dot products, where one horizontal sum each would take ~10 apiece)
inline vec hsum(const vec* v) {
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
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int W = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vec vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline void vstore(c10::BFloat16* p, vec x) {  // round to nearest even, as c10::BFloat16's conversion
  for (int i = 0; i < W; ++i) p[i] = static_cast<c10::BFloat16>(x[i]);
}
inline void vstore(c10::Half* p, vec x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vec vtile(const float* p) { return _mm256_load_ps(p); }
inline void vtile(float* p, vec x) { _mm256_store_ps(p, x); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }

// the 8 lane sums of v[0..7] as one vector: lane i = sum of v[i]'s lanes (two rounds of pairwise
// adds, then the two 128-bit halves added)
inline vec hsum(const vec* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // v0..v3 per half
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // v4..v7 per half
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// One decode row and KV head with G query heads of head_dim W * C, vectorized: scores W keys at a
// time (each key's row converted once into a float32 tile), softmax with a vector exp, the weighted
// sum in registers. Same numbers as the portable loop up to float32 summation order.
template <typename T, int G, int C>
void decode_item(const T* qb, const T* kh, const T* vh, const int64_t* table, int64_t L, int64_t block_tokens,
                 float scale, T* ob, std::vector<float>& scores) {
  constexpr int HD = W * C;
  vec qv[G][C];
  const vec sv = vset(scale);
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = vmul(vload(qb + h * HD + c * W), sv);
  const int64_t Lp = (L + W - 1) / W * W;
  if (static_cast<int64_t>(scores.size()) < G * Lp) scores.resize(G * Lp);
  float* sc = scores.data();
  alignas(64) float tile[W][HD];
  int64_t block = 0, offset = 0;  // where key t0 lies: table[block], offset
  for (int64_t t0 = 0; t0 < L; t0 += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, L - t0));
    for (int i = 0; i < n; ++i) {  // the keys' rows, converted once for every head
      const T* kt = kh + (table[block] * block_tokens + offset) * HD;
      for (int c = 0; c < C; ++c) vtile(tile[i] + c * W, vload(kt + c * W));
      if (++offset == block_tokens) offset = 0, ++block;
    }
    for (int h = 0; h < G; ++h) {
      vec dots[W];
      for (int i = 0; i < W; ++i) {
        if (i >= n) {
          dots[i] = vzero();
          continue;
        }
        vec a = vmul(qv[h][0], vtile(tile[i]));
        for (int c = 1; c < C; ++c) a = vfma(qv[h][c], vtile(tile[i] + c * W), a);
        dots[i] = a;
      }
      vstore(sc + h * Lp + t0, hsum(dots));
    }
  }
  float total[G];
  for (int h = 0; h < G; ++h) total[h] = exp_sum(sc + h * Lp, L);
  vec acc[G][C];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = vzero();
  block = 0, offset = 0;
  for (int64_t t = 0; t < L; ++t) {
    const T* vt = vh + (table[block] * block_tokens + offset) * HD;
    if (++offset == block_tokens) offset = 0, ++block;
    vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(vt + c * W);
    for (int h = 0; h < G; ++h) {
      const vec p = vset(sc[h * Lp + t]);
      for (int c = 0; c < C; ++c) acc[h][c] = vfma(p, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < G; ++h) {
    const vec inv = vset(1.f / total[h]);
    for (int c = 0; c < C; ++c) vstore(ob + h * HD + c * W, vmul(acc[h][c], inv));
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
    case 32: return item_for_g<T, 32 / W>(g);
    case 64: return item_for_g<T, 64 / W>(g);
    case 128: return item_for_g<T, 128 / W>(g);
    default: return nullptr;
  }
}
template <>
Item<double> item_for<double>(int64_t, int64_t) { return nullptr; }
#endif

#ifdef __AVX512F__

// --- AMX (bfloat16 pools, CPUs with AMX-BF16) ----------------------------------------------------
// The vectorized item above converts every key and value to float32 and multiplies with FMAs: at a
// batch of 32 its compute, not memory, bounds a step (~16 GB/s of K/V where a plain stream reads ~35).
// Here one item (a decode row, a KV head, its g <= 16 query heads) runs in three passes:
//  1. scores: S^T [16 keys x 16 columns] = K [16 keys x HD] (read from the pool as it lies: a
//     block's 16 rows are one tile) by Q^T [HD x 16] (g columns used), one tile product per 32
//     dims; the g columns gathered into each head's row of scores;
//  2. softmax per head over its L keys in float32 (vector exp), the probabilities rounded to bfloat16
//     (as SDPA's bfloat16 flash kernel and the prefill kernel do);
//  3. O [16 rows x HD] += P [16 rows x 32 keys] by V [32 keys x HD], V's key pairs interleaved in
//     registers per 32 keys, O resident in HD / 16 tiles.
// Used where block_tokens is a multiple of 16 (a block's keys in whole tiles) and HD is 32 or 64.
namespace amx {

// tiles (amx_tiles::configure): pass 1: 0 K rows, 1 / 2 Q^T's chunks, 6 scores; pass 3: 0 P rows,
// 1 V's key pairs, 2 .. 5 the output

// AMX-BF16 usable here, and AVX-512 BF16 for the conversions around it
bool supported() { return amx_tiles::permitted() && __builtin_cpu_supports("avx512bf16"); }

struct Scratch {
  std::vector<float> scores;     // [16][Lp]
  std::vector<uint16_t> probs;   // [16][Lp] bfloat16, rows >= g zero
  int64_t Lp = 0, g = 0;
  void fit(int64_t L, int64_t groups) {
    const int64_t need = (L + 31) / 32 * 32;
    if (need > Lp || groups != g) {
      Lp = std::max(need, Lp);
      g = groups;
      scores.assign(16 * Lp, 0.f);
      probs.assign(16 * Lp, 0);
    }
  }
};

template <int HD>
__attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512bw,avx512f,avx512vl,avx512dq"))) void item(
    const uint16_t* qb, int64_t g, const uint16_t* kh, const uint16_t* vh, const int64_t* table, int64_t L,
    int64_t block_tokens, float scale, uint16_t* ob, Scratch& s) {
  constexpr int P = HD / 2, D = HD / 32, C = HD / 16;
  s.fit(L, g);
  const int64_t Lp = s.Lp;
  alignas(64) uint32_t qt[P][16];
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < 16; ++c) qt[p][c] = c < g ? reinterpret_cast<const uint32_t*>(qb + c * HD)[p] : 0u;
  // 1. scores
  _tile_loadd(1, &qt[0][0], 64);  // Q^T chunks: tiles 1 .. D
  if constexpr (D == 2) _tile_loadd(2, &qt[16][0], 64);
  alignas(64) float cb[16][16];
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 sv = _mm512_set1_ps(scale);
  const int64_t ahead = 4 * 16;  // keys: prefetch distance (the blocks lie anywhere: no hardware stream across them)
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const uint16_t* krow = kh + (table[t0 / block_tokens] * block_tokens + t0 % block_tokens) * HD;
    if (t0 + ahead < L) {
      const char* next = reinterpret_cast<const char*>(
          kh + (table[(t0 + ahead) / block_tokens] * block_tokens + (t0 + ahead) % block_tokens) * HD);
      for (int line = 0; line < 16 * HD * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    }
    _tile_zero(6);
    _tile_loadd(0, krow, HD * 2);
    _tile_dpbf16ps(6, 0, 1);
    if constexpr (D == 2) {
      _tile_loadd(0, krow + 32, HD * 2);
      _tile_dpbf16ps(6, 0, 2);
    }
    _tile_stored(6, &cb[0][0], 64);
    for (int64_t h = 0; h < g; ++h)
      _mm512_storeu_ps(&s.scores[h * Lp + t0], _mm512_mul_ps(_mm512_i32gather_ps(column, &cb[0][h], 4), sv));
  }
  // 2. softmax per head; keys past L weigh 0
  float total[16];
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t h = 0; h < g; ++h) {
    float* sc = &s.scores[h * Lp];
    __m512 mx = ninf;
    for (int64_t t = 0; t < Lp; t += 16) {
      const __mmask16 in = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t))),
                                                   _mm512_set1_epi32(static_cast<int>(L)));
      const __m512 x = _mm512_mask_mov_ps(ninf, in, _mm512_loadu_ps(sc + t));
      _mm512_storeu_ps(sc + t, x);
      mx = _mm512_max_ps(mx, x);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    uint16_t* pr = &s.probs[h * Lp];
    for (int64_t t = 0; t < Lp; t += 32) {
      const __mmask16 in0 = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t))),
                                                    _mm512_set1_epi32(static_cast<int>(L)));
      const __mmask16 in1 = _mm512_cmplt_epi32_mask(
          _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t + 16))), _mm512_set1_epi32(static_cast<int>(L)));
      const __m512 p0 = _mm512_maskz_mov_ps(in0, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + t), m)));
      const __m512 p1 = _mm512_maskz_mov_ps(in1, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + t + 16), m)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(pr + t, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
    }
    total[h] = _mm512_reduce_add_ps(sum);
  }
  // 3. O += P by V, 32 keys at a time; V's rows past L read as zeros (they may hold anything)
  _tile_zero(2);  // O: tiles 2 .. 2 + C - 1 (Q^T's tiles are done)
  _tile_zero(3);
  if constexpr (C == 4) {
    _tile_zero(4);
    _tile_zero(5);
  }
  // V's key pairs interleaved by 16-bit unpacks of two rows, 32 dims at a time: unpacklo / unpackhi
  // take dims 0-3, 8-11, 16-19, 24-27 / 4-7, 12-15, 20-23, 28-31 of the 32, so O's columns come out in
  // that order (`dim_of`), put back in order when the output is written
  alignas(64) uint32_t vb[C][16][16];
  for (int64_t t0 = 0; t0 < L; t0 += 32) {
    for (int64_t t = t0 + ahead; t < std::min(L, t0 + ahead + 32); t += 16) {
      const char* next = reinterpret_cast<const char*>(vh + (table[t / block_tokens] * block_tokens + t % block_tokens) * HD);
      for (int line = 0; line < 16 * HD * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    }
    for (int u = 0; u < 16; ++u) {
      const int64_t t = t0 + 2 * u;
      const uint16_t* a = t < L ? vh + (table[t / block_tokens] * block_tokens + t % block_tokens) * HD : nullptr;
      const uint16_t* b = t + 1 < L ? vh + (table[(t + 1) / block_tokens] * block_tokens + (t + 1) % block_tokens) * HD : nullptr;
      for (int d = 0; d < D; ++d) {
        const __m512i x = a ? _mm512_loadu_si512(a + d * 32) : _mm512_setzero_si512();
        const __m512i y = b ? _mm512_loadu_si512(b + d * 32) : _mm512_setzero_si512();
        _mm512_store_si512(&vb[2 * d][u][0], _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(&vb[2 * d + 1][u][0], _mm512_unpackhi_epi16(x, y));
      }
    }
    _tile_loadd(0, &s.probs[t0], Lp * 2);  // P: 16 rows (heads; rows >= g zero) x 32 keys
    _tile_loadd(1, &vb[0][0][0], 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(1, &vb[1][0][0], 64);
    _tile_dpbf16ps(3, 0, 1);
    if constexpr (C == 4) {
      _tile_loadd(1, &vb[2][0][0], 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, &vb[3][0][0], 64);
      _tile_dpbf16ps(5, 0, 1);
    }
  }
  alignas(64) float o[16][HD];
  _tile_stored(2, &o[0][0], HD * 4);
  _tile_stored(3, &o[0][16], HD * 4);
  if constexpr (C == 4) {
    _tile_stored(4, &o[0][32], HD * 4);
    _tile_stored(5, &o[0][48], HD * 4);
  }
  // column of O holding dim e = 32 d + 8 lane + 4 half + i: 16 (2 d + half) + 4 lane + i; dims 16 c ..
  // 16 c + 15 read from `first_half` (+ 8 for odd c) + 32 (c / 2)
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  for (int64_t h = 0; h < g; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / total[h]);
    for (int c = 0; c < C; ++c) {
      const __m512i columns = _mm512_add_epi32(first_half, _mm512_set1_epi32(32 * (c / 2) + 8 * (c % 2)));
      const __m512 x = _mm512_i32gather_ps(columns, &o[h][0], 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + h * HD + c * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(x, inv))));
    }
  }
}

// whether the AMX items serve this call; and the call
bool serves(int64_t g, int64_t hd, int64_t block_tokens) {
  return supported() && g >= 1 && g <= 16 && (hd == 32 || hd == 64) && block_tokens % 16 == 0;
}

void decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables, const int64_t* lengths,
            uint16_t* out, int64_t B, int64_t H, int64_t n_kv, int64_t hd, int64_t slots, int64_t max_blocks,
            int64_t block_tokens, float scale) {
  const int64_t g = H / n_kv;
  at::parallel_for(0, B * n_kv, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    amx_tiles::configure();  // tile state is per thread
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / n_kv, j = it % n_kv;
      const uint16_t* qb = q + (b * H + j * g) * hd;
      uint16_t* ob = out + (b * H + j * g) * hd;
      if (hd == 32)
        item<32>(qb, g, k + j * slots * hd, v + j * slots * hd, tables + b * max_blocks, lengths[b], block_tokens, scale, ob, scratch);
      else
        item<64>(qb, g, k + j * slots * hd, v + j * slots * hd, tables + b * max_blocks, lengths[b], block_tokens, scale, ob, scratch);
    }
    amx_tiles::release();
  });
}

}  // namespace amx
#endif

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t B, int64_t H, int64_t n_kv, int64_t hd, int64_t slots, int64_t max_blocks,
            int64_t block_tokens, float scale) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

torch::Tensor run(bool use_amx, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const torch::Tensor& tables, const torch::Tensor& lengths, int64_t block_tokens, double scale) {
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
#ifdef __AVX512F__
  if (use_amx && q.scalar_type() == at::kBFloat16 && amx::serves(q.size(1) / k.size(0), q.size(2), block_tokens)) {
    amx::decode(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), tab, len,
                reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), B, q.size(1), k.size(0), q.size(2), slots,
                max_blocks, block_tokens, static_cast<float>(scale));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), tab, len,
                     out.data_ptr<scalar_t>(), B, q.size(1), k.size(0), q.size(2), slots, max_blocks, block_tokens,
                     static_cast<float>(scale));
  });
  return out;
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& tables, const torch::Tensor& lengths, int64_t block_tokens,
                               double scale) {
  return run(false, q, k, v, tables, lengths, block_tokens, scale);
}

// bfloat16 rows on AMX tiles where amx_serves(g, hd, block_tokens); anything else as decode_attention
torch::Tensor decode_attention_amx(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& tables, const torch::Tensor& lengths, int64_t block_tokens,
                                   double scale) {
  return run(true, q, k, v, tables, lengths, block_tokens, scale);
}

bool amx_supported() {
#ifdef __AVX512F__
  return amx::supported();
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over a KV pool (CPU)");
  m.def("decode_attention_amx", &decode_attention_amx, "the same, bfloat16 rows on AMX-BF16 tiles where they fit");
  m.def("amx_supported", &amx_supported, "whether this CPU has AMX-BF16 and this process may use its tiles");
}
