// RMSNorm over the last dimension, as Llama computes it: y = w * (x * rsqrt(mean(x^2) + eps)).
//
// x: (T, H) contiguous; w: (H,). One pass to sum squares, one to scale. Rows run in parallel when
// there are many (a prefill); a decode step's few rows run on the calling thread, where an
// OpenMP fork would cost more than the work. torch's composite rms_norm runs ~8 ops per call,
// ~30-70 us each time at decode sizes; this is one call of a few microseconds.
//
// float32: plain loops the compiler vectorizes (-O3 -march=native, reassociation allowed).
// bfloat16 (x and w both): the reference's steps and roundings one by one (kernels/norm.py,
// `w * (xf * rsqrt(var + eps)).to(bfloat16)`): the mean of squares in float32, summed in the
// order torch sums it (`sum_squares`), x * r rounded to bfloat16, then the bfloat16 product with
// w rounded again; so the result is torch's bit for bit (NaN payloads aside). At SmolLM2-135M's
// H = 576, reference -> this, us a call through kernels/norm.py (2-core Xeon, 2026-11-25): 17.0
// -> 2.2 at T = 1, 17.2 -> 2.8 at 8, 37.7 -> 7.3 at 64, 160.4 -> 44.2 at 512 (float32's: 1.4,
// 2.1, 5.2, 27.6).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_round.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

static void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

// ---- bfloat16 ----

// The build allows reassociation (-fassociative-math), which would let the compiler regroup the
// sums below; an empty asm that may change `v` pins each add where it is written.
#if defined(__x86_64__) || defined(__i386__)
#define PIN(v) asm("" : "+x"(v))
#else
#define PIN(v) asm("" : "+m"(v))
#endif

static inline float add_pinned(float a, float b) {
  float s = a + b;
  PIN(s);
  return s;
}

// Eight float32 lanes: the width torch's float32 sum runs at on x86, on an AVX-512 host too
// (torch 2.13 on the 2-core Xeon, 2026-11-25: its xf.pow(2).sum(-1) equals this order's in every
// row tried, H from 1 to 16384; a 16-lane order's in ~45% of the rows at H = 576).
#ifdef __AVX2__
using Lanes = __m256;
static inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
static inline Lanes lanes_add(Lanes a, Lanes b) {
  Lanes s = _mm256_add_ps(a, b);
  PIN(s);
  return s;
}
static inline Lanes lanes_squares(const uint16_t* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  return _mm256_mul_ps(v, v);  // exact: 8 significant bits squared fit in float32's 24
}
static inline void lanes_store(float* out, Lanes a) { _mm256_storeu_ps(out, a); }
#else
struct Lanes {
  float v[8];
};
static inline Lanes lanes_zero() { return Lanes{}; }
static inline Lanes lanes_add(Lanes a, Lanes b) {
  for (int l = 0; l < 8; ++l) a.v[l] = add_pinned(a.v[l], b.v[l]);
  return a;
}
static inline Lanes lanes_squares(const uint16_t* x) {
  Lanes s;
  for (int l = 0; l < 8; ++l) s.v[l] = bf16_to_float(x[l]) * bf16_to_float(x[l]);
  return s;
}
static inline void lanes_store(float* out, Lanes a) { std::memcpy(out, a.v, sizeof a.v); }
#endif

static inline int64_t ceil_log2(int64_t x) {  // as torch's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// torch's `row_sum` (aten/src/ATen/native/cpu/SumKernel.cpp): the row seen as (size / 4, 4),
// four partial sums abreast, each a cascade of levels of 2^power elements (`multi_row_sum`: a
// level's total moves up when it is full, so only sums of like size meet), the leftover
// elements into the first partial sum, then the four added in order. `load(i)` is element i.
template <typename Acc, typename Load, typename Add>
static inline Acc cascade_row_sum(int64_t size, Acc zero, Load load, Add add) {
  constexpr int64_t kLevels = 4, kRows = 4;
  const int64_t n = size / kRows;
  const int64_t power = std::max<int64_t>(4, ceil_log2(n) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  Acc acc[kLevels][kRows];
  for (auto& level : acc) std::fill_n(level, kRows, zero);
  int64_t i = 0;
  while (i + step <= n) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < kRows; ++k) acc[0][k] = add(acc[0][k], load(i * kRows + k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kRows; ++k) {
        acc[j][k] = add(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero;
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < n; ++i)
    for (int64_t k = 0; k < kRows; ++k) acc[0][k] = add(acc[0][k], load(i * kRows + k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kRows; ++k) acc[0][k] = add(acc[0][k], acc[j][k]);
  for (int64_t e = n * kRows; e < size; ++e) acc[0][0] = add(acc[0][0], load(e));
  for (int64_t k = 1; k < kRows; ++k) acc[0][0] = add(acc[0][0], acc[0][k]);
  return acc[0][0];
}

// sum(x^2) over a bfloat16 row, in float32, in the order torch's `xf.pow(2).sum(-1)` adds:
// rows of 8 or more as vectors of 8 (`vectorized_inner_sum`: cascade over the vectors, then the
// scalar tail summed from 0, then the 8 lanes added to it in order); shorter ones as scalars
// (`scalar_inner_sum`). A torch whose sum runs at another width sums in another order: var may
// then differ in its last bit, moving a bfloat16 rounding at a rare near-tie.
static float sum_squares(const uint16_t* x, int64_t H) {
  auto square = [&](int64_t i) { return bf16_to_float(x[i]) * bf16_to_float(x[i]); };
  if (H < 8) return cascade_row_sum<float>(H, 0.f, square, add_pinned);
  const int64_t nv = H / 8;
  const Lanes v = cascade_row_sum<Lanes>(
      nv, lanes_zero(), [&](int64_t i) { return lanes_squares(x + 8 * i); }, lanes_add);
  float acc = 0.f;
  for (int64_t i = nv * 8; i < H; ++i) acc = add_pinned(acc, square(i));
  alignas(32) float lanes[8];
  lanes_store(lanes, v);
  for (float l : lanes) acc = add_pinned(acc, l);
  return acc;
}

static void norm_row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t H, float eps) {
  // torch: mean = sum / H, then rsqrt as 1 / sqrt, each rounded once in float32
  const float r = 1.f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= H; i += 16) {
    const __m512 n = round16_bf16(_mm512_mul_ps(load16_bf16(x + i), rv));
    store16_bf16(y + i, _mm512_mul_ps(load16_bf16(w + i), n));
  }
#endif
  for (; i < H; ++i)
    y[i] = float_to_bf16(bf16_to_float(w[i]) * round_bf16(bf16_to_float(x[i]) * r));
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  // OpenMP's thread count is kept per calling thread: on one where torch has run no parallel op
  // yet (the engine's step loop is a fresh thread), a region would fork libgomp's default
  // (OMP_NUM_THREADS, or every core), not torch.set_num_threads' count; set it as torch's own
  // ops do on their first call in a thread.
  at::internal::lazy_init_num_threads();
  const bool bf16 = x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || (x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat),
              "rms_norm: x and w both float32 or both bfloat16 expected, got ", x.scalar_type(),
              " and ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: x (..., H) and w (H,) expected, got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rms_norm: contiguous tensors expected");
  auto y = torch::empty_like(x);
  const int64_t H = w.size(0);
  const int64_t T = H ? x.numel() / H : 0;
  const float e = static_cast<float>(eps);
  // Every row through `row` (element pointers of x, w, y): in parallel for a prefill's many
  // rows, on the calling thread for a decode step's few.
  auto run_rows = [&](const auto* xp, const auto* wp, auto* yp, auto row) {
    if (T >= 64) {
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < T; ++t) row(xp + t * H, wp, yp + t * H, H, e);
    } else {
      for (int64_t t = 0; t < T; ++t) row(xp + t * H, wp, yp + t * H, H, e);
    }
  };
  if (bf16)
    run_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), norm_row_bf16);
  else
    run_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), norm_row);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, float32 or bfloat16", py::arg("x"),
        py::arg("w"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
}
