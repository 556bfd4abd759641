// The decoder's per-token elementwise steps, one pass each: rms_norm, rope_, silu_mul_ (rounded where Hugging Face's
// bfloat16 ops round, so the results equal the chain of torch ops up to float32 summation order) and write_kv.
#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16_lanes.h"
#include "cpu_math.h"
#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using llmserve::check_cpu;
using llmserve::exp_any;
using llmserve::from_float;
using llmserve::to_float;
#ifdef __AVX512F__
using llmserve::load16;
#endif

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, double eps, torch::Tensor& out) {
  const int64_t rows = x.size(0), H = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * os;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      // HF: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype): the normalized row is rounded first.
#pragma omp simd
      for (int64_t i = 0; i < H; ++i)
        orow[i] = from_float<T>(to_float(wp[i]) * to_float(from_float<T>(to_float(xr[i]) * inv)));
    }
  });
}

template <typename T>
void rope_impl(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos,
               const torch::Tensor& sin) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1), cs = cos.stride(0);
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (half % 16 == 0) {  // 16 lanes of each half at a time, the same roundings as the loop below
      using llmserve::round_bf16;
      at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const T* c = cp + pos[t] * cs;
          const T* s = sp + pos[t] * cs;
          for (int64_t h = 0; h < H; ++h) {
            T* v = xp + t * ts + h * hs;
            for (int64_t d = 0; d < half; d += 16) {
              const __m512 x0 = load16(v + d), x1 = load16(v + d + half);
              const __m512 y0 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x0, load16(c + d))),
                                              round_bf16(_mm512_mul_ps(x1, load16(s + d))));
              const __m512 y1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, load16(c + d + half))),
                                              round_bf16(_mm512_mul_ps(x0, load16(s + d + half))));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + d), _mm512_cvtepi32_epi16(llmserve::to_bf16(y0)));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + d + half),
                                  _mm512_cvtepi32_epi16(llmserve::to_bf16(y1)));
            }
          }
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + pos[t] * cs;
      const T* s = sp + pos[t] * cs;
      for (int64_t h = 0; h < H; ++h) {
        T* v = xp + t * ts + h * hs;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) tmp[d] = to_float(v[d]);
        // x * cos + swap_halves(x) * sin_signed, each product and the sum rounded to T as the torch ops do; a loop
        // per half, so that each reads its partner half in order (one loop picking d +- half ran scalar)
        const auto rotate = [&](int64_t d0, int64_t shift) {
#pragma omp simd
          for (int64_t d = d0; d < d0 + half; ++d) {
            const float a = to_float(from_float<T>(tmp[d] * to_float(c[d])));
            const float b = to_float(from_float<T>(tmp[d + shift] * to_float(s[d])));
            v[d] = from_float<T>(a + b);
          }
        };
        rotate(0, half);
        rotate(half, -half);
      }
    }
  });
}

template <typename T>
void silu_mul_impl(torch::Tensor& gate, const torch::Tensor& up) {
  const int64_t rows = gate.size(0), H = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* gr = g + r * gs;
      const T* ur = u + r * us;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) {
        const float x = to_float(gr[i]);
        // F.silu(gate) rounded to T, then * up rounded: the two torch ops
        gr[i] = from_float<T>(to_float(from_float<T>(x / (1.f + exp_any(-x)))) * to_float(ur[i]));
      }
    }
  });
}

}  // namespace

// gate = silu(gate) * up in place; gate, up [rows, H] with unit stride in H.
void silu_mul_(torch::Tensor gate, const torch::Tensor& up) {
  check_cpu({gate, up}, "silu_mul_");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
                  gate.scalar_type() == up.scalar_type(), "silu_mul_: gate and up [rows, H], unit stride, one dtype");
  if (gate.scalar_type() == torch::kBFloat16) {
    silu_mul_impl<c10::BFloat16>(gate, up);
  } else {
    TORCH_CHECK(gate.scalar_type() == torch::kFloat32, "silu_mul_: float32 or bfloat16");
    silu_mul_impl<float>(gate, up);
  }
}

// key/value [T, Hkv, D] (each token's heads contiguous) into the caches [blocks, bs, Hkv, D] at slot_mapping [T]
// (int64, block * bs + offset; negative = skip), all of one dtype.
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor key_cache, torch::Tensor value_cache,
              const torch::Tensor& slot_mapping) {
  check_cpu({key, value, key_cache, value_cache, slot_mapping}, "write_kv");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2) &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0) &&
                  key_cache.size(2) * key_cache.size(3) == key.size(1) * key.size(2),
              "write_kv: key/value [T, Hkv, D] with contiguous heads, contiguous caches of their dtype, int64 slots");
  const int64_t n = key.size(0), row = key.size(1) * key.size(2) * key.element_size();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slots[t] < num_slots, "write_kv: slot ", slots[t], " past the cache");
  auto kp = static_cast<const char*>(key.data_ptr());
  auto vp = static_cast<const char*>(value.data_ptr());
  auto kc = static_cast<char*>(key_cache.data_ptr());
  auto vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * row, kp + t * ks, row);
    std::memcpy(vc + slots[t] * row, vp + t * vs, row);
  }
}

// RMSNorm of each row of x [rows, H] (unit stride in H) with weight [H], into a new tensor.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_cpu({x, w}, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1) &&
                  w.scalar_type() == x.scalar_type(), "rms_norm: x [rows, H] with unit stride, w [H] of x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == torch::kBFloat16) {
    rms_norm_impl<c10::BFloat16>(x, w, eps, out);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rms_norm: float32 or bfloat16");
    rms_norm_impl<float>(x, w, eps, out);
  }
  return out;
}

// Rotary embedding in place: x [T, H, D] (unit stride in D) at positions [T] (int64), with the cos and sign-flipped
// sin tables [max_position, D] (worker_svc.model.rope_tables): x = x * cos + swap_halves(x) * sin.
void rope_(torch::Tensor x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_cpu({x, positions, cos, sin}, "rope_");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(1) == x.size(2) && x.size(2) % 2 == 0 && positions.scalar_type() == torch::kInt64 &&
                  positions.is_contiguous() && positions.numel() == x.size(0) &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope_: x [T, H, D] unit stride in D, positions [T] int64, tables [P, D] of x's dtype");
  if (x.scalar_type() == torch::kBFloat16) {
    rope_impl<c10::BFloat16>(x, positions, cos, sin);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rope_: float32 or bfloat16");
    rope_impl<float>(x, positions, cos, sin);
  }
}
