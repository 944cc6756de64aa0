// The small per-layer steps of a decoder layer, each one call instead of several torch ops.
//
// At decode time a layer's elementwise work is a few KiB, and torch pays its dispatch for each
// op (~3-15 us on the 2-core development machine): the rotary embedding in the rotate-half
// layout (split, neg, cat, two muls, add, for q and k) and the two `index_copy_` writes of the KV
// cache took ~60 ops and ~1.5 ms of a ~20 ms single-request step over SmolLM2's 30 layers; the
// gated MLP's silu(gate) * up another three. Here each is one call: float32 in plain loops the
// compiler vectorizes (-O3 -march=native), bfloat16 in AVX-512 loops (scalar ones without
// AVX-512) that round as the reference does (below). Rows run in parallel when there are many (a
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
//
// Both take float32 or bfloat16 activations (q, k, v, cos and sin all of one). In bfloat16 they
// compute in float32 but round where the reference (kernels/rotary.py, kernels/activation.py on
// bfloat16 tensors) rounds, op by op, as torch computes a bfloat16 op: in float32, the result
// rounded to nearest even. RoPE: x * cos and rotate_half(x) * sin each rounded (exact float32
// products of bfloat16 values), then their sum; so it equals the reference bit for bit.
// SiLU-and-mul: silu(gate) rounded, then its product with up. torch's exp (Sleef's, or libm's
// on its scalar path) and ours (simd_exp.h, libm's on the tail) may differ in float32's last
// bit, which would move a bfloat16 rounding at a near-tie; but silu(gate) depends on the gate
// alone, one of 65536 bfloat16 values, and for every one of them the rounded result equals
// torch's (torch 2.13, 2-core Xeon, 2026-11-25; tests/test_fused_cpu.py checks them all), so the
// whole op equals the reference bit for bit there.
// bfloat16 at SmolLM2-135M's shapes, reference -> this, us a call through kernels/*.py (2-core
// Xeon, 2026-11-25): RoPE + KV write (9 + 3 heads of 64) 25.3 -> 2.9 at T = 1, 32.1 -> 4.1 at 8,
// 73.0 -> 12.8 at 64, 317.6 -> 61.3 at 512; SiLU-and-mul (I = 1536) 7.6 -> 2.1, 14.6 -> 6.6,
// 42.3 -> 24.1, 300.9 -> 176.9 (float32's kernel: 1.7, 4.5, 15.1, 165.1; the division and exp
// cost alike, bfloat16 adds the conversions and roundings).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "bf16_round.h"
#include "simd_exp.h"

// out = x * cos + rotate_half(x) * sin for one head of D (even) values.
static inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

// The same in bfloat16, rounded as the reference rounds: round(round(x * cos) +
// round(rotate_half(x) * sin)); rotate_half's negation is exact, and round(-p) = -round(p).
static inline void rotate_bf16(const uint16_t* x, const uint16_t* c, const uint16_t* s,
                               uint16_t* out, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16_bf16(x + i), x2 = load16_bf16(x + i + half);
    const __m512 a1 = round16_bf16(_mm512_mul_ps(x1, load16_bf16(c + i)));
    const __m512 b1 = round16_bf16(_mm512_mul_ps(x2, load16_bf16(s + i)));
    const __m512 a2 = round16_bf16(_mm512_mul_ps(x2, load16_bf16(c + i + half)));
    const __m512 b2 = round16_bf16(_mm512_mul_ps(x1, load16_bf16(s + i + half)));
    store16_bf16(out + i, _mm512_sub_ps(a1, b1));
    store16_bf16(out + i + half, _mm512_add_ps(a2, b2));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
    const float a1 = round_bf16(x1 * bf16_to_float(c[i]));
    const float b1 = round_bf16(x2 * bf16_to_float(s[i]));
    const float a2 = round_bf16(x2 * bf16_to_float(c[i + half]));
    const float b2 = round_bf16(x1 * bf16_to_float(s[i + half]));
    out[i] = float_to_bf16(a1 - b1);
    out[i + half] = float_to_bf16(a2 + b2);
  }
}

static void check_heads(const torch::Tensor& t, const char* name, int64_t T, int64_t D,
                        torch::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == T && t.size(2) == D,
              "rotary_write_kv: ", name, " (T=", T, ", heads, D=", D, ") expected, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, "rotary_write_kv: ", name, " float32 or bfloat16, as q, "
              "expected, got ", t.scalar_type());
  TORCH_CHECK(t.stride(2) == 1, "rotary_write_kv: ", name, " needs unit stride along head_dim");
}

std::tuple<torch::Tensor, torch::Tensor> rotary_write_kv(torch::Tensor q, torch::Tensor k,
                                                         torch::Tensor v, torch::Tensor cos,
                                                         torch::Tensor sin, torch::Tensor k_cache,
                                                         torch::Tensor v_cache, torch::Tensor slots) {
  // OpenMP's thread count is kept per calling thread: on one where torch has run no parallel op
  // yet (the engine's step loop is a fresh thread), a region would fork libgomp's default
  // (OMP_NUM_THREADS, or every core), not torch.set_num_threads' count; set it as torch's own
  // ops do on their first call in a thread.
  at::internal::lazy_init_num_threads();
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0, "rotary_write_kv: head_dim must be even, got ", D);
  const auto act = q.scalar_type();
  TORCH_CHECK(act == torch::kFloat || act == torch::kBFloat16,
              "rotary_write_kv: q float32 or bfloat16 expected, got ", act);
  check_heads(q, "q", T, D, act);
  check_heads(k, "k", T, D, act);
  check_heads(v, "v", T, D, act);
  const int64_t H = q.size(1), KVH = k.size(1);
  TORCH_CHECK(v.size(1) == KVH, "rotary_write_kv: k has ", KVH, " heads, v ", v.size(1));
  for (const auto* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == act && c->is_contiguous() && c->dim() == 2 &&
                    c->size(0) == T && c->size(1) == D,
                "rotary_write_kv: cos and sin (T, D) contiguous, of q's dtype (", act,
                "), expected, got ", c->sizes(), " ", c->scalar_type());
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
  float *kc = bf16 ? nullptr : k_cache.data_ptr<float>();
  float *vc = bf16 ? nullptr : v_cache.data_ptr<float>();
  at::BFloat16* kb = bf16 ? k_cache.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* vb = bf16 ? v_cache.data_ptr<at::BFloat16>() : nullptr;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  auto run_rows = [&](auto row) {
    if (T >= 16) {
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < T; ++t) row(t);
    } else {
      for (int64_t t = 0; t < T; ++t) row(t);
    }
  };

  // Each token: its q heads and k heads rotated into q_out and k_out, then (a slot >= 0) the
  // rotated k and v stored by `store(at, k row, v row)` at element `at` of the caches.
  auto rotate_rows = [&](const auto* qp, const auto* kp, const auto* vp, const auto* cp,
                         const auto* snp, auto* qo, auto* ko, auto rot, auto store) {
    run_rows([&](int64_t t) {
      const auto *c = cp + t * D, *s = snp + t * D;
      for (int64_t h = 0; h < H; ++h) rot(qp + t * qs0 + h * qs1, c, s, qo + (t * H + h) * D, D);
      for (int64_t h = 0; h < KVH; ++h) {
        auto* kr = ko + (t * KVH + h) * D;
        rot(kp + t * ks0 + h * ks1, c, s, kr, D);
        if (sp[t] >= 0) store((sp[t] * KVH + h) * D, kr, vp + t * vs0 + h * vs1);
      }
    });
  };

  if (act == torch::kBFloat16) {
    // The rotated k and v are bfloat16 values already: a bfloat16 cache takes their bits, a
    // float32 one their exact widening (the reference's .to(cache dtype)).
    using u16 = uint16_t;
    u16 *kbu = reinterpret_cast<u16*>(kb), *vbu = reinterpret_cast<u16*>(vb);
    rotate_rows(reinterpret_cast<const u16*>(q.data_ptr<at::BFloat16>()),
                reinterpret_cast<const u16*>(k.data_ptr<at::BFloat16>()),
                reinterpret_cast<const u16*>(v.data_ptr<at::BFloat16>()),
                reinterpret_cast<const u16*>(cos.data_ptr<at::BFloat16>()),
                reinterpret_cast<const u16*>(sin.data_ptr<at::BFloat16>()),
                reinterpret_cast<u16*>(q_out.data_ptr<at::BFloat16>()),
                reinterpret_cast<u16*>(k_out.data_ptr<at::BFloat16>()), rotate_bf16,
                [&](int64_t at, const u16* kr, const u16* vr) {
                  if (bf16) {
                    std::memcpy(kbu + at, kr, D * sizeof(u16));
                    std::memcpy(vbu + at, vr, D * sizeof(u16));
                  } else {
                    for (int64_t i = 0; i < D; ++i) {
                      kc[at + i] = bf16_to_float(kr[i]);
                      vc[at + i] = bf16_to_float(vr[i]);
                    }
                  }
                });
  } else {
    rotate_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                cos.data_ptr<float>(), sin.data_ptr<float>(), q_out.data_ptr<float>(),
                k_out.data_ptr<float>(), rotate,
                [&](int64_t at, const float* kr, const float* vr) {
                  if (bf16) {
                    for (int64_t i = 0; i < D; ++i) {
                      kb[at + i] = at::BFloat16(kr[i]);
                      vb[at + i] = at::BFloat16(vr[i]);
                    }
                  } else {
                    std::memcpy(kc + at, kr, D * sizeof(float));
                    std::memcpy(vc + at, vr, D * sizeof(float));
                  }
                });
  }
  return {q_out, k_out};
}

#ifdef __AVX512F__
// exp(x) of 16 lanes as torch's exp gives it: exp16 clamps its argument at ~88.376, where torch's
// goes on to ~88.72 and is inf beyond (silu -0 there, or NaN at a gate of -inf; the clamp gave
// -1e-36 and -inf). Lanes past the clamp, seldom seen, take std::exp.
static inline __m512 exp16_unclamped(__m512 x) {
  __m512 e = exp16(x);
  const __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.3762626647949f), _CMP_GT_OQ);
  if (big) {
    alignas(64) float ev[16], xv[16];
    _mm512_store_ps(ev, e);
    _mm512_store_ps(xv, x);
    for (int l = 0; l < 16; ++l)
      if (big >> l & 1) ev[l] = std::exp(xv[l]);
    e = _mm512_load_ps(ev);
  }
  return e;
}
#endif

// silu(gate) * up over one row of bfloat16, as the reference rounds: silu(gate) (torch: g / (1 +
// exp(-g)) in float32) rounded, then its product with up.
static void silu_mul_row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= I; i += 16) {
    const __m512 gv = load16_bf16(g + i);
    // a NaN gate gives a finite e, and a NaN result all the same
    const __m512 e = exp16_unclamped(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 sv = round16_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
    store16_bf16(o + i, _mm512_mul_ps(sv, load16_bf16(u + i)));
  }
#endif
  for (; i < I; ++i) {
    const float gf = bf16_to_float(g[i]);
    o[i] = float_to_bf16(round_bf16(gf / (1.f + std::exp(-gf))) * bf16_to_float(u[i]));
  }
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  at::internal::lazy_init_num_threads();  // torch.set_num_threads' count (see rotary_write_kv)
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "silu_and_mul: x (T, 2I) float32 or bfloat16 contiguous expected, got ", x.sizes(),
              " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even, got ", x.size(1));
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto y = torch::empty({T, I}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    auto row = [&](int64_t t) {
      silu_mul_row_bf16(xp + t * 2 * I, xp + t * 2 * I + I, yp + t * I, I);
    };
    if (T >= 16) {
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < T; ++t) row(t);
    } else {
      for (int64_t t = 0; t < T; ++t) row(t);
    }
    return y;
  }
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
      const __m512 e = exp16_unclamped(_mm512_sub_ps(_mm512_setzero_ps(), gv));
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

// The index of each row's largest value, as torch.argmax gives it: the first of equal maxima,
// and the first NaN where a row has one (NaN counts as the largest). Greedy sampling over a
// (B, V) float32 logits tensor: torch's argmax ran at ~6 GB/s here (2.2 ms for 64 rows of a
// 49,152-token vocabulary); this reads each row twice from L2 (max, then its first index).
static int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(m);
  __mmask16 nan = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  if (nan) {  // the first NaN wins
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < V; ++i) {
    if (std::isnan(x[i])) {
      for (int64_t j = 0; j <= i; ++j)
        if (std::isnan(x[j])) return j;
    }
    m = std::max(m, x[i]);
  }
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 target = _mm512_set1_ps(m);
  for (; j + 16 <= V; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < V; ++j)
    if (x[j] == m) return j;
  return 0;  // (a row of -inf only: torch gives 0 too)
}

torch::Tensor argmax_rows(torch::Tensor x) {
  at::internal::lazy_init_num_threads();  // torch.set_num_threads' count (see rotary_write_kv)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  x.size(1) >= 1,
              "argmax_rows: contiguous (B, V) float32 expected, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t B = x.size(0), V = x.size(1);
  auto out = torch::empty({B}, torch::kLong);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  if (B >= 4) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; ++b) op[b] = argmax_row(xp + b * V, V);
  } else {
    for (int64_t b = 0; b < B; ++b) op[b] = argmax_row(xp + b * V, V);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_write_kv", &rotary_write_kv,
        "q and k rotated (rotate-half RoPE), rotated k and v stored at their cache slots, float32 "
        "or bfloat16",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over (T, 2I) float32 or bfloat16",
        py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=1) of a (B, V) float32 tensor",
        py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
}
