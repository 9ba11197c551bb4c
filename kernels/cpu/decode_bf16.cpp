// Paged decode attention over bfloat16 caches on AVX512-BF16 (CPUs without AMX), one query token per
// sequence. A decode step's attention reads every cached key and value once and does little with
// them, so it runs at the speed of memory; what matters is how it reads:
//   - one task is a whole sequence (every KV head), its rows read in order, a few at a time by every
//     head in turn, each head prefetching its part of the rows ahead into L2;
//   - tasks go out longest-first to whichever thread is free, so unequal contexts do not leave one
//     core idle while the other finishes a long sequence;
//   - both products are vdpbf16ps: scores against the stored keys (the query rounded to bfloat16
//     once), and values two tokens at a time against probability pairs rounded to bfloat16, as flash
//     attention does. Softmax is exact, in float32, with each head's attention sink (gpt-oss) in its
//     denominator when given.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_exp.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {
constexpr int64_t kWindow = 8;  // rows every head goes through before the next rows are read
// Each head prefetches its part of the row this far ahead into L2. Into L1 (prefetcht0), or a whole
// row at once, or further ahead, all measured slower on an AMD EPYC: 16 rows into L2 read 1.5x faster.
constexpr int64_t kAhead = 16;
constexpr int kMaxD = 128;
alignas(64) const uint16_t kZeroRow[kMaxD] = {};  // the partner of an odd context's last token

// 16 vectors -> one vector whose lane j is the sum of all lanes of v[j] (butterfly, 15 adds in all),
// so a score costs a sixteenth of a full horizontal reduction.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

// Unpacking two rows' 16-bit elements pairs them within each 128-bit lane, so value accumulator `lo`
// lane 4k+j holds dimension 8k+j of its 32 and `hi` lane 4k+j holds 8k+4+j; this puts them in order.
inline void unshuffle_pairs(__m512 lo, __m512 hi, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, second, hi));
}

struct Cache {
  const c10::BFloat16* k;
  const c10::BFloat16* v;
  int64_t BS, s0, s1, s2;  // block size; strides of block, slot and head
};

struct Task {
  int64_t seq, h0, h1;  // KV heads [h0, h1) of one sequence
};

// Row starts (head h0) of tokens [t0, t0 + n).
inline void resolve_rows(const c10::BFloat16* base, const Cache& c, const int32_t* table, int64_t t0, int64_t n,
                         int64_t h0, const c10::BFloat16** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = t0 + j;
    rows[j] = base + table[t / c.BS] * c.s0 + (t % c.BS) * c.s1 + h0 * c.s2;
  }
}

// In place: each float32 score row becomes exp(s - max) rounded to bfloat16, packed into its own first
// half (writes trail reads), with a zero after an odd last token; returns 1 / sum per row, row r's sink
// (sinks[r]; nullptr: none) in the sum.
inline void probabilities(float* scores, int64_t rows, int64_t L, const float* sinks, float* inv) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = scores + r * L;
    inv[r] = softmax_unnormalised(sc, L, sinks ? sinks + r : nullptr);
    uint16_t* pb = reinterpret_cast<uint16_t*>(sc);
    int64_t t = 0;
    for (; t + 32 <= L; t += 32)
      _mm512_storeu_si512(pb + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + t + 16), _mm512_loadu_ps(sc + t)));
    for (; t < L; ++t) pb[t] = c10::BFloat16(sc[t]).x;
    if (L % 2) pb[L] = 0;
  }
}

// G query heads per KV head, head dim 32 * C2. qb: the task's queries [heads][G][D] in bfloat16,
// already scaled; part: scratch for [heads][G][16] partial dot products; out: [heads][G][D] float32
// attention outputs, normalised; sinks: the task's [heads][G] sinks, or nullptr.
template <int G, int C2>
void attend_task(const uint16_t* qb, const Cache& c, const int32_t* table, int64_t L, int64_t h0, int64_t H,
                 const float* sinks, float* scores, __m512* part, float* out) {
  constexpr int D = 32 * C2;
  const c10::BFloat16* rows[16];
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    resolve_rows(c.k, c, table, t0, n, h0, rows);
    for (int64_t w0 = 0; w0 < n; w0 += kWindow) {
      const int64_t m = std::min(kWindow, n - w0);
      for (int64_t h = 0; h < H; ++h) {
        __m512bh q[G][C2];
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < C2; ++i) q[g][i] = (__m512bh)_mm512_loadu_si512(qb + (h * G + g) * D + 32 * i);
        __m512* p = part + h * G * 16 + w0;
        for (int64_t j = 0; j < m; ++j) {
          const c10::BFloat16* kr = rows[w0 + j] + h * c.s2;
          if (t0 + w0 + j + kAhead < L) {
            const int64_t u = t0 + w0 + j + kAhead;
            const char* ap =
                reinterpret_cast<const char*>(c.k + table[u / c.BS] * c.s0 + (u % c.BS) * c.s1 + (h0 + h) * c.s2);
            for (int off = 0; off < D * 2; off += 64) _mm_prefetch(ap + off, _MM_HINT_T1);
          }
          __m512bh k[C2];  // loaded once for the group's G queries
          for (int i = 0; i < C2; ++i) k[i] = (__m512bh)_mm512_loadu_si512(kr + 32 * i);
          for (int g = 0; g < G; ++g) {
            __m512 sum = _mm512_setzero_ps();
            for (int i = 0; i < C2; ++i) sum = _mm512_dpbf16_ps(sum, q[g][i], k[i]);
            p[g * 16 + j] = sum;
          }
        }
      }
    }
    for (int64_t r = 0; r < H * G; ++r) {
      __m512* p = part + r * 16;
      for (int64_t j = n; j < 16; ++j) p[j] = _mm512_setzero_ps();
      _mm512_mask_storeu_ps(scores + r * L + t0, static_cast<__mmask16>((1u << n) - 1), reduce16(p));
    }
  }
  float inv[64 * G];
  probabilities(scores, H * G, L, sinks, inv);
  // Every head's value accumulators at once would not fit in the registers: between windows they
  // rest in `out` (in unpacked lane order).
  std::fill(out, out + H * G * D, 0.f);
  for (int64_t t0 = 0; t0 < L; t0 += kWindow) {
    const int64_t n = std::min(kWindow, L - t0);
    resolve_rows(c.v, c, table, t0, n, h0, rows);
    for (int64_t h = 0; h < H; ++h) {
      __m512 a[G][2 * C2];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2 * C2; ++i) a[g][i] = _mm512_loadu_ps(out + (h * G + g) * D + 16 * i);
      for (int64_t j = 0; j < n; j += 2) {
        for (int64_t u = t0 + j + kAhead; u < std::min(t0 + j + kAhead + 2, L); ++u) {
          const char* ap =
              reinterpret_cast<const char*>(c.v + table[u / c.BS] * c.s0 + (u % c.BS) * c.s1 + (h0 + h) * c.s2);
          for (int off = 0; off < D * 2; off += 64) _mm_prefetch(ap + off, _MM_HINT_T1);
        }
        const c10::BFloat16* v0 = rows[j] + h * c.s2;
        const c10::BFloat16* v1 = j + 1 < n ? rows[j + 1] + h * c.s2 : reinterpret_cast<const c10::BFloat16*>(kZeroRow);
        __m512bh lo[C2], hi[C2];
        for (int i = 0; i < C2; ++i) {
          const __m512i x0 = _mm512_loadu_si512(v0 + 32 * i), x1 = _mm512_loadu_si512(v1 + 32 * i);
          lo[i] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
          hi[i] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        }
        for (int g = 0; g < G; ++g) {
          int32_t pair;
          std::memcpy(&pair, reinterpret_cast<const uint16_t*>(scores + (h * G + g) * L) + t0 + j, 4);
          const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
          for (int i = 0; i < C2; ++i) {
            a[g][2 * i] = _mm512_dpbf16_ps(a[g][2 * i], lo[i], w);
            a[g][2 * i + 1] = _mm512_dpbf16_ps(a[g][2 * i + 1], hi[i], w);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2 * C2; ++i) _mm512_storeu_ps(out + (h * G + g) * D + 16 * i, a[g][i]);
    }
  }
  for (int64_t r = 0; r < H * G; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
    for (int i = 0; i < C2; ++i) {
      float* o = out + r * D + 32 * i;
      unshuffle_pairs(_mm512_mul_ps(_mm512_loadu_ps(o), s), _mm512_mul_ps(_mm512_loadu_ps(o + 16), s), o);
    }
  }
}

using TaskFn = void (*)(const uint16_t*, const Cache&, const int32_t*, int64_t, int64_t, int64_t, const float*,
                       float*, __m512*, float*);

// The register budget decides the shapes: G x C2 query registers, 2 G C2 value accumulators.
TaskFn pick(int64_t G, int64_t D) {
#define PAGEDSERVE_CASE(GG, CC) \
  if (G == GG && D == 32 * CC) return &attend_task<GG, CC>;
  PAGEDSERVE_CASE(1, 2) PAGEDSERVE_CASE(2, 2) PAGEDSERVE_CASE(3, 2) PAGEDSERVE_CASE(4, 2)
  PAGEDSERVE_CASE(1, 4) PAGEDSERVE_CASE(2, 4)
#undef PAGEDSERVE_CASE
  return nullptr;
}
}  // namespace

bool decode_bf16_usable(int64_t G, int64_t D, int64_t Hk) { return Hk <= 64 && pick(G, D) != nullptr; }

bool paged_decode_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* bt,
                       const int32_t* cl, c10::BFloat16* out, int64_t S, int64_t Hq, int64_t Hk, int64_t D, int64_t BS,
                       int64_t MB, int64_t q_s0, int64_t q_s1, int64_t c_s0, int64_t c_s1, int64_t c_s2,
                       int64_t o_s0, int64_t o_s1, float scale, const float* sinks) {
  const int64_t G = Hq / Hk;
  if (!decode_bf16_usable(G, D, Hk)) return false;
  const TaskFn fn = pick(G, D);
  const Cache cache{kc, vc, BS, c_s0, c_s1, c_s2};
  const int64_t threads = at::get_num_threads();
  // Few sequences: a task per KV head, or the other threads would wait on one sequence's heads.
  const int64_t per_task = S >= 4 * threads ? Hk : 1;
  std::vector<Task> tasks;
  tasks.reserve(S * (Hk / per_task));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < Hk; h += per_task) tasks.push_back({s, h, h + per_task});
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) { return cl[a.seq] > cl[b.seq]; });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> qb(per_task * G * D);
    std::vector<float> acc(per_task * G * D), scores;
    std::vector<__m512> part(per_task * G * 16);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
        const Task& task = tasks[i];
        const int64_t L = cl[task.seq], H = task.h1 - task.h0;
        if (L <= 0) {  // nothing to attend to: zeros, as the generic kernel gives
          for (int64_t r = 0; r < H * G; ++r)
            std::fill_n(out + task.seq * o_s0 + (task.h0 * G + r) * o_s1, D, c10::BFloat16(0.f));
          continue;
        }
        for (int64_t r = 0; r < H * G; ++r) {
          const c10::BFloat16* qp = q + task.seq * q_s0 + (task.h0 * G + r) * q_s1;
          for (int64_t d = 0; d < D; ++d) qb[r * D + d] = c10::BFloat16(static_cast<float>(qp[d]) * scale).x;
        }
        scores.resize(H * G * L + 1);
        fn(qb.data(), cache, bt + task.seq * MB, L, task.h0, H, sinks ? sinks + task.h0 * G : nullptr, scores.data(),
           part.data(), acc.data());
        for (int64_t r = 0; r < H * G; ++r) {
          c10::BFloat16* op = out + task.seq * o_s0 + (task.h0 * G + r) * o_s1;
          for (int64_t d = 0; d < D; ++d) op[d] = static_cast<c10::BFloat16>(acc[r * D + d]);
        }
      }
    }
  });
  return true;
}

#else  // built without AVX512-BF16: the generic AVX-512 kernel runs

bool decode_bf16_usable(int64_t, int64_t, int64_t) { return false; }
bool paged_decode_bf16(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int32_t*,
                       const int32_t*, c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, const float*) {
  return false;
}

#endif
