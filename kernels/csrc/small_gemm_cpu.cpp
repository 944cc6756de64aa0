// y = x @ w^T (+ bias) for a few rows of x: the decode-time matmul, bound by reading w.
//
// x: (M, K) float32; w: (N, K) row-major as nn.Linear stores it, float32 (M <= 48: a decode
// batch) or bfloat16 (any M); bias: (N,) float32 or none. Each weight row is read from memory
// once for all M rows of x; rows are split over OpenMP threads in contiguous groups, and several
// rows are in flight per thread so the FMA latency of one dot product does not stall the stream.
// Up to 8 rows, x lives in registers (`rows_avx2`; 2-8 rows `rows_avx512` where the CPU has
// AVX-512); from 9 rows, 8-row chunks of x run against 2 weight rows held in L1
// (`tiled_avx512`; `tile_avx2` 4-row chunks against 3 rows without AVX-512). Above 48 float32
// rows torch's blocked GEMM is as fast. AVX2 + FMA where the compiler targets them
// (-march=native), plain loops otherwise (same sums, slower).
//
// bfloat16 weights (`uint16_t` here: the bits) are widened to float32 in registers as they
// stream in: exact, since a bfloat16 is the top half of a float32, so the products and sums are
// float32's as with float32 weights, on half the bytes read. That halves a decode step's weight
// traffic, the whole cost of a few-row matmul; for more rows (prefill) the widening is paid once
// per weight row and 8-row chunk against 8 FMAs per weight vector.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

static inline float widen(float v) { return v; }
static inline float widen(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Weight rows [n0, N) that do not fill a whole group, against all M rows of x: plain loops.
template <typename W>
[[maybe_unused]] static void tail_rows(const float* x, const W* w, const float* bias, float* y,
                                       int64_t M, int64_t K, int64_t N, int64_t n0) {
  for (int64_t n = n0; n < N; ++n) {
    const W* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += widen(wr[k]) * x[m * K + k];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
  }
}

#ifdef __AVX2__
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// 8 weights as float32 lanes.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// R weight rows against M input rows: R * M accumulators of 8 lanes.
template <int M, int R, typename W>
static void rows_avx2(const float* x, const W* w, const float* bias, float* y, int64_t K,
                      int64_t N, int64_t n0) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const W* wr = w + (n0 + r) * K;
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) s += widen(wr[k]) * x[m * K + k];
      if (bias) s += bias[n0 + r];
      y[m * N + n0 + r] = s;
    }
  }
}
// R weight rows against M (<= 4) input rows: R * M accumulators of 8 lanes. x is read from L1
// on the fly (it is small and reused), so registers hold only accumulators and one weight load.
template <int M, int R, typename W>
static void tile_avx2(const float* x, const W* w, const float* bias, float* y, int64_t K,
                      int64_t N, int64_t n0) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const W* wr = w + (n0 + r) * K;
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) s += widen(wr[k]) * x[m * K + k];
      if (bias) s += bias[n0 + r];
      y[m * N + n0 + r] = s;
    }
  }
}

#ifdef __AVX512F__
// 16 weights as float32 lanes.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 2-8 input rows with AVX-512 (32 registers): R weight rows against M input rows, R * M
// accumulators of 16 lanes, x in registers, and the next R weight rows prefetched as these are
// read (a prefetch past the end of w is harmless: it never faults). Without the prefetch, 5 rows
// took 27 ms over SmolLM2's shapes against 17 ms for one; with it, 17 ms (measured 2026-11-22,
// 2-core Xeon): a few rows cost what one does, the weights streaming once at memory speed.
template <int M, int R, typename W>
static void rows_avx512(const float* x, const W* w, const float* bias, float* y, int64_t K,
                        int64_t N, int64_t n0) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + r + R) * K + k), _MM_HINT_T0);
      const __m512 wv = load16(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const W* wr = w + (n0 + r) * K;
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[r][m]);
      for (int64_t k = K16; k < K; ++k) s += widen(wr[k]) * x[m * K + k];
      if (bias) s += bias[n0 + r];
      y[m * N + n0 + r] = s;
    }
  }
}

// 9 or more rows with AVX-512: each thread takes pairs of weight rows and runs every 8-row chunk
// of x against them: the first chunk streams the pair from memory (prefetching the next), the
// others find it in L1. Over SmolLM2's shapes 16 rows took 45 ms and 48 rows 86 ms with the AVX2
// tiles.
template <int R, typename W>
static void tiled_avx512(const float* x, const W* w, const float* bias, float* y, int64_t M,
                         int64_t K, int64_t N) {
  const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n0 = g * R;
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) rows_avx512<8, R>(x + m0 * K, w, bias, y + m0 * N, K, N, n0);
    const float* xr = x + m0 * K;
    float* yr = y + m0 * N;
    switch (M - m0) {
      case 7: rows_avx512<7, R>(xr, w, bias, yr, K, N, n0); break;
      case 6: rows_avx512<6, R>(xr, w, bias, yr, K, N, n0); break;
      case 5: rows_avx512<5, R>(xr, w, bias, yr, K, N, n0); break;
      case 4: rows_avx512<4, R>(xr, w, bias, yr, K, N, n0); break;
      case 3: rows_avx512<3, R>(xr, w, bias, yr, K, N, n0); break;
      case 2: rows_avx512<2, R>(xr, w, bias, yr, K, N, n0); break;
      case 1: rows_avx512<1, R>(xr, w, bias, yr, K, N, n0); break;
      default: break;
    }
  }
  tail_rows(x, w, bias, y, M, K, N, groups * R);
}
#endif

// 9 or more rows without AVX-512: each thread takes groups of 3 weight rows and runs every 4-row
// chunk of x against them while they sit in L1 (x is re-read from L1 on the fly), so the weights
// still stream from memory once and the FMAs stay busy.
template <typename W>
[[maybe_unused]] static void run_tiled(const float* x, const W* w, const float* bias, float* y,
                                       int64_t M, int64_t K, int64_t N) {
  constexpr int R = 3;
  const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n0 = g * R;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) tile_avx2<4, R>(x + m0 * K, w, bias, y + m0 * N, K, N, n0);
    switch (M - m0) {
      case 3: tile_avx2<3, R>(x + m0 * K, w, bias, y + m0 * N, K, N, n0); break;
      case 2: tile_avx2<2, R>(x + m0 * K, w, bias, y + m0 * N, K, N, n0); break;
      case 1: tile_avx2<1, R>(x + m0 * K, w, bias, y + m0 * N, K, N, n0); break;
      default: break;
    }
  }
  tail_rows(x, w, bias, y, M, K, N, groups * R);
}
#endif

template <int M, typename W>
static void rows_scalar(const float* x, const W* w, const float* bias, float* y, int64_t K,
                        int64_t N, int64_t n0) {
  const W* wr = w + n0 * K;
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += widen(wr[k]) * x[m * K + k];
    y[m * N + n0] = s + (bias ? bias[n0] : 0.f);
  }
}

template <int M, typename W>
static void run(const float* x, const W* w, const float* bias, float* y, int64_t K, int64_t N) {
#ifdef __AVX512F__
  // One float32 row: the AVX2 loop already streams at memory speed. bfloat16 rows: widening 16
  // at a time keeps up with half the bytes.
  if constexpr (M >= 2 || sizeof(W) == 2) {
    constexpr int R = M <= 4 ? 4 : (M <= 7 ? 3 : 2);  // R * M + M + 1 <= 32 registers
    const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) rows_avx512<M, R>(x, w, bias, y, K, N, g * R);
    for (int64_t n = groups * R; n < N; ++n) rows_scalar<M>(x, w, bias, y, K, N, n);
    return;
  }
#endif
#ifdef __AVX2__
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
#else
  constexpr int R = 1;
#endif
  const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
#ifdef __AVX2__
    rows_avx2<M, R>(x, w, bias, y, K, N, g * R);
#else
    rows_scalar<M>(x, w, bias, y, K, N, g * R);
#endif
  }
  for (int64_t n = groups * R; n < N; ++n) rows_scalar<M>(x, w, bias, y, K, N, n);
}

template <typename W>
static void dispatch(const float* xp, const W* wp, const float* bp, float* yp, int64_t M,
                     int64_t K, int64_t N) {
  switch (M) {
    case 1: run<1>(xp, wp, bp, yp, K, N); break;
    case 2: run<2>(xp, wp, bp, yp, K, N); break;
    case 3: run<3>(xp, wp, bp, yp, K, N); break;
    case 4: run<4>(xp, wp, bp, yp, K, N); break;
    case 5: run<5>(xp, wp, bp, yp, K, N); break;
    case 6: run<6>(xp, wp, bp, yp, K, N); break;
    case 7: run<7>(xp, wp, bp, yp, K, N); break;
    case 8: run<8>(xp, wp, bp, yp, K, N); break;
    default:
#if defined(__AVX512F__)
      tiled_avx512<2>(xp, wp, bp, yp, M, K, N);
#elif defined(__AVX2__)
      run_tiled(xp, wp, bp, yp, M, K, N);
#else
      for (int64_t m = 0; m < M; ++m) tail_rows(xp + m * K, wp, bp, yp + m * N, 1, K, N, 0);
#endif
      break;
  }
}

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_linear: x (M, K) and w (N, K) expected");
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && (bf16 || w.scalar_type() == torch::kFloat),
              "small_linear: x float32 and w float32 or bfloat16 only, got ", x.scalar_type(),
              " and ", w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "small_linear: K differs: x ", x.sizes(), " w ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1 && (bf16 || x.size(0) <= 48),
              "small_linear: 1 <= M <= 48 with float32 weights, got ", x.size(0));
  TORCH_CHECK(w.is_contiguous(), "small_linear: w must be contiguous");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) &&
                    bias->scalar_type() == torch::kFloat && bias->is_contiguous(),
                "small_linear: bias (N,) float32 expected");
    bp = bias->data_ptr<float>();
  }
  auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (bf16)
    dispatch(xp, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), bp, yp, M, K, N);
  else
    dispatch(xp, w.data_ptr<float>(), bp, yp, M, K, N);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear,
        "x @ w.T (+ bias): x float32; w float32 (1-48 rows of x) or bfloat16 (any rows)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
}
