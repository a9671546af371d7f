// Paged prefill attention on the CPU in bfloat16 with AVX-512 BF16 dot products: one row's new
// tokens (a prefill chunk, verification's k + 1 tokens) against its prefix and themselves, causal,
// reading the row's blocks of the KV pool through its block table (no gather). Built only where
// the CPU has AVX-512 BF16 (consumer/engine/prefill_attention.py); the reference it is tested
// against is torch's SDPA over the same keys (tests/test_prefill_attention.py).
//
// Why: SDPA's CPU flash kernel computes bfloat16 attention in float32 FMAs (~115 GFLOPS at 2
// threads here, the same as float32), about half of a 2048-token prefill. VDPBF16PS does two
// bfloat16 products per float32 lane per instruction.
//
// Layout (KVPool's head-major storage, one layer): k, v [n_kv, slots, hd] contiguous (slot = block *
// block_tokens + offset); q [n, H, hd] contiguous, the g = H / n_kv query heads of KV head j being
// j * g .. j * g + g - 1; table [blocks] int64. Query i sits at position start + i and sees keys
// 0 .. start + i. Out [n, H, hd] bfloat16.
//
// Numbers, as SDPA's flash kernel for bfloat16: scores q.k in float32 (products of bfloat16 pairs
// accumulated in float32), scaled, online softmax in float32, the probabilities rounded to bfloat16
// for the weighted sum of values (accumulated in float32), the sum of probabilities in float32.
//
// Per call: the row's K and V of every KV head are repacked once into the pair-interleaved layout
// the dot products read (keys padded with zeros to a multiple of 32); then every group of R query
// rows (R consecutive (position, head) pairs of one KV head) walks the key tiles up to its last
// visible key, its scores, softmax state and output in registers. Every table entry and length is
// checked before any read.
//
// The AMX variant (prefill_attention_amx, CPUs with AMX-BF16): the same packed K / V, the same
// softmax and numbers, but each group of 16 query rows multiplies Q by a key tile's K and the
// probabilities by its V on AMX tiles (TDPBF16PS: a 16 x 32 by 32 x 16 bfloat16 product accumulated
// in float32 per instruction), the online softmax in AVX-512 between the two; the output is kept in
// float32 beside the tiles and rescaled there.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t TILE = 32;  // keys per tile: two vectors of 16 float32 scores

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

struct Shape {
  int64_t n, H, n_kv, g, slots, block_tokens, start, L, tiles;
  float scale;
};

// K of KV head j in tiles of 32 keys: kp[(tile * hd/2 + p) * 32 + key] = the bfloat16 pair (2p, 2p + 1)
// of that key (one uint32); V in key pairs: vp[u * hd + d] = (v[2u][d], v[2u + 1][d]). Zero past L.
template <int HD>
void pack(const uint16_t* k, const uint16_t* v, const int64_t* table, const Shape& s, int64_t j, uint32_t* kp,
          uint32_t* vp) {
  constexpr int P = HD / 2;
  auto row = [&](const uint16_t* base, int64_t t) {
    return base + (j * s.slots + table[t / s.block_tokens] * s.block_tokens + t % s.block_tokens) * HD;
  };
  for (int64_t tile = 0; tile < s.tiles; ++tile) {
    uint32_t* kt = kp + tile * P * TILE;
    for (int64_t key = 0; key < TILE; ++key) {
      const int64_t t = tile * TILE + key;
      if (t < s.L) {
        uint32_t pairs[P];
        std::memcpy(pairs, row(k, t), sizeof(pairs));
        for (int p = 0; p < P; ++p) kt[p * TILE + key] = pairs[p];
      } else {
        for (int p = 0; p < P; ++p) kt[p * TILE + key] = 0;
      }
    }
  }
  for (int64_t u = 0; u < s.tiles * TILE / 2; ++u) {
    const int64_t t = 2 * u;
    uint32_t* out = vp + u * HD;
    const uint16_t* a = t < s.L ? row(v, t) : nullptr;
    const uint16_t* b = t + 1 < s.L ? row(v, t + 1) : nullptr;
    for (int d = 0; d < HD; ++d)
      out[d] = static_cast<uint32_t>(a ? a[d] : 0) | (static_cast<uint32_t>(b ? b[d] : 0) << 16);
  }
}

// R query rows of KV head j: folded rows first .. first + R - 1 (row r: position r / g, head j * g + r % g)
template <int HD, int R>
void group(const uint16_t* q, const uint32_t* kp, const uint32_t* vp, uint16_t* out, const Shape& s, int64_t j,
           int64_t first) {
  constexpr int P = HD / 2, C = HD / 16;
  const int64_t rows = s.n * s.g;
  uint32_t qv[R][P];
  int64_t limit[R];  // the last key each row sees; -1: no row here
  int64_t top = -1;
  for (int r = 0; r < R; ++r) {
    const int64_t f = first + r;
    if (f >= rows) {
      limit[r] = -1;
      std::memset(qv[r], 0, sizeof(qv[r]));
      continue;
    }
    const int64_t pos = f / s.g, head = j * s.g + f % s.g;
    std::memcpy(qv[r], q + (pos * s.H + head) * HD, sizeof(qv[r]));
    limit[r] = s.start + pos;
    top = std::max(top, limit[r]);
  }
  __m512 acc[R][C];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) uint32_t prob[R][TILE / 2];
  for (int64_t t0 = 0; t0 <= top; t0 += TILE) {
    const uint32_t* kt = kp + (t0 / TILE) * P * TILE;
    __m512 sc[R][2];
    for (int r = 0; r < R; ++r) sc[r][0] = sc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512i k0 = _mm512_loadu_si512(kt + p * TILE), k1 = _mm512_loadu_si512(kt + p * TILE + 16);
      for (int r = 0; r < R; ++r) {
        const __m512i b = _mm512_set1_epi32(static_cast<int>(qv[r][p]));
        sc[r][0] = dot(sc[r][0], b, k0);
        sc[r][1] = dot(sc[r][1], b, k1);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (t0 > limit[r]) {  // every key of this tile is past the row's position (or no row): no weight
        std::memset(prob[r], 0, sizeof(prob[r]));
        continue;
      }
      // lanes past the row's last key: excluded from the maximum and given probability 0
      const __m512i last = _mm512_set1_epi32(static_cast<int>(limit[r] - t0));
      const __mmask16 in0 = _mm512_cmple_epi32_mask(lane, last);
      const __mmask16 in1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), last);
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 s0 = _mm512_mask_mul_ps(ninf, in0, sc[r][0], scale);
      const __m512 s1 = _mm512_mask_mul_ps(ninf, in1, sc[r][1], scale);
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      const float m_new = std::max(m[r], mx);
      const float alpha = std::exp(m[r] - m_new);  // 0 on the first tile (m = -inf)
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512 p0 = _mm512_maskz_mov_ps(in0, exp512(_mm512_sub_ps(s0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(in1, exp512(_mm512_sub_ps(s1, mv)));
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
      if (alpha != 1.f) {
        const __m512 a = _mm512_set1_ps(alpha);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], a);
      }
      // bfloat16 probabilities, keys (2u, 2u + 1) as pair u
      _mm512_store_si512(prob[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
    }
    const int64_t pairs = std::min<int64_t>(TILE, top + 1 - t0 + 1) / 2;  // key pairs up to the last one used
    const uint32_t* vt = vp + (t0 / 2) * HD;
    for (int64_t u = 0; u < pairs; ++u) {
      __m512i vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_si512(vt + u * HD + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512i b = _mm512_set1_epi32(static_cast<int>(prob[r][u]));
        for (int c = 0; c < C; ++c) acc[r][c] = dot(acc[r][c], b, vv[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (limit[r] < 0) continue;
    const int64_t f = first + r, pos = f / s.g, head = j * s.g + f % s.g;
    uint16_t* o = out + (pos * s.H + head) * HD;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv))));
  }
}

template <int HD, int R>
void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* table, uint16_t* out,
            const Shape& s) {
  const int64_t per_head = s.tiles * TILE / 2 * HD;  // uint32 pairs of one KV head's packed K, and of its V
  std::vector<uint32_t> kp(s.n_kv * per_head), vp(s.n_kv * per_head);
  at::parallel_for(0, s.n_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) pack<HD>(k, v, table, s, j, kp.data() + j * per_head, vp.data() + j * per_head);
  });
  const int64_t groups = (s.n * s.g + R - 1) / R;
  // later groups see more keys: item i takes groups from both ends in turn, so the contiguous ranges
  // at::parallel_for hands each thread carry about equal work
  at::parallel_for(0, s.n_kv * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item % s.n_kv, i = item / s.n_kv;
      const int64_t gi = i % 2 == 0 ? i / 2 : groups - 1 - i / 2;
      group<HD, R>(q, kp.data() + j * per_head, vp.data() + j * per_head, out, s, j, gi * R);
    }
  });
}


// --- AMX ---------------------------------------------------------------------------------------

constexpr int M = 16;  // query rows per group: one tile's columns

// tiles (amx_tiles::configure: 16 rows of 64 bytes each): 0 A (K rows or V^T rows), 1 B (Q^T or P^T
// pairs), 2 / 3 scores of keys 0-15 / 16-31 (keys x rows), 4 .. 7 output (dims x rows, 16 dims each)

// Everything transposed, so that the softmax runs down columns: the 16 query rows of a group are a
// vector's 16 lanes. Scores S^T [32 keys x 16 rows] = K [32 x HD] by Q^T; the maximum, exp and sums
// are vertical (no horizontal reductions); the weighted values O^T [HD x 16 rows] = V^T by P^T.
// kr: one KV head's keys row-major [keys, HD] (zero past L); vt: its values in tiles of 32 keys,
// vt[(tile * HD + d) * 16 + u] = (v[2u][d], v[2u + 1][d]) of the tile's keys.
template <int HD>
void group_amx(const uint16_t* q, const uint16_t* kr, const uint32_t* vt, uint16_t* out, const Shape& s, int64_t j,
               int64_t first) {
  constexpr int P = HD / 2;
  const int64_t rows = s.n * s.g;
  alignas(64) uint32_t qt[P][M];  // Q^T pairs: qt[p][r] = (q[r][2p], q[r][2p + 1])
  alignas(64) int32_t lim[M];     // the last key each row sees; -1: no row here
  int64_t top = -1, low = std::numeric_limits<int64_t>::max();  // the last key any row sees; the least that every row sees
  for (int r = 0; r < M; ++r) {
    const int64_t f = first + r;
    if (f >= rows) {
      lim[r] = -1;
      for (int p = 0; p < P; ++p) qt[p][r] = 0;
      continue;
    }
    const int64_t pos = f / s.g, head = j * s.g + f % s.g;
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + (pos * s.H + head) * HD);
    for (int p = 0; p < P; ++p) qt[p][r] = qr[p];
    lim[r] = static_cast<int32_t>(s.start + pos);
    top = std::max<int64_t>(top, lim[r]);
    low = std::min<int64_t>(low, lim[r]);
  }
  const __m512i limv = _mm512_load_si512(lim);
  alignas(64) float acc[HD][M];
  std::memset(acc, 0, sizeof(acc));
  alignas(64) float st[TILE][M];
  alignas(64) float ot[16][M];
  alignas(64) uint32_t pt[TILE / 2][M];
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // the softmax in base 2: e^(x - m) = 2^(x log2(e) - m log2(e)); the maximum, the lazy margin and
  // the rescale factors are kept in base-2 units, and the scale's log2(e) rides in the one multiply
  // (a fused multiply-subtract) each score takes anyway
  const __m512 scale2 = _mm512_set1_ps(s.scale * 1.44269504088896341f);
  // bfloat16 lanes 0..15 (p of key 2u) and 16..31 (key 2u + 1) -> pairs per row
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // HD <= 64: the output's HD / 16 tiles stay in tile registers 4.. across the key tiles, and the
  // running maximum moves only when a row's scores pass it by more than LAZY (then the output is
  // stored, rescaled and reloaded): weights up to 2^LAZY, far inside float32 and bfloat16's range.
  // HD = 128 has no tiles to spare: its output is stored and rescaled every key tile.
  constexpr bool resident = HD <= 64;
  constexpr float LAZY = 11.f;
  auto store_out = [&]() {
    if constexpr (resident) {
      _tile_stored(4, &acc[0][0], 64);
      _tile_stored(5, &acc[16][0], 64);
      if constexpr (HD == 64) {
        _tile_stored(6, &acc[32][0], 64);
        _tile_stored(7, &acc[48][0], 64);
      }
    }
  };
  auto load_out = [&]() {
    if constexpr (resident) {
      _tile_loadd(4, &acc[0][0], 64);
      _tile_loadd(5, &acc[16][0], 64);
      if constexpr (HD == 64) {
        _tile_loadd(6, &acc[32][0], 64);
        _tile_loadd(7, &acc[48][0], 64);
      }
    }
  };
  load_out();  // zeros
  __m512 m = ninf, l = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 <= top; t0 += TILE) {
    // S^T: keys t0 .. t0 + 15 and t0 + 16 .. t0 + 31 by Q^T, 32 dims per product
    _tile_zero(2);
    _tile_zero(3);
    for (int d = 0; d < HD / 32; ++d) {
      _tile_loadd(1, &qt[d * 16][0], 64);
      _tile_loadd(0, kr + t0 * HD + d * 32, HD * 2);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(0, kr + (t0 + 16) * HD + d * 32, HD * 2);
      _tile_dpbf16ps(3, 0, 1);
    }
    _tile_stored(2, &st[0][0], 64);
    _tile_stored(3, &st[16][0], 64);
    // the raw scores' maximum over the keys each row sees (the scale is positive: scaling after
    // the maximum is the same), in base-2 units
    // A tile every row sees whole (below the diagonal: most of them) needs no masks; rows past the
    // group's end (lim -1) then weigh their zero scores, never stored.
    const bool full = t0 + TILE - 1 <= low;
    __mmask16 in[TILE];
    __m512 tmax = ninf;
    if (full) {
      for (int i = 0; i < TILE; ++i) tmax = _mm512_max_ps(tmax, _mm512_load_ps(st[i]));
    } else {
      for (int i = 0; i < TILE; ++i) {
        in[i] = _mm512_cmpge_epi32_mask(limv, _mm512_set1_epi32(static_cast<int>(t0 + i)));
        tmax = _mm512_mask_max_ps(tmax, in[i], tmax, _mm512_load_ps(st[i]));
      }
    }
    tmax = _mm512_mul_ps(tmax, scale2);  // -inf stays -inf
    // rows whose maximum moves: all of them where the output is not resident, else only those
    // passed by more than LAZY (and those with no maximum yet)
    const __mmask16 moves = resident ? _mm512_cmp_ps_mask(tmax, _mm512_add_ps(m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ)
                                     : __mmask16(0xffff);
    __m512 alpha = _mm512_set1_ps(1.f);
    if (moves) {
      const __m512 m_new = _mm512_mask_max_ps(m, moves, m, tmax);
      const __mmask16 was = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);  // rows with a maximum before
      alpha = _mm512_mask_mov_ps(alpha, moves & was, exp2_512(_mm512_sub_ps(m, m_new)));
      alpha = _mm512_mask_mov_ps(alpha, moves & ~was, _mm512_setzero_ps());  // nothing summed yet: 0 stays 0
      m = m_new;
      l = _mm512_mul_ps(l, alpha);
      if constexpr (resident) {
        store_out();
        for (int d = 0; d < HD; ++d) _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), alpha));
        load_out();
      }
    }
    // rows with no key yet (or no row): keep -inf, subtract 0 so nothing is NaN; their weights are 0.
    // Scores are finite (keys past L are zeros), so every exponent is; masked lanes' weights are 0.
    const __mmask16 live = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
    const __m512 base = _mm512_maskz_mov_ps(live, m);
    auto weigh = [&](auto masked) {
      for (int u = 0; u < TILE / 2; ++u) {
        __m512 p0 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(st[2 * u]), scale2, base));
        __m512 p1 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(st[2 * u + 1]), scale2, base));
        if constexpr (decltype(masked)::value) {
          p0 = _mm512_maskz_mov_ps(in[2 * u], p0);
          p1 = _mm512_maskz_mov_ps(in[2 * u + 1], p1);
        }
        l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
        const __m512i pair = _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
        _mm512_store_si512(pt[u], pair);
      }
    };
    if (full) weigh(std::false_type{});
    else weigh(std::true_type{});
    // O^T += V^T [16 dims x 32 keys] by P^T, 16 dims at a time
    _tile_loadd(1, &pt[0][0], 64);
    const uint32_t* vtile = vt + (t0 / TILE) * HD * 16;
    if constexpr (resident) {
      _tile_loadd(0, vtile, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(0, vtile + 16 * 16, 64);
      _tile_dpbf16ps(5, 0, 1);
      if constexpr (HD == 64) {
        _tile_loadd(0, vtile + 2 * 16 * 16, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(0, vtile + 3 * 16 * 16, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
    } else {
      for (int c = 0; c < HD / 16; ++c) {  // the running sum rescaled by alpha
        _tile_zero(4);
        _tile_loadd(0, vtile + c * 16 * 16, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_stored(4, &ot[0][0], 64);
        for (int d = 0; d < 16; ++d)
          _mm512_store_ps(acc[c * 16 + d], _mm512_fmadd_ps(_mm512_load_ps(acc[c * 16 + d]), alpha, _mm512_load_ps(ot[d])));
      }
    }
  }
  store_out();
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  for (int d = 0; d < HD; ++d) _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), inv));
  const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(M));
  for (int r = 0; r < M; ++r) {
    if (lim[r] < 0) continue;
    const int64_t f = first + r, pos = f / s.g, head = j * s.g + f % s.g;
    uint16_t* o = out + (pos * s.H + head) * HD;
    for (int c = 0; c < HD / 16; ++c) {
      const __m512 x = _mm512_i32gather_ps(down, &acc[c * 16][r], 4);  // acc[c * 16 + i][r], i = 0..15
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    }
  }
}

// one KV head's keys row-major and values transposed in 32-key tiles, zero past L (see group_amx)
template <int HD>
void pack_amx(const uint16_t* k, const uint16_t* v, const int64_t* table, const Shape& s, int64_t j, uint16_t* kr,
              uint32_t* vt) {
  auto row = [&](const uint16_t* base, int64_t t) {
    return base + (j * s.slots + table[t / s.block_tokens] * s.block_tokens + t % s.block_tokens) * HD;
  };
  const int64_t keys = s.tiles * TILE;
  for (int64_t t = 0; t < keys; ++t) {
    if (t < s.L) std::memcpy(kr + t * HD, row(k, t), HD * 2);
    else std::memset(kr + t * HD, 0, HD * 2);
  }
  for (int64_t tile = 0; tile < s.tiles; ++tile) {
    uint32_t* out = vt + tile * HD * 16;
    for (int u = 0; u < 16; ++u) {
      const int64_t t = tile * TILE + 2 * u;
      const uint16_t* a = t < s.L ? row(v, t) : nullptr;
      const uint16_t* b = t + 1 < s.L ? row(v, t + 1) : nullptr;
      for (int d = 0; d < HD; ++d)
        out[d * 16 + u] = static_cast<uint32_t>(a ? a[d] : 0) | (static_cast<uint32_t>(b ? b[d] : 0) << 16);
    }
  }
}

template <int HD>
void attend_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* table, uint16_t* out,
                const Shape& s) {
  const int64_t keys = s.tiles * TILE;
  std::vector<uint16_t> kr(s.n_kv * keys * HD);
  std::vector<uint32_t> vt(s.n_kv * keys / 2 * HD);
  at::parallel_for(0, s.n_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      pack_amx<HD>(k, v, table, s, j, kr.data() + j * keys * HD, vt.data() + j * keys / 2 * HD);
  });
  const int64_t groups = (s.n * s.g + M - 1) / M;
  at::parallel_for(0, s.n_kv * groups, 1, [&](int64_t begin, int64_t end) {
    amx_tiles::configure();  // tile state is per thread
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item % s.n_kv, i = item / s.n_kv;
      const int64_t gi = i % 2 == 0 ? i / 2 : groups - 1 - i / 2;
      group_amx<HD>(q, kr.data() + j * keys * HD, vt.data() + j * keys / 2 * HD, out, s, j, gi * M);
    }
    amx_tiles::release();
  });
}

// AMX-BF16 on this CPU and the kernel allowed to use its tiles
bool amx_supported() { return amx_tiles::permitted(); }

torch::Tensor run(bool use_amx, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& table, int64_t start, int64_t block_tokens, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && table.device().is_cpu(),
                    "prefill_attention: q, k, v, table must be CPU tensors");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                       v.scalar_type() == at::kBFloat16,
                   "prefill_attention: q, k, v must be bfloat16; got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q must be [n, H, hd] and k / v ",
                    "[n_kv, slots, hd]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
                    "prefill_attention: q, k, v must be contiguous");
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "prefill_attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  const int64_t hd = q.size(2);
  TORCH_CHECK_VALUE(hd == k.size(2), "prefill_attention: q's head_dim ", hd, " != k's ", k.size(2));
  TORCH_CHECK_VALUE(hd == 32 || hd == 64 || hd == 128, "prefill_attention: head_dim ", hd, " not one of 32, 64, 128");
  TORCH_CHECK_VALUE(k.size(0) > 0 && q.size(1) % k.size(0) == 0, "prefill_attention: q's ", q.size(1),
                    " heads are not a multiple of k's ", k.size(0), " KV heads");
  TORCH_CHECK_VALUE(q.size(0) >= 1, "prefill_attention: no query");
  TORCH_CHECK_VALUE(block_tokens > 0 && block_tokens <= k.size(1), "prefill_attention: block_tokens ", block_tokens,
                    " outside 1 .. the pool's ", k.size(1), " slots");
  // start + n below overflow: the table check below then bounds both
  TORCH_CHECK_VALUE(start >= 0 && start <= (std::numeric_limits<int64_t>::max() >> 2), "prefill_attention: start ",
                    start, " outside 0 .. 2**61 - 1");
  TORCH_CHECK_TYPE(table.scalar_type() == at::kLong, "prefill_attention: table must be int64; got ", table.scalar_type());
  TORCH_CHECK_VALUE(table.dim() == 1 && table.is_contiguous(), "prefill_attention: table must be contiguous [blocks]; got ",
                    table.sizes());
  Shape s{};
  s.n = q.size(0), s.H = q.size(1), s.n_kv = k.size(0), s.g = s.H / s.n_kv, s.slots = k.size(1);
  s.block_tokens = block_tokens, s.start = start, s.L = start + s.n, s.scale = static_cast<float>(scale);
  s.tiles = (s.L + TILE - 1) / TILE;
  const int64_t used = (s.L - 1) / block_tokens + 1, pool_blocks = s.slots / block_tokens;
  TORCH_CHECK_VALUE(used <= table.size(0), "prefill_attention: ", s.L, " keys need ", used, " blocks of ",
                    block_tokens, "; the table has ", table.size(0));
  const int64_t* tab = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK_VALUE(tab[i] >= 0 && tab[i] < pool_blocks, "prefill_attention: block ", tab[i],
                      " outside the pool's 0 .. ", pool_blocks - 1);
  auto out = torch::empty_like(q);
  auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (use_amx) {
    TORCH_CHECK(amx_supported(), "prefill_attention_amx: this CPU (or this process) cannot use AMX-BF16 tiles");
    if (hd == 32) attend_amx<32>(qp, kp, vp, tab, op, s);
    else if (hd == 64) attend_amx<64>(qp, kp, vp, tab, op, s);
    else attend_amx<128>(qp, kp, vp, tab, op, s);
  } else if (hd == 32) attend<32, 4>(qp, kp, vp, tab, op, s);
  else if (hd == 64) attend<64, 4>(qp, kp, vp, tab, op, s);
  else attend<128, 2>(qp, kp, vp, tab, op, s);
  return out;
}

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& table, int64_t start, int64_t block_tokens, double scale) {
  return run(false, q, k, v, table, start, block_tokens, scale);
}

torch::Tensor prefill_attention_amx(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& table, int64_t start, int64_t block_tokens, double scale) {
  return run(true, q, k, v, table, start, block_tokens, scale);
}

bool supported() { return __builtin_cpu_supports("avx512bf16"); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention, "paged causal prefill attention, bfloat16, AVX-512 BF16 (CPU)");
  m.def("supported", &supported, "whether this CPU runs AVX-512 BF16 instructions");
  m.def("prefill_attention_amx", &prefill_attention_amx, "the same on AMX-BF16 tiles (CPU)");
  m.def("amx_supported", &amx_supported, "whether this CPU has AMX-BF16 and this process may use its tiles");
}
