// y = x @ w^T (+ bias) on the CPU: the decode-time matmul (a few rows of x, bound by reading w)
// and, with bfloat16 weights or up to kMaxRowsF32 float32 rows, prefill's.
//
// x: (M, K) float32; w: (N, K) row-major as nn.Linear stores it, float32 (M <= kMaxRowsF32) or
// bfloat16 (any M); bias: (N,) float32 or none. Rows of w are split over OpenMP threads in
// contiguous groups.
//
// Up to 8 rows of x each weight row is read from memory once for all of them, several rows in
// flight per thread so the FMA latency of one dot product does not stall the stream: x lives in
// registers (`rows_avx2`; 2-8 rows `rows_avx512` where the CPU has AVX-512). 9-15 rows: 8-row
// chunks of x against 2 weight rows held in L1 (`tiled_avx512`). From 16 rows (`gemm_avx512`): a
// blocked GEMM, each thread widening/transposing 32 weight rows at a time into a K x 32 float32
// panel and running up to 12 rows of x against it with broadcasts (no horizontal sums).
// Without AVX-512: `tile_avx2`, 4-row chunks of x against 3 weight rows; without AVX2, plain
// loops (same sums, slower). AVX2 + FMA where the compiler targets them (-march=native).
//
// bfloat16 weights (`uint16_t` here: the bits) are widened to float32 in registers: exact, since
// a bfloat16 is the top half of a float32, so the products and sums are float32's as with
// float32 weights (x is never rounded to bfloat16), on half the bytes read. That halves a decode
// step's weight traffic, the whole cost of a few-row matmul; in the GEMM the widening is paid
// once per weight and call, in the panel.
//
// Over SmolLM2-135M's weight shapes (30 x [(960,576),(576,576),(3072,576),(576,1536)]), ms per
// pass, 2 threads, 2-core AVX-512 Xeon, measured 2026-11-23 (see the commit for the full table):
// M = 16: torch F.linear fp32 38, this fp32 29, bf16 21; M = 128: 112 / 100 / 100; M = 512:
// 483 / 496 / 525 (the machine was shared: +-10%).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <vector>
#include <cstdlib>
#include <utility>
#include <cstdint>
#include <cstring>

#include <omp.h>

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

// 9-15 rows with AVX-512: each thread takes pairs of weight rows and runs every 8-row chunk of x
// against them: the first chunk streams the pair from memory (prefetching the next), the others
// find it in L1. At 9-12 rows this beats the GEMM below, whose panel packing then costs more than
// it saves (M = 9: 22 against 30 ms per pass over SmolLM2's float32 weights); about even at 16.
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

// ---- 16 or more rows with AVX-512: a blocked GEMM with broadcasts (no horizontal sums). ----
//
// Each thread takes panels of NR = 32 weight rows (output features, contiguous in memory),
// widens and transposes each once into a thread-local K x 32 float32 panel (72 KB at K = 576:
// L2), then runs micro-tiles of up to MR_MAX rows of x against it: 2 accumulators of 16 output
// features per row, x[m, k] broadcast from memory, y rows stored directly (masked at a partial
// panel). While a panel is being multiplied, the next one's weights are prefetched into L2, so
// the stream from memory overlaps the FMAs.
constexpr int NR = 32;
constexpr int MR_MAX = 12;  // 2 * MR_MAX accumulators + 2 panel vectors <= 32 registers

// Per-thread scratch for one panel (OpenMP's threads persist, so this is allocated once).
struct PanelBuf {
  float* p = nullptr;
  size_t cap = 0;
  float* get(size_t n) {
    if (n > cap) {
      std::free(p);
      p = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) & ~size_t(63)));
      TORCH_CHECK(p != nullptr, "small_linear: out of memory for a ", n, "-float panel");
      cap = n;
    }
    return p;
  }
  ~PanelBuf() { std::free(p); }
};
static thread_local PanelBuf tl_panel;

// Transposes 16 vectors (r[i] = row i, 16 lanes) so that r[c] holds lane c of every row.
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4q + j], 128-bit block b: lane 4b + j of rows 4q .. 4q + 3
  __m512 u[16];
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 e = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);   // blocks 0, 2 of rows 0-7
    const __m512 f = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);   // blocks 1, 3
    const __m512 g = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 h = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_f32x4(e, g, 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(e, g, 0xdd);
    r[4 + j] = _mm512_shuffle_f32x4(f, h, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(f, h, 0xdd);
  }
}

// Columns [k0, K) of 16 weight rows into the panel, one at a time (the ragged end of K).
template <typename W>
static inline void pack_cols_scalar(const W* w, int64_t K, int64_t k0, float* panel) {
  for (int j = 0; j < 16; ++j)
    for (int64_t k = k0; k < K; ++k) panel[k * NR + j] = widen(w[j * K + k]);
}

// 16 full weight rows (w points at the first) into panel columns [0, 16): panel[k * NR + j].
static void pack16(const float* w, int64_t K, float* panel) {
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k0 = 0; k0 < K16; k0 += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(w + i * K + k0);
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_store_ps(panel + (k0 + c) * NR, r[c]);
  }
  pack_cols_scalar(w, K, K16, panel);
}
// bfloat16: 32 at a time, widened without a shuffle: shifting each 32-bit pair left by 16 gives
// the even-indexed ones as float32, masking off the low half the odd-indexed ones; each set is
// transposed on its own and lands on its own panel rows.
static void pack16(const uint16_t* w, int64_t K, float* panel) {
  const int64_t K32 = K & ~int64_t(31);
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t k0 = 0; k0 < K32; k0 += 32) {
    __m512 ev[16], od[16];
    for (int i = 0; i < 16; ++i) {
      const __m512i v = _mm512_loadu_si512(w + i * K + k0);
      ev[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      od[i] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    }
    transpose16(ev);
    for (int c = 0; c < 16; ++c) _mm512_store_ps(panel + (k0 + 2 * c) * NR, ev[c]);
    transpose16(od);
    for (int c = 0; c < 16; ++c) _mm512_store_ps(panel + (k0 + 2 * c + 1) * NR, od[c]);
  }
  int64_t k0 = K32;
  if (K - k0 >= 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = load16(w + i * K + k0);
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_store_ps(panel + (k0 + c) * NR, r[c]);
    k0 += 16;
  }
  pack_cols_scalar(w, K, k0, panel);
}

// Weight rows [n0, n0 + nc) (nc <= NR) as the K x NR panel, zeros past nc.
template <typename W>
static void pack_panel(const W* w, int64_t K, int64_t n0, int nc, float* panel) {
  if (nc == NR) {
    pack16(w + n0 * K, K, panel);
    pack16(w + (n0 + 16) * K, K, panel + 16);
    return;
  }
  for (int j = 0; j < NR; ++j) {
    const W* wr = w + (n0 + j) * K;
    for (int64_t k = 0; k < K; ++k) panel[k * NR + j] = j < nc ? widen(wr[k]) : 0.f;
  }
}

// Rows [m0, m0 + mr) of x, k-major (xp[k * mr + m]), so that a micro-tile's broadcasts walk
// one pointer: tile t's rows land at xp + m0 * K.
static_assert(MR_MAX <= 16, "pack_x transposes up to 16 rows of x");
static void pack_x(const float* x, int64_t K, int64_t m0, int64_t mr, float* xp) {
  const int64_t K16 = K & ~int64_t(15);
  const __mmask16 keep = __mmask16((1u << mr) - 1);
  for (int64_t k0 = 0; k0 < K16; k0 += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < mr ? _mm512_loadu_ps(x + (m0 + i) * K + k0) : _mm512_setzero_ps();
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_mask_storeu_ps(xp + (k0 + c) * mr, keep, r[c]);
  }
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t k = K16; k < K; ++k) xp[k * mr + m] = x[(m0 + m) * K + k];
}

// MR rows of packed x (xp: K x MR) against the K x NR panel: y[m, 0:nc] (row stride N) =
// x[m] . panel (+ bias). Prefetches npf cache lines from pf (the next panel's weights) into L2
// every 8 steps of k.
template <int MR>
static void micro_tile(const float* xp, const float* panel, int64_t K, float* y, int64_t N,
                       const float* bias, int nc, const char* pf, int npf) {
  __m512 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int i = 0; i < npf; ++i) _mm_prefetch(pf + int64_t(i) * 64, _MM_HINT_T1);
    pf += int64_t(npf) * 64;
    for (int kk = 0; kk < 8; ++kk) {
      const __m512 b0 = _mm512_load_ps(panel + (k + kk) * NR);
      const __m512 b1 = _mm512_load_ps(panel + (k + kk) * NR + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 a = _mm512_set1_ps(xp[(k + kk) * MR + m]);
        c0[m] = _mm512_fmadd_ps(a, b0, c0[m]);
        c1[m] = _mm512_fmadd_ps(a, b1, c1[m]);
      }
    }
  }
  for (; k < K; ++k) {
    const __m512 b0 = _mm512_load_ps(panel + k * NR);
    const __m512 b1 = _mm512_load_ps(panel + k * NR + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(xp[k * MR + m]);
      c0[m] = _mm512_fmadd_ps(a, b0, c0[m]);
      c1[m] = _mm512_fmadd_ps(a, b1, c1[m]);
    }
  }
  const __mmask16 k0 = nc >= 16 ? __mmask16(0xffff) : __mmask16((1u << nc) - 1);
  const __mmask16 k1 = nc >= 32 ? __mmask16(0xffff)
                                : (nc > 16 ? __mmask16((1u << (nc - 16)) - 1) : __mmask16(0));
  if (bias) {
    const __m512 b0 = _mm512_maskz_loadu_ps(k0, bias), b1 = _mm512_maskz_loadu_ps(k1, bias + 16);
    for (int m = 0; m < MR; ++m) {
      c0[m] = _mm512_add_ps(c0[m], b0);
      c1[m] = _mm512_add_ps(c1[m], b1);
    }
  }
  if (nc == NR) {
    for (int m = 0; m < MR; ++m) {
      _mm512_storeu_ps(y + m * N, c0[m]);
      _mm512_storeu_ps(y + m * N + 16, c1[m]);
    }
  } else {
    for (int m = 0; m < MR; ++m) {
      _mm512_mask_storeu_ps(y + m * N, k0, c0[m]);
      _mm512_mask_storeu_ps(y + m * N + 16, k1, c1[m]);
    }
  }
}

using MicroFn = void (*)(const float*, const float*, int64_t, float*, int64_t, const float*, int,
                         const char*, int);
template <int... I>
static constexpr auto micro_table(std::integer_sequence<int, I...>) {
  return std::array<MicroFn, sizeof...(I)>{&micro_tile<I + 1>...};
}
static constexpr auto kMicro = micro_table(std::make_integer_sequence<int, MR_MAX>{});

static thread_local PanelBuf tl_xpack;

// Where the GEMM's weights come from: `pack(n0, nc, panel)` writes rows [n0, n0 + nc) as the
// K x NR float32 panel; `row(n)` / `row_bytes()` locate a row's bytes for the prefetch. Dense
// float32 or bfloat16 rows here; the packed block formats further down.
template <typename W>
struct Dense {
  const W* w;
  int64_t K;
  void pack(int64_t n0, int nc, float* panel) const { pack_panel(w, K, n0, nc, panel); }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * K); }
  int64_t row_bytes() const { return K * int64_t(sizeof(W)); }
};

template <typename Src>
static void gemm_avx512(const float* x, const Src& src, const float* bias, float* y, int64_t M,
                        int64_t K, int64_t N) {
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t tiles = (M + MR_MAX - 1) / MR_MAX;  // rows split evenly: 16 = 8 + 8, 17 = 8 + 9
  // The next panel's weights, in cache lines, prefetched over this panel's tiles: npf lines
  // every 8 steps of k.
  const int64_t lines = (int64_t(NR) * src.row_bytes() + 63) / 64;
  const int64_t chunks = tiles * std::max<int64_t>(K / 8, 1);
  const int npf = int((lines + chunks - 1) / chunks);
#pragma omp parallel
  {
    // Each thread packs its own copy of x (M * K copies against M * K * N / threads FMAs), so
    // no barrier stands between packing and use.
    float* xp = nullptr;
    float* panel = tl_panel.get(size_t(K) * NR);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      if (xp == nullptr) {
        xp = tl_xpack.get(size_t(M) * K);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
          pack_x(x, K, m0, m1 - m0, xp + m0 * K);
        }
      }
      const int64_t n0 = p * NR;
      const int nc = int(std::min<int64_t>(NR, N - n0));
      src.pack(n0, nc, panel);
      // prefetch past the end of w is harmless (a prefetch never faults), but pointless
      const bool next = N - n0 >= 2 * NR;
      const char* pf = src.row(n0 + NR);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
        kMicro[m1 - m0 - 1](xp + m0 * K, panel, K, y + m0 * N + n0, N,
                            bias ? bias + n0 : nullptr, nc, pf, next ? npf : 0);
        pf += int64_t(npf) * 64 * (K / 8);
      }
    }
  }
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

#if defined(__AVX512F__)
constexpr int64_t kGemmRows = 16;  // from here gemm_avx512, below tiled_avx512
#endif

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
      if (M < kGemmRows)
        tiled_avx512<2>(xp, wp, bp, yp, M, K, N);
      else
        gemm_avx512(xp, Dense<W>{wp, K}, bp, yp, M, K, N);
#elif defined(__AVX2__)
      run_tiled(xp, wp, bp, yp, M, K, N);
#else
      for (int64_t m = 0; m < M; ++m) tail_rows(xp + m * K, wp, bp, yp + m * N, 1, K, N, 0);
#endif
      break;
  }
}

// ---- Packed weights: float32 weights that are exactly block-quantized values. ----
//
// A model imported from a GGUF file (llama.cpp's Q4_1 and Q8_0 formats, dequantized to float32
// by runtime.gguf_import) holds float32 weights each of which, in its block of 32 along a row,
// is d * q + m (Q4_1: q in 0..15, d and m float16; Q4_0 too, with m = -8 d; Q4_K's sub-blocks
// too, with d and m float32 products of a float16 and a 6-bit scale: see find_kquant; Q5_1, Q5_0 and Q5_K
// alike with q in 0..31) or d * q
// (Q8_0: q in -128..127, d float16; Q6_K's sub-blocks of 16 too, with a d of their own: see
// find_q8_16).
// `pack_blocks` finds d, m and q again from the float32 values and checks that every weight comes
// back (bit for bit, but for the sign of a zero: see fits_affine); the packed form (5 or 8.5 bits
// a weight, + 32 or 16 bits of float32 scales a block) is then read instead of 32 bits, and
// widened in registers to the very same float32 values: d * q is exact in float32 (11 x 8
// significant bits), so one rounding (the + m, an FMA) gives what the importer's numpy gave.
// Products and sums stay float32's, as with dense weights; a decode step reads a fifth of the
// bytes.
//
// Layout (N rows, K / 32 blocks a row). Q4_1: qs uint8 (N, K / 2), 16 bytes a block, byte j
// holding q[j] in its low nibble and q[j + 16] in its high one; scales float32 (N, K / 32, 2),
// (d, m) a block. Q8_0: qs int8 (N, K); scales float32 (N, K / 32), d a block. Q6_K: qs int8
// (N, K); scales float32 (N, K / 16), a d for each 16 values. Q5: qs uint8 (N, K), a q a byte;
// scales float32 (N, K / 32, 2), (d, m) a block. The dtype of qs and the number of scales name
// the format.
constexpr int64_t kBlock = 32;

static inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Nearby float16 scales to try for a block: the float16 nearest the float32 estimate, then its
// neighbours (positive float16s order as their bit patterns).
template <typename Fn>
static bool try_scales(float estimate, Fn&& fits) {
  const int base = c10::Half(estimate).x;
  for (int t : {0, -1, 1, -2, 2}) {
    const int b = base + t;
    if (b <= 0 || b >= 0x7c00) continue;  // zero, negative, inf or NaN
    const float d = float(c10::Half(uint16_t(b), c10::Half::from_bits()));
    if (fits(d)) return true;
  }
  return false;
}

// Whether every x[i] of a block is fma(d, q, m) for an integer q in [lo, hi] (the very operation
// the kernels widen a weight with); the q into q_out. Equal as numbers: bit for bit, but for the
// sign of a zero (Q4_0 gives d * (8 - 8) = -0 for a negative d; here 8 d - 8 d = +0), which no
// product or sum with a nonzero term can tell.
static bool fits_affine(const float* x, float d, float m, float lo, float hi, int32_t* q_out,
                        int n = kBlock) {  // n: a multiple of 16
#ifdef __AVX512F__
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  const __m512 lov = _mm512_set1_ps(lo), hiv = _mm512_set1_ps(hi);
  for (int h = 0; h < n; h += 16) {
    const __m512 v = _mm512_loadu_ps(x + h);
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(v, mv), dv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 back = _mm512_fmadd_ps(dv, q, mv);
    const __mmask16 ok = _mm512_cmp_ps_mask(back, v, _CMP_EQ_OQ) &
                         _mm512_cmp_ps_mask(q, lov, _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(q, hiv, _CMP_LE_OQ);
    if (ok != 0xffff) return false;
    _mm512_storeu_si512(q_out + h, _mm512_cvtps_epi32(q));
  }
  return true;
#else
  for (int i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i] - m) / d);
    if (!(q >= lo && q <= hi) || std::fma(d, q, m) != x[i]) return false;
    q_out[i] = int32_t(q);
  }
  return true;
#endif
}

// v rounded to `bits` significant bits (nearest, in double: exact for a float32 v).
static inline double round_to_bits(double v, int bits) {
  int e;
  std::frexp(v, &e);
  const double unit = std::ldexp(1.0, e - bits);
  return std::nearbyint(v / unit) * unit;
}

// A sub-block of 32 of llama.cpp's Q4_K (QMAX 15) or Q5_K (QMAX 31) (super-blocks of 256:
// x = (d * sc) * q - dmin * m, q in 0..QMAX, d and dmin float16 and sc and m 6-bit integers of each sub-block, evaluated in float32
// by the importer's numpy), in the Q4_1 layout: s = d * sc and o = dmin * m are exact float32
// products of at most 17 significant bits, s * q is exact, so fma(s, q, -o) rounds once as the
// importer did. s and o are found again from the block's range: s near (max - min) / k for the
// block's spread of q, k <= QMAX (the widest first), rounded to 17 bits; -o is min itself when the
// smallest q is 0, else min - s * q0 rounded to 17 bits. The neighbours on that lattice are
// tried too; fits_affine has the last word. A block that is not such fails after at most
// QMAX x 3 x (QMAX + 1) x 3 checks (the search over a tensor ends at its first block that does
// not fit).
template <int QMAX>
static bool find_kquant(const float* x, float mn, float mx, int32_t* q, float* d_out,
                        float* m_out) {
  const double range = double(mx) - double(mn);
  if (!(range > 0.0)) return false;
  for (int k = QMAX; k >= 1; --k) {
    const double s0 = round_to_bits(range / k, 17);
    int e;
    std::frexp(s0, &e);
    const double sunit = std::ldexp(1.0, e - 17);
    for (int ds : {0, -1, 1}) {
      const float s = float(s0 + ds * sunit);
      if (!(s > 0.f) || !std::isfinite(s)) continue;
      for (int q0 = 0; q0 + k <= QMAX; ++q0) {
        const double neg_o = double(mn) - double(s) * q0;
        if (q0 == 0) {  // the block's minimum is -o itself
          if (fits_affine(x, s, mn, 0.f, float(QMAX), q)) {
            *d_out = s;
            *m_out = mn;
            return true;
          }
          continue;
        }
        if (neg_o == 0.0) continue;
        const double o0 = round_to_bits(neg_o, 17);
        std::frexp(o0, &e);
        const double ounit = std::ldexp(1.0, e - 17);
        for (int dm : {0, -1, 1}) {
          const float m = float(o0 + dm * ounit);
          if (fits_affine(x, s, m, 0.f, float(QMAX), q)) {
            *d_out = s;
            *m_out = m;
            return true;
          }
        }
      }
    }
  }
  return false;
}

// One block of 32 as d * q + m, q in 0..QMAX (15: the Q4_1 layout; 31: the Q5 one), the q into
// q. As llama.cpp's Q4_1 / Q5_1 make it (the minimum has q = 0, so m is it, a float16, and d a
// float16 near (max - min) / QMAX), or its Q4_0 / Q5_0 (d * (q - h), h = (QMAX + 1) / 2: the
// first weight of largest magnitude has q = 0, so d is it / -h, a float16; then m = -h d, and
// d * q + m is d * (q - h) exactly), or a k-quant's sub-block (find_kquant).
template <int QMAX>
static bool find_affine(const float* x, int32_t* q, float* d_out, float* m_out) {
  constexpr float kHalf = float((QMAX + 1) / 2);
  float mn = x[0], mx = x[0], amax = std::fabs(x[0]), vmax = x[0];
  for (int i = 1; i < kBlock; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      vmax = x[i];
    }
  }
  if (!std::isfinite(mn) || !std::isfinite(mx)) return false;
  float d = 0.f, m = mn;
  auto fits = [&](float dc) {
    if (!fits_affine(x, dc, mn, 0.f, float(QMAX), q)) return false;
    d = dc;
    return true;
  };
  bool found = true;
  for (int i = 1; i < kBlock && found; ++i) found = bits_of(x[i]) == bits_of(x[0]);
  if (found) {  // one value v: d * 0 + v, or for a zero of either sign v * 1 + v
    const bool zero = x[0] == 0.f;
    d = zero ? x[0] : 0.f;
    m = x[0];
    for (int i = 0; i < kBlock; ++i) q[i] = zero ? 1 : 0;
  } else if (float(c10::Half(mn)) == mn) {
    found = try_scales((mx - mn) / float(QMAX), fits);
  }
  if (!found && amax > 0.f) {  // Q4_0 / Q5_0
    const float d0 = vmax / -kHalf;
    found = float(c10::Half(d0)) == d0 && fits_affine(x, d0, -kHalf * d0, 0.f, float(QMAX), q);
    if (found) {
      d = d0;
      m = -kHalf * d0;
    }
  }
  if (!found) found = find_kquant<QMAX>(x, mn, mx, q, &d, &m);
  if (!found) return false;
  *d_out = d;
  *m_out = m;
  return true;
}

// One block of 32 in the Q4_1 layout (Q4_1, Q4_0, Q4_K): two 4-bit q a byte.
static bool find_q4_1(const float* x, uint8_t* qs, float* dm) {
  int32_t q[kBlock];
  if (!find_affine<15>(x, q, dm, dm + 1)) return false;
  for (int j = 0; j < 16; ++j) qs[j] = uint8_t(q[j] | (q[j + 16] << 4));
  return true;
}

// One block of 32 in the Q5 layout (Q5_1, Q5_0, Q5_K): a byte a q (5 bits used).
static bool find_q5(const float* x, uint8_t* qs, float* dm) {
  int32_t q[kBlock];
  if (!find_affine<31>(x, q, dm, dm + 1)) return false;
  for (int j = 0; j < kBlock; ++j) qs[j] = uint8_t(q[j]);
  return true;
}

// One block of 32 as Q8_0: d * q, q in -128..127 (the largest magnitude has |q| = 127).
static bool find_q8_0(const float* x, int8_t* qs, float* scale) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (!std::isfinite(amax)) return false;
  int32_t q[kBlock];
  float d = 0.f;
  auto fits = [&](float dc) {
    if (!fits_affine(x, dc, 0.f, -128.f, 127.f, q)) return false;  // fma(d, q, +0) is d * q
    d = dc;
    return true;
  };
  if (amax == 0.f) {
    for (int i = 0; i < kBlock; ++i) {
      q[i] = 0;
    }
  } else if (!try_scales(amax / 127.f, fits)) {
    return false;
  }
  for (int i = 0; i < kBlock; ++i) qs[i] = int8_t(q[i]);
  *scale = d;
  return true;
}

// One block of 32 as two halves of 16, each d * q (int8 q, a float32 d each): llama.cpp's
// Q6_K (super-blocks of 256: x = (d * sc) * (q - 32), d float16, sc an 8-bit integer a
// sub-block of 16, q 6-bit; d * sc has at most 18 significant bits and its products with q are
// exact in float32). The weight of largest magnitude has |q| = j <= 32, so |d| = amax / j
// exactly for the right j; the largest j that fits is taken.
static bool find_q8_16(const float* x, int8_t* qs, float* scales) {
  for (int half = 0; half < 2; ++half) {
    const float* h = x + 16 * half;
    float amax = 0.f;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(h[i]));
    if (!std::isfinite(amax)) return false;
    int32_t q[16];
    float d = 0.f;
    if (amax == 0.f) {
      for (int i = 0; i < 16; ++i) q[i] = 0;
    } else {
      bool found = false;
      for (int j = 32; j >= 1 && !found; --j) {
        d = amax / float(j);
        found = fits_affine(h, d, 0.f, -127.f, 127.f, q, 16);  // fma(d, q, +0) is d * q
      }
      if (!found) return false;
    }
    for (int i = 0; i < 16; ++i) qs[16 * half + i] = int8_t(q[i]);
    scales[half] = d;
  }
  return true;
}

#ifdef __AVX512F__
static inline void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
#endif

struct Q4_1 {
  const uint8_t* qs;
  const float* dm;
  int64_t K;
  int64_t blocks() const { return K / kBlock; }
  void unpack_row(int64_t n, float* out) const {
    const uint8_t* q = qs + n * (K / 2);
    const float* s = dm + n * blocks() * 2;
    for (int64_t b = 0; b < blocks(); ++b)
      for (int j = 0; j < 16; ++j) {
        const uint8_t v = q[b * 16 + j];
        out[b * kBlock + j] = std::fma(s[2 * b], float(v & 15), s[2 * b + 1]);
        out[b * kBlock + j + 16] = std::fma(s[2 * b], float(v >> 4), s[2 * b + 1]);
      }
  }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(qs + n * (K / 2)); }
  int64_t row_bytes() const { return K / 2; }
#ifdef __AVX512F__
  // Block b of row n: weights 32b .. 32b + 15 in lo, 32b + 16 .. 32b + 31 in hi.
  inline void load(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const float* s = dm + (n * blocks() + b) * 2;
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + n * (K / 2) + b * 16)));
    const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
  }
  // The cache lines of row n that block b's loads begin (one every 4 blocks of qs, 8 of dm).
  inline void prefetch(int64_t n, int64_t b) const {
    if ((b & 3) == 0) prefetch_line(qs + n * (K / 2) + b * 16);
    if ((b & 7) == 0) prefetch_line(dm + (n * blocks() + b) * 2);
  }
#endif
};

// The Q5 layout (Q5_1, Q5_0, Q5_K): a byte a q, (d, m) a block of 32: fma(d, q, m).
struct Q5 {
  const uint8_t* qs;
  const float* dm;
  int64_t K;
  int64_t blocks() const { return K / kBlock; }
  void unpack_row(int64_t n, float* out) const {
    const uint8_t* q = qs + n * K;
    const float* s = dm + n * blocks() * 2;
    for (int64_t k = 0; k < K; ++k)
      out[k] = std::fma(s[2 * (k / kBlock)], float(q[k]), s[2 * (k / kBlock) + 1]);
  }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(qs + n * K); }
  int64_t row_bytes() const { return K; }
#ifdef __AVX512F__
  inline void load(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const uint8_t* q = qs + n * K + b * kBlock;
    const float* s = dm + (n * blocks() + b) * 2;
    const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d, m);
  }
  inline void prefetch(int64_t n, int64_t b) const {
    if ((b & 1) == 0) prefetch_line(qs + n * K + b * kBlock);
    if ((b & 7) == 0) prefetch_line(dm + (n * blocks() + b) * 2);
  }
#endif
};

// Q8_0 (S = 1: one d a block of 32) and Q6_K's halves (S = 2: a d for each 16 values).
template <int S>
struct Q8 {
  const int8_t* qs;
  const float* d;
  int64_t K;
  int64_t blocks() const { return K / kBlock; }
  void unpack_row(int64_t n, float* out) const {
    for (int64_t k = 0; k < K; ++k)
      out[k] = d[n * blocks() * S + k / (kBlock / S)] * float(qs[n * K + k]);
  }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(qs + n * K); }
  int64_t row_bytes() const { return K; }
#ifdef __AVX512F__
  inline void load(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const int8_t* q = qs + n * K + b * kBlock;
    const float* s = d + (n * blocks() + b) * S;
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))),
                       _mm512_set1_ps(s[0]));
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))),
                       _mm512_set1_ps(s[S - 1]));
  }
  inline void prefetch(int64_t n, int64_t b) const {
    if ((b & 1) == 0) prefetch_line(qs + n * K + b * kBlock);
    if ((b & (16 / S - 1)) == 0) prefetch_line(d + (n * blocks() + b) * S);
  }
#endif
};
using Q8_0 = Q8<1>;
using Q8_16 = Q8<2>;

#ifdef __AVX512F__
// Weight rows [n0, n0 + nc) of a packed source as the GEMM's K x NR panel: 16 rows at a time,
// each block widened into two vectors a row and transposed onto the panel's rows.
template <typename Src>
static void pack_panel_packed(const Src& src, int64_t n0, int nc, float* panel) {
  if (nc < NR) {
    std::vector<float> row(size_t(src.K));
    for (int j = 0; j < NR; ++j) {
      if (j < nc) src.unpack_row(n0 + j, row.data());
      for (int64_t k = 0; k < src.K; ++k) panel[k * NR + j] = j < nc ? row[size_t(k)] : 0.f;
    }
    return;
  }
  for (int half = 0; half < 2; ++half) {
    for (int64_t b = 0; b < src.blocks(); ++b) {
      __m512 lo[16], hi[16];
      for (int i = 0; i < 16; ++i) src.load(n0 + 16 * half + i, b, lo[i], hi[i]);
      transpose16(lo);
      transpose16(hi);
      float* p = panel + b * kBlock * NR + 16 * half;
      for (int c = 0; c < 16; ++c) {
        _mm512_store_ps(p + c * NR, lo[c]);
        _mm512_store_ps(p + (16 + c) * NR, hi[c]);
      }
    }
  }
}

template <typename Src>
struct PanelOf {
  const Src& src;
  void pack(int64_t n0, int nc, float* panel) const { pack_panel_packed(src, n0, nc, panel); }
  const char* row(int64_t n) const { return src.row(n); }
  int64_t row_bytes() const { return src.row_bytes(); }
};

// R packed weight rows against M (<= 8) rows of x, a block of 32 at a time: the block widened
// once (two vectors) for all M rows, x read from L1 (held in registers, 16 of them at M = 8,
// the same pass took 16.3 ms against 10.9); the next R rows prefetched as these stream.
template <int M, int R, typename Src>
static void rows_packed(const float* x, const Src& src, const float* bias, float* y, int64_t K,
                        int64_t N, int64_t n0) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < src.blocks(); ++b) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      if (n0 + r + R < N) src.prefetch(n0 + r + R, b);
      src.load(n0 + r, b, lo[r], hi[r]);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xl = _mm512_loadu_ps(x + m * K + b * kBlock);
      const __m512 xh = _mm512_loadu_ps(x + m * K + b * kBlock + 16);
      for (int r = 0; r < R; ++r) {
        acc[r][m] = _mm512_fmadd_ps(lo[r], xl, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(hi[r], xh, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n0 + r] : 0.f);
}

// All N rows against M (<= 8) rows of x: groups of R rows over the threads, the rest one by one.
template <int M, typename Src>
static void run_packed(const float* x, const Src& src, const float* bias, float* y, int64_t N) {
  // R * M accumulators + 2 R widened blocks; more rows at once measured slower from M = 3 (8.0
  // against 7.6 ms a pass at M = 4 with R = 4; 12.1 against 10.9 at M = 8 with R = 2)
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) rows_packed<M, R>(x, src, bias, y, src.K, N, g * R);
  for (int64_t n = groups * R; n < N; ++n) rows_packed<M, 1>(x, src, bias, y, src.K, N, n);
}

template <typename Src>
static void dispatch_packed(const float* x, const Src& src, const float* bias, float* y,
                            int64_t M, int64_t N) {
  const int64_t K = src.K;
  switch (M) {
    case 1: run_packed<1>(x, src, bias, y, N); return;
    case 2: run_packed<2>(x, src, bias, y, N); return;
    case 3: run_packed<3>(x, src, bias, y, N); return;
    case 4: run_packed<4>(x, src, bias, y, N); return;
    case 5: run_packed<5>(x, src, bias, y, N); return;
    case 6: run_packed<6>(x, src, bias, y, N); return;
    case 7: run_packed<7>(x, src, bias, y, N); return;
    case 8: run_packed<8>(x, src, bias, y, N); return;
    default: gemm_avx512(x, PanelOf<Src>{src}, bias, y, M, K, N); return;
  }
}
#else
// Without AVX-512: each thread widens a row at a time and takes its dot products with every row
// of x (correct everywhere; the fast paths above are what `packed_fast()` reports).
template <typename Src>
static void dispatch_packed(const float* x, const Src& src, const float* bias, float* y,
                            int64_t M, int64_t N) {
  const int64_t K = src.K;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(K));  // (not row(size_t(K)): a declaration)
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      src.unpack_row(n, row.data());
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += row[size_t(k)] * x[m * K + k];
        y[m * N + n] = s + (bias ? bias[n] : 0.f);
      }
    }
  }
}
#endif

// Whether fits_block(n, b) holds for block b of every row n: rows over nt threads, the search
// ending at the first block that does not fit.
template <typename Fn>
static bool every_block(int64_t N, int64_t nb, int nt, Fn&& fits_block) {
  std::atomic<bool> fits{true};
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb && fits.load(std::memory_order_relaxed); ++b)
      if (!fits_block(n, b)) fits.store(false, std::memory_order_relaxed);
  return fits.load();
}

// (qs, scales) of w as Q4_1 (or Q4_0), else as Q8_0, else None: every block must fit.
// `threads`: OpenMP threads for the search (0: all); called without the GIL, so a background
// thread can pack while the model serves.
c10::optional<std::vector<torch::Tensor>> pack_blocks(torch::Tensor w, int64_t threads) {
  at::internal::lazy_init_num_threads();  // torch.set_num_threads' count (see small_linear)
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat,
              "pack_blocks: a 2-D float32 weight expected, got ", w.scalar_type(), " ", w.sizes());
  const int nt = threads > 0 ? int(threads) : omp_get_max_threads();
  const int64_t N = w.size(0), K = w.size(1);
  if (K % kBlock != 0 || N == 0) return c10::nullopt;
  auto wc = w.contiguous();
  const float* wp = wc.data_ptr<float>();
  const int64_t nb = K / kBlock;
  auto q4 = torch::empty({N, K / 2}, torch::kUInt8);
  auto dm = torch::empty({N, nb, 2}, torch::kFloat);
  uint8_t* q4p = q4.data_ptr<uint8_t>();
  float* dmp = dm.data_ptr<float>();
  if (every_block(N, nb, nt, [&](int64_t n, int64_t b) {
        const int64_t at = n * nb + b;
        return find_q4_1(wp + at * kBlock, q4p + at * 16, dmp + at * 2);
      }))
    return std::vector<torch::Tensor>{q4, dm};
  auto q8 = torch::empty({N, K}, torch::kInt8);
  auto d = torch::empty({N, nb}, torch::kFloat);
  int8_t* q8p = q8.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  if (every_block(N, nb, nt, [&](int64_t n, int64_t b) {
        const int64_t at = n * nb + b;
        return find_q8_0(wp + at * kBlock, q8p + at * kBlock, dp + at);
      }))
    return std::vector<torch::Tensor>{q8, d};
  auto d16 = torch::empty({N, nb * 2}, torch::kFloat);
  float* d16p = d16.data_ptr<float>();
  if (every_block(N, nb, nt, [&](int64_t n, int64_t b) {
        const int64_t at = n * nb + b;
        return find_q8_16(wp + at * kBlock, q8p + at * kBlock, d16p + at * 2);
      }))
    return std::vector<torch::Tensor>{q8, d16};
  auto q5 = torch::empty({N, K}, torch::kUInt8);
  uint8_t* q5p = q5.data_ptr<uint8_t>();
  if (every_block(N, nb, nt, [&](int64_t n, int64_t b) {
        const int64_t at = n * nb + b;
        return find_q5(wp + at * kBlock, q5p + at * kBlock, dmp + at * 2);
      }))
    return std::vector<torch::Tensor>{q5, dm};
  return c10::nullopt;
}

// Checks (qs, scales) as pack_blocks makes them and calls fn with the format's source.
template <typename Fn>
static void with_source(const torch::Tensor& qs, const torch::Tensor& scales, Fn&& fn) {
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && scales.is_contiguous() &&
                  scales.scalar_type() == torch::kFloat,
              "packed weights: contiguous qs (N, ...) and float32 scales expected");
  const int64_t N = qs.size(0);
  if (qs.scalar_type() == torch::kUInt8) {  // Q4_1: (N, K / 2); Q5: (N, K); (d, m) each 32
    const int64_t c = qs.size(1);
    if (c % (kBlock / 2) == 0 && scales.numel() == N * (2 * c / kBlock) * 2) {
      fn(Q4_1{qs.data_ptr<uint8_t>(), scales.data_ptr<float>(), 2 * c}, N, 2 * c);
    } else {
      TORCH_CHECK(c % kBlock == 0 && scales.numel() == N * (c / kBlock) * 2,
                  "packed weights: Q4_1 (qs (N, K / 2)) or Q5 (qs (N, K)) scales (N, K / 32, 2) "
                  "expected");
      fn(Q5{qs.data_ptr<uint8_t>(), scales.data_ptr<float>(), c}, N, c);
    }
  } else {
    TORCH_CHECK(qs.scalar_type() == torch::kInt8,
                "packed weights: qs uint8 (Q4_1) or int8 (Q8_0, Q6_K)");
    const int64_t K = qs.size(1);
    TORCH_CHECK(K % kBlock == 0 && (scales.numel() == N * (K / kBlock) ||
                                    scales.numel() == N * (K / kBlock) * 2),
                "packed weights: Q8_0 scales (N, K / 32) or Q6_K's (N, K / 16) expected");
    if (scales.numel() == N * (K / kBlock))
      fn(Q8_0{qs.data_ptr<int8_t>(), scales.data_ptr<float>(), K}, N, K);
    else
      fn(Q8_16{qs.data_ptr<int8_t>(), scales.data_ptr<float>(), K}, N, K);
  }
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales,
                            c10::optional<torch::Tensor> bias) {
  at::internal::lazy_init_num_threads();  // torch.set_num_threads' count (see small_linear)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(0) >= 1,
              "packed_linear: x (M, K) float32 expected");
  auto xc = x.contiguous();
  torch::Tensor y;
  with_source(qs, scales, [&](const auto& src, int64_t N, int64_t K) {
    TORCH_CHECK(x.size(1) == K, "packed_linear: K differs: x ", x.sizes(), ", weights K ", K);
    const float* bp = nullptr;
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat &&
                      bias->is_contiguous(),
                  "packed_linear: bias (N,) float32 expected");
      bp = bias->data_ptr<float>();
    }
    y = torch::empty({x.size(0), N}, x.options());
    dispatch_packed(xc.data_ptr<float>(), src, bp, y.data_ptr<float>(), x.size(0), N);
  });
  return y;
}

// The float32 weights back: (N, K).
torch::Tensor unpack_blocks(torch::Tensor qs, torch::Tensor scales) {
  at::internal::lazy_init_num_threads();  // torch.set_num_threads' count (see small_linear)
  torch::Tensor w;
  with_source(qs, scales, [&](const auto& src, int64_t N, int64_t K) {
    w = torch::empty({N, K}, torch::kFloat);
    float* wp = w.data_ptr<float>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) src.unpack_row(n, wp + n * K);
  });
  return w;
}

bool packed_fast() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// float32 weights: up to here the kernel is as fast as torch's GEMM or faster (256 rows: within
// the noise of a shared machine; 128 and fewer: ahead); beyond, torch.
constexpr int64_t kMaxRowsF32 = 256;

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  // OpenMP's thread count is kept per calling thread: on one where torch has run no parallel op
  // yet (the engine's step loop is a fresh thread), a region would fork libgomp's default
  // (OMP_NUM_THREADS, or every core), not torch.set_num_threads' count; set it as torch's own
  // ops do on their first call in a thread.
  at::internal::lazy_init_num_threads();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_linear: x (M, K) and w (N, K) expected");
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && (bf16 || w.scalar_type() == torch::kFloat),
              "small_linear: x float32 and w float32 or bfloat16 only, got ", x.scalar_type(),
              " and ", w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "small_linear: K differs: x ", x.sizes(), " w ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1 && (bf16 || x.size(0) <= kMaxRowsF32),
              "small_linear: 1 <= M <= ", kMaxRowsF32, " with float32 weights, got ", x.size(0));
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
        "x @ w.T (+ bias): x float32; w float32 (1-256 rows of x) or bfloat16 (any rows)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_blocks", &pack_blocks,
        "(qs, scales) of a float32 weight whose blocks of 32 are exactly Q4_1, Q4_0, Q4_K, Q8_0, "
        "Q6_K, Q5_1, Q5_0 or Q5_K values; None otherwise (threads: 0 for all)",
        py::arg("w"), py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &packed_linear, "x @ w.T (+ bias) with w packed by pack_blocks",
        py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("unpack_blocks", &unpack_blocks, "the float32 weight of pack_blocks' (qs, scales)",
        py::arg("qs"), py::arg("scales"),
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_fast", &packed_fast, "whether packed_linear has its AVX-512 kernels here");
}
