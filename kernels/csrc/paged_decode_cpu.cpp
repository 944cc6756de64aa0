// Attention over the paged KV cache, on the CPU, reading keys and values in place: decode rows
// (paged_decode_attention, below) and prompt chunks (paged_prefill_attention, at the end).
//
// The PyTorch reference (kernels/attention.py) copies every request's blocks into a padded
// tensor before calling SDPA; this kernel walks the block table instead, so each cached key and
// value is read once and nothing is copied. One task per (request, kv head): the G query heads
// that share the kv head are computed together, so each key is loaded once for all of them.
//
//   q        (n, H, D)                    one query per request
//   k_cache  (num_blocks, block_size, Hkv, D) q's dtype, or bfloat16 under float32 q (a KV
//                                         cache kept in bfloat16: widened in registers, exact)
//   v_cache  (num_blocks, block_size, Hkv, D)
//   blocks   (n, nb) int64                block table of each request (padding unused)
//   lens     (n,) int64                   keys each request attends to
//   out      (n, H, D)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define EI_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd_exp.h"

namespace {

// exp(x) for x <= 0 (softmax arguments), about 1 ulp, written so the compiler vectorizes it
// (glibc's expf is a scalar call here and was 40% of the kernel's time).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.3f);                          // below this exp underflows to 0 anyway
  const float n = std::nearbyint(x * 1.44269504088896341f);  // x / ln 2
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, in two parts
  float p = 1.9875691500e-4f;                       // Cephes expf polynomial on [-ln2/2, ln2/2]
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;            // times 2^n
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// The largest of x[0..n-1] (n >= 1); GCC leaves std::max loops scalar (NaN semantics), a chain
// of dependent maxss that took a fifth of the kernel's time.
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX512F__)
  if (n >= 64) {
    __m512 m0 = _mm512_set1_ps(m), m1 = m0, m2 = m0, m3 = m0;
    for (; j + 64 <= n; j += 64) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + j));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + j + 16));
      m2 = _mm512_max_ps(m2, _mm512_loadu_ps(x + j + 32));
      m3 = _mm512_max_ps(m3, _mm512_loadu_ps(x + j + 48));
    }
    m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  }
#elif defined(EI_AVX2)
  if (n >= 32) {
    __m256 m0 = _mm256_set1_ps(m), m1 = m0, m2 = m0, m3 = m0;
    for (; j + 32 <= n; j += 32) {
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + j));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + j + 8));
      m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + j + 16));
      m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + j + 24));
    }
    const __m256 r = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, r);
    for (float v : lanes) m = std::max(m, v);
  }
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

#ifdef EI_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

// Scores of keys j0..j0+tn-1 of one block: scores[g * L + j] = q_g . k_j. Generic version.
template <typename T>
inline void block_scores(const float* qf, const T* base, int64_t tok_stride, int64_t tn, int64_t G,
                         int64_t D, float* scores, int64_t L, int64_t j0) {
  for (int64_t t = 0; t < tn; ++t) {
    const T* key = base + t * tok_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(key[d]);
      scores[g * L + j0 + t] = s;
    }
  }
}

// acc[g * D + d] += sum_t p[g, j0 + t] * v_t[d] over one block. Generic version.
template <typename T>
inline void block_values(const float* scores, const T* base, int64_t tok_stride, int64_t tn,
                         int64_t G, int64_t D, float* acc, int64_t L, int64_t j0) {
  for (int64_t t = 0; t < tn; ++t) {
    const T* val = base + t * tok_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + j0 + t];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(val[d]);
    }
  }
}

#ifdef EI_AVX2
// float32 with head_dim a multiple of 8: AVX2 + FMA by hand (the compiler's version spent its
// time in horizontal sums and in reloading the accumulators for every key).
template <>
inline void block_scores<float>(const float* qf, const float* base, int64_t tok_stride, int64_t tn,
                                int64_t G, int64_t D, float* scores, int64_t L, int64_t j0) {
  if (D % 8) {
    for (int64_t t = 0; t < tn; ++t)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * base[t * tok_stride + d];
        scores[g * L + j0 + t] = s;
      }
    return;
  }
  for (int64_t t = 0; t < tn; ++t) {
    const float* key = base + t * tok_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(key + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(key + d + 8), a1);
      }
      if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(key + d), a0);
      scores[g * L + j0 + t] = hsum(_mm256_add_ps(a0, a1));
    }
  }
}

template <>
inline void block_values<float>(const float* scores, const float* base, int64_t tok_stride,
                                int64_t tn, int64_t G, int64_t D, float* acc, int64_t L,
                                int64_t j0) {
  if (D % 8 || G > 8) {
    for (int64_t t = 0; t < tn; ++t)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          acc[g * D + d] += scores[g * L + j0 + t] * base[t * tok_stride + d];
    return;
  }
  // Eight values of each head stay in registers while the block's keys stream by.
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a[8];
    for (int64_t g = 0; g < G; ++g) a[g] = _mm256_loadu_ps(acc + g * D + d);
    for (int64_t t = 0; t < tn; ++t) {
      const __m256 v = _mm256_loadu_ps(base + t * tok_stride + d);
      for (int64_t g = 0; g < G; ++g)
        a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + g * L + j0 + t), v, a[g]);
    }
    for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * D + d, a[g]);
  }
}
#endif

#ifdef __AVX512F__
// float32 with head_dim a multiple of 16 and up to 8 query heads per kv head: AVX-512. A step of
// decode attention reads the whole KV cache once, so these keep the instruction count well under
// what the memory system delivers (the AVX2 versions above ran at ~10 GB/s, compute-bound, on a
// machine that streams ~26 GB/s); the caller prefetches the blocks (prefetch_rows).
#define EI_AVX512 1

// 16 cached values as float32 lanes: float32 as they are, bfloat16 widened (exact: a bfloat16 is
// the top half of a float32), so the sums are float32's either way, on half the bytes read.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 vectors in, one out: lane t holds the sum of all lanes of a[t]. Each step adds pairs of
// vectors' halves, so no lane ever mixes two inputs.
inline __m512 reduce16(__m512* a) {
  __m512 s1[8], s2[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a, b, c, d], each a partial sum
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  // Across the four 128-bit lanes: (x0 x2 y0 y2) + (x1 x3 y1 y3), twice.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88),
                                 _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x88),
                                 _mm512_shuffle_f32x4(s2[2], s2[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w, z, 0x88), _mm512_shuffle_f32x4(w, z, 0xDD));
}

// Scores of up to 16 keys (rows key + t * tok_stride, t < tn) against G query heads, C = D / 16
// vectors per row.
template <typename KV>
inline void scores16(const float* qf, const KV* key, int64_t tok_stride, int64_t tn, int64_t G,
                     int64_t C, float* scores, int64_t L, int64_t j0) {
  const __mmask16 keep = static_cast<__mmask16>((1u << tn) - 1);
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(qf + g * C * 16 + c * 16);
      if (tn == 16) {
        for (int t = 0; t < 16; ++t)
          acc[t] = _mm512_fmadd_ps(qc, load16(key + t * tok_stride + c * 16), acc[t]);
      } else {
        for (int t = 0; t < 16; ++t)
          if (t < tn)
            acc[t] = _mm512_fmadd_ps(qc, load16(key + t * tok_stride + c * 16), acc[t]);
      }
    }
    _mm512_mask_storeu_ps(scores + g * L + j0, keep, reduce16(acc));
  }
}

#ifdef __AVX512BF16__
// bfloat16 queries over a bfloat16 cache (a bfloat16 model): the scores of up to 16 keys with
// VDPBF16PS, 32 elements an instruction, each product exact in float32 (8-bit mantissas) and the
// sums float32's, so no widening of the keys; the scale is applied to the sums, as q is not
// rounded again. q: the task's G heads, raw bfloat16 (G x D); C2 = D / 32.
inline void scores16_bf16(const at::BFloat16* q, const at::BFloat16* key, int64_t tok_stride,
                          int64_t tn, int64_t G, int64_t C2, float scale, float* scores,
                          int64_t L, int64_t j0) {
  const __mmask16 keep = static_cast<__mmask16>((1u << tn) - 1);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C2; ++c) {
      const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + g * C2 * 32 + c * 32);
      for (int t = 0; t < 16; ++t)
        if (t < tn)
          acc[t] = _mm512_dpbf16_ps(
              acc[t], (__m512bh)_mm512_loadu_si512(key + t * tok_stride + c * 32), qc);
    }
    _mm512_mask_storeu_ps(scores + g * L + j0, keep, _mm512_mul_ps(reduce16(acc), sc));
  }
}
#define EI_AVX512_BF16 1
#endif

// acc[g] += sum_t p[g, j0 + t] * v_t over up to 16 rows, G query heads held in registers.
// CB vectors of each head at a time, and even and odd rows in separate accumulators: at least
// eight independent FMA chains, so the loop is not bound by the FMA's latency.
template <int G, typename KV>
inline void values16(const float* scores, const KV* val, int64_t tok_stride, int64_t tn,
                     int64_t C, float* acc, int64_t L, int64_t j0) {
  constexpr int CB = std::max(1, std::min(4, 8 / G));
  for (int64_t c0 = 0; c0 < C; c0 += CB) {
    const int cb = static_cast<int>(std::min<int64_t>(CB, C - c0));
    __m512 a[2][G][CB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CB; ++c) {
        a[0][g][c] = c < cb ? _mm512_loadu_ps(acc + g * C * 16 + (c0 + c) * 16)
                            : _mm512_setzero_ps();
        a[1][g][c] = _mm512_setzero_ps();
      }
    // Rows in pairs, the second into the other accumulators (written out twice: a lambda over
    // `a` made GCC keep the accumulators on the stack).
    int64_t t = 0;
    for (; t + 1 < tn; t += 2) {
      const KV* r0 = val + t * tok_stride + c0 * 16;
      const KV* r1 = r0 + tok_stride;
      __m512 v0[CB], v1[CB];
      for (int c = 0; c < CB; ++c) {
        v0[c] = c < cb ? load16(r0 + c * 16) : _mm512_setzero_ps();
        v1[c] = c < cb ? load16(r1 + c * 16) : _mm512_setzero_ps();
      }
      for (int g = 0; g < G; ++g) {
        const __m512 p0 = _mm512_set1_ps(scores[g * L + j0 + t]);
        const __m512 p1 = _mm512_set1_ps(scores[g * L + j0 + t + 1]);
        for (int c = 0; c < CB; ++c) {
          a[0][g][c] = _mm512_fmadd_ps(p0, v0[c], a[0][g][c]);
          a[1][g][c] = _mm512_fmadd_ps(p1, v1[c], a[1][g][c]);
        }
      }
    }
    if (t < tn) {
      const KV* r0 = val + t * tok_stride + c0 * 16;
      for (int g = 0; g < G; ++g) {
        const __m512 p0 = _mm512_set1_ps(scores[g * L + j0 + t]);
        for (int c = 0; c < CB; ++c)  // constant bounds everywhere: `a` stays in registers
          if (c < cb) a[0][g][c] = _mm512_fmadd_ps(p0, load16(r0 + c * 16), a[0][g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CB; ++c)
        if (c < cb)
          _mm512_storeu_ps(acc + g * C * 16 + (c0 + c) * 16,
                           _mm512_add_ps(a[0][g][c], a[1][g][c]));
  }
}

inline bool avx512_shape(int64_t G, int64_t D) { return D % 16 == 0 && G >= 1 && G <= 8; }

// Rows [0, tn) of heads [h0, h1) of one cached block, into L2 ahead of their use (one contiguous
// range when the task holds every head). The blocks lie in the order of the block table, which
// the hardware prefetchers cannot guess, and one block's pass, about a microsecond, is too short
// to hide a DRAM round trip for its lines unless they are asked for a block ahead; into L2, not
// L1, whose few miss buffers a block's 150-200 lines would fill. 64 requests of 400-700 keys,
// float32 cache: 1.3-1.6x faster on a 2-vCPU AMD EPYC guest (2026-11-27, interleaved runs).
// Both helpers are forced inline: called out of line (GCC's choice) they lost all of that gain.
template <typename KV>
__attribute__((always_inline)) inline void prefetch_rows(const KV* block, int64_t tn,
                                                        int64_t tok_stride, int64_t h0,
                                                        int64_t h1, int64_t D) {
  for (int64_t t = 0; t < tn; ++t) {
    const char* p = reinterpret_cast<const char*>(block + t * tok_stride + h0 * D);
    const char* e = reinterpret_cast<const char*>(block + t * tok_stride + h1 * D);
    for (; p < e; p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
}

// Before the pass over block j0 / bs of `cache` (keys or values): the next block of it, or
// after the last, the first block of `then` (the values after the keys; null after the values).
template <typename KV>
__attribute__((always_inline)) inline void prefetch_after(
    const KV* cache, const KV* then, const int64_t* table, int64_t j0, int64_t bs, int64_t L,
    int64_t blk_stride, int64_t tok_stride, int64_t h0, int64_t h1, int64_t D) {
  if (j0 + bs < L)
    prefetch_rows(cache + table[j0 / bs + 1] * blk_stride, std::min(bs, L - j0 - bs), tok_stride,
                  h0, h1, D);
  else if (then != nullptr)
    prefetch_rows(then + table[0] * blk_stride, std::min(bs, L), tok_stride, h0, h1, D);
}

// One head's block through values16, its G picked at compile time.
template <typename KV>
inline void values16_any(int64_t G, const float* scores, const KV* val, int64_t tok_stride,
                         int64_t tn, int64_t C, float* acc, int64_t L, int64_t j0) {
  switch (G) {
    case 1: return values16<1, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    case 2: return values16<2, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    case 3: return values16<3, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    case 4: return values16<4, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    case 5: return values16<5, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    case 6: return values16<6, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    case 7: return values16<7, KV>(scores, val, tok_stride, tn, C, acc, L, j0);
    default: return values16<8, KV>(scores, val, tok_stride, tn, C, acc, L, j0);  // G == 8
  }
}
#endif

// T: q's and out's element type; KV: the cache's (T, or bfloat16 under float32 q).
template <typename T, typename KV = T>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& blocks, const torch::Tensor& lens, double scale,
                   torch::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, nb = blocks.size(1);
  const T* qp = q.data_ptr<T>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t tok_stride = Hkv * D, blk_stride = bs * Hkv * D;
  const float fscale = static_cast<float>(scale);
#ifdef EI_AVX512
  // float32 queries over a float32 or bfloat16 cache, and bfloat16 queries over a bfloat16 cache,
  // take the AVX-512 loops, sums in float32 and the output rounded to T once at the end. The
  // queries are widened to float32 scratch (exact) and scaled there; bfloat16 queries over a
  // bfloat16 cache with AVX512-BF16 and D % 32 == 0 score with VDPBF16PS on the raw queries
  // instead, the scale applied to the sums (scores16_bf16).
  constexpr bool kFastTypes =
      (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) &&
      (std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16>);
  const bool fast = kFastTypes && avx512_shape(G, D);
#endif

  // A task is one request and a range of its kv heads: all of them when there are enough requests
  // to keep the threads busy, so that each cached row (every head of a token) is read once.
  const int64_t heads_per_task = n >= 8 ? Hkv : 1;
  const int64_t tasks_per_req = Hkv / heads_per_task;
  const int64_t num_tasks = n * tasks_per_req;
  // Each thread takes a contiguous run of tasks holding about its share of the keys: the engine
  // passes decodes sorted by length, and equal task counts would give one thread the long ones.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> cut(parts + 1, num_tasks);
  {
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += lp[i] * tasks_per_req;
    int64_t seen = 0, p = 1;
    cut[0] = 0;
    for (int64_t task = 0; task < num_tasks && p < parts; ++task) {
      seen += lp[task / tasks_per_req];
      while (p < parts && seen * parts >= total * p) cut[p++] = task + 1;
    }
  }
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf(H * D), acc(H * D), scores;
    for (int64_t task = cut[part_begin]; task < cut[part_end]; ++task) {
      const int64_t i = task / tasks_per_req;
      const int64_t h0 = (task % tasks_per_req) * heads_per_task, h1 = h0 + heads_per_task;
      const int64_t L = lp[i];
      const int64_t* table = bp + i * nb;
      scores.resize(H * L);
      // Pass 1: scores of every key, block by block; the block stays in cache across heads.
      bool scored = false;
#ifdef EI_AVX512_BF16
      if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
        if (fast && D % 32 == 0) {
          for (int64_t j0 = 0; j0 < L; j0 += bs) {
            const KV* block = kp + table[j0 / bs] * blk_stride;
            prefetch_after(kp, vp, table, j0, bs, L, blk_stride, tok_stride, h0, h1, D);
            const int64_t tn = std::min(bs, L - j0);
            for (int64_t h = h0; h < h1; ++h)
              for (int64_t t0 = 0; t0 < tn; t0 += 16)
                scores16_bf16(qp + (i * H + h * G) * D, block + t0 * tok_stride + h * D,
                              tok_stride, std::min<int64_t>(16, tn - t0), G, D / 32, fscale,
                              scores.data() + h * G * L, L, j0 + t0);
          }
          scored = true;
        }
      }
#endif
      if (!scored) {  // from the queries, scaled, in float32
        for (int64_t hq = h0 * G; hq < h1 * G; ++hq)
          for (int64_t d = 0; d < D; ++d)
            qf[hq * D + d] = static_cast<float>(qp[(i * H + hq) * D + d]) * fscale;
#ifdef EI_AVX512
        if (fast) {
          if constexpr (kFastTypes) {
            for (int64_t j0 = 0; j0 < L; j0 += bs) {
              const KV* block = kp + table[j0 / bs] * blk_stride;
              prefetch_after(kp, vp, table, j0, bs, L, blk_stride, tok_stride, h0, h1, D);
              const int64_t tn = std::min(bs, L - j0);
              for (int64_t h = h0; h < h1; ++h)
                for (int64_t t0 = 0; t0 < tn; t0 += 16)
                  scores16(qf.data() + h * G * D, block + t0 * tok_stride + h * D, tok_stride,
                           std::min<int64_t>(16, tn - t0), G, D / 16,
                           scores.data() + h * G * L, L, j0 + t0);
            }
          }
        } else
#endif
        for (int64_t j0 = 0; j0 < L; j0 += bs) {
          const KV* block = kp + table[j0 / bs] * blk_stride;
          const int64_t tn = std::min(bs, L - j0);
          for (int64_t h = h0; h < h1; ++h)
            block_scores<KV>(qf.data() + h * G * D, block + h * D, tok_stride, tn, G, D,
                            scores.data() + h * G * L, L, j0);
        }
      }
      // Softmax per query head (exp vectorized).
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
        float* sg = scores.data() + hq * L;
        const float m = row_max(sg, L);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) {
          const float e = exp_nonpos(sg[j] - m);
          sg[j] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
      }
      // Pass 2: weighted sum of values, block by block.
      std::fill(acc.begin(), acc.end(), 0.f);
#ifdef EI_AVX512
      if (fast) {
        if constexpr (kFastTypes) {
          for (int64_t j0 = 0; j0 < L; j0 += bs) {
            const KV* block = vp + table[j0 / bs] * blk_stride;
            prefetch_after(vp, static_cast<const KV*>(nullptr), table, j0, bs, L, blk_stride,
                           tok_stride, h0, h1, D);
            const int64_t tn = std::min(bs, L - j0);
            for (int64_t h = h0; h < h1; ++h)
              for (int64_t t0 = 0; t0 < tn; t0 += 16)
                values16_any(G, scores.data() + h * G * L, block + t0 * tok_stride + h * D,
                             tok_stride, std::min<int64_t>(16, tn - t0), D / 16,
                             acc.data() + h * G * D, L, j0 + t0);
          }
        }
      } else
#endif
      for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const KV* block = vp + table[j0 / bs] * blk_stride;
        const int64_t tn = std::min(bs, L - j0);
        for (int64_t h = h0; h < h1; ++h)
          block_values<KV>(scores.data() + h * G * L, block + h * D, tok_stride, tn, G, D,
                          acc.data() + h * G * D, L, j0);
      }
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq)
        for (int64_t d = 0; d < D; ++d)
          op[(i * H + hq) * D + d] = static_cast<T>(acc[hq * D + d]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor blocks, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q (n, H, D), caches (blocks, block_size, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16)),
              "paged_decode_attention: the caches must be q's dtype, or bfloat16 under float32 q; "
              "got q ", q.scalar_type(), ", caches ", k_cache.scalar_type(), " and ",
              v_cache.scalar_type());
  TORCH_CHECK(k_cache.size(2) > 0 && q.size(2) == k_cache.size(3) &&
                  q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head_dim or head count mismatch");
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64 &&
                  blocks.is_contiguous() && lens.is_contiguous(),
              "paged_decode_attention: blocks and lens must be contiguous int64");
  TORCH_CHECK(blocks.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "paged_decode_attention: one block table and one length per query");
  {  // a length past the table, or a block id outside the cache, would read past it: an error
    // here, as the reference's indexing raises (it read garbage, or crashed the worker)
    const int64_t bs = k_cache.size(1), nb = blocks.size(1), nblocks = k_cache.size(0);
    const int64_t cap = nb * bs;
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* bp = blocks.data_ptr<int64_t>();
    for (int64_t i = 0; i < lens.size(0); ++i) {
      TORCH_CHECK(lp[i] >= 1 && lp[i] <= cap, "paged_decode_attention: length ", lp[i],
                  " of query ", i, " outside 1..", cap, " (block table width x block size)");
      for (int64_t b = 0; b < (lp[i] + bs - 1) / bs; ++b)
        TORCH_CHECK(bp[i * nb + b] >= 0 && bp[i * nb + b] < nblocks, "paged_decode_attention: "
                    "block ", bp[i * nb + b], " of query ", i, " outside the cache's ", nblocks);
    }
  }
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16) {
    decode_kernel<float, at::BFloat16>(q, k_cache, v_cache, blocks, lens, scale, out);
  } else if (q.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(q, k_cache, v_cache, blocks, lens, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q, k_cache, v_cache, blocks, lens, scale, out);
  } else if (q.scalar_type() == torch::kFloat16) {
    decode_kernel<at::Half>(q, k_cache, v_cache, blocks, lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}


#ifdef EI_AVX512
// ---------------------------------------------------------------------------------------------
// Prefill attention, float32, AVX-512: each prompt chunk's queries (positions ctx .. ctx + n - 1
// of its request) over keys 0 .. their own position, read in place from the paged cache (the
// chunk's own keys and values are written there before attention runs).
//
// torch's fused CPU SDPA takes no GQA (the KV heads must be repeated first) and a chunk after
// cached tokens needs its keys gathered and a mask built. Here a task is one chunk, one kv head
// and up to QT consecutive queries: its R = G * QT query rows share every key and value loaded.
// Flash-attention style, with the rows in the vector lanes: Qt (D x R) holds the queries
// transposed, so the scores of 16 rows against one key are one vector, D FMAs with the key's
// elements broadcast from the cache as it lies; the running max and sum per row are vectors too
// (no horizontal reductions), and Ot (D x R) accumulates p * v the same way.
constexpr int64_t QT = 16;  // queries per task

struct PrefillTask {
  int64_t chunk, head, q0, qn, keys;  // keys: how many the task's last query attends to
};

// A cached element as float32 (a bfloat16 widened: exact).
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// Scratch of one thread, sized for the largest task; KV: the cache's element type.
template <typename KV>
struct PrefillScratch {
  std::vector<float> qt, ot, p;
  std::vector<const KV*> krow, vrow;
  void fit(int64_t R, int64_t D) {
    qt.assign(D * R, 0.f);
    ot.assign(D * R, 0.f);
    p.assign(16 * R, 0.f);
    krow.resize(16);
    vrow.resize(16);
  }
};

// One task. Rows r = i * G + g (query i of the task, head g of the kv head's group); R rounded up
// to a multiple of 16 with copies of the last query (never written out).
template <typename KV>
void prefill_task(const PrefillTask& t, const float* q, const KV* kf, const KV* vf,
                  const int64_t* table, const int64_t* span, int64_t bs, int64_t Hkv, int64_t G,
                  int64_t D, float scale, float* out, PrefillScratch<KV>& s) {
  const int64_t H = Hkv * G, tok_stride = Hkv * D, blk_stride = bs * tok_stride;
  const int64_t row0 = span[0], ctx = span[2];
  const int64_t R = (t.qn * G + 15) / 16 * 16, NG = R / 16;
  float* qt = s.qt.data();
  float* ot = s.ot.data();
  float* pb = s.p.data();
  // Qt[d][r] = scale * q[r][d]; positions per row (padding rows repeat the last real row).
  alignas(64) int32_t pos[8 * QT + 16];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rr = std::min(r, t.qn * G - 1), i = rr / G, g = rr % G;
    const float* qrow = q + ((row0 + t.q0 + i) * H + t.head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * R + r] = qrow[d] * scale;
    pos[r] = static_cast<int32_t>(ctx + t.q0 + i);
  }
  std::fill(ot, ot + D * R, 0.f);
  __m512 m[8], l[8];  // per row group: running max and sum (NG <= 8 * QT / 16 = 8)
  // Per row group: rows that met a NaN or +inf score, or (below) whose every score is -inf: NaN
  // out, as the reference's softmax gives. Left to the loop they came out finite and wrong:
  // max_ps drops a NaN that a later key's score follows, and exp16 turns NaN into a finite value.
  __mmask16 broken[8] = {};
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t rg = 0; rg < NG; ++rg) {
    m[rg] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[rg] = _mm512_setzero_ps();
  }
  const int64_t min_pos = ctx + t.q0;  // the task's first query
  for (int64_t j0 = 0; j0 < t.keys; j0 += 16) {
    const int64_t tn = std::min<int64_t>(16, t.keys - j0);
    for (int64_t u = 0; u < tn; ++u) {
      const int64_t j = j0 + u;
      const int64_t off = table[j / bs] * blk_stride + (j % bs) * tok_stride + t.head * D;
      s.krow[u] = kf + off;
      s.vrow[u] = vf + off;
    }
    const bool diagonal = j0 + tn - 1 > min_pos;  // some row sees only part of this tile
    for (int64_t rg = 0; rg < NG; ++rg) {
      const float* qg = qt + rg * 16;
      // Scores: one vector (16 rows) per key, eight keys' chains at a time.
      __m512 sc[16];
      for (int64_t u0 = 0; u0 < tn; u0 += 8) {
        const int64_t un = std::min<int64_t>(8, tn - u0);
        __m512 a[8];
        for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
        if (un == 8) {
          for (int64_t d = 0; d < D; ++d) {
            const __m512 qd = _mm512_loadu_ps(qg + d * R);
            for (int u = 0; u < 8; ++u)
              a[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(widen(s.krow[u0 + u][d])), a[u]);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) {
            const __m512 qd = _mm512_loadu_ps(qg + d * R);
            for (int u = 0; u < 8; ++u)
              if (u < un)
                a[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(widen(s.krow[u0 + u][d])), a[u]);
          }
        }
        for (int u = 0; u < 8; ++u)
          if (u < un) sc[u0 + u] = a[u];
      }
      // Causal mask, then the running max.
      const __m512i pv = _mm512_load_si512(pos + rg * 16);
      __mmask16 valid[16];
      __m512 mx = m[rg];
      for (int64_t u = 0; u < tn; ++u) {
        valid[u] = diagonal ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j0 + u)),
                                                   pv, _MM_CMPINT_LE)
                            : static_cast<__mmask16>(0xFFFF);
        mx = _mm512_mask_max_ps(mx, valid[u], mx, sc[u]);
        broken[rg] |= _mm512_mask_cmp_ps_mask(valid[u], sc[u], inf, _CMP_NLT_UQ);  // NaN, +inf
      }
      // Rescale what is accumulated when a row's max grew (exp of -inf - finite: ~0, and the
      // accumulators are still 0 then).
      const __mmask16 grew = _mm512_cmp_ps_mask(mx, m[rg], _CMP_GT_OQ);
      if (grew) {
        const __m512 alpha = exp16(_mm512_sub_ps(m[rg], mx));
        l[rg] = _mm512_mask_mul_ps(l[rg], grew, l[rg], alpha);
        float* og = ot + rg * 16;
        for (int64_t d = 0; d < D; ++d)
          _mm512_storeu_ps(og + d * R, _mm512_mask_mul_ps(_mm512_loadu_ps(og + d * R), grew,
                                                         _mm512_loadu_ps(og + d * R), alpha));
        m[rg] = mx;
      }
      __m512 sum = l[rg];
      for (int64_t u = 0; u < tn; ++u) {
        const __m512 e = _mm512_maskz_mov_ps(valid[u], exp16(_mm512_sub_ps(sc[u], mx)));
        _mm512_storeu_ps(pb + u * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
      l[rg] = sum;
      // Values: Ot[d] += p_u * v_u[d], eight elements of d at a time kept in registers.
      float* og = ot + rg * 16;
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m512 o[8];
        for (int c = 0; c < 8; ++c) o[c] = _mm512_loadu_ps(og + (d0 + c) * R);
        for (int64_t u = 0; u < tn; ++u) {
          const __m512 pu = _mm512_loadu_ps(pb + u * 16);
          const KV* v = s.vrow[u] + d0;
          for (int c = 0; c < 8; ++c)
            o[c] = _mm512_fmadd_ps(pu, _mm512_set1_ps(widen(v[c])), o[c]);
        }
        for (int c = 0; c < 8; ++c) _mm512_storeu_ps(og + (d0 + c) * R, o[c]);
      }
    }
  }
  // out[row] = Ot[:, r] / l[r] for the real rows.
  alignas(64) float inv[8 * 16];
  for (int64_t rg = 0; rg < NG; ++rg) {
    broken[rg] |= _mm512_cmp_ps_mask(m[rg], _mm512_sub_ps(_mm512_setzero_ps(), inf), _CMP_EQ_OQ);
    _mm512_storeu_ps(inv + rg * 16,
                     _mm512_mask_mov_ps(_mm512_div_ps(_mm512_set1_ps(1.f), l[rg]), broken[rg],
                                        _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
  }
  for (int64_t r = 0; r < t.qn * G; ++r) {
    const int64_t i = r / G, g = r % G;
    float* orow = out + ((row0 + t.q0 + i) * H + t.head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = ot[d * R + r] * inv[r];
  }
}
#endif

// Whether paged_prefill_attention takes G query heads per kv head of head_dim D here.
bool prefill_supported(int64_t G, int64_t D) {
#ifdef EI_AVX512
  return G >= 1 && G <= 8 && D % 16 == 0;
#else
  (void)G;
  (void)D;
  return false;
#endif
}

// out[rows of each chunk] = causal attention of those rows of q over their request's keys.
//   q, out   (T, H, D) float32 contiguous: the step's rows (decode rows are left alone)
//   k_cache, v_cache (num_blocks, block_size, Hkv, D) float32, or bfloat16 (widened as read)
//   spans    (C, 3) int64: per chunk, its first row in q, its rows, its tokens cached before it
//   tables   (C, nb) int64: per chunk, its request's block table (covering ctx + rows keys)
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor spans, torch::Tensor tables, double scale,
                             torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  out.sizes() == q.sizes(),
              "paged_prefill_attention: q, out (T, H, D), caches (blocks, block_size, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_prefill_attention: tensors must be contiguous");
  for (const auto* x : {&q, &out})
    TORCH_CHECK(x->scalar_type() == torch::kFloat32, "paged_prefill_attention: float32 q and out");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (bf16 || k_cache.scalar_type() == torch::kFloat32),
              "paged_prefill_attention: float32 or bfloat16 caches, got ", k_cache.scalar_type(),
              " and ", v_cache.scalar_type());
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && D == k_cache.size(3) && H % Hkv == 0,
              "paged_prefill_attention: head_dim or head count mismatch");
  const int64_t G = H / Hkv;
  TORCH_CHECK(prefill_supported(G, D), "paged_prefill_attention: ", G, " query heads per kv "
              "head of head_dim ", D, " not supported here (prefill_supported)");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && tables.scalar_type() == torch::kInt64 &&
                  spans.is_contiguous() && tables.is_contiguous() && spans.dim() == 2 &&
                  spans.size(1) == 3 && tables.dim() == 2 && tables.size(0) == spans.size(0),
              "paged_prefill_attention: spans (C, 3) and tables (C, nb) contiguous int64");
#ifdef EI_AVX512  // (prefill_supported says no elsewhere: the check above has failed)
  const int64_t C = spans.size(0), nb = tables.size(1), nblocks = k_cache.size(0);
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<PrefillTask> tasks;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t row0 = sp[3 * c], n = sp[3 * c + 1], ctx = sp[3 * c + 2];
    // (written so that no sum can overflow: huge values are refused, not wrapped around)
    TORCH_CHECK(n >= 1 && row0 >= 0 && row0 <= T && n <= T - row0 && ctx >= 0,
                "paged_prefill_attention: chunk ", c, " rows ", row0, " + ", n,
                " outside the step's ", T);
    TORCH_CHECK(ctx <= nb * bs - n, "paged_prefill_attention: chunk ", c, " has ", ctx, " + ",
                n, " keys, its block table ", nb * bs);
    for (int64_t b = 0; b < (ctx + n + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[c * nb + b] >= 0 && tp[c * nb + b] < nblocks, "paged_prefill_attention: "
                  "block ", tp[c * nb + b], " of chunk ", c, " outside the cache's ", nblocks);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t q0 = 0; q0 < n; q0 += QT) {
        const int64_t qn = std::min(QT, n - q0);
        tasks.push_back({c, h, q0, qn, ctx + q0 + qn});
      }
  }
  // Longest first, handed out one at a time: the threads finish together.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& a, const PrefillTask& b) { return a.keys > b.keys; });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntasks)));
  auto run = [&](const auto* kf, const auto* vf) {
    using KV = std::remove_cv_t<std::remove_pointer_t<decltype(kf)>>;
#pragma omp parallel num_threads(threads)
    {
      PrefillScratch<KV> scratch;
      scratch.fit((QT * G + 15) / 16 * 16, D);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < ntasks; ++i) {
        const PrefillTask& t = tasks[i];
        prefill_task(t, qp, kf, vf, tp + t.chunk * nb, sp + 3 * t.chunk, bs, Hkv, G, D, fscale,
                     op, scratch);
      }
    }
  };
  if (bf16)
    run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal attention of prompt chunks over a paged KV cache, in place (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_supported", &prefill_supported,
        "Whether paged_prefill_attention takes G query heads per kv head of head_dim D");
}
