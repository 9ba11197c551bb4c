// Linear layers over quantized weights (W8A16, W4A16, FP8 weights): y = x @ w.T (+ bias), where
// w[n][k] = s[n][g] * q[n][k] + b[n][g] for the group g = k / group_size, and q is a 4-bit or 8-bit integer
// code, an e4m3 float or an e2m1 float (MXFP4); x is bfloat16, products and sums are float32, the output is rounded to bfloat16
// once. Decode is bandwidth-bound on the CPU: a 4-bit weight moves a quarter of the bytes of a bfloat16
// one, so dequantizing inside the kernel, never to memory, is what makes it faster.
//
// Written for AVX2 + FMA (every x86-64 server CPU of the last decade; AVX-512 machines run it too):
// - one or two rows (decode at low load): each 8-column slice of a pair of k is dequantized in registers and
//   multiplied straight away; the weight is read once and nothing is written back.
// - more rows: a task (a block of up to 64 rows x a panel of 64 output columns) dequantizes the panel a chunk
//   of K at a time into a float32 buffer that stays in L2, then runs register-blocked FMAs of two rows at a
//   time over it, accumulating in float32 across chunks.
//
// Layouts (made by services/engine/quant/panel_weight.py):
//   codes, 8-bit and fp8: [panels][K/2][64][2] bytes; 4-bit: [panels][K/2][64] bytes, the even k in the
//     low nibble, the odd k in the high one. K is padded to whole pairs, N to whole panels (zeros).
//   scale: [panels][groups][64] float16 or float32.
//   offset (b, optional): [panels][groups][64] float16 or float32; or zero (optional): [panels][groups][64]
//     uint8, b = -s * zero; or neither: b = -s * zero_const.
//   fp8 codes are e4m3 bit patterns, widened to float32 exactly (subnormals included).
//   fp4 codes (MXFP4's e2m1) are packed as the 4-bit ones: sign in bit 3, the magnitude (0, 0.5, 1, 1.5, 2,
//     3, 4, 6) looked up in a register; with its power-of-two block scale and no offset the product is exact.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int64_t kQPanel = 64;
constexpr int64_t kChunkPairs = 256;  // 512 k per dequantized chunk: 128 KiB of float32, resident in L2
enum CodeKind : int64_t { kU8 = 0, kU4 = 1, kFp8 = 2, kFp4 = 3 };
}  // namespace

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {
struct GroupParams {
  const void* scale;
  bool scale_f16;
  const void* offset;  // nullptr: none
  bool offset_f16;
  const uint8_t* zero;  // nullptr: none
  float zero_const;
  int64_t groups;
};

inline __m256 load8(const void* base, bool f16, int64_t idx) {
  if (f16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
      reinterpret_cast<const uint16_t*>(base) + idx)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(base) + idx);
}

// s and b of the 64 columns of one panel for group g.
inline void group_vectors(const GroupParams& gp, int64_t panel, int64_t g, float* s, float* b) {
  const int64_t base = (panel * gp.groups + g) * kQPanel;
  for (int j = 0; j < 8; ++j) {
    const __m256 sv = load8(gp.scale, gp.scale_f16, base + 8 * j);
    __m256 bv;
    if (gp.offset) {
      bv = load8(gp.offset, gp.offset_f16, base + 8 * j);
    } else if (gp.zero) {
      const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp.zero + base + 8 * j))));
      bv = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), sv), z);
    } else {
      bv = _mm256_mul_ps(sv, _mm256_set1_ps(-gp.zero_const));
    }
    _mm256_storeu_ps(s + 8 * j, sv);
    _mm256_storeu_ps(b + 8 * j, bv);
  }
}

inline __m256 fp8_to_float(__m256i bytes) {
  const __m256i mag = _mm256_and_si256(bytes, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(0x80)), 24);
  // Normal: exponent e - 7 + 127 = e + 120 with the mantissa bits in place; subnormal (e == 0): m * 2^-9.
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20),
                                                             _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  const __m256 v = _mm256_blendv_ps(normal, sub, is_sub);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

// e2m1 nibbles (in 32-bit lanes) to float32: the magnitude from an 8-entry table, the sign bit moved to bit 31.
inline __m256 fp4_to_float(__m256i nib) {
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 mag = _mm256_permutevar8x32_ps(table, _mm256_and_si256(nib, _mm256_set1_epi32(7)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(8)), 28);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}

// The codes of 8 columns (slice j of the panel) for the pair of k of one pair-row: (even k, odd k).
template <int KIND>
inline void codes8(const uint8_t* row, int j, __m256& even, __m256& odd) {
  if (KIND == kFp4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * j)));
    even = fp4_to_float(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    odd = fp4_to_float(_mm256_srli_epi32(v, 4));
    return;
  }
  if (KIND == kU4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * j)));
    even = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    return;
  }
  const __m128i pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j));
  const __m128i split = _mm_shuffle_epi8(pairs, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m256i e = _mm256_cvtepu8_epi32(split), o = _mm256_cvtepu8_epi32(_mm_srli_si128(split, 8));
  if (KIND == kFp8) {
    even = fp8_to_float(e);
    odd = fp8_to_float(o);
  } else {
    even = _mm256_cvtepi32_ps(e);
    odd = _mm256_cvtepi32_ps(o);
  }
}

inline float bf16_at(const uint16_t* a, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(a[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <int KIND>
constexpr int64_t row_bytes() { return KIND == kU4 || KIND == kFp4 ? kQPanel : 2 * kQPanel; }

// One row of x against one panel, dequantizing in registers: acc[64] = sum over k.
template <int KIND>
void direct_row(const uint16_t* a, const uint8_t* panel_codes, const GroupParams& gp, int64_t panel,
                int64_t group_pairs, int64_t pairs, float* acc) {
  alignas(32) float s[kQPanel], b[kQPanel];
  __m256 c[8];
  for (int j = 0; j < 8; ++j) c[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g * group_pairs < pairs; ++g) {
    group_vectors(gp, panel, g, s, b);
    const int64_t p1 = std::min(pairs, (g + 1) * group_pairs);
    for (int64_t p = g * group_pairs; p < p1; ++p) {
      const uint8_t* row = panel_codes + p * row_bytes<KIND>();
      const __m256 x0 = _mm256_set1_ps(bf16_at(a, 2 * p)), x1 = _mm256_set1_ps(bf16_at(a, 2 * p + 1));
      for (int j = 0; j < 8; ++j) {
        __m256 e, o;
        codes8<KIND>(row, j, e, o);
        const __m256 sv = _mm256_load_ps(s + 8 * j), bv = _mm256_load_ps(b + 8 * j);
        c[j] = _mm256_fmadd_ps(x0, _mm256_fmadd_ps(e, sv, bv), c[j]);
        c[j] = _mm256_fmadd_ps(x1, _mm256_fmadd_ps(o, sv, bv), c[j]);
      }
    }
  }
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + 8 * j, c[j]);
}

// Dequantize pair-rows [p0, p1) of one panel into `buf` ([2 * (p1 - p0)][64] float32, k-major).
template <int KIND>
void dequant_chunk(const uint8_t* panel_codes, const GroupParams& gp, int64_t panel, int64_t group_pairs,
                   int64_t p0, int64_t p1, float* buf) {
  alignas(32) float s[kQPanel], b[kQPanel];
  int64_t current = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = p / group_pairs;
    if (g != current) {
      group_vectors(gp, panel, g, s, b);
      current = g;
    }
    const uint8_t* row = panel_codes + p * row_bytes<KIND>();
    float* even_out = buf + 2 * (p - p0) * kQPanel;
    for (int j = 0; j < 8; ++j) {
      __m256 e, o;
      codes8<KIND>(row, j, e, o);
      const __m256 sv = _mm256_load_ps(s + 8 * j), bv = _mm256_load_ps(b + 8 * j);
      _mm256_storeu_ps(even_out + 8 * j, _mm256_fmadd_ps(e, sv, bv));
      _mm256_storeu_ps(even_out + kQPanel + 8 * j, _mm256_fmadd_ps(o, sv, bv));
    }
  }
}

// acc[MR][64] (+)= a[MR rows][k0, k0 + ks) . buf[ks][64].
template <int MR>
inline void accumulate_tile(const uint16_t* a, int64_t lda, int64_t k0, const float* buf, int64_t ks, float* acc,
                            bool first) {
  for (int half = 0; half < 2; ++half) {
    __m256 c[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j)
        c[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + m * kQPanel + 32 * half + 8 * j);
    for (int64_t k = 0; k < ks; ++k) {
      const float* wk = buf + k * kQPanel + 32 * half;
      __m256 w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(wk + 8 * j);
      for (int m = 0; m < MR; ++m) {
        const __m256 x = _mm256_set1_ps(bf16_at(a, m * lda + k0 + k));
        for (int j = 0; j < 4; ++j) c[m][j] = _mm256_fmadd_ps(x, w[j], c[m][j]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + m * kQPanel + 32 * half + 8 * j, c[m][j]);
  }
}

template <int KIND>
void run(const uint16_t* a, int64_t lda, int64_t m, const uint8_t* codes, int64_t pairs, const GroupParams& gp,
         int64_t group_pairs, const float* bias, const float* row_scale, c10::BFloat16* out, int64_t out_features) {
  constexpr int64_t kRowCap = 64;
  constexpr int64_t kDirectRows = 2;
  const int64_t used_panels = (out_features + kQPanel - 1) / kQPanel;
  const int64_t row_blocks = (m + kRowCap - 1) / kRowCap;
  at::parallel_for(0, row_blocks * used_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk(m > kDirectRows ? 2 * kChunkPairs * kQPanel : 0);
    alignas(32) float acc[kRowCap * kQPanel];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rb = t / used_panels, pn = t % used_panels;
      const int64_t r0 = rb * kRowCap, r1 = std::min(m, r0 + kRowCap);
      const uint8_t* panel_codes = codes + pn * pairs * row_bytes<KIND>();
      if (m <= kDirectRows) {
        for (int64_t r = r0; r < r1; ++r)
          direct_row<KIND>(a + r * lda, panel_codes, gp, pn, group_pairs, pairs, acc + (r - r0) * kQPanel);
      } else {
        for (int64_t c0 = 0; c0 < pairs; c0 += kChunkPairs) {
          const int64_t c1 = std::min(pairs, c0 + kChunkPairs);
          dequant_chunk<KIND>(panel_codes, gp, pn, group_pairs, c0, c1, chunk.data());
          for (int64_t r = r0; r < r1; r += 2) {
            float* dst = acc + (r - r0) * kQPanel;
            if (r + 1 < r1) accumulate_tile<2>(a + r * lda, lda, 2 * c0, chunk.data(), 2 * (c1 - c0), dst, c0 == 0);
            else accumulate_tile<1>(a + r * lda, lda, 2 * c0, chunk.data(), 2 * (c1 - c0), dst, c0 == 0);
          }
        }
      }
      const int64_t cols = std::min(kQPanel, out_features - pn * kQPanel);
      for (int64_t r = r0; r < r1; ++r) {
        const float rs = row_scale ? row_scale[r] : 1.0f;
        const float* src = acc + (r - r0) * kQPanel;
        c10::BFloat16* dst = out + r * out_features + pn * kQPanel;
        for (int64_t c = 0; c < cols; ++c)
          dst[c] = c10::BFloat16(src[c] * rs + (bias ? bias[pn * kQPanel + c] : 0.0f));
      }
    }
  });
}
}  // namespace

bool quant_gemm_supported() { return true; }

torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor codes, int64_t kind, int64_t group_size, torch::Tensor scale,
                         c10::optional<torch::Tensor> offset, c10::optional<torch::Tensor> zero, double zero_const,
                         int64_t out_features, c10::optional<torch::Tensor> bias,
                         c10::optional<torch::Tensor> row_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_gemm: a 2-D bfloat16 input");
  TORCH_CHECK(kind == kU8 || kind == kU4 || kind == kFp8 || kind == kFp4,
              "quant_gemm: code kind 0 (u8), 1 (u4), 2 (fp8) or 3 (fp4)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3,
              "quant_gemm: codes are contiguous uint8 [panels, K/2, bytes per pair-row]");
  const int64_t row_bytes = kind == kU4 || kind == kFp4 ? kQPanel : 2 * kQPanel;
  const int64_t panels = codes.size(0), pairs = codes.size(1), m = x.size(0), k = x.size(1);
  TORCH_CHECK(codes.size(2) == row_bytes, "quant_gemm: codes' last dimension does not match the code kind");
  TORCH_CHECK(pairs * 2 >= k && pairs * 2 <= k + 1, "quant_gemm: codes do not match the input's K");
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0, "quant_gemm: group_size is even and >= 2");
  TORCH_CHECK(out_features <= panels * kQPanel, "quant_gemm: out_features past the panels");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == panels && scale.size(2) == kQPanel && scale.is_contiguous() &&
              (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "quant_gemm: scale is contiguous float32/float16 [panels, groups, 64]");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups * group_size >= pairs * 2 - 1, "quant_gemm: fewer scale groups than K needs");
  GroupParams gp{scale.data_ptr(), scale.scalar_type() == at::kHalf, nullptr, false, nullptr,
                 static_cast<float>(zero_const), groups};
  if (offset.has_value() && offset->defined()) {
    TORCH_CHECK(offset->sizes() == scale.sizes() && offset->is_contiguous() &&
                (offset->scalar_type() == at::kFloat || offset->scalar_type() == at::kHalf),
                "quant_gemm: offset is float32/float16 shaped like scale");
    gp.offset = offset->data_ptr();
    gp.offset_f16 = offset->scalar_type() == at::kHalf;
  } else if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(zero->sizes() == scale.sizes() && zero->is_contiguous() && zero->scalar_type() == at::kByte,
                "quant_gemm: zero is uint8 shaped like scale");
    gp.zero = zero->data_ptr<uint8_t>();
  }
  if (x.stride(1) != 1 || (k % 2)) {
    auto padded = torch::zeros({m, pairs * 2}, x.options());
    padded.narrow(1, 0, k).copy_(x);
    x = padded;
  }
  auto y = torch::empty({m, out_features}, x.options());
  if (m == 0) return y;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() >= panels * kQPanel,
                "quant_gemm: the bias is float32, padded to whole panels");
    b = bias->data_ptr<float>();
  }
  const float* rs = nullptr;
  if (row_scale.has_value() && row_scale->defined()) {
    TORCH_CHECK(row_scale->scalar_type() == at::kFloat && row_scale->is_contiguous() && row_scale->numel() == m,
                "quant_gemm: row_scale is float32 [M]");
    rs = row_scale->data_ptr<float>();
  }
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t group_pairs = group_size / 2;
  auto* out = y.data_ptr<c10::BFloat16>();
  if (kind == kU4) run<kU4>(a, x.stride(0), m, c, pairs, gp, group_pairs, b, rs, out, out_features);
  else if (kind == kFp4) run<kFp4>(a, x.stride(0), m, c, pairs, gp, group_pairs, b, rs, out, out_features);
  else if (kind == kFp8) run<kFp8>(a, x.stride(0), m, c, pairs, gp, group_pairs, b, rs, out, out_features);
  else run<kU8>(a, x.stride(0), m, c, pairs, gp, group_pairs, b, rs, out, out_features);
  return y;
}

#else  // built for a CPU without AVX2/FMA/F16C: the engine dequantizes through the PyTorch reference
bool quant_gemm_supported() { return false; }

torch::Tensor quant_gemm(torch::Tensor, torch::Tensor, int64_t, int64_t, torch::Tensor, c10::optional<torch::Tensor>,
                         c10::optional<torch::Tensor>, double, int64_t, c10::optional<torch::Tensor>,
                         c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "quant_gemm: this build has no AVX2/FMA/F16C");
}
#endif
