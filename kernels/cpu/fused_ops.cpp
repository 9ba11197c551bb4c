// Fused elementwise steps of a Llama layer for the CPU: each replaces several PyTorch ops (and their
// per-op dispatch and thread fork/join, which dominate at decode batch sizes) with one pass.
// Arithmetic is float32; storage keeps the tensors' dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "widen.h"
#include "simd_exp.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
// bfloat16 <-> float32 lanes; the narrowing rounds to nearest even, as c10::BFloat16 does.
static inline __m512 bf16_load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
static inline void bf16_store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
static inline __m512 bf16_round(__m512 x) {  // x rounded to bfloat16 and widened back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif

#if defined(__AVX512BF16__)
// The bfloat16 rows sixteen lanes at a time, with the same two roundings as the scalar code.
static bool add_rms_norm_row_bf16(c10::BFloat16* hr, const c10::BFloat16* dr, const c10::BFloat16* w,
                                  c10::BFloat16* orow, int64_t dim, float eps) {
  if (dim % 16) return false;
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 x = bf16_load16(hr + i);
    if (dr) {
      x = bf16_round(_mm512_add_ps(x, bf16_load16(dr + i)));
      bf16_store16(hr + i, x);
    }
    ss = _mm512_fmadd_ps(x, x, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / dim + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 normed = bf16_round(_mm512_mul_ps(bf16_load16(hr + i), inv));
    bf16_store16(orow + i, _mm512_mul_ps(bf16_load16(w + i), normed));
  }
  return true;
}
#endif

template <typename T>
static void add_rms_norm_kernel(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t dim,
                                int64_t h_s, int64_t d_s, int64_t o_s, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        if (add_rms_norm_row_bf16(h + r * h_s, delta ? delta + r * d_s : nullptr, w, out + r * o_s, dim, eps))
          continue;
      }
#endif
      T* hr = h + r * h_s;
      float ss = 0.f;
      if (delta) {
        const T* dr = delta + r * d_s;
        for (int64_t i = 0; i < dim; ++i) {
          const T sum = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
          hr[i] = sum;
          const float f = static_cast<float>(sum);
          ss += f * f;
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) { const float f = static_cast<float>(hr[i]); ss += f * f; }
      }
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      T* orow = out + r * o_s;
      for (int64_t i = 0; i < dim; ++i) {
        const T normed = static_cast<T>(static_cast<float>(hr[i]) * inv);
        orow[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

// h += delta (when given), then return rms_norm(h) * weight.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1, "h must be 2-D with contiguous rows");
  auto out = torch::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* d = nullptr;
    int64_t d_s = 0;
    if (delta.has_value()) {
      TORCH_CHECK(delta->sizes() == h.sizes() && delta->stride(1) == 1, "delta must match h");
      d = delta->data_ptr<scalar_t>();
      d_s = delta->stride(0);
    }
    add_rms_norm_kernel<scalar_t>(h.data_ptr<scalar_t>(), d, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  h.size(0), h.size(1), h.stride(0), d_s, out.stride(0), static_cast<float>(eps));
  });
  return out;
}

// Rotate, in place, the query and key heads that sit at the front of each fused qkv row: the first R dims
// of each head of D (partial rotary when R < D), with tables of R / 2 columns.
template <typename T>
static void rope_kernel(T* qkv, const int64_t* pos, const float* cos, const float* sin, int64_t rows,
                        int64_t row_s, int64_t heads, int64_t D, int64_t R) {
  const int64_t half = R / 2;
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* c = cos + pos[r] * half;
      const float* s = sin + pos[r] * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x = qkv + r * row_s + hd * D;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same<T, c10::BFloat16>::value) {
          if (half % 16 == 0) {
            for (int64_t i = 0; i < half; i += 16) {
              const __m512 x1 = bf16_load16(x + i), x2 = bf16_load16(x + i + half);
              const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
              bf16_store16(x + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)));
              bf16_store16(x + i + half, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)));
            }
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void rope_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                  int64_t rotated_heads, int64_t head_dim, int64_t rotary_dim) {
  if (rotary_dim < 0) rotary_dim = head_dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be 2-D with contiguous rows");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim && cos.size(-1) == rotary_dim / 2,
              "rotary_dim must be even, <= head_dim, and twice the tables' width");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "tables: float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_inplace", [&] {
    rope_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), qkv.size(0), qkv.stride(0), rotated_heads, head_dim, rotary_dim);
  });
}

template <typename T>
static void silu_mul_kernel(const T* gu, T* out, int64_t rows, int64_t inter, int64_t gu_s) {
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * gu_s;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= inter; i += 16) {
          const __m512 x = bf16_load16(g + i);
          // -x capped at 88 keeps exp finite (silu(x) is -0 there anyway): an infinite denominator turns
          // into NaN once -ffast-math lets the compiler divide by reciprocal and Newton step.
          const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.f)));
          const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
          bf16_store16(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), bf16_load16(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        // Capped as above: GCC vectorizes this loop too (AVX2 machines take it for every element), and
        // with -ffast-math x / (1 + inf) became inf * 0 = NaN at x = -100.
        o[i] = static_cast<T>(x / (1.f + std::exp(std::min(-x, 88.f))) * static_cast<float>(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up: [T, 2I]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter,
                              gate_up.stride(0));
  });
  return out;
}

// New keys and values into their cache slots (slot -1: padding, skipped), one row copy per token and
// tensor: index_copy_ plus the padding check cost several times more at decode batch sizes.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k, v: [T, kv_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "k, v and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k/v heads must match the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
              slots.is_contiguous(), "slot_mapping: int64 [T]");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(sl[i] >= -1 && sl[i] < num_slots, "slot ", sl[i], " of token ", i, " outside the cache (",
                num_slots, " slots)");
  const int64_t esz = k.element_size(), row = H * D * esz;
  const char* kb = static_cast<const char*>(k.data_ptr());
  const char* vb = static_cast<const char*>(v.data_ptr());
  char* kcb = static_cast<char*>(k_cache.data_ptr());
  char* vcb = static_cast<char*>(v_cache.data_ptr());
  for (int64_t i = 0; i < T; ++i) {
    if (sl[i] < 0) continue;
    for (int64_t hd = 0; hd < H; ++hd) {
      std::memcpy(kcb + sl[i] * row + hd * D * esz, kb + (i * k.stride(0) + hd * k.stride(1)) * esz, D * esz);
      std::memcpy(vcb + sl[i] * row + hd * D * esz, vb + (i * v.stride(0) + hd * v.stride(1)) * esz, D * esz);
    }
  }
}

constexpr int64_t kArgmaxChunk = 1024;  // logits widened to float32 this many at a time

// Structured output: token t of a row is allowed when bit t of the row's packed mask is set (int32 words,
// little-endian bit order, as llguidance writes them). Rows without a mask are the kMasked = false
// instantiations below: exactly the unmasked code, no bit test.
static inline bool token_allowed(const int32_t* mask, int64_t t) {
  return (static_cast<uint32_t>(mask[t >> 5]) >> (t & 31)) & 1u;
}

// Greedy sampling: index of the largest logit of each row (the first one on ties), read once in the
// logits' own dtype. Replaces logits.float().max(-1), which writes a float32 copy of the whole matrix.
// Masked: the largest allowed logit; -1 for a row that allows no token at all.
template <typename T, bool kMasked>
static void argmax_rows_kernel(const T* x, const int32_t* mask, int64_t mask_s, int64_t* out, int64_t rows,
                               int64_t cols, int64_t row_s) {
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    float buf[kArgmaxChunk];
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * row_s;
      const int32_t* rmask = kMasked ? mask + r * mask_s : nullptr;
      float best = -INFINITY;
      int64_t best_chunk = -1;
      for (int64_t c = 0; c < cols; c += kArgmaxChunk) {
        const int64_t n = std::min(kArgmaxChunk, cols - c);
        widen(row + c, buf, n);
        float m = -INFINITY;
        bool any = !kMasked;
        if constexpr (kMasked) {
          for (int64_t i = 0; i < n; i += 32) {  // chunks start on a word: skip disallowed words whole
            const uint32_t bits = static_cast<uint32_t>(rmask[(c + i) >> 5]);
            if (bits == 0) continue;
            const int64_t end = std::min<int64_t>(32, n - i);
            for (int64_t j = 0; j < end; ++j) {
              if ((bits >> j) & 1u) { m = any ? std::max(m, buf[i + j]) : buf[i + j]; any = true; }
            }
          }
        } else {
          for (int64_t i = 0; i < n; ++i) m = std::max(m, buf[i]);
        }
        // strict: keeps the first chunk on ties
        if (any && (best_chunk < 0 || m > best)) { best = m; best_chunk = c; }
      }
      if (best_chunk < 0) { out[r] = -1; continue; }  // masked: nothing allowed
      const int64_t n = std::min(kArgmaxChunk, cols - best_chunk);
      widen(row + best_chunk, buf, n);
      int64_t at = best_chunk;
      for (int64_t i = 0; i < n; ++i) {
        if (buf[i] == best && (!kMasked || token_allowed(rmask, best_chunk + i))) { at = best_chunk + i; break; }
      }
      out[r] = at;
    }
  });
}

// Largest value of a row among its allowed tokens, read once in the logits' own dtype (-inf: none).
template <typename T, bool kMasked>
static float row_max(const T* row, const int32_t* mask, int64_t cols, float* buf) {
  float m = -INFINITY;
  for (int64_t c = 0; c < cols; c += kArgmaxChunk) {
    const int64_t n = std::min(kArgmaxChunk, cols - c);
    widen(row + c, buf, n);
    if constexpr (kMasked) {
      for (int64_t i = 0; i < n; i += 32) {
        const uint32_t bits = static_cast<uint32_t>(mask[(c + i) >> 5]);
        if (bits == 0) continue;
        const int64_t end = std::min<int64_t>(32, n - i);
        for (int64_t j = 0; j < end; ++j) if ((bits >> j) & 1u) m = std::max(m, buf[i + j]);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) m = std::max(m, buf[i]);
    }
  }
  return m;
}

// Greedy sampling that a half-precision tie cannot decide: logits rounded to bfloat16 carry one unit
// in the last place of ~0.1 at typical magnitudes, so two tokens a few hundredths apart in float32 can
// round to the same value and the lower id would win. Every token within one such unit of the row's
// maximum is rescored as an exact float32 dot product of the final hidden state and its output-
// embedding row; the best score wins (the first on ties). Typically a handful of dots per row.
// Masked: only allowed tokens are candidates; -1 for a row that allows none.
template <typename T, bool kMasked>
static void argmax_exact_kernel(const T* x, const T* hid, const T* w, const int32_t* mask, int64_t mask_s,
                                int64_t* out, int64_t rows, int64_t cols, int64_t H, int64_t x_s, int64_t h_s,
                                int64_t w_s) {
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(kArgmaxChunk), hf(H), wf(H);
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * x_s;
      const int32_t* rmask = kMasked ? mask + r * mask_s : nullptr;
      const float m = row_max<T, kMasked>(row, rmask, cols, buf.data());
      // >= one unit in the last place at m for bfloat16 (8 significant bits) and float16 (11).
      const float floor_value = m - std::max(std::fabs(m) / 128.f, 1e-30f);
      widen(hid + r * h_s, hf.data(), H);
      float best = -INFINITY;
      int64_t at = -1;
      for (int64_t c = 0; c < cols; c += kArgmaxChunk) {
        const int64_t n = std::min(kArgmaxChunk, cols - c);
        widen(row + c, buf.data(), n);
        for (int64_t i = 0; i < n; ++i) {
          if (!(buf[i] >= floor_value)) continue;
          if constexpr (kMasked) {
            if (!token_allowed(rmask, c + i)) continue;
          }
          widen(w + (c + i) * w_s, wf.data(), H);
          float dot = 0.f;
          for (int64_t k = 0; k < H; ++k) dot += hf[k] * wf[k];
          if (at < 0 || dot > best) { best = dot; at = c + i; }
        }
      }
      if constexpr (kMasked) {
        if (at < 0) {  // every allowed logit is -inf (or none is allowed): the first allowed token, or -1
          for (int64_t t = 0; t < cols && at < 0; ++t) if (token_allowed(rmask, t)) at = t;
        }
        out[r] = at;
      } else {
        out[r] = at < 0 ? 0 : at;
      }
    }
  });
}

static void check_mask(const torch::Tensor& x, const torch::Tensor& mask) {
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == x.size(0) && mask.stride(1) == 1 &&
              mask.scalar_type() == at::kInt, "mask: int32 [rows, words] with contiguous rows");
  TORCH_CHECK(mask.size(1) * 32 >= x.size(1), "mask: fewer bits than the vocabulary");
}

static void check_exact_args(const torch::Tensor& x, const torch::Tensor& hidden, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits must be 2-D with contiguous rows");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == x.size(0) && hidden.stride(1) == 1, "hidden: [rows, H]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= x.size(1) && weight.size(1) == hidden.size(1) &&
              weight.stride(1) == 1, "weight: [vocab, H]");
  TORCH_CHECK(hidden.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "logits, hidden and weight must share a dtype");
}

torch::Tensor argmax_rows_exact(torch::Tensor x, torch::Tensor hidden, torch::Tensor weight) {
  check_exact_args(x, hidden, weight);
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows_exact", [&] {
    argmax_exact_kernel<scalar_t, false>(x.data_ptr<scalar_t>(), hidden.data_ptr<scalar_t>(),
                                         weight.data_ptr<scalar_t>(), nullptr, 0, out.data_ptr<int64_t>(), x.size(0),
                                         x.size(1), hidden.size(1), x.stride(0), hidden.stride(0), weight.stride(0));
  });
  return out;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits must be 2-D with contiguous rows");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    argmax_rows_kernel<scalar_t, false>(x.data_ptr<scalar_t>(), nullptr, 0, out.data_ptr<int64_t>(), x.size(0),
                                        x.size(1), x.stride(0));
  });
  return out;
}

// The masked twins: `mask` is int32 [rows, >= ceil(vocab / 32)], a row's bit t set when token t is allowed.
torch::Tensor argmax_rows_masked(torch::Tensor x, torch::Tensor mask) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits must be 2-D with contiguous rows");
  check_mask(x, mask);
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows_masked", [&] {
    argmax_rows_kernel<scalar_t, true>(x.data_ptr<scalar_t>(), mask.data_ptr<int32_t>(), mask.stride(0),
                                       out.data_ptr<int64_t>(), x.size(0), x.size(1), x.stride(0));
  });
  return out;
}

torch::Tensor argmax_rows_exact_masked(torch::Tensor x, torch::Tensor hidden, torch::Tensor weight,
                                       torch::Tensor mask) {
  check_exact_args(x, hidden, weight);
  check_mask(x, mask);
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows_exact_masked", [&] {
    argmax_exact_kernel<scalar_t, true>(x.data_ptr<scalar_t>(), hidden.data_ptr<scalar_t>(),
                                        weight.data_ptr<scalar_t>(), mask.data_ptr<int32_t>(), mask.stride(0),
                                        out.data_ptr<int64_t>(), x.size(0), x.size(1), hidden.size(1), x.stride(0),
                                        hidden.stride(0), weight.stride(0));
  });
  return out;
}

// Disallowed tokens' logits set to -inf in place (before temperature, top-k, top-p and log-softmax).
template <typename T>
static void apply_bitmask_kernel(T* x, const int32_t* mask, int64_t mask_s, int64_t rows, int64_t cols,
                                 int64_t row_s) {
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* row = x + r * row_s;
      const int32_t* rmask = mask + r * mask_s;
      for (int64_t w = 0; w * 32 < cols; ++w) {
        const uint32_t bits = static_cast<uint32_t>(rmask[w]);
        if (bits == 0xffffffffu) continue;
        const int64_t end = std::min<int64_t>(32, cols - w * 32);
        for (int64_t i = 0; i < end; ++i) {
          if (!((bits >> i) & 1u)) row[w * 32 + i] = neg_inf;
        }
      }
    }
  });
}

void apply_token_bitmask(torch::Tensor x, torch::Tensor mask) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits must be 2-D with contiguous rows");
  check_mask(x, mask);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "apply_token_bitmask", [&] {
    apply_bitmask_kernel<scalar_t>(x.data_ptr<scalar_t>(), mask.data_ptr<int32_t>(), mask.stride(0), x.size(0),
                                   x.size(1), x.stride(0));
  });
}
