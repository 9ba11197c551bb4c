// Causal attention of a fresh prompt over its own new keys, bfloat16, on AVX512-BF16 (no AMX needed).
// PyTorch's CPU flash attention and a decode-style kernel both run this at ~15 GFLOP/s on an AVX-512
// core: their inner products are float32 FMAs over widened rows. Here both products are vdpbf16ps
// tiles: keys are re-laid out once per (sequence, KV head) so that 16 keys sit in the lanes of one
// register (scores), and values so that head dims sit in the lanes (outputs). Softmax is exact
// (two passes over a float32 score block); probabilities are rounded to bfloat16 for the second
// product, as flash attention does on GPUs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_exp.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {
constexpr int64_t kQTokens = 16;  // query tokens per task (times the group's heads = its rows)

inline uint16_t bits(c10::BFloat16 x) { return x.x; }
inline uint32_t pair_bits(const c10::BFloat16* p) { return uint32_t(bits(p[0])) | (uint32_t(bits(p[1])) << 16); }

// keys [L, D] of one KV head -> [L/16][D/2][16][2]: one register holds 16 keys' pair (d, d+1).
void pack_keys(const c10::BFloat16* k, int64_t s0, int64_t L, int64_t D, uint32_t* out) {
  const int64_t blocks = (L + 15) / 16;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < D / 2; ++j)
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t key = b * 16 + t;
        out[(b * (D / 2) + j) * 16 + t] = key < L ? pair_bits(k + key * s0 + 2 * j) : 0u;
      }
}

// values [L, D] of one KV head -> [L/2][D][2]: one register holds 16 dims' pair (t, t+1).
void pack_values(const c10::BFloat16* v, int64_t s0, int64_t L, int64_t D, uint16_t* out) {
  const int64_t pairs = (L + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t t0 = 2 * p, t1 = 2 * p + 1;
      out[(p * D + d) * 2] = bits(v[t0 * s0 + d]);
      out[(p * D + d) * 2 + 1] = t1 < L ? bits(v[t1 * s0 + d]) : uint16_t(0);
    }
}

// One task: query tokens [i0, i1) of the G heads sharing KV head g. Rows are (token, head) pairs;
// query token i sits at key position off + i and sees keys [0, off + i].
template <int DZ>  // D / 16 registers per output row
void task(const c10::BFloat16* q, int64_t q_s0, int64_t q_s1, int64_t h0, int G, int64_t i0, int64_t i1, int64_t off,
          const uint32_t* kp, const uint16_t* vp, float scale, c10::BFloat16* out, int64_t o_s0, int64_t o_s1,
          std::vector<float>& scores, std::vector<uint16_t>& probs, std::vector<uint16_t>& zeros) {
  constexpr int64_t D = DZ * 16;
  const int64_t L = off + i1;  // keys this block can see: all before its last token
  const int64_t Lb = (L + 15) / 16 * 16, Lp = (L + 1) / 2 * 2;
  const int rows = static_cast<int>((i1 - i0) * G);
  scores.resize(size_t(rows) * Lb);
  probs.resize(size_t(rows) * Lp);
  zeros.assign(size_t(Lp), 0);
  std::vector<float> inv(rows);
  // Scores: 8 rows x 1 key block of 16 per inner loop over D/2 pairs.
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int nr = std::min(8, rows - r0);
    uint32_t qpairs[8][D / 2] = {};  // rows past nr stay zero: fixed trip counts keep acc in registers
    for (int m = 0; m < nr; ++m) {
      const int64_t tok = i0 + (r0 + m) / G, head = h0 + (r0 + m) % G;
      const c10::BFloat16* qr = q + tok * q_s0 + head * q_s1;
      for (int64_t j = 0; j < D / 2; ++j) qpairs[m][j] = pair_bits(qr + 2 * j);
    }
    const int64_t last_tok = i0 + (r0 + nr - 1) / G;
    const int64_t blocks = (off + last_tok) / 16 + 1;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 acc[8];
      for (int m = 0; m < 8; ++m) acc[m] = _mm512_setzero_ps();
      const uint32_t* kb = kp + b * (D / 2) * 16;
      for (int64_t j = 0; j < D / 2; ++j) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + j * 16);
        for (int m = 0; m < 8; ++m)
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(int32_t(qpairs[m][j])), kv);
      }
      for (int m = 0; m < 8; ++m)
        if (m < nr) _mm512_storeu_ps(&scores[size_t(r0 + m) * Lb + b * 16], acc[m]);
    }
  }
  // Softmax per row over keys [0, tok]: unnormalised exp rounded to bfloat16, 1/sum kept in float32.
  for (int r = 0; r < rows; ++r) {
    const int64_t tok = i0 + r / G, n = off + tok + 1;
    float* s = &scores[size_t(r) * Lb];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
      const int64_t left = std::min<int64_t>(16, n - t);
      const __mmask16 km = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      vmax = _mm512_mask_max_ps(vmax, km, vmax, _mm512_maskz_loadu_ps(km, s + t));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale), sv = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    uint16_t* p = &probs[size_t(r) * Lp];
    int64_t t = 0;
    for (; t < Lp; t += 16) {
      const int64_t left = std::min<int64_t>(16, n - t);
      __m512 e = _mm512_setzero_ps();
      if (left > 0) {
        const __mmask16 km = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        e = _mm512_maskz_mov_ps(km, exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(km, s + t), sv), mv)));
      }
      const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
      // Sum what the second product will use: the rounded probabilities.
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
      const int64_t w = std::min<int64_t>(16, Lp - t);
      const __mmask16 wm = w >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << w) - 1);
      _mm256_mask_storeu_epi16(p + t, wm, eb);
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // Outputs: OR rows x D dims per inner loop over key pairs, OR * DZ = 24 accumulators in registers.
  constexpr int OR = 24 / DZ;
  for (int r0 = 0; r0 < rows; r0 += OR) {
    const int nr = std::min(OR, rows - r0);
    __m512 acc[OR][DZ];
    for (int m = 0; m < OR; ++m)
      for (int c = 0; c < DZ; ++c) acc[m][c] = _mm512_setzero_ps();
    const int64_t last_tok = i0 + (r0 + nr - 1) / G;
    const int64_t pairs = (off + last_tok + 2) / 2;
    const uint16_t* prow[OR];
    for (int m = 0; m < OR; ++m) prow[m] = m < nr ? &probs[size_t(r0 + m) * Lp] : zeros.data();
    for (int64_t pp = 0; pp < pairs; ++pp) {
      __m512bh vv[DZ];
      for (int c = 0; c < DZ; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (pp * D + c * 16) * 2);
      for (int m = 0; m < OR; ++m) {
        int32_t pr;
        std::memcpy(&pr, prow[m] + 2 * pp, sizeof(pr));
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pr);
        for (int c = 0; c < DZ; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], pv, vv[c]);
      }
    }
    // A fixed trip count with a guard, not `m < nr`: indexing acc by a runtime bound makes the compiler
    // keep acc in memory and store every accumulator on every key pair (2x slower).
    for (int m = 0; m < OR; ++m) {
      if (m >= nr) continue;
      const int64_t tok = i0 + (r0 + m) / G, head = h0 + (r0 + m) % G;
      c10::BFloat16* orow = out + tok * o_s0 + head * o_s1;
      const __m512 iv = _mm512_set1_ps(inv[r0 + m]);
      for (int c = 0; c < DZ; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][c], iv)));
    }
  }
}
}  // namespace

bool prefill_bf16_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// q [n, Hq, D], k/v [q_offset + n, Hk, D] (rows may be strided, dims contiguous), bfloat16: causal
// attention of query i over keys 0..q_offset + i (q_offset > 0: a chunk continuing its context, whose
// keys the caller gathered). Returns [n, Hq, D].
torch::Tensor prefill_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t q_offset) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_bf16: q, k, v are [tokens, heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "prefill_bf16: bfloat16 inputs");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_bf16: head_dim contiguous");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), nk = q_offset + n;
  TORCH_CHECK(q_offset >= 0, "prefill_bf16: q_offset >= 0");
  TORCH_CHECK(k.size(0) == nk && v.size(0) == nk && k.sizes() == v.sizes() && k.size(2) == D,
              "prefill_bf16: q, k, v disagree in shape");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "prefill_bf16: query heads are a multiple of KV heads");
  TORCH_CHECK(prefill_bf16_supported(D), "prefill_bf16: head_dim 64 or 128");
  TORCH_CHECK(scale > 0, "prefill_bf16: a positive scale");
  auto out = torch::empty({n, Hq, D}, q.options());
  if (n == 0) return out;
  const int G = static_cast<int>(Hq / Hk);
  const int64_t Lb = (nk + 15) / 16 * 16, Lp = (nk + 1) / 2 * 2;
  std::vector<uint32_t> kp(size_t(Hk) * Lb * (D / 2));
  std::vector<uint16_t> vp(size_t(Hk) * Lp * D);
  const auto* qd = q.data_ptr<at::BFloat16>();
  const auto* kd = k.data_ptr<at::BFloat16>();
  const auto* vd = v.data_ptr<at::BFloat16>();
  at::parallel_for(0, Hk, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      pack_keys(kd + g * k.stride(1), k.stride(0), nk, D, kp.data() + g * Lb * (D / 2));
      pack_values(vd + g * v.stride(1), v.stride(0), nk, D, vp.data() + g * Lp * D);
    }
  });
  const int64_t qblocks = (n + kQTokens - 1) / kQTokens;
  auto* od = out.data_ptr<at::BFloat16>();
  // Tasks from the longest (last) query blocks down, so the threads' shares even out.
  at::parallel_for(0, Hk * qblocks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    std::vector<uint16_t> probs, zeros;
    for (int64_t t = b; t < e; ++t) {
      const int64_t g = t % Hk, qb = qblocks - 1 - t / Hk;
      const int64_t i0 = qb * kQTokens, i1 = std::min(n, i0 + kQTokens);
      const uint32_t* kpg = kp.data() + g * Lb * (D / 2);
      const uint16_t* vpg = vp.data() + g * Lp * D;
      if (D == 64)
        task<4>(qd, q.stride(0), q.stride(1), g * G, G, i0, i1, q_offset, kpg, vpg, float(scale), od, out.stride(0),
                out.stride(1), scores, probs, zeros);
      else
        task<8>(qd, q.stride(0), q.stride(1), g * G, G, i0, i1, q_offset, kpg, vpg, float(scale), od, out.stride(0),
                out.stride(1), scores, probs, zeros);
    }
  });
  return out;
}

#else  // no AVX512-BF16 in this build: the engine keeps PyTorch's SDPA
bool prefill_bf16_supported(int64_t) { return false; }

torch::Tensor prefill_bf16(torch::Tensor, torch::Tensor, torch::Tensor, double, int64_t) {
  TORCH_CHECK(false, "prefill_bf16: this build has no AVX512-BF16");
}
#endif
