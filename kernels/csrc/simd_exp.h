// exp over the lanes of a vector, shared by the CPU extensions that include it (each builds on
// its own; kernels/cpu_ext.py hashes this header into every extension's build key).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

// exp over 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-7 fit (Cephes'
// expf coefficients; relative error ~1e-7, as libm's), the power of two by scalef; x clamped to
// +-88 (exp overflows float32 beyond), so exp16(-inf) is ~1e-38, not 0: mask lanes that must be
// 0. A NaN x comes out finite (min/max return their second operand on NaN).
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif
