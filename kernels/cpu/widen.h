// Widening rows of cache or logits to float32, shared by the CPU kernels.
#pragma once
#include <torch/extension.h>
#include <cstdint>

template <typename T>
static inline void widen(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 -> float32 is a 16-bit shift; written so the compiler vectorises it (c10::BFloat16's own
// conversion operator does not).
template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}
