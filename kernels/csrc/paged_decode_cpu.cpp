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

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / Hkv, h = task % Hkv;
      const int64_t L = lp[i];
      scores.assign(G * L, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(qp[(i * H + h * G + g) * D + d]) * fscale;
      // Pass 1: scores of every key, for the G query heads.
      for (int64_t j = 0; j < L; ++j) {
        const T* key = kp + bp[i * nb + j / bs] * blk_stride + (j % bs) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(key[d]);
          scores[g * L + j] = s;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < L; ++j) m = std::max(m, sg[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = std::exp(sg[j] - m);
          sum += sg[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
      }
      // Pass 2: weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < L; ++j) {
        const T* val = vp + bp[i * nb + j / bs] * blk_stride + (j % bs) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(val[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(i * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
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
