// Horizontal sums of AVX2 float32 lanes, shared by the C++ kernels (kernels/cpu_ops.py builds every csrc/*.cpp
// into one module and keys the build on csrc/*.h too).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace llmserve {

// the sum of 8 lanes
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one transpose-and-add
inline __m256 sum8x8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

}  // namespace llmserve
#endif
