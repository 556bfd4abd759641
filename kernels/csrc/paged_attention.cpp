// decode_attention: each query row over its sequence's paged K/V, blocks read in place, float32 scores, rounded
// once to the cache dtype (see kernels/README.md). Paths by ISA tier: AMX tiles (bfloat16, x86-64-v4-amx), AVX-512
// (head_dim 64 / 128), AVX2 (head_dim a multiple of 64), and a portable loop for everything else.
#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include "avx2_sum.h"
#include "bf16_lanes.h"
#include "cpu_math.h"
#include "cpu_ops.h"
#include "shared_chunks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "with_count.h"

namespace {

using llmserve::check_cpu;
using llmserve::exp_any;
using llmserve::from_float;
using llmserve::to_float;
#ifdef __AVX512F__
using llmserve::load16;
#endif
#ifdef LLMSERVE_AVX2_ONLY
using llmserve::load8;
using llmserve::sum8;
using llmserve::sum8x8;
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(LLMSERVE_AVX2_ONLY)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();  // two chains: the adds do not wait on each other
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
  }
  for (; d + 8 <= D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
  s = sum8(_mm256_add_ps(a0, a1));
#endif
  for (; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc += p * v over D values
template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t D) {
  int64_t d = 0;
#ifdef __AVX512F__
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
#elif defined(LLMSERVE_AVX2_ONLY)
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < D; ++d) acc[d] += p * to_float(v[d]);
}

// Where position t of a sequence lives in a paged cache (its block from the table), and a prefetch of its rows of
// heads [0, H): the blocks are scattered, so no stream prefetcher can fetch them ahead.
struct PagedRows {
  const int32_t* table;
  int64_t block_size, blk_stride, tok_stride, head_stride, H, row_bytes;
  template <typename T>
  const T* at(const T* cache, int64_t t) const {
    return cache + table[t / block_size] * blk_stride + (t % block_size) * tok_stride;
  }
  template <typename T>
  void prefetch(const T* cache, int64_t t) const {
    const T* r = at(cache, t);
    for (int64_t h = 0; h < H; ++h) {
      const char* p = reinterpret_cast<const char*>(r + h * head_stride);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
  }
};

// Where a task over part of a sequence's positions leaves its unnormalized result for merge_parts: per query
// head, the weighted sum of values (D floats), the part's max score and its sum of exp(score - max). A null `acc`
// means the task covers every position: it normalizes and writes the output itself.
struct Partial {
  float *acc = nullptr, *max = nullptr, *sum = nullptr;
};

// Positions per task of the portable decode attention: one decode at batch 1 still spreads over every thread, and
// the scores of a task stay in L1.
constexpr int64_t kPartLen = 128;

// One task: KV heads [0, H) of one sequence (head_stride apart in the cache), each with its G query heads, over
// positions [start, len). Two passes over the keys (scores, then the weighted sum of values) with every score kept:
// a decode's context is at most max_model_len rows, and the exact max makes the softmax match the one-pass float32
// reference. With every KV head in one task each position's row is read whole, in order.
template <typename T>
void attend_one(const T* q, int64_t q_head_stride, const T* kc, const T* vc, int64_t blk_stride, int64_t tok_stride,
                int64_t head_stride, const int32_t* table, int64_t start, int64_t len, int64_t block_size, int64_t H,
                int64_t G, int64_t D, float scale, float softcap, const float* sinks, float* scores, float* acc,
                float* qf, T* out, int64_t out_head_stride, Partial part) {
  const int64_t Hq = H * G;
  for (int64_t hq = 0; hq < Hq; ++hq)
    for (int64_t d = 0; d < D; ++d) qf[hq * D + d] = to_float(q[hq * q_head_stride + d]) * scale;
  const int64_t n = len - start;
  // Ask for the rows kAhead positions on while this one is used.
  constexpr int64_t kAhead = 8;
  const PagedRows rows{table, block_size, blk_stride, tok_stride, head_stride, H, D * static_cast<int64_t>(sizeof(T))};
  for (int64_t t = start; t < len; ++t) {
    if (t + kAhead < len) rows.prefetch(kc, t + kAhead);
    const T* k = rows.at(kc, t);
    for (int64_t hq = 0; hq < Hq; ++hq) scores[hq * n + (t - start)] = dot(qf + hq * D, k + (hq / G) * head_stride, D);
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* sg = scores + hq * n;
    if (softcap > 0.f)
      for (int64_t i = 0; i < n; ++i) sg[i] = softcap * std::tanh(sg[i] / softcap);
    float m = sinks ? sinks[hq] : -std::numeric_limits<float>::max();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    float sum = sinks ? exp_any(sinks[hq] - m) : 0.f;
    for (int64_t i = 0; i < n; ++i) sg[i] = exp_any(sg[i] - m);
    for (int64_t i = 0; i < n; ++i) sum += sg[i];
    if (part.acc) {
      part.max[hq] = m;
      part.sum[hq] = sum;
      continue;
    }
    const float inv = n > 0 ? 1.f / sum : 0.f;
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
  std::fill(acc, acc + Hq * D, 0.f);
  for (int64_t t = start; t < len; ++t) {
    if (t + kAhead < len) rows.prefetch(vc, t + kAhead);
    const T* v = rows.at(vc, t);
    for (int64_t hq = 0; hq < Hq; ++hq) axpy(scores[hq * n + (t - start)], v + (hq / G) * head_stride, acc + hq * D, D);
  }
  if (part.acc) {
    std::copy(acc, acc + Hq * D, part.acc);
    return;
  }
  for (int64_t hq = 0; hq < Hq; ++hq)
    for (int64_t d = 0; d < D; ++d) out[hq * out_head_stride + d] = from_float<T>(acc[hq * D + d]);
}

#ifdef LLMSERVE_AVX2_ONLY
// exp_any on 8 lanes (inputs <= 0: softmax terms), the same steps as exp16
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// attend_one for head_dim a multiple of 64 on AVX2: the scores of 8 positions at a time (8 partial vectors summed
// by one transpose-and-add, the key rows as memory operands), the softmax in 8 lanes, and each query head's
// weighted sum of values in 8 registers (64 dims at a time) instead of a load-add-store per position.
template <typename T>
void attend_one_avx2(const T* q, int64_t q_head_stride, const T* kc, const T* vc, int64_t blk_stride,
                     int64_t tok_stride, int64_t head_stride, const int32_t* table, int64_t start, int64_t len,
                     int64_t block_size, int64_t H, int64_t G, int64_t D, float scale, float softcap,
                     const float* sinks, float* scores, float* qf, float* inv, T* out, int64_t out_head_stride,
                     Partial part) {
  const int64_t Hq = H * G, n = len - start;
  for (int64_t hq = 0; hq < Hq; ++hq)
    for (int64_t d = 0; d < D; ++d) qf[hq * D + d] = to_float(q[hq * q_head_stride + d]) * scale;
  const PagedRows paged{table, block_size, blk_stride, tok_stride, head_stride, H, D * static_cast<int64_t>(sizeof(T))};
  const auto row_at = [&](const T* cache, int64_t t) { return paged.at(cache, t); };
  for (int64_t t0 = start; t0 < len; t0 += 8) {
    const int m = static_cast<int>(std::min<int64_t>(8, len - t0));
    const T* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = row_at(kc, t0 + (j < m ? j : 0));  // past the end: any valid row
    for (int64_t t = t0 + 8; t < std::min(t0 + 16, len); ++t) paged.prefetch(kc, t);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        const float* qh = qf + hq * D;
        __m256 a[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(rows[j] + h * head_stride + d), a[j]);
        }
        const __m256 sv = sum8x8(a);
        float* dst = scores + hq * n + (t0 - start);
        if (m == 8) {
          _mm256_storeu_ps(dst, sv);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, sv);
          std::copy(tmp, tmp + m, dst);
        }
      }
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* sg = scores + hq * n;
    if (softcap > 0.f)
      for (int64_t i = 0; i < n; ++i) sg[i] = softcap * std::tanh(sg[i] / softcap);
    float mx = sinks ? sinks[hq] : -std::numeric_limits<float>::max();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
    const __m256 mb = _mm256_set1_ps(mx);
    __m256 sumv = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mb));
      _mm256_storeu_ps(sg + i, e);
      sumv = _mm256_add_ps(sumv, e);
    }
    float sum = sum8(sumv) + (sinks ? exp_any(sinks[hq] - mx) : 0.f);
    for (; i < n; ++i) sum += (sg[i] = exp_any(sg[i] - mx));
    inv[hq] = n > 0 ? 1.f / sum : 0.f;
    if (part.acc) {  // the sum of values stays unnormalized (times 1: the same bits)
      part.max[hq] = mx;
      part.sum[hq] = sum;
      inv[hq] = 1.f;
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t hq = h * G + g;
      const float* p = scores + hq * n;
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int dv = 0; dv < 8; ++dv) acc[dv] = _mm256_setzero_ps();
        for (int64_t t = start; t < len;) {  // one run of positions inside a block at a time
          const int64_t run = std::min(block_size - t % block_size, len - t);
          const T* v = row_at(vc, t) + h * head_stride + d0;
          for (int64_t j = 0; j < run; ++j, v += tok_stride) {
            if (g == 0 && d0 == 0 && t + j + 8 < len)
              _mm_prefetch(row_at(vc, t + j + 8) + h * head_stride, _MM_HINT_T0);
            const __m256 pv = _mm256_set1_ps(p[t + j - start]);
#pragma GCC unroll 8
            for (int dv = 0; dv < 8; ++dv) acc[dv] = _mm256_fmadd_ps(pv, load8(v + dv * 8), acc[dv]);
          }
          t += run;
        }
        const __m256 iv = _mm256_set1_ps(inv[hq]);
        alignas(32) float res[64];
#pragma GCC unroll 8
        for (int dv = 0; dv < 8; ++dv) _mm256_store_ps(res + dv * 8, _mm256_mul_ps(acc[dv], iv));
        if (part.acc) {
          std::copy(res, res + 64, part.acc + hq * D + d0);
          continue;
        }
        T* o = out + hq * out_head_stride + d0;
        for (int d = 0; d < 64; ++d) o[d] = from_float<T>(res[d]);
      }
    }
}
#endif

#ifdef __AVX512F__
// exp_any on 16 lanes (inputs <= 0: softmax terms)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

// Visits positions [start, len) of a paged sequence as runs of consecutive positions inside one block, at most
// `max_run` long: fn(first position, run length, pointer to the first position's row). Both passes of
// attend_seq_avx512 walk the cache this way, so each block streams from memory in order.
template <typename T, typename Fn>
inline void for_each_run(const T* cache, const int32_t* table, int64_t start, int64_t len, int64_t block_size,
                         int64_t blk_stride, int64_t tok_stride, int64_t max_run, Fn&& fn) {
  for (int64_t t = start; t < len;) {
    const int64_t b = t / block_size, stop = std::min({len, (b + 1) * block_size, t + max_run});
    fn(t, static_cast<int>(stop - t), cache + table[b] * blk_stride + (t - b * block_size) * tok_stride);
    t = stop;
  }
}

// Lane j of the result = the sum of the 16 lanes of v[j] (16 dot products finished in ~45 shuffles and adds
// instead of 16 horizontal reductions of ~8 each).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], s[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum of v4i .. v4i+3
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // the four 128-bit lanes of each s[i] summed into 128-bit lane i of the result
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44), _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44), _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// The query of one head, ready for key_dot: float32 lanes, or (bfloat16 with AVX512-BF16) the raw bf16 pairs.
template <typename T, int DV>
struct QueryRow {
  __m512 f[DV];
  void load(const T* q) {
    for (int dv = 0; dv < DV; ++dv) f[dv] = load16(q + dv * 16);
  }
  // 16 partial products of q . k, summed by sum16
  __m512 key_dot(const T* k) const {
    __m512 a = _mm512_mul_ps(f[0], load16(k));
    for (int dv = 1; dv < DV; ++dv) a = _mm512_fmadd_ps(f[dv], load16(k + dv * 16), a);
    return a;
  }
};

#ifdef __AVX512BF16__
// bfloat16 products are exact in float32: one dpbf16 per 32 values instead of a conversion and an FMA per 16.
template <int DV>
struct QueryRow<c10::BFloat16, DV> {
  __m512i b[DV / 2];
  void load(const c10::BFloat16* q) {
    for (int c = 0; c < DV / 2; ++c) b[c] = _mm512_loadu_si512(q + c * 32);
  }
  __m512 key_dot(const c10::BFloat16* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < DV / 2; ++c) a = _mm512_dpbf16_ps(a, (__m512bh)b[c], (__m512bh)_mm512_loadu_si512(k + c * 32));
    return a;
  }
};
#endif

// acc[g * D + d] (+)= sum over rows i < rows of p[g * p_head + i * p_row] * v[i * tok_stride + d], for NG query heads
// of one KV head (v: that head's first row), the NG x DV sums in registers and added in row order; `first`: acc starts
// at zero.
template <typename T, int DV, int NG>
void weighted_values(const T* v, int64_t rows, int64_t tok_stride, const float* p, int64_t p_head, int64_t p_row,
                     float* acc, bool first) {
  __m512 a[NG][DV];
#pragma GCC unroll 16
  for (int i = 0; i < NG * DV; ++i)
    a[i / DV][i % DV] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (i / DV) * 16 * DV + (i % DV) * 16);
  for (int64_t r = 0; r < rows; ++r, v += tok_stride) {
    __m512 vv[DV];
#pragma GCC unroll 8
    for (int dv = 0; dv < DV; ++dv) vv[dv] = load16(v + dv * 16);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_head + r * p_row]);
#pragma GCC unroll 8
      for (int dv = 0; dv < DV; ++dv) a[g][dv] = _mm512_fmadd_ps(pg, vv[dv], a[g][dv]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NG * DV; ++i) _mm512_storeu_ps(acc + (i / DV) * 16 * DV + (i % DV) * 16, a[i / DV][i % DV]);
}

// Positions of values weighed per step. The AMX path copies a decode's chunk into a per-thread buffer first: the copy
// reads them in address order, which the hardware prefetcher follows; reading each head's rows in place (strided)
// ran at 10-13 GB/s from memory against the ~34 GB/s a sum read (the AVX-512 path asks for them ahead instead).
constexpr int64_t kValueChunk = 32;

// The next decode's key and value rows, asked of L2 a few cache lines at a time while this decode computes (see
// attend_seq_avx512's `ahead`): a decode's blocks are scattered through the pool, so no hardware prefetcher runs
// ahead of them, and fetched only as a pass reached them they arrived at ~12 GB/s of the ~30 a sum reads here.
struct RowsAhead {
  std::vector<std::pair<const char*, const char*>> spans;  // line-aligned byte ranges, keys' then values'
  size_t span = 0;
  const char* at = nullptr;
  int64_t per_step = 0;

  void clear() { spans.clear(), span = 0, per_step = 0; }
  // rows of positions [start, len) (span: the elements of a row), spread over `steps` calls of step()
  template <typename T>
  void plan(const T* kc, const T* vc, const int32_t* table, int64_t start, int64_t len, int64_t block_size,
            int64_t blk_stride, int64_t tok_stride, int64_t row_span, int64_t steps) {
    clear();
    int64_t lines = 0;
    for (const T* cache : {kc, vc})
      for_each_run(cache, table, start, len, block_size, blk_stride, tok_stride, block_size,
                   [&](int64_t, int m, const T* r) {
                     const auto first = reinterpret_cast<uintptr_t>(r) & ~uintptr_t{63};
                     const auto end = reinterpret_cast<uintptr_t>(r + (m - 1) * tok_stride + row_span);
                     spans.emplace_back(reinterpret_cast<const char*>(first), reinterpret_cast<const char*>(end));
                     lines += static_cast<int64_t>((end - first + 63) / 64);
                   });
    at = spans.empty() ? nullptr : spans[0].first;
    per_step = (lines + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() {
    for (int64_t l = 0; l < per_step && span < spans.size(); ++l) {
      _mm_prefetch(at, _MM_HINT_T1);
      if ((at += 64) >= spans[span].second && ++span < spans.size()) at = spans[span].first;
    }
  }
};

// Rows of positions [t0, t1) of a paged sequence into buf, tok_stride apart; span: the elements of one row.
template <typename T>
inline void copy_rows(const T* cache, const int32_t* table, int64_t t0, int64_t t1, int64_t block_size,
                      int64_t blk_stride, int64_t tok_stride, int64_t span, T* buf) {
  for_each_run(cache, table, t0, t1, block_size, blk_stride, tok_stride, t1 - t0, [&](int64_t t, int m, const T* r) {
    std::memcpy(buf + (t - t0) * tok_stride, r, ((m - 1) * tok_stride + span) * sizeof(T));
  });
}

// One decode's attention, all heads, for head_dim = 16 * DV. The keys are read in the cache's order, a run of
// positions of one block at a time, the scores of all heads into a small per-thread buffer in L1/L2; then the values,
// a run of up to kValueChunk positions at a time, each KV head's query heads' sums in registers over the run (summing
// in memory stored and reloaded every accumulator at every position; kernels/README.md has the timings). Both passes
// read the cache in place: `ahead` has asked L2 for this decode's rows while the previous one computed, and asks for
// the next one's between this one's steps (a copy of each run first, for the prefetcher's sake, ran 1.1-1.2x slower).
template <typename T, int DV>
void attend_seq_avx512(const T* q, int64_t q_head_stride, const T* kc, const T* vc, int64_t blk_stride,
                       int64_t tok_stride, int64_t head_stride, const int32_t* table, int64_t start, int64_t len,
                       int64_t block_size, int64_t h0, int64_t h1, int64_t G, float scale, float softcap,
                       const float* sinks, float* scores, float* acc, float* inv, T* out, int64_t out_head_stride,
                       RowsAhead& ahead) {
  constexpr int D = 16 * DV;
  const int64_t n = len - start;
  const __m512 scale_v = _mm512_set1_ps(scale);
  // scores[hq * n + i] = scale * q . k for position start + i, 16 positions at a time
  for_each_run(kc, table, start, len, block_size, blk_stride, tok_stride, 16, [&](int64_t t, int m, const T* k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
    for (int64_t h = h0; h < h1; ++h) {
      ahead.step();
      const T* kh = k + h * head_stride;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        QueryRow<T, DV> qr;
        qr.load(q + hq * q_head_stride);
        __m512 part[16];
        for (int j = 0; j < 16; ++j) part[j] = j < m ? qr.key_dot(kh + j * tok_stride) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(scores + hq * n + (t - start), mask, _mm512_mul_ps(sum16(part), scale_v));
      }
    }
  });
  for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
    float* sg = scores + hq * n;
    const float* sink = sinks ? sinks + hq : nullptr;
    if (softcap > 0.f)
      for (int64_t i = 0; i < n; ++i) sg[i] = softcap * std::tanh(sg[i] / softcap);
    __m512 mv = _mm512_set1_ps(sink ? *sink : -std::numeric_limits<float>::max());
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + i));
    float m = _mm512_reduce_max_ps(mv);
    for (; i < n; ++i) m = std::max(m, sg[i]);
    __m512 sumv = _mm512_setzero_ps();
    const __m512 mb = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), mb));
      _mm512_storeu_ps(sg + i, e);
      sumv = _mm512_add_ps(sumv, e);
    }
    float sum = _mm512_reduce_add_ps(sumv) + (sink ? exp_any(*sink - m) : 0.f);
    for (; i < n; ++i) sum += (sg[i] = exp_any(sg[i] - m));
    inv[hq] = n > 0 ? 1.f / sum : 0.f;
  }
  // the weighted sums of V: per KV head, up to 16 / DV of its query heads at a time with their sums in registers
  constexpr int kHeads = 16 / DV;
  if (n == 0) std::fill(acc + h0 * G * D, acc + h1 * G * D, 0.f);
  for_each_run(vc, table, start, len, block_size, blk_stride, tok_stride, kValueChunk, [&](int64_t c, int rows,
                                                                                           const T* v) {
    for (int64_t h = h0; h < h1; ++h, ahead.step())
      for (int64_t g = 0; g < G; g += kHeads)
        llmserve::with_count<kHeads>(std::min<int64_t>(kHeads, G - g), [&](auto heads) {
          const int64_t hq = h * G + g;
          weighted_values<T, DV, heads()>(v + h * head_stride, rows, tok_stride, scores + hq * n + (c - start), n,
                                          1, acc + hq * D, c == start);
        });
  });
  for (int64_t hq = h0 * G; hq < h1 * G; ++hq)
    for (int d = 0; d < D; ++d) out[hq * out_head_stride + d] = from_float<T>(acc[hq * D + d] * inv[hq]);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Attention in AMX tiles, bfloat16 (head_dim 64 or 128, blocks a multiple of 16 positions, no window, softcap or
// sinks). A score tile is 16 positions x 16 columns, a column a (query row, query head) pair of one sequence: the
// keys are the tile instruction's first operand, read in place from the cache (16 rows, one head's 32 values each),
// the columns' queries the second, laid out once per set of columns. A decode's set is its query heads (one key tile
// per KV head and 32 values: a column only sums its own KV head's products, the other heads' query tiles hold zeros);
// a prefill chunk's 16 rows of one head share each key tile instead of reading it once per row. Everything after the
// scores runs per column in its own vector lane or registers, over positions in order: a column's result does not
// depend on the other columns of its set, so a row's bits are the same whether it is a decode, a prefill row or a
// speculative draft, whatever the batch.
constexpr int kTileColumns = 16;
constexpr int64_t kTileKeys = 16;

// What every set of columns of one call shares.
struct CacheShape {
  const c10::BFloat16 *kc, *vc;
  int64_t blk_stride, tok_stride, head_stride, block_size;
  float scale;
};

// Up to 16 (row, head) columns of one sequence, their heads in increasing order; unused columns have len 0.
struct ColumnSet {
  const c10::BFloat16* q[kTileColumns];
  c10::BFloat16* out[kTileColumns];
  alignas(64) int32_t len[kTileColumns];
  int32_t kv_head[kTileColumns];
  int count;
  int64_t rows;  // rows of the set's block
  const int32_t* table;
};

struct TileScratch {
  std::vector<uint32_t> queries;    // the query tiles: KV heads x parts x 16 pair rows x 16 columns
  std::vector<float> p;             // positions x 16 columns: scores, then exponentials
  std::vector<float> acc;           // 16 columns x D sums of values
  std::vector<c10::BFloat16> buf;   // kValueChunk positions of values
  llmserve::BorrowedTiles tiles;
};

template <int DV>
void attend_columns_amx(const CacheShape& a, const ColumnSet& cs, TileScratch& s) {
  constexpr int D = 16 * DV, kParts = D / 32;
  const int C = cs.count, h0 = cs.kv_head[0], heads = cs.kv_head[C - 1] - h0 + 1;
  int64_t n = 0;
  for (int c = 0; c < C; ++c) n = std::max<int64_t>(n, cs.len[c]);
  // query tile (head h - h0, part j): row k, column c = pair 16 j + k of column c's query where c is of head h
  uint32_t* qt = s.queries.data();
  std::fill(qt, qt + heads * kParts * 256, 0u);
  for (int c = 0; c < C; ++c) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(cs.q[c]);
    uint32_t* tile = qt + (cs.kv_head[c] - h0) * kParts * 256 + c;
    for (int k = 0; k < D / 2; ++k) tile[(k / 16) * 256 + (k % 16) * 16] = pairs[k];
  }
  float* p = s.p.data();
  const c10::BFloat16* k0 = a.kc + h0 * a.head_stride;
  for (int64_t t = 0; t < n; t += kTileKeys) {
    const c10::BFloat16* k = k0 + cs.table[t / a.block_size] * a.blk_stride + (t % a.block_size) * a.tok_stride;
    _tile_zero(0);
    for (int h = 0; h < heads; ++h)
      for (int j = 0; j < kParts; ++j) {
        _tile_loadd(1, k + h * a.head_stride + 32 * j, a.tok_stride * 2);
        _tile_loadd(2, qt + (h * kParts + j) * 256, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    _tile_stored(0, p + t * kTileColumns, 64);
  }
  // each column's softmax over its own positions (a lane each; positions past a column's length are masked off)
  const __m512i lens = _mm512_load_si512(cs.len);
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::max()), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __mmask16 live = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(static_cast<int32_t>(t)));
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p + t * kTileColumns), scale);
    _mm512_storeu_ps(p + t * kTileColumns, x);
    m = _mm512_mask_max_ps(m, live, m, x);
  }
  for (int64_t t = 0; t < n; ++t) {
    const __mmask16 live = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(static_cast<int32_t>(t)));
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + t * kTileColumns), m)));
    _mm512_storeu_ps(p + t * kTileColumns, e);
    sum = _mm512_add_ps(sum, e);
  }
  alignas(64) float inv[kTileColumns];
  _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(1.f), sum));
  // the weighted sums of values: consecutive columns of one KV head, up to 16 / DV at a time, in registers
  float* acc = s.acc.data();
  if (n == 0) std::fill(acc, acc + C * D, 0.f);
  // v: the rows of positions [c0, c0 + rows), tok_stride apart, from head h0 on
  auto weigh = [&](const c10::BFloat16* v, int64_t c0, int64_t rows) {
    for (int g0 = 0; g0 < C;) {
      int g1 = g0 + 1;
      while (g1 < C && cs.kv_head[g1] == cs.kv_head[g0] && g1 - g0 < 16 / DV) ++g1;
      llmserve::with_count<16 / DV>(g1 - g0, [&](auto cols) {
        weighted_values<c10::BFloat16, DV, cols()>(v + (cs.kv_head[g0] - h0) * a.head_stride, rows, a.tok_stride,
                                                   p + c0 * kTileColumns + g0, 1, kTileColumns, acc + g0 * D,
                                                   c0 == 0);
      });
      g0 = g1;
    }
  };
  const c10::BFloat16* v0 = a.vc + h0 * a.head_stride;
  if (cs.rows > 1) {  // the sequence's values were just written or are shared by the block's sets: in cache
    for_each_run(v0, cs.table, 0, n, a.block_size, a.blk_stride, a.tok_stride, a.block_size,
                 [&](int64_t t, int m, const c10::BFloat16* v) { weigh(v, t, m); });
  } else {  // a decode's values come from memory: copied first (see kValueChunk)
    const int64_t span = (heads - 1) * a.head_stride + D;
    for (int64_t c0 = 0; c0 < n; c0 += kValueChunk) {
      const int64_t rows = std::min(kValueChunk, n - c0);
      copy_rows(v0, cs.table, c0, c0 + rows, a.block_size, a.blk_stride, a.tok_stride, span, s.buf.data());
      weigh(s.buf.data(), c0, rows);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int d = 0; d < D; ++d) cs.out[c][d] = from_float<c10::BFloat16>(acc[c * D + d] * inv[c]);
}

// Whether decode_attention's call runs in AMX tiles (see attend_columns_amx).
bool attention_in_tiles(const torch::Tensor& query, const torch::Tensor& key_cache, int64_t window, double softcap,
                        const c10::optional<torch::Tensor>& sinks) {
  const int64_t D = query.size(2), G = query.size(1) / key_cache.size(2);
  return query.scalar_type() == torch::kBFloat16 && (D == 64 || D == 128) && key_cache.size(1) % kTileKeys == 0 &&
         G <= kTileColumns && window <= 0 && softcap <= 0.0 && !sinks.has_value() && llmserve::amx_ready();
}

// The rows in blocks of up to 16 consecutive rows of one sequence (the same table row); a block's (row, head) pairs,
// head-major, in sets of 16 columns; a set is an item.
void attention_amx(const torch::Tensor& query, const torch::Tensor& rows, const torch::Tensor& key_cache,
                   const torch::Tensor& value_cache, const torch::Tensor& tables, const torch::Tensor& seq_lens,
                   double scale, torch::Tensor& out) {
  using Bf16 = c10::BFloat16;
  const int64_t num = rows.size(0), Hq = query.size(1), D = query.size(2), Hkv = key_cache.size(2), G = Hq / Hkv;
  const int64_t width = tables.size(1), max_len = width * key_cache.size(1);
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  std::vector<int64_t> block_first{0}, set_first{0};  // block b: rows [block_first[b], block_first[b + 1])
  for (int64_t i = 1; i <= num; ++i)
    if (i == num || i - block_first.back() == kTileColumns ||
        std::memcmp(tab + i * width, tab + (i - 1) * width, width * sizeof(int32_t)) != 0) {
      const int64_t pairs = (i - block_first.back()) * Hq;
      set_first.push_back(set_first.back() + (pairs + kTileColumns - 1) / kTileColumns);
      block_first.push_back(i);
    }
  const CacheShape shape{key_cache.data_ptr<Bf16>(), value_cache.data_ptr<Bf16>(), key_cache.stride(0),
                         key_cache.stride(1), key_cache.stride(2), key_cache.size(1), static_cast<float>(scale)};
  const Bf16* q = query.data_ptr<Bf16>();
  Bf16* o = out.data_ptr<Bf16>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1), o_tok = out.stride(0), o_head = out.stride(1);
  auto fn = D == 64 ? attend_columns_amx<4> : attend_columns_amx<8>;
  llmserve::share_chunks(
      set_first.back(),
      [&] {
        return TileScratch{std::vector<uint32_t>(Hkv * (D / 32) * 256),
                           std::vector<float>((max_len + kTileKeys) * kTileColumns),
                           std::vector<float>(kTileColumns * D), std::vector<Bf16>(kValueChunk * shape.tok_stride), {}};
      },
      [&](TileScratch& s, int64_t begin, int64_t end) {
        if (!s.tiles.taken) {  // tiles 0: scores, 1: keys, 2: queries, each 16 rows of 64 bytes
          s.tiles.take();
          llmserve::TileConfig config;
          for (int t = 0; t < 3; ++t) config.colsb[t] = 64, config.rows[t] = 16;
          _tile_loadconfig(&config);
        }
        int64_t b = std::upper_bound(set_first.begin(), set_first.end(), begin) - set_first.begin() - 1;
        for (int64_t set = begin; set < end; ++set) {
          while (set >= set_first[b + 1]) ++b;
          const int64_t first = block_first[b], R = block_first[b + 1] - first;
          ColumnSet cs{};
          cs.table = tab + first * width;
          const int64_t c0 = (set - set_first[b]) * kTileColumns;
          cs.count = static_cast<int>(std::min<int64_t>(kTileColumns, R * Hq - c0));
          cs.rows = R;
          for (int c = 0; c < cs.count; ++c) {
            const int64_t hq = (c0 + c) / R, i = first + (c0 + c) % R;
            cs.q[c] = q + row[i] * q_tok + hq * q_head;
            cs.out[c] = o + row[i] * o_tok + hq * o_head;
            cs.len[c] = lens[i];
            cs.kv_head[c] = static_cast<int32_t>(hq / G);
          }
          fn(shape, cs, s);
        }
      });
}
#endif

// A decode's output from the P partial results of its position parts (part_stride floats apart, each laid out as
// Partial: Hq x D sums, Hq maxima, Hq sums of exponentials): every part rescaled to the overall max, the softmax's
// exact combination.
template <typename T>
void merge_parts(float* parts, int64_t P, int64_t part_stride, int64_t Hq, int64_t D, T* out,
                 int64_t out_head_stride) {
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float m = -std::numeric_limits<float>::max(), sum = 0.f;
    for (int64_t p = 0; p < P; ++p) m = std::max(m, parts[p * part_stride + Hq * D + hq]);
    for (int64_t p = 0; p < P; ++p) {  // each part's max becomes its weight exp(max - m)
      float* part = parts + p * part_stride;
      part[Hq * D + hq] = exp_any(part[Hq * D + hq] - m);
      sum += part[Hq * D + hq] * part[Hq * D + Hq + hq];
    }
    const float inv = 1.f / sum;  // > 0: the part holding the max adds at least exp(0) = 1
    for (int64_t d = 0; d < D; ++d) {
      float o = 0.f;
      for (int64_t p = 0; p < P; ++p) o += parts[p * part_stride + Hq * D + hq] * parts[p * part_stride + hq * D + d];
      out[hq * out_head_stride + d] = from_float<T>(o * inv);
    }
  }
}

template <typename T>
void decode_attention_impl(const torch::Tensor& query, const torch::Tensor& rows, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, const torch::Tensor& tables,
                           const torch::Tensor& seq_lens, double scale, int64_t window, double softcap,
                           const c10::optional<torch::Tensor>& sinks, torch::Tensor& out) {
  const int64_t num = rows.size(0), Hq = query.size(1), D = query.size(2), Hkv = key_cache.size(2);
  const int64_t G = Hq / Hkv, block_size = key_cache.size(1), max_len = tables.size(1) * block_size;
  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const int64_t q_tok = query.stride(0), q_head = query.stride(1), o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t blk = key_cache.stride(0), tok = key_cache.stride(1), head = key_cache.stride(2);
#ifdef __AVX512F__
  if (D == 64 || D == 128) {  // a task per decode (or a share of its KV heads): its blocks stream from memory in order
    auto fn = D == 64 ? attend_seq_avx512<T, 4> : attend_seq_avx512<T, 8>;
    struct Scratch {
      std::vector<float> scores, acc, inv;
      RowsAhead ahead;
    };
    // Fewer decodes than threads (batch 1): each decode's KV heads split among as many tasks, so that every thread
    // reads and computes a share (a head's sums never involve another head's: the same bits either way).
    const int64_t parts = num < at::get_num_threads() ? std::min<int64_t>(Hkv, at::get_num_threads()) : 1;
    llmserve::share_chunks(
        num * parts,
        [&] {
          return Scratch{std::vector<float>(Hq * max_len), std::vector<float>(Hq * D), std::vector<float>(Hq),
                         RowsAhead{}};
        },
        [&](Scratch& s, int64_t begin, int64_t end) {
          const int64_t width = tables.size(1), span = (Hkv - 1) * head + D;
          const auto start_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0; };
          for (int64_t task = begin; task < end; ++task) {
            const int64_t i = task / parts, part = task % parts, len = lens[i], start = start_of(i);
            // the next row's keys and values while this one computes, unless it reads the same blocks (a prompt's
            // next row); past the chunk's end too, as the next chunk is often this thread's
            s.ahead.clear();
            if (parts == 1 && width > 0 && i + 1 < num && tab[(i + 1) * width] != tab[i * width]) {
              const int64_t steps = Hkv * ((len - start + 15) / 16 + (len - start + kValueChunk - 1) / kValueChunk);
              s.ahead.plan(kc, vc, tab + (i + 1) * width, start_of(i + 1), lens[i + 1], block_size, blk, tok, span,
                           steps);
            }
            fn(q + row[i] * q_tok, q_head, kc, vc, blk, tok, head, tab + i * width, start, len, block_size,
               Hkv * part / parts, Hkv * (part + 1) / parts, G, static_cast<float>(scale),
               static_cast<float>(softcap), sink, s.scores.data(), s.acc.data(), s.inv.data(), o + row[i] * o_tok,
               o_head, s.ahead);
          }
        });
    return;
  }
#endif
  // Tasks: a decode with all its KV heads (each row read whole), or (fewer decodes than threads) a decode's KV head
  // each, times the decode's parts of kPartLen positions, so that a few long decodes still give every thread work.
  // A decode of more than one part leaves partial results that merge_parts combines afterwards. The split depends
  // on the decode's own length only, so its output is the same bits whatever else is in the batch.
  const int64_t per_task = num >= at::get_num_threads() ? Hkv : 1, heads_split = Hkv / per_task;
  std::vector<int64_t> first_task(num + 1, 0), first_part(num + 1, 0), starts(num);
  for (int64_t i = 0; i < num; ++i) {
    starts[i] = window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0;
    const int64_t parts = std::max<int64_t>(1, (lens[i] - starts[i] + kPartLen - 1) / kPartLen);
    first_task[i + 1] = first_task[i] + parts * heads_split;
    first_part[i + 1] = first_part[i] + (parts > 1 ? parts : 0);
  }
  const int64_t part_stride = Hq * (D + 2);
  std::vector<float> partials(first_part[num] * part_stride);
  at::parallel_for(0, first_task[num], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(per_task * G * kPartLen), acc(per_task * G * D), qf(per_task * G * D);
    int64_t i = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[i + 1]) ++i;
      const int64_t k = task - first_task[i], p = k / heads_split, h = (k % heads_split) * per_task;
      const int64_t start = starts[i] + p * kPartLen, len = std::min<int64_t>(start + kPartLen, lens[i]);
      Partial part;
      if (first_part[i + 1] > first_part[i]) {  // more than one part: partial results for merge_parts
        float* base = partials.data() + (first_part[i] + p) * part_stride;
        part = {base + h * G * D, base + Hq * D + h * G, base + Hq * D + Hq + h * G};
      }
      const float* task_sinks = sink && p == 0 ? sink + h * G : nullptr;  // a sink counts once, in part 0
#ifdef LLMSERVE_AVX2_ONLY
      if (D % 64 == 0) {
        attend_one_avx2<T>(q + row[i] * q_tok + h * G * q_head, q_head, kc + h * head, vc + h * head, blk, tok, head,
                           tab + i * tables.size(1), start, len, block_size, per_task, G, D,
                           static_cast<float>(scale), static_cast<float>(softcap), task_sinks, scores.data(),
                           qf.data(), acc.data(), o + row[i] * o_tok + h * G * o_head, o_head, part);
        continue;
      }
#endif
      attend_one<T>(q + row[i] * q_tok + h * G * q_head, q_head, kc + h * head, vc + h * head, blk, tok, head,
                    tab + i * tables.size(1), start, len, block_size, per_task, G, D, static_cast<float>(scale),
                    static_cast<float>(softcap), task_sinks, scores.data(), acc.data(), qf.data(),
                    o + row[i] * o_tok + h * G * o_head, o_head, part);
    }
  });
  if (first_part[num] == 0) return;
  at::parallel_for(0, num, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      if (first_part[i + 1] > first_part[i])
        merge_parts(partials.data() + first_part[i] * part_stride, first_part[i + 1] - first_part[i], part_stride,
                    Hq, D, o + row[i] * o_tok, o_head);
  });
}

}  // namespace

// out[rows[i]] = attention of query[rows[i]] over sequence i's first seq_lens[i] cached positions (the last
// `window` of them when window > 0). query/out: [T, Hq, D] with unit stride in D; caches [blocks, bs, Hkv, D].
void decode_attention(const torch::Tensor& query, const torch::Tensor& rows, const torch::Tensor& key_cache,
                      const torch::Tensor& value_cache, const torch::Tensor& tables, const torch::Tensor& seq_lens,
                      double scale, int64_t window, double softcap, const c10::optional<torch::Tensor>& sinks,
                      torch::Tensor out) {
  check_cpu({query, rows, key_cache, value_cache, tables, seq_lens, out}, "decode_attention");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4, "decode_attention: bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.strides() == key_cache.strides(),
              "decode_attention: head dims must be contiguous and the caches alike");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "decode_attention: query, cache and out must share a dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && tables.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32 && tables.is_contiguous(),
              "decode_attention: rows int64, tables and seq_lens int32");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "decode_attention: Hq must be a multiple of Hkv");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (attention_in_tiles(query, key_cache, window, softcap, sinks))
    return attention_amx(query, rows, key_cache, value_cache, tables, seq_lens, scale, out);
#endif
  if (query.scalar_type() == torch::kBFloat16) {
    decode_attention_impl<c10::BFloat16>(query, rows, key_cache, value_cache, tables, seq_lens, scale, window,
                                         softcap, sinks, out);
  } else {
    TORCH_CHECK(query.scalar_type() == torch::kFloat32, "decode_attention: float32 or bfloat16");
    decode_attention_impl<float>(query, rows, key_cache, value_cache, tables, seq_lens, scale, window, softcap,
                                 sinks, out);
  }
}
