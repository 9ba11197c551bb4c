// Widening rows of cache or logits to float32, shared by the CPU kernels.
#pragma once
#include <torch/extension.h>
#include <array>
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

// float8_e4m3fn -> float32 through a table of its 256 values (FP8 KV caches).
template <>
inline void widen<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* __restrict src, float* __restrict dst, int64_t n) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = table[bits[i]];
}
