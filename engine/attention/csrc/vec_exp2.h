// exp2 on AVX-512 lanes, shared by the native attention kernels (paged_decode.cpp,
// prefill_attention.cpp). engine.native_build hashes the headers beside a source into its
// build's name, so a change here rebuilds both.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// 2^x for x <= 0: x = n + f with f in [-0.5, 0.5], 2^f by a degree-6 polynomial (fitted on
// Chebyshev nodes; max relative error ~1e-7, about one fp32 ulp), then vscalefps applies 2^n.
// Inputs below -126 give ~2^-126: such probabilities are below fp32 resolution against the max.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5469732170458883e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3400432653725147e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618025273084640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327152013779e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650718688965f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471824645996f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

#endif  // __AVX512F__
