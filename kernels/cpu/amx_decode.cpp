// Paged decode attention on Intel AMX tiles, bfloat16 caches: both matrix products of attention run
// on the tile unit instead of AVX-512 lanes, and sequences that share prefix blocks share the work on
// them. One task is a unit of up to 16 / G consecutive sequences (decodes arrive sorted by first
// block) with a common run of prefix blocks, and one KV head; its R = n * G query rows go together:
//   scores^T [16 tokens x R] = K rows (tile-loaded straight from the cache block) . Q^T
//     over the shared blocks once for all rows, then over each sequence's own blocks
//   softmax per row (float32, AVX-512), probabilities rounded to bfloat16
//   out [R x 64 dims]        = P [R x 16 tokens] . V rows, the same split into shared and own blocks
// Output tiles stay in tile registers across the whole context. Falls back (returns false) when the
// CPU, the kernel's permission, or the shape does not fit; the AVX-512 kernel then runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "simd_exp.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

std::atomic<bool> g_enabled{true};

// Linux hands out AMX's 8 KiB of tile state per process on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction raises SIGILL.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Tile roles: 0 scores^T [16 x R] f32, 1 key rows or value rows [16 x 32 dims], 2 Q^T pairs
// [16 x R pairs], 3 probabilities [R x 16 tokens, each paired with a zero], 4-7 outputs [R x 16] f32:
// (dims 0-31 even, odd), (dims 32-63 even, odd) of the current 64-dim sweep.
void configure_tiles(int R) {
  TileConfig cfg;
  cfg.rows[0] = 16; cfg.colsb[0] = static_cast<uint16_t>(4 * R);
  cfg.rows[1] = 16; cfg.colsb[1] = 64;
  cfg.rows[2] = 16; cfg.colsb[2] = static_cast<uint16_t>(4 * R);
  for (int t = 3; t < 8; ++t) { cfg.rows[t] = static_cast<uint8_t>(R); cfg.colsb[t] = 64; }
  load_tile_config(cfg);
}

// Consecutive sequences whose block tables start with the same blocks; `shared` tokens (a multiple
// of 16, short of every member's last token) are read once for all of them.
struct Unit {
  int64_t first;
  int n;
  int64_t shared;
};

std::vector<Unit> form_units(const int32_t* bt, const int32_t* cl, int64_t S, int64_t MB, int64_t BS, int max_n) {
  std::vector<Unit> units;
  for (int64_t s = 0; s < S;) {
    const int32_t* base = bt + s * MB;
    int64_t common = (cl[s] + BS - 1) / BS, min_len = cl[s];
    int n = 1;
    while (n < max_n && s + n < S) {
      const int32_t* other = bt + (s + n) * MB;
      const int64_t limit = std::min<int64_t>(common, (cl[s + n] + BS - 1) / BS);
      int64_t lcp = 0;
      while (lcp < limit && other[lcp] == base[lcp]) ++lcp;
      if (lcp == 0) break;
      common = lcp;
      min_len = std::min<int64_t>(min_len, cl[s + n]);
      ++n;
    }
    const int64_t shared = n == 1 ? 0 : std::min<int64_t>(common * BS, (min_len - 1) / 16 * 16);
    units.push_back({s, n, shared});
    s += n;
  }
  return units;
}

struct Scratch {
  std::vector<float> scores;      // [R x Lmax16] query-major
  std::vector<uint32_t> p_even;   // [R x Lmax16] bfloat16 probability in the low half of each word
  std::vector<uint32_t> p_odd;    // [R x Lmax16] ... in the high half
  std::vector<uint16_t> q_pairs;  // [D/32][16][R][2] bfloat16
  std::vector<float> acc;         // [R x D]
  alignas(64) uint16_t v_tail[16 * 64];  // the last, partial group of value rows, zero padded
  alignas(64) uint32_t own_even[16 * 16];  // one sequence's probability rows, the others zero
  alignas(64) uint32_t own_odd[16 * 16];
  alignas(64) float tile[16 * 16];
};

// Blocks sit at scattered addresses, so the hardware prefetchers stop at each one: fetch the 16
// rows (this head's elements of each) of a block ahead ourselves.
inline void prefetch_rows(const uint16_t* rows, int64_t stride, int64_t n) {
  for (int64_t j = 0; j < 16; ++j)
    for (int64_t off = 0; off < n * 2; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + j * stride) + off, _MM_HINT_T0);
}

inline __mmask16 first_n(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// 16 x 16 float32, row-major in `in` -> out[j] = column j.
inline void transpose16(const float* in, __m512* out) {
  __m512 r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + 16 * i);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // u[4q + j], 128-bit lane k: column 4k + j of rows 4q..4q+3
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
    out[j] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    out[j + 8] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    out[j + 4] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    out[j + 12] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

struct Geometry {  // the cache and the tables, as the task sees them
  const uint16_t* kc;
  const uint16_t* vc;
  const int32_t* bt;
  const int32_t* cl;
  int64_t MB, BS, c_s0, c_s1, c_s2;
  int G;
  int64_t D;
  const uint16_t* row(const uint16_t* cache, int64_t seq, int64_t t, int64_t h_off) const {
    return cache + bt[seq * MB + t / BS] * c_s0 + (t % BS) * c_s1 + h_off;
  }
};

// Scores of rows [r0, r1) for 16 tokens from t0 of sequence `seq`, into the query-major buffer.
inline void score_tile(const Geometry& g, Scratch& sc, int64_t seq, int64_t t0, int64_t len, int64_t h_off,
                       int R, int r0, int r1, int64_t Lmax16, __m512* vmax) {
  const uint16_t* kp = g.row(g.kc, seq, t0, h_off);
  if (t0 + 32 < len) prefetch_rows(g.row(g.kc, seq, t0 + 32, h_off), g.c_s1, g.D);
  _tile_zero(0);
  for (int64_t c = 0; c < g.D / 32; ++c) {
    _tile_loadd(1, kp + 32 * c, g.c_s1 * 2);
    _tile_loadd(2, sc.q_pairs.data() + c * 16 * R * 2, 4 * R);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, sc.tile, 64);
  __m512 col[16];
  transpose16(sc.tile, col);
  const __mmask16 k = first_n(len - t0);  // rows past the context hold anything: masked from here on
  for (int r = r0; r < r1; ++r) {
    const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), k, col[r]);
    vmax[r] = _mm512_max_ps(vmax[r], v);
    _mm512_storeu_ps(sc.scores.data() + r * Lmax16 + t0, v);
  }
}

// out tiles += P . V for 16 value rows from t0 of `seq`. The tile multiply pairs adjacent elements of
// a B row, so with raw value rows as B (16 tokens x 32 dims) and probabilities spread as (p, 0) pairs
// the product holds the even dims, and as (0, p) pairs the odd dims: twice the (cheap) tile work
// instead of re-laying out every value row.
inline void value_tile(const Geometry& g, Scratch& sc, int64_t seq, int64_t t0, int64_t len, int64_t h_off,
                       const uint32_t* pe, const uint32_t* po, int64_t p_bytes) {
  const uint16_t* rows = g.row(g.vc, seq, t0, h_off);
  int64_t stride = g.c_s1 * 2;
  if (t0 + 32 < len) prefetch_rows(g.row(g.vc, seq, t0 + 32, h_off), g.c_s1, 64);
  if (len - t0 < 16) {  // a value row past the context may hold NaN, and 0 * NaN is NaN: copy, pad
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t d = 0; d < 64; ++d) sc.v_tail[j * 64 + d] = j < len - t0 ? rows[j * g.c_s1 + d] : 0;
    rows = sc.v_tail;
    stride = 128;
  }
  _tile_loadd(3, pe, p_bytes);
  _tile_loadd(1, rows, stride);
  _tile_dpbf16ps(4, 3, 1);
  _tile_loadd(1, rows + 32, stride);
  _tile_dpbf16ps(6, 3, 1);
  _tile_loadd(3, po, p_bytes);
  _tile_dpbf16ps(7, 3, 1);
  _tile_loadd(1, rows, stride);
  _tile_dpbf16ps(5, 3, 1);
}

// One unit and KV head h. qf: R x D scaled queries (float32); sc.acc receives R x D normalised outputs.
void attend_unit(const Geometry& g, const Unit& u, int64_t h, const float* qf, Scratch& sc) {
  const int G = g.G, R = u.n * G;
  const int64_t D = g.D, h_off = h * g.c_s2;
  int64_t Lmax16 = 0;
  for (int i = 0; i < u.n; ++i) Lmax16 = std::max<int64_t>(Lmax16, (g.cl[u.first + i] + 15) / 16 * 16);
  sc.scores.resize(R * Lmax16);
  sc.p_even.resize(R * Lmax16);
  sc.p_odd.resize(R * Lmax16);
  sc.q_pairs.resize(D / 32 * 16 * R * 2);
  sc.acc.resize(R * D);
  for (int64_t c = 0; c < D / 32; ++c)
    for (int p = 0; p < 16; ++p)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 2; ++j)
          sc.q_pairs[((c * 16 + p) * R + r) * 2 + j] = c10::BFloat16(qf[r * D + 32 * c + 2 * p + j]).x;
  __m512 vmax[16];
  for (int r = 0; r < R; ++r) vmax[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = 0; t0 < u.shared; t0 += 16)
    score_tile(g, sc, u.first, t0, u.shared, h_off, R, 0, R, Lmax16, vmax);
  for (int i = 0; i < u.n; ++i) {
    const int64_t len = g.cl[u.first + i];
    for (int64_t t0 = u.shared; t0 < len; t0 += 16)
      score_tile(g, sc, u.first + i, t0, len, h_off, R, i * G, (i + 1) * G, Lmax16, vmax);
  }
  float inv[16];
  for (int r = 0; r < R; ++r) {
    const int64_t len = g.cl[u.first + r / G];
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __m512 s = _mm512_loadu_ps(sc.scores.data() + r * Lmax16 + t);
      const __m512 e = _mm512_maskz_mov_ps(first_n(len - t), exp512(_mm512_sub_ps(s, m)));
      sum = _mm512_add_ps(sum, e);
      const __m512i w = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e));
      _mm512_storeu_si512(sc.p_even.data() + r * Lmax16 + t, w);
      _mm512_storeu_si512(sc.p_odd.data() + r * Lmax16 + t, _mm512_slli_epi32(w, 16));
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  const int64_t p_bytes = Lmax16 * 4;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t t0 = 0; t0 < u.shared; t0 += 16)
      value_tile(g, sc, u.first, t0, u.shared, h_off + d0, sc.p_even.data() + t0, sc.p_odd.data() + t0, p_bytes);
    for (int i = 0; i < u.n; ++i) {
      const int64_t len = g.cl[u.first + i];
      for (int64_t t0 = u.shared; t0 < len; t0 += 16) {
        if (u.n == 1) {
          value_tile(g, sc, u.first, t0, len, h_off + d0, sc.p_even.data() + t0, sc.p_odd.data() + t0, p_bytes);
          continue;
        }
        // Own blocks: only this sequence's rows may weigh them; the others' rows are zero.
        std::fill(sc.own_even, sc.own_even + R * 16, 0u);
        std::fill(sc.own_odd, sc.own_odd + R * 16, 0u);
        for (int r = i * G; r < (i + 1) * G; ++r) {
          _mm512_store_si512(sc.own_even + r * 16, _mm512_loadu_si512(sc.p_even.data() + r * Lmax16 + t0));
          _mm512_store_si512(sc.own_odd + r * 16, _mm512_loadu_si512(sc.p_odd.data() + r * Lmax16 + t0));
        }
        value_tile(g, sc, u.first + i, t0, len, h_off + d0, sc.own_even, sc.own_odd, 64);
      }
    }
    float* o = sc.tile;  // four [R x 16] results, interleaved back into dims
    for (int part = 0; part < 4; ++part) {
      switch (part) {
        case 0: _tile_stored(4, o, 64); break;
        case 1: _tile_stored(5, o, 64); break;
        case 2: _tile_stored(6, o, 64); break;
        default: _tile_stored(7, o, 64); break;
      }
      const int64_t base = d0 + 32 * (part / 2) + part % 2;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 16; ++j) sc.acc[r * D + base + 2 * j] = o[r * 16 + j] * inv[r];
    }
  }
}

}  // namespace

bool amx_decode_usable(int64_t G, int64_t D, int64_t BS) {
  return g_enabled.load() && G >= 1 && G <= 16 && D % 64 == 0 && BS % 16 == 0 && amx_permitted();
}

bool paged_decode_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                      const int32_t* bt, const int32_t* cl, c10::BFloat16* out, int64_t S, int64_t Hq, int64_t Hk,
                      int64_t D, int64_t BS, int64_t MB, int64_t q_s0, int64_t q_s1, int64_t c_s0, int64_t c_s1,
                      int64_t c_s2, int64_t o_s0, int64_t o_s1, float scale) {
  const int64_t G = Hq / Hk;
  if (!amx_decode_usable(G, D, BS)) return false;
  const std::vector<Unit> units = form_units(bt, cl, S, MB, BS, static_cast<int>(16 / G));
  const Geometry geo{reinterpret_cast<const uint16_t*>(kc), reinterpret_cast<const uint16_t*>(vc), bt, cl, MB, BS,
                     c_s0, c_s1, c_s2, static_cast<int>(G), D};
  const int64_t tasks = static_cast<int64_t>(units.size()) * Hk;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    std::vector<float> qf;
    int configured = 0;
    for (int64_t task = begin; task < end; ++task) {
      const Unit& u = units[task / Hk];
      const int64_t h = task % Hk;
      const int R = u.n * static_cast<int>(G);
      if (R != configured) {  // tile state is per thread, and oneDNN's matmuls load their own
        configure_tiles(R);
        configured = R;
      }
      qf.resize(R * D);
      for (int r = 0; r < R; ++r) {
        const c10::BFloat16* qp = q + (u.first + r / G) * q_s0 + (h * G + r % G) * q_s1;
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qp[d]) * scale;
      }
      attend_unit(geo, u, h, qf.data(), sc);
      for (int r = 0; r < R; ++r) {
        c10::BFloat16* op = out + (u.first + r / G) * o_s0 + (h * G + r % G) * o_s1;
        for (int64_t d = 0; d < D; ++d) op[d] = static_cast<c10::BFloat16>(sc.acc[r * D + d]);
      }
    }
    _tile_release();
  });
  return true;
}

bool set_amx_enabled(bool enabled) { return g_enabled.exchange(enabled); }
bool amx_available() { return amx_permitted(); }

#else  // built without AMX: the AVX-512 kernel always runs

bool amx_decode_usable(int64_t, int64_t, int64_t) { return false; }
bool paged_decode_amx(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int32_t*,
                      const int32_t*, c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float) {
  return false;
}
bool set_amx_enabled(bool) { return false; }
bool amx_available() { return false; }

#endif
