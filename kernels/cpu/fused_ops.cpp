// Fused elementwise steps of a Llama layer for the CPU: each replaces several PyTorch ops (and their
// per-op dispatch and thread fork/join, which dominate at decode batch sizes) with one pass.
// Arithmetic is float32; storage keeps the tensors' dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "widen.h"

template <typename T>
static void add_rms_norm_kernel(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t dim,
                                int64_t h_s, int64_t d_s, int64_t o_s, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
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

// Rotate, in place, the query and key heads that sit at the front of each fused qkv row.
template <typename T>
static void rope_kernel(T* qkv, const int64_t* pos, const float* cos, const float* sin, int64_t rows,
                        int64_t row_s, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* c = cos + pos[r] * half;
      const float* s = sin + pos[r] * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x = qkv + r * row_s + hd * D;
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
                  int64_t rotated_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be 2-D with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "tables: float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_inplace", [&] {
    rope_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), qkv.size(0), qkv.stride(0), rotated_heads, head_dim);
  });
}

template <typename T>
static void silu_mul_kernel(const T* gu, T* out, int64_t rows, int64_t inter, int64_t gu_s) {
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * gu_s;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = static_cast<T>(x / (1.f + std::exp(-x)) * static_cast<float>(u[i]));
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

// Greedy sampling: index of the largest logit of each row (the first one on ties), read once in the
// logits' own dtype. Replaces logits.float().max(-1), which writes a float32 copy of the whole matrix.
template <typename T>
static void argmax_rows_kernel(const T* x, int64_t* out, int64_t rows, int64_t cols, int64_t row_s) {
  constexpr int64_t kChunk = 1024;
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    float buf[kChunk];
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * row_s;
      float best = -INFINITY;
      int64_t best_chunk = 0;
      for (int64_t c = 0; c < cols; c += kChunk) {
        const int64_t n = std::min(kChunk, cols - c);
        widen(row + c, buf, n);
        float m = -INFINITY;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, buf[i]);
        if (m > best) { best = m; best_chunk = c; }  // strict: keeps the first chunk on ties
      }
      const int64_t n = std::min(kChunk, cols - best_chunk);
      widen(row + best_chunk, buf, n);
      int64_t at = best_chunk;
      for (int64_t i = 0; i < n; ++i) {
        if (buf[i] == best) { at = best_chunk + i; break; }
      }
      out[r] = at;
    }
  });
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits must be 2-D with contiguous rows");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    argmax_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<int64_t>(), x.size(0), x.size(1),
                                 x.stride(0));
  });
  return out;
}
