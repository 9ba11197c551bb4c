// Causal attention of a fresh prompt (or a long chunk after its gathered context) on Intel AMX tiles,
// bfloat16: the AMX counterpart of prefill_bf16.cpp. PyTorch's CPU flash attention runs this at
// ~150 GFLOP/s on 2 AMX cores at 256-512 tokens (its blocks are small and its softmax dominates); here
// both products are tile dot products and the softmax is exact over a whole row:
//   one task: 16 query tokens of one query head (A tiles straight from q, dims 0-31 and 32-63, ...)
//   scores [16 x 16 keys] = Q . K^T, K packed once per (KV head) into B-tile layout [L/16][D/2][16][2]
//   softmax per row (float32, AVX-512) over keys [0, position], probabilities rounded to bfloat16 as
//     flash attention rounds them, 1/sum of the rounded values kept in float32
//   out [16 x D] = P [16 x 32 keys] . V, V packed into B-tile layout [L/32][D/16][16 pairs][16][2]
// Output tiles hold 64 dims at a time (4 of the 8 tiles), so D = 128 takes two sweeps of the second
// product. Query token i sits at key position q_offset + i and sees keys [0, q_offset + i].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "simd_exp.h"

bool amx_available();  // amx_decode.cpp: this build and this process may use the tiles

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

// Every tile is 16 rows x 64 bytes: 0, 1 query dims (0-31, 32-63) or probabilities; 2 keys or values;
// 3 scores; 4-7 outputs (16 dims each), or in the first product of D = 128 query dims 64-127 (4, 5).
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  load_tile_config(cfg);
}

inline uint16_t bits(c10::BFloat16 x) { return x.x; }

// keys [L, D] of one KV head -> [Lb/16][D/2][16][2] (zero past L): block b's rows j are dim pair j of its
// 16 keys, a B tile per 32 dims. One gather of 16 keys' pair j per output row.
void pack_keys(const c10::BFloat16* k, int64_t s0, int64_t L, int64_t b0, int64_t b1, int64_t D, uint16_t* out) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(s0 / 2)));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t left = std::min<int64_t>(16, L - b * 16);
    const __mmask16 km = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << std::max<int64_t>(left, 0)) - 1);
    const int32_t* base = reinterpret_cast<const int32_t*>(k + b * 16 * s0);
    for (int64_t j = 0; j < D / 2; ++j)
      _mm512_storeu_si512(out + (b * (D / 2) + j) * 32,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), km, rows, base + j, 4));
  }
}

// values [L, D] of one KV head -> [L32/32][D/16][16 pairs][16 dims][2] (zero past L): a B tile per 32
// keys and 16 dims. Rows t and t + 1 interleaved 16 dims at a time.
void pack_values(const c10::BFloat16* v, int64_t s0, int64_t L, int64_t c0, int64_t c1, int64_t D, uint16_t* out) {
  const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t t0 = c * 32 + 2 * p;
      const uint16_t* r0 = reinterpret_cast<const uint16_t*>(v + t0 * s0);
      const uint16_t* r1 = reinterpret_cast<const uint16_t*>(v + (t0 + 1) * s0);
      for (int64_t g = 0; g < D / 16; ++g) {
        const __m256i a = t0 < L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + g * 16)) : zero;
        const __m256i b = t0 + 1 < L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + g * 16)) : zero;
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(out + (((c * (D / 16) + g) * 16 + p) * 16) * 2, _mm512_permutexvar_epi16(mix, both));
      }
    }
}

struct Scratch {
  std::vector<float> scores;    // [16 x Lb]
  std::vector<uint16_t> probs;  // [16 x L32] bfloat16, zero past each row's keys
  alignas(64) uint16_t q[16 * 128];
  alignas(64) float out[16 * 128];
  float inv[16];
};

// Query tokens [i0, i1) of query head h (KV head g's packed keys kp and values vp).
void task(const c10::BFloat16* q, int64_t q_s0, int64_t q_s1, int64_t h, int64_t i0, int64_t i1, int64_t off,
          int64_t D, int64_t Lb, int64_t L32, const uint16_t* kp, const uint16_t* vp, float scale,
          c10::BFloat16* out, int64_t o_s0, int64_t o_s1, Scratch& sc) {
  const int rows = static_cast<int>(i1 - i0);
  const int64_t last = off + i1;  // keys the block's last token sees
  const int64_t kblocks = (last + 15) / 16, kchunks = (last + 31) / 32;
  // The queries, zero rows past the block's end (a tile always reads 16 rows).
  std::memset(sc.q, 0, sizeof(sc.q));
  for (int r = 0; r < rows; ++r)
    std::memcpy(sc.q + r * D, q + (i0 + r) * q_s0 + h * q_s1, D * sizeof(uint16_t));
  float* scores = sc.scores.data();
  _tile_loadd(0, sc.q, D * 2);
  _tile_loadd(1, sc.q + 32, D * 2);
  if (D == 128) {
    _tile_loadd(4, sc.q + 64, D * 2);
    _tile_loadd(5, sc.q + 96, D * 2);
  }
  for (int64_t b = 0; b < kblocks; ++b) {
    const uint16_t* kb = kp + b * (D / 2) * 32;
    _tile_zero(3);
    _tile_loadd(2, kb, 64);
    _tile_dpbf16ps(3, 0, 2);
    _tile_loadd(2, kb + 16 * 32, 64);
    _tile_dpbf16ps(3, 1, 2);
    if (D == 128) {
      _tile_loadd(2, kb + 32 * 32, 64);
      _tile_dpbf16ps(3, 4, 2);
      _tile_loadd(2, kb + 48 * 32, 64);
      _tile_dpbf16ps(3, 5, 2);
    }
    _tile_stored(3, scores + b * 16, Lb * 4);
  }
  // Softmax per row over keys [0, off + i]: unnormalised exp rounded to bfloat16, zero past them.
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < 16; ++r) {
    uint16_t* p = sc.probs.data() + r * L32;
    if (r >= rows) {
      std::memset(p, 0, kchunks * 32 * sizeof(uint16_t));
      continue;
    }
    const int64_t n = off + i0 + r + 1;
    const float* s = scores + r * Lb;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
      const int64_t left = std::min<int64_t>(16, n - t);
      const __mmask16 km = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      vmax = _mm512_mask_max_ps(vmax, km, vmax, _mm512_maskz_loadu_ps(km, s + t));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < kchunks * 32; t += 16) {
      const int64_t left = std::min<int64_t>(16, n - t);
      __m512 e = _mm512_setzero_ps();
      if (left > 0) {
        const __mmask16 km = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        e = _mm512_maskz_mov_ps(km, exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(km, s + t), sv, mv)));
      }
      const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
      // Sum what the second product uses: the rounded probabilities.
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), eb);
    }
    sc.inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // out = P . V, 64 dims per sweep in tiles 4-7.
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < kchunks; ++c) {
      _tile_loadd(0, sc.probs.data() + c * 32, L32 * 2);
      const uint16_t* vc = vp + (c * (D / 16) + d0 / 16) * 16 * 32;
      _tile_loadd(2, vc, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(2, vc + 16 * 32, 64);
      _tile_dpbf16ps(5, 0, 2);
      _tile_loadd(2, vc + 32 * 32, 64);
      _tile_dpbf16ps(6, 0, 2);
      _tile_loadd(2, vc + 48 * 32, 64);
      _tile_dpbf16ps(7, 0, 2);
    }
    _tile_stored(4, sc.out + d0, D * 4);
    _tile_stored(5, sc.out + d0 + 16, D * 4);
    _tile_stored(6, sc.out + d0 + 32, D * 4);
    _tile_stored(7, sc.out + d0 + 48, D * 4);
  }
  for (int r = 0; r < rows; ++r) {
    c10::BFloat16* orow = out + (i0 + r) * o_s0 + h * o_s1;
    const __m512 iv = _mm512_set1_ps(sc.inv[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sc.out + r * D + d), iv)));
  }
}
}  // namespace

bool amx_prefill_supported(int64_t head_dim) { return (head_dim == 64 || head_dim == 128) && amx_available(); }

// q [n, Hq, D], k/v [q_offset + n, Hk, D] (rows may be strided, dims contiguous), bfloat16. Returns [n, Hq, D].
torch::Tensor amx_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t q_offset) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "amx_prefill: q, k, v are [tokens, heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "amx_prefill: bfloat16 inputs");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "amx_prefill: head_dim contiguous");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), nk = q_offset + n;
  TORCH_CHECK(q_offset >= 0, "amx_prefill: q_offset >= 0");
  TORCH_CHECK(k.size(0) == nk && v.size(0) == nk && k.sizes() == v.sizes() && k.size(2) == D,
              "amx_prefill: q, k, v disagree in shape");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "amx_prefill: query heads are a multiple of KV heads");
  TORCH_CHECK(D == 64 || D == 128, "amx_prefill: head_dim 64 or 128");
  TORCH_CHECK(scale > 0, "amx_prefill: a positive scale");
  TORCH_CHECK(amx_available(), "amx_prefill: no AMX tiles for this process");
  auto out = torch::empty({n, Hq, D}, q.options());
  if (n == 0) return out;
  const int64_t G = Hq / Hk;
  const int64_t Lb = (nk + 15) / 16 * 16, L32 = (nk + 31) / 32 * 32;
  // Packed keys and values, every element written below (no zero fill first).
  std::unique_ptr<uint16_t[]> kp(new uint16_t[size_t(Hk) * Lb * D]), vp(new uint16_t[size_t(Hk) * L32 * D]);
  const auto* qd = q.data_ptr<at::BFloat16>();
  const auto* kd = k.data_ptr<at::BFloat16>();
  const auto* vd = v.data_ptr<at::BFloat16>();
  // One task per (KV head, 32 keys), so both threads pack even with 3 KV heads.
  const int64_t chunks = L32 / 32;
  at::parallel_for(0, Hk * chunks, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t g = t / chunks, c = t % chunks;
      pack_keys(kd + g * k.stride(1), k.stride(0), nk, 2 * c, std::min(2 * c + 2, Lb / 16), D,
                kp.get() + g * Lb * D);
      pack_values(vd + g * v.stride(1), v.stride(0), nk, c, c + 1, D, vp.get() + g * L32 * D);
    }
  });
  const int64_t qblocks = (n + 15) / 16;
  auto* od = out.data_ptr<at::BFloat16>();
  // Tasks from the longest (last) query blocks down, so the threads' shares even out.
  at::parallel_for(0, Hq * qblocks, 1, [&](int64_t b, int64_t e) {
    configure_tiles();
    Scratch sc;
    sc.scores.resize(size_t(16) * Lb);
    sc.probs.resize(size_t(16) * L32);
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t % Hq, qb = qblocks - 1 - t / Hq, g = h / G;
      const int64_t i0 = qb * 16, i1 = std::min(n, i0 + 16);
      task(qd, q.stride(0), q.stride(1), h, i0, i1, q_offset, D, Lb, L32, kp.get() + g * Lb * D,
           vp.get() + g * L32 * D, float(scale), od, out.stride(0), out.stride(1), sc);
    }
    _tile_release();
  });
  return out;
}

#else  // no AMX in this build: the engine keeps PyTorch's SDPA
bool amx_prefill_supported(int64_t) { return false; }

torch::Tensor amx_prefill(torch::Tensor, torch::Tensor, torch::Tensor, double, int64_t) {
  TORCH_CHECK(false, "amx_prefill: this build has no AMX");
}
#endif
