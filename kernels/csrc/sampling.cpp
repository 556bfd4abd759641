// sample_rows: each row's token by the exponential race over its vocabulary, the Exp(1) draws from a counter hash
// of (key, token id), so a row's token depends on its logits and key alone (worker_svc/sampler.py).
#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using llmserve::check_cpu;
using llmserve::exp_any;

// ln x for a positive normal float, as plain arithmetic a compiler vectorizes: x = 2^e m with m in [sqrt(1/2),
// sqrt(2)), ln m = 2 atanh(s), s = (m - 1) / (m + 1) in [-0.172, 0.172], by its series to s^9 (relative error ~1e-8).
inline float log_positive(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  int32_t e = ((bits >> 23) & 0xff) - 127;
  bits = (bits & 0x007fffff) | 0x3f800000;
  float m;
  std::memcpy(&m, &bits, 4);
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e += big ? 1 : 0;
  const float s = (m - 1.f) / (m + 1.f), s2 = s * s;
  const float series = s * (2.f + s2 * (0.6666666667f + s2 * (0.4f + s2 * (0.2857142857f + s2 * 0.2222222222f))));
  return static_cast<float>(e) * 0.69314718056f + series;
}

// The Exp(1) variable of vocabulary entry i in the row keyed by `key`: a 32-bit hash of (key, i) (lowbias32) gives
// 24 uniform bits u in (0, 1), never 0, and E = -ln u > 0.
inline float exponential_draw(uint64_t key, uint32_t i) {
  uint32_t x = i * 0x9E3779B9u + static_cast<uint32_t>(key);
  x ^= static_cast<uint32_t>(key >> 32);
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  const float u = (static_cast<float>(x >> 8) + 0.5f) * (1.f / 16777216.f);
  return -log_positive(u);
}

// The largest of x[0..n) (n >= 1; no NaN), in vector lanes: the compiler keeps a float max reduction scalar.
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float best = x[0];
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(best);
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  best = _mm512_reduce_max_ps(mv);
#elif defined(LLMSERVE_AVX2_ONLY)
  __m256 mv = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (const float v : lanes) best = std::max(best, v);
#endif
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// The first index of the largest of x[0..n) (n >= 1; no NaN): a max pass, then the first lane equal to it.
inline int64_t first_argmax(const float* x, int64_t n) {
  const float best = max_of(x, n);
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 bv = _mm512_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), bv, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#elif defined(LLMSERVE_AVX2_ONLY)
  const __m256 bv = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), bv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

}  // namespace

// Each row's token by the exponential race: argmax over the vocabulary of e^(logit - max) / E_i, E_i the Exp(1) draws
// of the row's key (uint64 as int64), which samples from softmax(logits[row]). Masking a token that would not have
// won (a -inf logit: weight 0) never changes the winner, so logit bias, bad words and grammars change only the draws
// they must. First index on ties. logits [rows, vocab] float32 contiguous, keys [rows] int64.
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& keys) {
  check_cpu({logits, keys}, "sample_rows");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32 &&
                  keys.scalar_type() == torch::kInt64 && keys.is_contiguous() && keys.numel() == logits.size(0),
              "sample_rows: logits [rows, vocab] float32 contiguous, keys [rows] int64");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto out = torch::empty({rows}, torch::kInt64);
  const float* lp = logits.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> score;  // a vocabulary's worth: kept, not mapped and faulted in per call
    score.resize(V);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      const uint64_t key = static_cast<uint64_t>(kp[r]);
      float m = V > 0 ? max_of(x, V) : -std::numeric_limits<float>::infinity();
      if (!(m > -std::numeric_limits<float>::infinity())) m = 0.f;  // every logit -inf: all weights 0, token 0
#pragma omp simd
      for (int64_t i = 0; i < V; ++i) {
        const float w = x[i] == -std::numeric_limits<float>::infinity() ? 0.f : exp_any(x[i] - m);
        score[i] = w / exponential_draw(key, static_cast<uint32_t>(i));
      }
      op[r] = first_argmax(score.data(), V);
    }
  });
  return out;
}
