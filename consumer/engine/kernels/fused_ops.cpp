// The engine forward's elementwise steps fused, one pass each (AVX-512, or AVX2 + FMA; built by
// consumer/engine/fused_ops.py):
//   rms_norm      out = w * norm(x)                       (transformers' RMSNorm: float32 statistics)
//   add_rms_norm  h' = h + d; out = w * norm(h')          (the residual add and the next norm)
//   silu_mul      out = silu(gate) * up                   (gate_up = [gate | up] per row)
//   rope          out = x * cos + rotate_half(x) * sin    (every head of a token, one table row)
// Each rounds where transformers' eager modules round: bfloat16 tensors round every op's result to
// bfloat16 (round to nearest even, as torch does), float32 ones do not. Eager torch runs each of these
// as 3-10 separate kernels with their own dispatch; at a decode step's 32 rows that dispatch is the cost.
// Rows are independent: a row's result does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

using bf16 = uint16_t;

// One vector layer, so the steps below are written once: 16 float32 lanes on AVX-512, 8 on AVX2 + FMA.
// A load or store of a row's last, partial vector (`tail(left)` lanes) reads and writes only the
// row's own elements.
#ifdef __AVX512F__
using vec = __m512;
using lanes = __mmask16;
constexpr int64_t W = 16;
inline lanes tail(int64_t left) { return left >= W ? lanes(0xffff) : lanes((1u << left) - 1); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vexp(vec x) { return exp512(x); }

inline vec load(const float* p, lanes m) { return _mm512_maskz_loadu_ps(m, p); }
inline vec load(const bf16* p, lanes m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// v rounded to bfloat16 (nearest even; NaN -> torch's 0x7fc0), as float32 bits (low half zero)
inline __m512i bf16_bits(vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                               _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

// what an op's result is in T: rounded to bfloat16, or float32 as it is. The AVX-512 BF16 build
// (CPUs that have it: consumer/engine/fused_ops.py) rounds with its one conversion instruction,
// nearest even as bf16_bits (a NaN stays a NaN); the bit arithmetic is ~7 instructions a vector, a
// quarter of these steps' time at a prefill chunk's width.
#ifdef __AVX512BF16__
inline __m256i to_bf16(vec v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#else
inline __m256i to_bf16(vec v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)); }
#endif
inline vec rnd(vec v, const float*) { return v; }
inline vec rnd(vec v, const bf16*) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16)); }

inline void store(float* p, vec v, lanes m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(bf16* p, vec v, lanes m) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }
#else  // AVX2 + FMA: no masked 16-bit loads or stores, so a partial vector goes through a small buffer
using vec = __m256;
using lanes = int64_t;  // how many of the vector's lanes are the row's
constexpr int64_t W = 8;
inline lanes tail(int64_t left) { return left >= W ? W : left; }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec vexp(vec x) { return exp256(x); }

template <typename T>
inline const T* part(const T* p, lanes m, T* buf) {  // p, or its first m elements then zeros in buf
  if (m == W) return p;
  for (int64_t i = 0; i < W; ++i) buf[i] = i < m ? p[i] : T(0);
  return buf;
}
inline vec load(const float* p, lanes m) {
  alignas(32) float buf[W];
  return _mm256_loadu_ps(part(p, m, buf));
}
inline vec load(const bf16* p, lanes m) {
  alignas(16) bf16 buf[W];
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(part(p, m, buf)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// v rounded to bfloat16 (nearest even; NaN -> torch's 0x7fc0), as float32 bits (low half zero)
inline __m256i bf16_bits(vec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
}
inline vec rnd(vec v, const float*) { return v; }
inline vec rnd(vec v, const bf16*) { return _mm256_castsi256_ps(bf16_bits(v)); }

inline void store(float* p, vec v, lanes m) {
  if (m == W) return _mm256_storeu_ps(p, v);
  alignas(32) float buf[W];
  _mm256_store_ps(buf, v);
  for (int64_t i = 0; i < m; ++i) p[i] = buf[i];
}
inline void store(bf16* p, vec v, lanes m) {
  const __m256i s = _mm256_srli_epi32(bf16_bits(v), 16);  // each lane's bfloat16 in its low half
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  if (m == W) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  alignas(16) bf16 buf[W];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), h);
  for (int64_t i = 0; i < m; ++i) p[i] = buf[i];
}
#endif

// grain: rows per task, about 16k elements (a decode step's 32 rows of 576 run on one thread)
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t d, float eps) {
  vec acc = vzero();
  for (int64_t i = 0; i < d; i += W) {
    const vec v = load(x + i, tail(d - i));
    acc = vfma(v, v, acc);
  }
  const float inv = 1.f / std::sqrt(vsum(acc) / static_cast<float>(d) + eps);
  const vec s = vset(inv);
  for (int64_t i = 0; i < d; i += W) {
    const lanes m = tail(d - i);
    const vec y = rnd(vmul(load(x + i, m), s), x);  // normalized, in the input's dtype
    store(out + i, rnd(vmul(load(w + i, m), y), x), m);
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  const T* px = reinterpret_cast<const T*>(x.data_ptr());
  const T* pw = reinterpret_cast<const T*>(w.data_ptr());
  T* po = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, grain(d), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) norm_row(px + r * d, pw, po + r * d, d, static_cast<float>(eps));
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, at::Tensor& sum,
                       at::Tensor& out, double eps) {
  const int64_t rows = h.size(0), d = h.size(1);
  const T* ph = reinterpret_cast<const T*>(h.data_ptr());
  const T* pd = reinterpret_cast<const T*>(delta.data_ptr());
  const T* pw = reinterpret_cast<const T*>(w.data_ptr());
  T* ps = reinterpret_cast<T*>(sum.data_ptr());
  T* po = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, grain(d), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      for (int64_t i = 0; i < d; i += W) {
        const lanes m = tail(d - i);
        store(ps + r * d + i, rnd(vadd(load(ph + r * d + i, m), load(pd + r * d + i, m)), ph), m);
      }
      norm_row(ps + r * d, pw, po + r * d, d, static_cast<float>(eps));
    }
  });
}

template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  const T* pg = reinterpret_cast<const T*>(gu.data_ptr());
  T* po = reinterpret_cast<T*>(out.data_ptr());
  const vec one = vset(1.f);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const T* g = pg + r * 2 * n;
      for (int64_t i = 0; i < n; i += W) {
        const lanes m = tail(n - i);
        const vec x = load(g + i, m);
        const vec e = vexp(vsub(vzero(), x));
        const vec s = rnd(vdiv(x, vadd(one, e)), g);  // silu(gate) in the dtype
        store(po + r * n + i, rnd(vmul(s, load(g + n + i, m)), g), m);
      }
    }
  });
}

template <typename T>
void rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  const int64_t stride = x.stride(0);
  const T* px = reinterpret_cast<const T*>(x.data_ptr());
  const T* pc = reinterpret_cast<const T*>(cos.data_ptr());
  const T* psn = reinterpret_cast<const T*>(sin.data_ptr());
  T* po = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, tokens, grain(heads * hd), [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const T* c = pc + t * hd;
      const T* s = psn + t * hd;
      for (int64_t h = 0; h < heads; ++h) {
        const T* v = px + t * stride + h * hd;
        T* o = po + (t * heads + h) * hd;
        for (int64_t i = 0; i < half; i += W) {
          const lanes m = tail(half - i);
          const vec x1 = load(v + i, m), x2 = load(v + half + i, m);
          // first half: x1 * cos - x2 * sin; second: x2 * cos + x1 * sin (rotate_half = [-x2, x1])
          const vec lo = vadd(rnd(vmul(x1, load(c + i, m)), v), rnd(vmul(vsub(vzero(), x2), load(s + i, m)), v));
          const vec hi = vadd(rnd(vmul(x2, load(c + half + i, m)), v), rnd(vmul(x1, load(s + half + i, m)), v));
          store(o + i, rnd(lo, v), m);
          store(o + half + i, rnd(hi, v), m);
        }
      }
    }
  });
}

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dims) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": a CPU tensor");
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, ": dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK_VALUE(t.dim() == dims, name, ": ", dims, " dimensions, got ", t.dim());
}

void check_dtype(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                    "fused ops: float32 or bfloat16, got ", t.scalar_type());
}

#define DISPATCH(t, ...) \
  if ((t).scalar_type() == at::kFloat) { using T = float; __VA_ARGS__; } else { using T = bf16; __VA_ARGS__; }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_dtype(x);
  check(x, "x", x.scalar_type(), 2);
  check(w, "weight", x.scalar_type(), 1);
  TORCH_CHECK_VALUE(x.is_contiguous() && w.is_contiguous() && w.size(0) == x.size(1), "rms_norm: contiguous x [T, d], weight [d]");
  at::Tensor out = at::empty_like(x);
  DISPATCH(x, rms_norm_impl<T>(x, w, out, eps));
  return out;
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_dtype(h);
  check(h, "h", h.scalar_type(), 2);
  check(delta, "delta", h.scalar_type(), 2);
  check(w, "weight", h.scalar_type(), 1);
  TORCH_CHECK_VALUE(h.is_contiguous() && delta.is_contiguous() && w.is_contiguous() && h.sizes() == delta.sizes() &&
                        w.size(0) == h.size(1),
                    "add_rms_norm: contiguous h, delta [T, d], weight [d]");
  at::Tensor sum = at::empty_like(h), out = at::empty_like(h);
  DISPATCH(h, add_rms_norm_impl<T>(h, delta, w, sum, out, eps));
  return {sum, out};
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_dtype(gu);
  check(gu, "gate_up", gu.scalar_type(), 2);
  TORCH_CHECK_VALUE(gu.is_contiguous() && gu.size(1) % 2 == 0, "silu_mul: contiguous gate_up [T, 2 * n]");
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  DISPATCH(gu, silu_mul_impl<T>(gu, out));
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(x);
  check(x, "x", x.scalar_type(), 3);
  check(cos, "cos", x.scalar_type(), 2);
  check(sin, "sin", x.scalar_type(), 2);
  TORCH_CHECK_VALUE(x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
                    "rope: x [T, heads, hd] with contiguous heads and an even head_dim");
  TORCH_CHECK_VALUE(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                        sin.sizes() == cos.sizes(),
                    "rope: contiguous cos, sin [T, hd]");
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  DISPATCH(x, rope_impl<T>(x, cos, sin, out));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "x [T, d], weight [d], eps -> weight * rmsnorm(x)");
  m.def("add_rms_norm", &add_rms_norm, "h, delta [T, d], weight [d], eps -> [h + delta, weight * rmsnorm(h + delta)]");
  m.def("silu_mul", &silu_mul, "gate_up [T, 2n] -> silu(gate) * up [T, n]");
  m.def("rope", &rope, "x [T, heads, hd], cos, sin [T, hd] -> x * cos + rotate_half(x) * sin");
}
