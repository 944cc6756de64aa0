// The small per-layer steps of a decoder layer, each one call instead of several torch ops.
//
// At decode time a layer's elementwise work is a few KiB, and torch pays its dispatch for each
// op (~3-15 us on the 2-core development machine): the rotary embedding in the rotate-half
// layout (split, neg, cat, two muls, add, for q and k) and the two `index_copy_` writes of the KV
// cache took ~60 ops and ~1.5 ms of a ~20 ms single-request step over SmolLM2's 30 layers; the
// gated MLP's silu(gate) * up another three. Here each is one call: float32, plain loops the
// compiler vectorizes (-O3 -march=native). Rows run in parallel when there are many (a
// prefill); a decode step's few rows run on the calling thread, where an OpenMP fork would cost
// more than the work.
//
// rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots) -> (q_rot, k_rot)
//   q (T, H, D), k and v (T, KVH, D): views with unit stride along D (e.g. slices of the fused
//   qkv projection's output); cos, sin (T, D) contiguous; caches (S, KVH, D) contiguous, float32
//   or bfloat16 (a KV cache kept in bfloat16: rounded to nearest even, as torch's .to()); slots
//   (T,) int64, a negative slot writes nothing (a padded row). Returns q and k rotated, as new
//   contiguous tensors, and stores the rotated k and v at their slots.
// silu_and_mul(x) -> y: x (T, 2I) contiguous, gate then up -> y (T, I) = silu(gate) * up.

#include <torch/extension.h>

#include <cmath>
#include <tuple>

#include "simd_exp.h"

// out = x * cos + rotate_half(x) * sin for one head of D (even) values.
static inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

static void check_heads(const torch::Tensor& t, const char* name, int64_t T, int64_t D) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == T && t.size(2) == D,
              "rotary_write_kv: ", name, " (T=", T, ", heads, D=", D, ") expected, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == torch::kFloat, "rotary_write_kv: ", name, " float32 only");
  TORCH_CHECK(t.stride(2) == 1, "rotary_write_kv: ", name, " needs unit stride along head_dim");
}

std::tuple<torch::Tensor, torch::Tensor> rotary_write_kv(torch::Tensor q, torch::Tensor k,
                                                         torch::Tensor v, torch::Tensor cos,
                                                         torch::Tensor sin, torch::Tensor k_cache,
                                                         torch::Tensor v_cache, torch::Tensor slots) {
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0, "rotary_write_kv: head_dim must be even, got ", D);
  check_heads(q, "q", T, D);
  check_heads(k, "k", T, D);
  check_heads(v, "v", T, D);
  const int64_t H = q.size(1), KVH = k.size(1);
  TORCH_CHECK(v.size(1) == KVH, "rotary_write_kv: k has ", KVH, " heads, v ", v.size(1));
  for (const auto* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == torch::kFloat && c->is_contiguous() && c->dim() == 2 &&
                    c->size(0) == T && c->size(1) == D,
                "rotary_write_kv: cos and sin (T, D) float32 contiguous expected, got ", c->sizes());
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  for (const auto* c : {&k_cache, &v_cache})
    TORCH_CHECK((c->scalar_type() == torch::kFloat || c->scalar_type() == torch::kBFloat16) &&
                    c->scalar_type() == k_cache.scalar_type() && c->is_contiguous() &&
                    c->dim() == 3 && c->size(1) == KVH && c->size(2) == D,
                "rotary_write_kv: caches (slots, ", KVH, ", ", D, ") contiguous, both float32 or "
                "both bfloat16, expected, got ", c->sizes(), " ", c->scalar_type());
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == T,
              "rotary_write_kv: slots (T,) int64 expected, got ", slots.sizes());
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t S = k_cache.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < S, "rotary_write_kv: slot ", sp[t], " past the cache's ", S, " slots");

  auto q_out = torch::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  auto k_out = torch::empty({T, KVH, D}, k.options().memory_format(at::MemoryFormat::Contiguous));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  float *kc = bf16 ? nullptr : k_cache.data_ptr<float>();
  float *vc = bf16 ? nullptr : v_cache.data_ptr<float>();
  at::BFloat16* kb = bf16 ? k_cache.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* vb = bf16 ? v_cache.data_ptr<at::BFloat16>() : nullptr;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);

  auto row = [&](int64_t t) {
    const float *c = cp + t * D, *s = snp + t * D;
    for (int64_t h = 0; h < H; ++h) rotate(qp + t * qs0 + h * qs1, c, s, qo + (t * H + h) * D, D);
    for (int64_t h = 0; h < KVH; ++h) {
      float* kr = ko + (t * KVH + h) * D;
      rotate(kp + t * ks0 + h * ks1, c, s, kr, D);
      if (sp[t] < 0) continue;
      const int64_t at = (sp[t] * KVH + h) * D;
      const float* vr = vp + t * vs0 + h * vs1;
      if (bf16) {
        for (int64_t i = 0; i < D; ++i) {
          kb[at + i] = at::BFloat16(kr[i]);
          vb[at + i] = at::BFloat16(vr[i]);
        }
      } else {
        for (int64_t i = 0; i < D; ++i) {
          kc[at + i] = kr[i];
          vc[at + i] = vr[i];
        }
      }
    }
  };
  if (T >= 16) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) row(t);
  } else {
    for (int64_t t = 0; t < T; ++t) row(t);
  }
  return {q_out, k_out};
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "silu_and_mul: x (T, 2I) float32 contiguous expected, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even, got ", x.size(1));
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto y = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto row = [&](int64_t t) {
    const float *g = xp + t * 2 * I, *u = g + I;
    float* o = yp + t * I;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= I; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      // a NaN gate gives a finite e, and a NaN result all the same (through gv)
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)),
                                            _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  };
  if (T >= 16) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) row(t);
  } else {
    for (int64_t t = 0; t < T; ++t) row(t);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_write_kv", &rotary_write_kv,
        "q and k rotated (rotate-half RoPE), rotated k and v stored at their cache slots, float32",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over (T, 2I) float32", py::arg("x"));
}
