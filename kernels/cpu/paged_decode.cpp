// Paged decode attention for the CPU: one query token per sequence, reading K/V straight from the
// block table (no gather into a padded copy), all query heads of one KV group per task so each key
// and value row is loaded once. Softmax and accumulation in float32 whatever the storage dtype.
// bfloat16 caches go to the AMX kernel (amx_decode.cpp) or the AVX512-BF16 one (decode_bf16.cpp)
// where the CPU and the shape allow; this file is the path for every other case. Attention sinks
// (gpt-oss: one logit per query head in the softmax's denominator, none in its values) are a pointer to
// the group's G sinks, nullptr for none, taken by every path here and by decode_bf16.cpp's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "widen.h"
#include "simd_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>

// Load 16 elements as float32 lanes.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
constexpr int64_t kPrefetch = 16;  // rows ahead to prefetch (into L2: see decode_bf16.cpp)
#endif

// Logit soft-capping (Gemma 2): cap * tanh(score / cap) on the scaled scores, in place; cap 0: none.
// Declared before the AVX-512 paths, which call it from templates (GCC looks the name up at the definition).
static inline void cap_scores(float* scores, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
}

#if defined(__AVX512F__)
// Second half of a register-resident task: softmax the G score rows in place, then accumulate the
// weighted value rows (G x C float32 registers) and write the normalised outputs to `acc`.
template <typename T, int G, int C>
static inline void softmax_values(const T* vc, const int32_t* table, int64_t t0, int64_t L, int64_t BS,
                                  int64_t c_s0, int64_t c_s1, int64_t h_off, const float* sinks, float* scores,
                                  float* acc) {
  const int64_t n = L - t0;  // scores[g * n + (t - t0)] for positions t in [t0, L)
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_unnormalised(scores + g * n, n, sinks ? sinks + g : nullptr);
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t t = t0; t < L; ++t) {
    const T* vp = vc + table[t / BS] * c_s0 + (t % BS) * c_s1 + h_off;
    if (t + kPrefetch < L) {  // blocks sit at random addresses: hardware prefetchers stop at each one
      const char* ahead = reinterpret_cast<const char*>(
          vc + table[(t + kPrefetch) / BS] * c_s0 + ((t + kPrefetch) % BS) * c_s1 + h_off);
      for (int64_t off = 0; off < static_cast<int64_t>(C * 16 * sizeof(T)); off += 64)
        _mm_prefetch(ahead + off, _MM_HINT_T1);
    }
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vp + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + t - t0]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * C * 16 + 16 * c, _mm512_mul_ps(a[g][c], s));
  }
}
#endif

#if defined(__AVX512F__)
// Register-resident variant for small groups (G query heads x C 16-lane chunks <= 16 registers): the
// queries and the output accumulators never leave registers. SmolLM2 (G=3, D=64) and most GQA models
// with D=64 take this path.
template <typename T, int G, int C>
static void attend_group_regs(const float* qf, const T* kc, const T* vc, const int32_t* table, int64_t t0,
                              int64_t L, int64_t BS, int64_t c_s0, int64_t c_s1, int64_t h_off, float cap,
                              const float* sinks, float* scores, float* acc) {
  const int64_t n = L - t0;
  __m512 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(qf + g * C * 16 + 16 * c);
  for (int64_t t = t0; t < L; ++t) {
    const T* kp = kc + table[t / BS] * c_s0 + (t % BS) * c_s1 + h_off;
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(kp + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 sum = _mm512_mul_ps(q[g][0], k[0]);
      for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(q[g][c], k[c], sum);
      scores[g * n + t - t0] = _mm512_reduce_add_ps(sum);
    }
  }
  cap_scores(scores, G * n, cap);
  softmax_values<T, G, C>(vc, table, t0, L, BS, c_s0, c_s1, h_off, sinks, scores, acc);
}

template <typename T>
static bool attend_group_fast(const float* qf, const T* kc, const T* vc, const int32_t* table, int64_t t0,
                              int64_t L, int64_t G, int64_t D, int64_t BS, int64_t c_s0, int64_t c_s1,
                              int64_t h_off, float cap, const float* sinks, float* scores, float* acc) {
#define PAGEDSERVE_CASE(GG, CC)                                                                              \
  if (G == GG && D == CC * 16) {                                                                            \
    attend_group_regs<T, GG, CC>(qf, kc, vc, table, t0, L, BS, c_s0, c_s1, h_off, cap, sinks, scores, acc); \
    return true;                                                                                            \
  }
  PAGEDSERVE_CASE(1, 4) PAGEDSERVE_CASE(2, 4) PAGEDSERVE_CASE(3, 4) PAGEDSERVE_CASE(4, 4)
  PAGEDSERVE_CASE(1, 8) PAGEDSERVE_CASE(2, 8)
#undef PAGEDSERVE_CASE
  return false;
}
#endif

// Normalised softmax of each of the G score rows, in place (the portable paths); row g's sink, when
// `sinks` is set, takes its share of the denominator.
static inline void softmax_rows(float* scores, int64_t G, int64_t L, const float* sinks) {
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * L;
    float m = sinks ? sinks[g] : -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sc[t]);
    float total = sinks ? std::exp(sinks[g] - m) : 0.f;
    for (int64_t t = 0; t < L; ++t) { sc[t] = std::exp(sc[t] - m); total += sc[t]; }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
  }
}

// One (sequence, KV head) task: the G query heads of the group attend over positions [t0, L) of the
// sequence's blocks (t0 > 0: a sliding window), scores soft-capped when cap > 0, with the G heads' sinks
// (nullptr: none).
// Two passes (scores, then weighted values) over rows read in place from the cache.
template <typename T>
static void attend_group(const float* qf, const T* kc, const T* vc, const int32_t* table, int64_t t0, int64_t L,
                         int64_t G, int64_t D, int64_t BS, int64_t c_s0, int64_t c_s1, int64_t h_off, float cap,
                         const float* sinks, float* scores, float* acc, float* row) {
  const int64_t n = L - t0;
#if defined(__AVX512F__)
  // float8 caches take the portable path (rows widened through a 256-entry table).
  if constexpr (!std::is_same<T, double>::value && !std::is_same<T, c10::Float8_e4m3fn>::value) {
  if (attend_group_fast<T>(qf, kc, vc, table, t0, L, G, D, BS, c_s0, c_s1, h_off, cap, sinks, scores, acc))
    return;
  if (D % 16 == 0 && D <= 256) {
    const int64_t C = D / 16;
    for (int64_t t = t0; t < L; ++t) {
      const T* kp = kc + table[t / BS] * c_s0 + (t % BS) * c_s1 + h_off;
      __m512 k[16];
      for (int64_t c = 0; c < C; ++c) k[c] = load16(kp + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        __m512 sum = _mm512_mul_ps(load16(qf + g * D), k[0]);
        for (int64_t c = 1; c < C; ++c) sum = _mm512_fmadd_ps(load16(qf + g * D + 16 * c), k[c], sum);
        scores[g * n + t - t0] = _mm512_reduce_add_ps(sum);
      }
    }
    cap_scores(scores, G * n, cap);
    softmax_rows(scores, G, n, sinks);
    std::fill(acc, acc + G * D, 0.f);
    for (int64_t t = t0; t < L; ++t) {
      const T* vp = vc + table[t / BS] * c_s0 + (t % BS) * c_s1 + h_off;
      __m512 v[16];
      for (int64_t c = 0; c < C; ++c) v[c] = load16(vp + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * n + t - t0]);
        float* ag = acc + g * D;
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(w, v[c], _mm512_loadu_ps(ag + 16 * c)));
      }
    }
    return;
  }
  }
#endif
  for (int64_t t = t0; t < L; ++t) {
    widen(kc + table[t / BS] * c_s0 + (t % BS) * c_s1 + h_off, row, D);
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * row[d];
      scores[g * n + t - t0] = dot;
    }
  }
  cap_scores(scores, G * n, cap);
  softmax_rows(scores, G, n, sinks);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = t0; t < L; ++t) {
    widen(vc + table[t / BS] * c_s0 + (t % BS) * c_s1 + h_off, row, D);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += scores[g * n + t - t0] * row[d];
  }
}

// T: the queries' and outputs' type; C: the cache's (T, or float8_e4m3fn for an FP8 cache, whose per-tensor
// scales the caller folds into `scale` and the output).
template <typename T, typename C = T>
static void decode_kernel(const T* __restrict q, const C* __restrict kc, const C* __restrict vc,
                          const int32_t* __restrict bt, const int32_t* __restrict cl, T* __restrict out,
                          int64_t S, int64_t Hq, int64_t Hk, int64_t D, int64_t BS, int64_t MB,
                          int64_t q_s0, int64_t q_s1, int64_t c_s0, int64_t c_s1, int64_t c_s2,
                          int64_t o_s0, int64_t o_s1, float scale, int64_t window, float cap,
                          const float* __restrict sinks) {
  const int64_t G = Hq / Hk;
  at::parallel_for(0, S * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Hk, h = task % Hk;
      const int64_t L = cl[s];
      const int64_t t0 = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      for (int64_t g = 0; g < G; ++g) {
        widen(q + s * q_s0 + (h * G + g) * q_s1, qf.data() + g * D, D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
      }
      scores.resize(G * (L - t0));
      attend_group<C>(qf.data(), kc, vc, bt + s * MB, t0, L, G, D, BS, c_s0, c_s1, h * c_s2, cap,
                      sinks ? sinks + h * G : nullptr, scores.data(), acc.data(), row.data());
      for (int64_t g = 0; g < G; ++g) {
        T* op = out + s * o_s0 + (h * G + g) * o_s1;
        for (int64_t d = 0; d < D; ++d) op[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}

// Defined in amx_decode.cpp: the tile-unit path for bfloat16, false when it cannot run here.
bool paged_decode_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                      const int32_t* bt, const int32_t* cl, c10::BFloat16* out, int64_t S, int64_t Hq, int64_t Hk,
                      int64_t D, int64_t BS, int64_t MB, int64_t q_s0, int64_t q_s1, int64_t c_s0, int64_t c_s1,
                      int64_t c_s2, int64_t o_s0, int64_t o_s1, float scale);
bool set_amx_enabled(bool enabled);
// Defined in decode_bf16.cpp: the AVX512-BF16 path for bfloat16 caches, false when it cannot run here.
bool paged_decode_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                       const int32_t* bt, const int32_t* cl, c10::BFloat16* out, int64_t S, int64_t Hq, int64_t Hk,
                       int64_t D, int64_t BS, int64_t MB, int64_t q_s0, int64_t q_s1, int64_t c_s0, int64_t c_s1,
                       int64_t c_s2, int64_t o_s0, int64_t o_s1, float scale, const float* sinks);
bool decode_bf16_usable(int64_t G, int64_t D, int64_t Hk);
bool amx_decode_usable(int64_t G, int64_t D, int64_t BS);
bool amx_available();

// window > 0: each query sees only the last `window` positions of its context; softcap > 0: scores are
// soft-capped. Either option takes the generic kernel (the AMX and AVX512-BF16 paths have neither).
// sinks: float32 [Hq], one logit per query head (gpt-oss); the AVX512-BF16 path takes them, the AMX one
// does not (untested without the hardware), so sinks skip it.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window,
                           double softcap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be 3-D and the caches 4-D");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache must share strides");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "tables must be contiguous");
  auto out = torch::empty_like(q);
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hk = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == Hq &&
                    sinks->is_contiguous() && sinks->device().is_cpu(),
                "sinks must be a contiguous float32 CPU tensor with one logit per query head");
    sink_ptr = sinks->data_ptr<float>();
  }
  if (q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && window == 0 && softcap == 0) {
    // Each path says false when it cannot take this shape here.
    if (sink_ptr == nullptr &&
        paged_decode_amx(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int32_t>(),
                         context_lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), S, Hq, Hk, D, BS, MB,
                         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         out.stride(0), out.stride(1), static_cast<float>(scale)))
      return out;
    if (paged_decode_bf16(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                          v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int32_t>(),
                          context_lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), S, Hq, Hk, D, BS, MB,
                          q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          out.stride(0), out.stride(1), static_cast<float>(scale), sink_ptr))
      return out;
  }
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    TORCH_CHECK(v_cache.scalar_type() == at::kFloat8_e4m3fn, "k_cache and v_cache must share a dtype");
    using F8 = c10::Float8_e4m3fn;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_fp8", [&] {
      decode_kernel<scalar_t, F8>(q.data_ptr<scalar_t>(), k_cache.data_ptr<F8>(), v_cache.data_ptr<F8>(),
                                  block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                                  out.data_ptr<scalar_t>(), S, Hq, Hk, D, BS, MB, q.stride(0), q.stride(1),
                                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
                                  out.stride(1), static_cast<float>(scale), window, static_cast<float>(softcap),
                                  sink_ptr);
    });
    return out;
  }
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "the caches are the queries' dtype or float8_e4m3fn");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                            out.data_ptr<scalar_t>(), S, Hq, Hk, D, BS, MB, q.stride(0), q.stride(1),
                            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
                            out.stride(1), static_cast<float>(scale), window, static_cast<float>(softcap),
                            sink_ptr);
  });
  return out;
}

// Defined in fused_ops.cpp.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
void rope_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                  int64_t rotated_heads, int64_t head_dim, int64_t rotary_dim);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor argmax_rows_exact(torch::Tensor x, torch::Tensor hidden, torch::Tensor weight);
torch::Tensor argmax_rows_masked(torch::Tensor x, torch::Tensor mask);
torch::Tensor argmax_rows_exact_masked(torch::Tensor x, torch::Tensor hidden, torch::Tensor weight, torch::Tensor mask);
void apply_token_bitmask(torch::Tensor x, torch::Tensor mask);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
// Defined in bf16_gemm.cpp.
torch::Tensor bf16_gemm_pack(torch::Tensor w);
torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias);
torch::Tensor bf16_grouped_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor offsets, int64_t out_features,
                                c10::optional<torch::Tensor> bias);
bool bf16_gemm_supported();
double bf16_dot_peak_gflops(double seconds);
// Defined in quant_gemm.cpp.
torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor codes, int64_t kind, int64_t group_size, torch::Tensor scale,
                         c10::optional<torch::Tensor> offset, c10::optional<torch::Tensor> zero, double zero_const,
                         int64_t out_features, c10::optional<torch::Tensor> bias,
                         c10::optional<torch::Tensor> row_scale);
bool quant_gemm_supported();
// Defined in prefill_bf16.cpp.
torch::Tensor prefill_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t q_offset);
// Defined in amx_prefill.cpp: the same causal prefill on AMX tiles.
torch::Tensor amx_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t q_offset);
bool amx_prefill_supported(int64_t head_dim);
bool prefill_bf16_supported(int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("set_amx_enabled", &set_amx_enabled, "allow the AMX decode path (returns the previous setting)");
  m.def("amx_decode_usable", &amx_decode_usable, "whether the AMX path takes (group, head_dim, block_size) now");
  m.def("decode_bf16_usable", &decode_bf16_usable, "whether the AVX512-BF16 decode path takes (group, head_dim, kv_heads)");
  m.def("amx_available", &amx_available, "whether this build and CPU can run the AMX decode path");
  m.def("add_rms_norm", &add_rms_norm, "h += delta; return rms_norm(h) * weight");
  m.def("rope_inplace", &rope_inplace, "rotary embedding of the q and k heads of a fused qkv buffer, in place "
        "(the first rotary_dim dims of each head; -1: all)", py::arg("qkv"), py::arg("positions"), py::arg("cos"),
        py::arg("sin"), py::arg("rotated_heads"), py::arg("head_dim"), py::arg("rotary_dim") = -1);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up buffer");
  m.def("write_kv", &write_kv, "new keys and values into their cache slots (-1 skipped)");
  m.def("argmax_rows_exact", &argmax_rows_exact, "greedy argmax with near-ties rescored in float32");
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (first on ties)");
  m.def("argmax_rows_masked", &argmax_rows_masked, "argmax over each row's allowed tokens (packed int32 mask; -1: none)");
  m.def("argmax_rows_exact_masked", &argmax_rows_exact_masked, "argmax_rows_exact over each row's allowed tokens");
  m.def("apply_token_bitmask", &apply_token_bitmask, "logits of tokens a row's packed int32 mask disallows to -inf, in place");
  m.def("bf16_gemm_pack", &bf16_gemm_pack, "a bfloat16 [N, K] weight in bf16_gemm's panel layout");
  m.def("bf16_gemm", &bf16_gemm, "x @ w.T (+ bias) over a packed bfloat16 weight (AVX512-BF16)");
  m.def("bf16_grouped_gemm", &bf16_grouped_gemm, "each expert's rows of x times its packed weight, one call "
        "for a mixture-of-experts layer (AVX512-BF16)");
  m.def("bf16_dot_peak_gflops", &bf16_dot_peak_gflops, "the AVX512-BF16 dot-product peak over every thread, "
        "GFLOP/s (0 without AVX512-BF16)", py::arg("seconds") = 0.5);
  m.def("bf16_gemm_supported", &bf16_gemm_supported, "whether this build has the AVX512-BF16 GEMM");
  m.def("quant_gemm", &quant_gemm, "x @ dequantize(codes).T (+ bias) over 4-bit, 8-bit or fp8 codes (AVX512-BF16)",
        py::arg("x"), py::arg("codes"), py::arg("kind"), py::arg("group_size"), py::arg("scale"), py::arg("offset"),
        py::arg("zero"), py::arg("zero_const"), py::arg("out_features"), py::arg("bias"), py::arg("row_scale"));
  m.def("quant_gemm_supported", &quant_gemm_supported, "whether this build has the quantized GEMM");
  m.def("prefill_bf16", &prefill_bf16, "causal attention of new tokens over their keys, after q_offset earlier ones (AVX512-BF16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("q_offset") = 0);
  m.def("prefill_bf16_supported", &prefill_bf16_supported, "whether prefill_bf16 takes this head_dim here");
  m.def("amx_prefill", &amx_prefill, "causal attention of new tokens over their keys, after q_offset earlier ones (AMX)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("q_offset") = 0);
  m.def("amx_prefill_supported", &amx_prefill_supported, "whether amx_prefill takes this head_dim here (AMX usable)");
}
