// Vector math and AMX tile setup the CPU kernels share (decode_attention.cpp, prefill_attention.cpp,
// fused_ops.cpp). Builds fold this file's digest into their flags
// (consumer/engine/paged_attention.py), so an edit here rebuilds them.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// e^x for 16 lanes: 2^n * p(r), r = x - n ln 2, a degree-6 polynomial (relative error ~2e-7); x
// clamped below at -104 (e^-104 is below float32's smallest normal: the result flushes to ~0)
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for 16 lanes: 2^n * p(r), n = round(x), r = x - n in [-1/2, 1/2], p a degree-5 fit (relative
// error < 3e-7, as exp512's); cheaper than exp512 where the caller folds log2(e) into a scale it
// applies anyway. x must not be -inf or NaN (r would be NaN): callers mask such lanes; x below
// about -150 gives 0.
inline __m512 exp2_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3216948508e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6667540221e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5508338204e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022318176e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314693804e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// AMX tiles, as both kernels use them: 8 tiles of 16 rows x 64 bytes. The functions carry their own
// target attributes, so a build without AMX flags (the decode kernel's AVX-512 build) runs them only
// where `amx_tiles::permitted()` says so.
namespace amx_tiles {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// the calling thread's tile configuration (tile state is per thread)
__attribute__((target("amx-tile"))) inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  // the intrinsic's asm does not tell the compiler it reads cfg: without this barrier GCC 12 drops the
  // stores above as dead (a config of palette 1 and no tiles: the first tile load is an illegal instruction)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

// AMX-BF16 on this CPU and this process allowed to use its tiles (Linux: asked once per process)
inline bool permitted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

}  // namespace amx_tiles
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// e^x for 8 lanes, exp512's polynomial and clamp below; AVX2 has no scalef, so 2^n is two exponent
// fields, 2^(n/2) and 2^(n - n/2), each a normal float32 over n's whole range: the product flushes
// to 0 below e^-104 and reaches infinity above float32's largest (x clamped at 89, past that point)
inline __m256 exp256(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i ni = _mm256_cvtps_epi32(n);  // in [-150, 128]
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);  // each in [-75, 64]
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif
