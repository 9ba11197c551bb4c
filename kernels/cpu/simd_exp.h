// exp and an unnormalised softmax for AVX-512 float32 lanes, shared by the CPU attention kernels.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * p(f), p a degree-6
// polynomial of 2^f on [-0.5, 0.5] (relative error ~1e-7). Scalar std::exp cost more than the dots.
static inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.54035304e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// In place: sc[t] = exp(sc[t] - max); returns 1 / sum. `sink` (gpt-oss; nullptr: none): a logit that
// joins the max and the sum but gets no slot, so the probabilities it leaves sum to less than 1. A pointer,
// not -inf for none: -ffast-math lets the compiler assume no infinities.
static inline float softmax_unnormalised(float* sc, int64_t L, const float* sink = nullptr) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sc + t));
  float m = _mm512_reduce_max_ps(vm);
  for (; t < L; ++t) m = std::max(m, sc[t]);
  if (sink) m = std::max(m, *sink);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 vs = _mm512_setzero_ps();
  for (t = 0; t + 16 <= L; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mv));
    _mm512_storeu_ps(sc + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  if (t < L) {
    const __mmask16 k = static_cast<__mmask16>((1u << (L - t)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), mv));
    _mm512_mask_storeu_ps(sc + t, k, e);
    vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(k, e));
  }
  float total = _mm512_reduce_add_ps(vs);
  if (sink) total += std::exp(*sink - m);
  return 1.f / total;
}
#endif
