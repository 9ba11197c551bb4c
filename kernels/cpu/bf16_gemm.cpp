// bfloat16 linear layers on AVX512-BF16 without AMX: y = x @ w.T (+ bias), float32 accumulation.
// On CPUs without AMX, oneDNN's AVX512-BF16 GEMM runs a quarter to a half of the chip's dot-product
// peak at 1-8 rows (the batches of low-load decoding); this register-blocked kernel over weights packed
// once at load time keeps the dot-product unit busy there, and matches or beats oneDNN up to 2048 rows. On AMX machines oneDNN's AMX GEMM stays faster
// and the engine keeps it (services/engine/linear.py chooses).
//
// Packed weight layout: [panels][K/2][64][2]: a panel is 64 output columns; for each pair of k its 64
// columns hold (w[n][k], w[n][k+1]) side by side, the operand layout of vdpbf16ps. N and K are padded
// with zeros to whole panels and pairs, so the kernel never branches on them inside the k loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int64_t kPanel = 64;  // output columns per panel: 4 zmm of 16 float32 accumulators
constexpr int kNr = 4;
constexpr int kMr = 6;  // rows per micro-tile: 6 x 4 = 24 accumulators, 4 weight and 6 broadcast loads
}

torch::Tensor bf16_gemm_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_gemm_pack: a 2-D bfloat16 weight");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  auto padded = torch::zeros({panels * kPanel, pairs * 2}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {
template <int MR>
inline void micro_tile(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t pairs, const float* bias,
                       c10::BFloat16* c, int64_t ldc, int64_t cols) {
  __m512 acc[MR][kNr];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kNr; ++j) acc[m][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = panel + p * kPanel * 2;
    __m512bh wv[kNr];
    for (int j = 0; j < kNr; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kNr; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, wv[j]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    c10::BFloat16* row = c + m * ldc;
    for (int j = 0; j < kNr; ++j) {
      const int64_t left = cols - 16 * j;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      _mm256_mask_storeu_epi16(row + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
    }
  }
}

void tile(int rows, const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t pairs, const float* bias,
          c10::BFloat16* c, int64_t ldc, int64_t cols) {
  switch (rows) {
    case 6: micro_tile<6>(a, lda, panel, pairs, bias, c, ldc, cols); break;
    case 5: micro_tile<5>(a, lda, panel, pairs, bias, c, ldc, cols); break;
    case 4: micro_tile<4>(a, lda, panel, pairs, bias, c, ldc, cols); break;
    case 3: micro_tile<3>(a, lda, panel, pairs, bias, c, ldc, cols); break;
    case 2: micro_tile<2>(a, lda, panel, pairs, bias, c, ldc, cols); break;
    default: micro_tile<1>(a, lda, panel, pairs, bias, c, ldc, cols); break;
  }
}
}  // namespace

bool bf16_gemm_supported() { return true; }

torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                        c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_gemm: a 2-D bfloat16 input");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 >= x.size(1) && packed.size(1) * 2 <= x.size(1) + 1,
              "bf16_gemm: packed weight does not match the input's K");
  TORCH_CHECK(out_features <= packed.size(0) * kPanel, "bf16_gemm: out_features past the packed panels");
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(1), panels = packed.size(0);
  if (x.stride(1) != 1 || (k % 2)) {
    // The last pair of an odd K would read past the row: a copy with a zero after it; strided rows: one copy.
    auto padded = torch::zeros({m, pairs * 2}, x.options());
    padded.narrow(1, 0, k).copy_(x);
    x = padded;
  }
  auto y = torch::empty({m, out_features}, x.options());
  if (m == 0) return y;
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() >= panels * kPanel,
                "bf16_gemm: the bias is float32, padded to whole panels");
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  const int64_t lda = x.stride(0), ldc = out_features, panel_elems = pairs * kPanel * 2;
  const int64_t used_panels = (out_features + kPanel - 1) / kPanel;
  // Rows in blocks that keep a block of A in L1/L2 while the panels stream past; tasks are
  // (row block, panel) with the panel fastest, so each thread walks a contiguous run of panels.
  // Row blocks of at most kRowCap rows (a block of A stays in L2 while the panels stream past), even in
  // size, and enough (block, panel) tasks for every thread to get an even share (o_proj has only 9
  // panels at SmolLM2's width).
  constexpr int64_t kRowCap = 64;
  const int64_t want_tasks = 8 * static_cast<int64_t>(at::get_num_threads());
  int64_t blocks = (m + kRowCap - 1) / kRowCap;
  while (blocks * used_panels < want_tasks && (blocks + 1) * 2 * kMr <= m) ++blocks;
  const int64_t row_block = ((m + blocks - 1) / blocks + kMr - 1) / kMr * kMr;
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * used_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rb = t / used_panels, pn = t % used_panels;
      const int64_t r0 = rb * row_block, r1 = std::min(m, r0 + row_block);
      const int64_t cols = std::min(kPanel, out_features - pn * kPanel);
      const float* pb = b ? b + pn * kPanel : nullptr;
      for (int64_t r = r0; r < r1; r += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, r1 - r));
        tile(rows, a + r * lda, lda, w + pn * panel_elems, pairs, pb, out + r * ldc + pn * kPanel, ldc, cols);
      }
    }
  });
  return y;
}

// A mixture-of-experts layer's GEMMs in one call: rows [offsets[e], offsets[e + 1]) of x (the tokens routed
// to expert e, grouped by expert) times expert e's packed weight packed[e]. One parallel region walks every
// (expert, row block, panel) task, so the weights of all active experts stream past the cores without a
// thread wake-up and a cold start per expert (at decode, an expert has 1-3 rows and 0.5-1 MB of weights).
// The micro tiles are bf16_gemm's: each row's result is bit-identical to bf16_gemm on that expert alone.
torch::Tensor bf16_grouped_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor offsets, int64_t out_features,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "bf16_grouped_gemm: a 2-D bfloat16 input with unit column stride and even K");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
              packed.size(2) * 2 == x.size(1) && packed.size(3) == kPanel && packed.size(4) == 2,
              "bf16_grouped_gemm: packed is contiguous [E, panels, K/2, 64, 2] bfloat16 matching x's K");
  const int64_t experts = packed.size(0), panels = packed.size(1), pairs = packed.size(2), m = x.size(0);
  TORCH_CHECK(out_features <= panels * kPanel, "bf16_grouped_gemm: out_features past the packed panels");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == experts + 1 && offsets.scalar_type() == at::kLong &&
              offsets.is_contiguous(), "bf16_grouped_gemm: offsets is int64 [E + 1]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[experts] == m, "bf16_grouped_gemm: offsets must run from 0 to x's rows");
  for (int64_t e = 0; e < experts; ++e) TORCH_CHECK(off[e] <= off[e + 1], "bf16_grouped_gemm: offsets decrease");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 2 &&
                bias->size(0) == experts && bias->size(1) >= panels * kPanel,
                "bf16_grouped_gemm: the bias is float32 [E, panels * 64]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, out_features}, x.options());
  if (m == 0) return y;
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  const int64_t lda = x.stride(0), ldc = out_features, panel_elems = pairs * kPanel * 2;
  const int64_t used_panels = (out_features + kPanel - 1) / kPanel;
  const int64_t bias_stride = b ? bias->size(1) : 0;
  // Tasks: (expert, block of up to kRowCap rows, panel), panels fastest, as bf16_gemm's.
  constexpr int64_t kRowCap = 64;
  std::vector<int64_t> task_expert, task_row;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; r += kRowCap) {
      task_expert.push_back(e);
      task_row.push_back(r);
    }
  const int64_t blocks = static_cast<int64_t>(task_expert.size());
  at::parallel_for(0, blocks * used_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = t / used_panels, pn = t % used_panels, e = task_expert[blk];
      const int64_t r0 = task_row[blk], r1 = std::min(off[e + 1], r0 + kRowCap);
      const int64_t cols = std::min(kPanel, out_features - pn * kPanel);
      const float* pb = b ? b + e * bias_stride + pn * kPanel : nullptr;
      const uint16_t* panel = w + (e * panels + pn) * panel_elems;
      for (int64_t r = r0; r < r1; r += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, r1 - r));
        tile(rows, a + r * lda, lda, panel, pairs, pb, out + r * ldc + pn * kPanel, ldc, cols);
      }
    }
  });
  return y;
}

// The chip's bfloat16 dot-product peak, GFLOP/s over every thread: 24 independent vdpbf16ps chains per
// thread for about `seconds`. `bench gemm` divides the GEMM's rate by it (a GEMM at 85% of it has little
// left to gain on a CPU without AMX; only fewer multiplications would be faster).
double bf16_dot_peak_gflops(double seconds) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> rate(threads, 0.0);
  std::vector<float> sink(threads, 0.f);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m512 acc[24];
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
      __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
      int64_t rounds = 0;
      const auto start = std::chrono::steady_clock::now();
      double elapsed = 0;
      do {
        for (int r = 0; r < 100000; ++r) {
#pragma GCC unroll 24
          for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
          asm volatile("" : "+v"(a));  // a fresh operand each round: the loop is not folded away
        }
        rounds += 100000;
        elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      } while (elapsed < seconds);
      float total = 0.f;
      for (int i = 0; i < 24; ++i) total += _mm512_reduce_add_ps(acc[i]);
      sink[t] = total;
      rate[t] = rounds * 24.0 * 64.0 / elapsed;  // 16 lanes x 2 products x 2 FLOP per instruction
    }
  });
  volatile float keep = 0.f;
  for (const float v : sink) keep = keep + v;
  double sum = 0;
  for (const double r : rate) sum += r;
  return sum / 1e9;
}

#else  // built for a CPU without AVX512-BF16: the engine keeps oneDNN
bool bf16_gemm_supported() { return false; }
double bf16_dot_peak_gflops(double) { return 0.0; }

torch::Tensor bf16_gemm(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "bf16_gemm: this build has no AVX512-BF16");
}

torch::Tensor bf16_grouped_gemm(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "bf16_grouped_gemm: this build has no AVX512-BF16");
}
#endif
