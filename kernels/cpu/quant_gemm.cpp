// Linear layers over quantized weights on AVX512-BF16 (W8A16, W4A16, FP8 weights): y = x @ w.T (+ bias),
// where w[n][k] = s[n][g] * q[n][k] + b[n][g] for the group g = k / group_size, and q is a 4-bit or 8-bit
// integer code or an e4m3 float. Decode is bandwidth-bound on the CPU: reading a 4-bit weight moves a
// quarter of the bytes of a bfloat16 one, so dequantizing inside the kernel is what makes it faster.
//
// Each task takes a block of rows and a panel of 64 output columns. It dequantizes the panel a chunk of
// K at a time into a bfloat16 buffer in the layout of bf16_gemm.cpp ([K/2][64][2]: the operand layout of
// vdpbf16ps), so the weight is rounded to bfloat16 exactly as a bfloat16 copy of the dequantized weight
// would be, then runs register-blocked dot products of every row of the block over it, accumulating in
// float32 across chunks. Weight bytes are read once per row block (once per call at decode sizes).
//
// Layouts (made by services/engine/quant/cpu_layout.py):
//   codes, 8-bit and fp8: [panels][K/2][64][2] bytes; 4-bit: [panels][K/2][64] bytes, the even k in the
//     low nibble, the odd k in the high one. K is padded to whole pairs, N to whole panels (zeros).
//   scale: [panels][groups][64] float16 or float32.
//   offset (b, optional): [panels][groups][64] float16 or float32; or zero (optional): [panels][groups][64]
//     uint8, b = -s * zero; or neither: b = -s * zero_const.
//   fp8 codes: s already includes nothing extra; the e4m3 bit pattern is widened to float32 exactly.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {
constexpr int64_t kQPanel = 64;
constexpr int64_t kChunkPairs = 256;  // 512 k per dequantized chunk: 64 KiB of bfloat16, resident in L2
constexpr int kQMr = 6;
enum CodeKind : int64_t { kU8 = 0, kU4 = 1, kFp8 = 2 };
}  // namespace

#if defined(__AVX512BF16__)
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

inline __m512 load_f(const void* base, bool f16, int64_t idx) {
  if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      reinterpret_cast<const uint16_t*>(base) + idx)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + idx);
}

// s and b of 64 columns of one panel for group g.
inline void group_vectors(const GroupParams& gp, int64_t panel, int64_t g, __m512 s[4], __m512 b[4]) {
  const int64_t base = (panel * gp.groups + g) * kQPanel;
  for (int j = 0; j < 4; ++j) {
    s[j] = load_f(gp.scale, gp.scale_f16, base + 16 * j);
    if (gp.offset) {
      b[j] = load_f(gp.offset, gp.offset_f16, base + 16 * j);
    } else if (gp.zero) {
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(gp.zero + base + 16 * j))));
      b[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), s[j]), z);
    } else {
      b[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(-gp.zero_const));
    }
  }
}

// 16 codes (8 columns x the pair of k) as float32 lanes (c0k0, c0k1, c1k0, ...).
inline __m512 fp8_to_float(__m512i bytes) {
  const __m512i mag = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x80)), 24);
  // Normal: exponent e - 7 + 127 = e + 120, mantissa bits in place; subnormal (e == 0): m * 2^-9.
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20),
                                                             _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_sub, normal, sub);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

template <int KIND>
inline __m512 codes_as_float(const uint8_t* row, int half) {
  // `row`: one pair-row of the panel; `half`: which 8 columns (0..7 of a 16-column slice) -> 16 lanes.
  if (KIND == kU4) {
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * half)));
    const __m512i v = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, b), shifts),
                                       _mm512_set1_epi32(0xF));
    return _mm512_cvtepi32_ps(v);
  }
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * half)));
  if (KIND == kFp8) return fp8_to_float(b);
  return _mm512_cvtepi32_ps(b);
}

// Dequantize pair-rows [p0, p1) of one panel into `buf` ([p1 - p0][64][2] bfloat16).
template <int KIND>
void dequant_chunk(const uint8_t* panel_codes, const GroupParams& gp, int64_t panel, int64_t group_pairs,
                   int64_t p0, int64_t p1, uint16_t* buf) {
  constexpr int64_t row_bytes = KIND == kU4 ? kQPanel : 2 * kQPanel;
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  __m512 s[4], b[4];
  int64_t current = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = p / group_pairs;
    if (g != current) {
      group_vectors(gp, panel, g, s, b);
      current = g;
    }
    const uint8_t* row = panel_codes + p * row_bytes;
    uint16_t* out = buf + (p - p0) * kQPanel * 2;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* cols = row + (KIND == kU4 ? 16 * j : 32 * j);
      const __m512 lo = _mm512_fmadd_ps(codes_as_float<KIND>(cols, 0), _mm512_permutexvar_ps(dup_lo, s[j]),
                                        _mm512_permutexvar_ps(dup_lo, b[j]));
      const __m512 hi = _mm512_fmadd_ps(codes_as_float<KIND>(cols, 1), _mm512_permutexvar_ps(dup_hi, s[j]),
                                        _mm512_permutexvar_ps(dup_hi, b[j]));
      _mm512_storeu_si512(out + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// acc[MR][64] (+)= a[MR rows] . chunk, over `pairs` pairs of k starting at pair `p0` of each row of a.
template <int MR>
inline void accumulate_tile(const uint16_t* a, int64_t lda, int64_t p0, const uint16_t* chunk, int64_t pairs,
                            float* acc, bool first) {
  __m512 c[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) c[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + m * kQPanel + 16 * j);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = chunk + p * kQPanel * 2;
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * (p0 + p), sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) c[m][j] = _mm512_dpbf16_ps(c[m][j], av, w[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + m * kQPanel + 16 * j, c[m][j]);
}

void accumulate_rows(int rows, const uint16_t* a, int64_t lda, int64_t p0, const uint16_t* chunk, int64_t pairs,
                     float* acc, bool first) {
  switch (rows) {
    case 6: accumulate_tile<6>(a, lda, p0, chunk, pairs, acc, first); break;
    case 5: accumulate_tile<5>(a, lda, p0, chunk, pairs, acc, first); break;
    case 4: accumulate_tile<4>(a, lda, p0, chunk, pairs, acc, first); break;
    case 3: accumulate_tile<3>(a, lda, p0, chunk, pairs, acc, first); break;
    case 2: accumulate_tile<2>(a, lda, p0, chunk, pairs, acc, first); break;
    default: accumulate_tile<1>(a, lda, p0, chunk, pairs, acc, first); break;
  }
}

template <int KIND>
void run(const uint16_t* a, int64_t lda, int64_t m, const uint8_t* codes, int64_t pairs, int64_t panels,
         const GroupParams& gp, int64_t group_pairs, const float* bias, const float* row_scale,
         c10::BFloat16* out, int64_t out_features) {
  constexpr int64_t row_bytes = KIND == kU4 ? kQPanel : 2 * kQPanel;
  constexpr int64_t kRowCap = 64;
  const int64_t used_panels = (out_features + kQPanel - 1) / kQPanel;
  const int64_t row_blocks = (m + kRowCap - 1) / kRowCap;
  at::parallel_for(0, row_blocks * used_panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t chunk[kChunkPairs * kQPanel * 2];
    alignas(64) float acc[kRowCap * kQPanel];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rb = t / used_panels, pn = t % used_panels;
      const int64_t r0 = rb * kRowCap, r1 = std::min(m, r0 + kRowCap);
      const uint8_t* panel_codes = codes + pn * pairs * row_bytes;
      for (int64_t c0 = 0; c0 < pairs; c0 += kChunkPairs) {
        const int64_t c1 = std::min(pairs, c0 + kChunkPairs);
        dequant_chunk<KIND>(panel_codes, gp, pn, group_pairs, c0, c1, chunk);
        for (int64_t r = r0; r < r1; r += kQMr) {
          const int rows = static_cast<int>(std::min<int64_t>(kQMr, r1 - r));
          accumulate_rows(rows, a + r * lda, lda, c0, chunk, c1 - c0, acc + (r - r0) * kQPanel, c0 == 0);
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
  TORCH_CHECK(kind == kU8 || kind == kU4 || kind == kFp8, "quant_gemm: code kind 0 (u8), 1 (u4) or 2 (fp8)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3,
              "quant_gemm: codes are contiguous uint8 [panels, K/2, bytes per pair-row]");
  const int64_t row_bytes = kind == kU4 ? kQPanel : 2 * kQPanel;
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
  if (kind == kU4) run<kU4>(a, x.stride(0), m, c, pairs, panels, gp, group_pairs, b, rs, out, out_features);
  else if (kind == kFp8) run<kFp8>(a, x.stride(0), m, c, pairs, panels, gp, group_pairs, b, rs, out, out_features);
  else run<kU8>(a, x.stride(0), m, c, pairs, panels, gp, group_pairs, b, rs, out, out_features);
  return y;
}

#else  // built for a CPU without AVX512-BF16: the engine dequantizes through the PyTorch reference
bool quant_gemm_supported() { return false; }

torch::Tensor quant_gemm(torch::Tensor, torch::Tensor, int64_t, int64_t, torch::Tensor, c10::optional<torch::Tensor>,
                         c10::optional<torch::Tensor>, double, int64_t, c10::optional<torch::Tensor>,
                         c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "quant_gemm: this build has no AVX512-BF16");
}
#endif
