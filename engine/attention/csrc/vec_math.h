// Vector math shared by the native attention kernels (paged_decode.cpp, prefill_attention.cpp):
// exp2 on 16 (AVX-512) and 8 (AVX2) lanes, and 8-lane reductions. engine.native_build hashes the
// headers beside a source into its build's name, so a change here rebuilds both.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// 2^f for f in [-0.5, 0.5] by a degree-6 polynomial (fitted on Chebyshev nodes; max relative
// error ~1e-7, about one fp32 ulp): its coefficients, highest degree first (Horner's order).
constexpr float kExp2Poly[7] = {1.5469732170458883e-4f, 1.3400432653725147e-3f,
                                9.618025273084640e-3f,  5.550327152013779e-2f,
                                0.24022650718688965f,   0.6931471824645996f,
                                1.f};

#if defined(__AVX512F__)

// 2^x for x <= 0: x = n + f with f in [-0.5, 0.5], 2^f by kExp2Poly, then vscalefps applies
// 2^n. Inputs below -126 give ~2^-126: such probabilities are below fp32 resolution against
// the max.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)

// 2^x for x <= 0 on 8 lanes: kExp2Poly as in exp2_ps, with 2^n put into the exponent bits (AVX2
// has no vscalefps). n is in [-126, 0], so n + 127 is a normal exponent.
inline __m256 exp2_ps8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// r[t] = sum of the 8 lanes of v[t]: two rounds of hadd and one cross-half add for 8 dot
// products.
inline __m256 reduce8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // b0 = [v0..v3 low-half sums | v0..v3 high-half sums], b1 the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

#endif  // __AVX2__ && __FMA__
