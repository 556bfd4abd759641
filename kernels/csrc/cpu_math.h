// What the attention, sampling and elementwise kernels share: the device check, float32 <-> bfloat16 conversions
// as bit arithmetic, exp_any, and float32 lane loads of either dtype. Which lanes exist is the build's ISA tier
// (kernels/cpu_isa.py): AVX-512 (x86-64-v4 and up), AVX2 + FMA alone (x86-64-v3), or neither (x86-64-v2).
#pragma once

#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace llmserve {

inline void check_cpu(std::initializer_list<torch::Tensor> tensors, const char* op) {
  for (const auto& t : tensors) TORCH_CHECK(t.device().is_cpu(), op, ": CPU tensors only");
}

// Conversions written as plain bit arithmetic (no branch) so that loops over them vectorize.
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
// Round to nearest even, NaN to the quiet NaN: the same bits as torch's float -> bfloat16 conversion.
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(r), c10::BFloat16::from_bits());
}

// e^x (x clamped to [-87, 88]) as plain arithmetic a compiler vectorizes: 2^(x log2 e) split into 2^n, built in the
// exponent bits, and 2^f for f in [-0.5, 0.5] by a degree-6 polynomial (relative error ~2e-7, float32's own).
inline float exp_any(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = y - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

#ifdef __AVX512F__
// 16 values as float32 lanes
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 8 values as float32 lanes: the portable attention path's dot and axpy on CPUs with AVX2 but not AVX-512
#define LLMSERVE_AVX2_ONLY 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

}  // namespace llmserve
