// Decode attention over the paged KV cache, on the CPU, reading keys and values in place.
//
// The PyTorch reference (kernels/attention.py) copies every request's blocks into a padded
// tensor before calling SDPA; this kernel walks the block table instead, so each cached key and
// value is read once and nothing is copied. One task per (request, kv head): the G query heads
// that share the kv head are computed together, so each key is loaded once for all of them.
//
//   q        (n, H, D)                    one query per request
//   k_cache  (num_blocks, block_size, Hkv, D)
//   v_cache  (num_blocks, block_size, Hkv, D)
//   blocks   (n, nb) int64                block table of each request (padding unused)
//   lens     (n,) int64                   keys each request attends to
//   out      (n, H, D)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EI_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

template <typename T>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& blocks, const torch::Tensor& lens, double scale,
                   torch::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, nb = blocks.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t tok_stride = Hkv * D, blk_stride = bs * Hkv * D;
  const float fscale = static_cast<float>(scale);

  // A task is one request and a range of its kv heads: all of them when there are enough requests
  // to keep the threads busy, so that each cached row (every head of a token) is read once.
  const int64_t heads_per_task = n >= 8 ? Hkv : 1;
  const int64_t tasks_per_req = Hkv / heads_per_task;
  at::parallel_for(0, n * tasks_per_req, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / tasks_per_req;
      const int64_t h0 = (task % tasks_per_req) * heads_per_task, h1 = h0 + heads_per_task;
      const int64_t L = lp[i];
      const int64_t* table = bp + i * nb;
      scores.resize(H * L);
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq)
        for (int64_t d = 0; d < D; ++d)
          qf[hq * D + d] = static_cast<float>(qp[(i * H + hq) * D + d]) * fscale;
      // Pass 1: scores of every key, block by block; the block stays in cache across heads.
      for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const T* block = kp + table[j0 / bs] * blk_stride;
        const int64_t tn = std::min(bs, L - j0);
        for (int64_t h = h0; h < h1; ++h)
          block_scores<T>(qf.data() + h * G * D, block + h * D, tok_stride, tn, G, D,
                          scores.data() + h * G * L, L, j0);
      }
      // Softmax per query head (exp vectorized).
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
        float* sg = scores.data() + hq * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < L; ++j) m = std::max(m, sg[j]);
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
      for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const T* block = vp + table[j0 / bs] * blk_stride;
        const int64_t tn = std::min(bs, L - j0);
        for (int64_t h = h0; h < h1; ++h)
          block_values<T>(scores.data() + h * G * L, block + h * D, tok_stride, tn, G, D,
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_decode_attention: dtype mismatch");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head_dim or head count mismatch");
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64 &&
                  blocks.is_contiguous() && lens.is_contiguous(),
              "paged_decode_attention: blocks and lens must be contiguous int64");
  TORCH_CHECK(blocks.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "paged_decode_attention: one block table and one length per query");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU)");
}
