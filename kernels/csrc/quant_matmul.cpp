// Weight-only quantized matmuls for a few activation rows (decode steps), memory-bound by design: each weight group
// is read once, turned into float32 in registers (w = scale * q + zero, the file's values exactly) and multiplied
// into every row; or, with integer activations (--activation-quantization), multiplied in integers into rows
// quantized per 32-group. torch's int4 and int8 weight-packed CPU kernels run these shapes at a fraction of the
// memory bandwidth; they remain the fallback where this file is not built (worker_svc/quant.py picks).
#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_sum.h"
#include "with_count.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kGroup = 32;  // int4 values per (scale, zero) pair, packed in 16 bytes

using llmserve::sum8;

// Output rows ahead of the one being computed whose weight bytes are asked for (codes, scales, zeros: separate
// arrays, each a stream of its own). Without it each row's first bytes waited on memory: the hardware prefetcher
// stops at page ends and trails three streams; with it the batch-1 quantized forward ran 6-10% faster with int8
// activations, 1-3% with float ones.
constexpr int64_t kAheadRows = 4;

inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
}

// Output row n's weight bytes: its codes, its scales and (int4) its zeros.
inline void prefetch_row(const uint8_t* codes, int64_t row_bytes, const float* scale, const float* zero, int64_t G,
                         int64_t n) {
  prefetch_bytes(codes + n * row_bytes, row_bytes);
  prefetch_bytes(scale + n * G, G * 4);
  if (zero) prefetch_bytes(zero + n * G, G * 4);
}

// x [M, K] (float32 or bfloat16) checked, as float32 row-major: the activations are tiny next to the weights.
torch::Tensor check_rows(const torch::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, op, ": x must be [rows, ", K, "] on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, op,
              ": x must be float32 or bfloat16");
  return x.to(torch::kFloat32).contiguous();
}

// Rows [m0, m0 + R) of y for outputs [n0, n1), in AVX2 (8 float32 lanes; every x86-64 CPU of the last decade).
// Per group `weights(n, g, w)` makes the group's 32 weights float32 in registers (w[0..3]: values 0-7, 8-15, 16-23,
// 24-31), multiplied into every row; two accumulators per row so that consecutive multiply-adds do not wait on each
// other (AVX2 has 16 vector registers: 4 rows x 2 next to the 4 weight vectors). Every row is summed in the same
// order whatever the tile size, so a row's result does not depend on the other rows of the batch.
template <int R, typename GroupWeights, typename Ahead>
void float_tile(const float* x, int64_t K, GroupWeights weights, Ahead ahead, int64_t n0, int64_t n1, float* y,
                int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    ahead(std::min(n + kAheadRows, N - 1));
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 w[4];
      weights(n, g, w);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + g * kGroup;
        for (int i = 0; i < 4; ++i) acc[r][i % 2] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % 2]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
}

#ifdef __AVX512F__
// float_tile in 16 lanes: `weights(n, g, w)` makes the group's 32 weights (w[0]: values 0-15, w[1]: 16-31), the
// same floats as the AVX2 path's, and each row's products go to four accumulators (the group's two halves, even
// and odd groups) so that consecutive multiply-adds do not wait on each other. Half the instructions of the AVX2
// tile per group; the sums in another order.
template <int R, typename GroupWeights, typename Ahead>
void float_tile512(const float* x, int64_t K, GroupWeights weights, Ahead ahead, int64_t n0, int64_t n1, float* y,
                   int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    ahead(std::min(n + kAheadRows, N - 1));
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    const auto group = [&](int64_t g, int a) {  // a: 0 (even groups) or 2 (odd), a constant after unrolling
      __m512 w[2];
      weights(n, g, w);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + g * kGroup;
        acc[r][a] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[r][a]);
        acc[r][a + 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[r][a + 1]);
      }
    };
    int64_t g = 0;
    for (; g + 1 < G; g += 2) group(g, 0), group(g + 1, 2);
    if (g < G) group(g, 0);
    for (int r = 0; r < R; ++r)
      y[r * N + n] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
  }
}
#endif

// Runs `tile(R, m, n0, n1)` (rows [m, m + R) of y, outputs [n0, n1)) over every row in tiles of at most 4 rows
// (4 rows x 2 accumulators + the weights stay in registers), the outputs split between the threads and walked 32
// at a time. `residual` (float32 [M, N] or null) is added to each tile as it is finished: residual + product, the
// sum a separate float32 add gives.
template <typename Tile>
torch::Tensor over_rows(int64_t M, int64_t N, torch::ScalarType out_dtype, const float* residual, Tile tile) {
  auto y = torch::empty({M, N}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += 32) {  // 32 outputs' weights stay in L1 across the row tiles
      const int64_t e = std::min(b + 32, n1);
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t R = std::min<int64_t>(4, M - m);
        tile(R, m, b, e, yp + m * N);
        if (residual)
          for (int64_t r = m; r < m + R; ++r)
            for (int64_t n = b; n < e; ++n) yp[r * N + n] = residual[r * N + n] + yp[r * N + n];
      }
    }
  });
  return out_dtype == torch::kFloat32 ? y : y.to(out_dtype);  // round once, as a bfloat16 matmul does
}

// The optional residual as a float32 [M, N] pointer (float32 x only: a bfloat16 add rounds twice, so it stays a
// separate add there).
const float* residual_rows(const std::optional<torch::Tensor>& residual, const torch::Tensor& x, int64_t N,
                           const char* op) {
  if (!residual) return nullptr;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && residual->scalar_type() == torch::kFloat32 &&
                  residual->is_contiguous() && residual->dim() == 2 && residual->size(0) == x.size(0) &&
                  residual->size(1) == N,
              op, ": residual must be [rows, N] float32 contiguous, with float32 x");
  return residual->data_ptr<float>();
}

// ---- integer activations (--activation-quantization): each 32-group of a row becomes int16 or int8 codes with
// one step, so that a group's 32 products are integer multiply-adds in place of float conversions and fused
// multiply-adds. Not exact: each activation moves by up to half its group's step (absmax / 32767 or / 127).

struct QRows {
  torch::Tensor q;    // int8 or int16 [M, K]: round(x / step) per 32-group
  torch::Tensor d;    // float32 [M, K / 32]: the group's step, absmax / 127 or / 32767 (0 for an all-zero group)
  torch::Tensor sum;  // float32 [M, K / 32]: the group's float sum (for the int4 weights' zero term, exactly)
};

template <typename T>
QRows quantize_groups(const torch::Tensor& xf) {
  constexpr float kMax = std::is_same_v<T, int8_t> ? 127.0f : 32767.0f;
  const int64_t M = xf.size(0), K = xf.size(1), G = K / kGroup;
  QRows out{torch::empty({M, K}, std::is_same_v<T, int8_t> ? torch::kInt8 : torch::kInt16),
            torch::empty({M, G}, torch::kFloat32), torch::empty({M, G}, torch::kFloat32)};
  const float* x = xf.data_ptr<float>();
  T* q = out.q.data_ptr<T>();
  float *d = out.d.data_ptr<float>(), *s = out.sum.data_ptr<float>();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' per-lane interleave
  for (int64_t i = 0; i < M * G; ++i) {
    const float* v = x + i * kGroup;
    __m256 f[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      f[j] = _mm256_loadu_ps(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[j]));
    }
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float a = _mm_cvtss_f32(_mm_max_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    d[i] = a / kMax;
    s[i] = sum8(_mm256_add_ps(_mm256_add_ps(f[0], f[1]), _mm256_add_ps(f[2], f[3])));
    const __m256 inv = _mm256_set1_ps(a > 0.0f ? kMax / a : 0.0f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], inv));  // to nearest, ties to even
    const __m256i lo = _mm256_packs_epi32(c[0], c[1]), hi = _mm256_packs_epi32(c[2], c[3]);
    if constexpr (std::is_same_v<T, int8_t>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order));
    } else {  // each pack interleaves 64-bit quarters: 0, 2, 1, 3 back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup), _mm256_permute4x64_epi64(lo, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup + 16), _mm256_permute4x64_epi64(hi, 0xD8));
    }
  }
  return out;
}

// sum over g < G of a[g] * b[g]: 8 groups a step (a scalar chain would wait 4 cycles a group)
inline float dot_groups(const float* a, const float* b, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
  float t = sum8(acc);
  for (; g < G; ++g) t += a[g] * b[g];
  return t;
}

// One weight group's 32 codes, readied once and multiplied into each row's 32 activation codes: `dot` gives 8
// int32 partial sums. int4 codes (0..15) against int8 activations: one maddubs (u8 x s8, pairs summed to 16 bits:
// at most 2 x 15 x 127, no saturation) and a madd by ones; against int16: the codes widened to 16 bits, two madds.
// int8 codes: the same with |w| against x carrying w's sign (maddubs takes one unsigned operand) / widened.
template <typename Act>
struct Int4Group {
  __m256i w0, w1;  // int8 activations: w0 holds all 32 codes (bytes 0-15 values 0-15, 16-31 the rest)
  explicit Int4Group(const uint8_t* c) {
    if constexpr (std::is_same_v<Act, int8_t>) {  // the 16 bytes in both halves, the upper shifted by a nibble
      const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      w0 = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), low4 = _mm_set1_epi8(0x0F);
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low4));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low4));
    }
  }
  __m256i dot(const Act* x) const {
    const __m256i* xv = reinterpret_cast<const __m256i*>(x);
    if constexpr (std::is_same_v<Act, int8_t>)
      return _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_loadu_si256(xv)), _mm256_set1_epi16(1));
    else
      return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)),
                              _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
  }
};

template <typename Act>
struct Int8Group {
  __m256i w0, w1;
  explicit Int8Group(const uint8_t* c) {
    if constexpr (std::is_same_v<Act, int8_t>) {
      w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), w1 = _mm256_abs_epi8(w0);
    } else {
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)));
    }
  }
  __m256i dot(const Act* x) const {
    const __m256i* xv = reinterpret_cast<const __m256i*>(x);
    if constexpr (std::is_same_v<Act, int8_t>)
      return _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(_mm256_loadu_si256(xv), w0)),
                               _mm256_set1_epi16(1));
    else
      return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)),
                              _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
  }
};

// Rows [m0, m0 + R) of y for outputs [n0, n1) from quantized rows: per group the integer dot, times weight step x
// activation step in one float multiply-add. int4 (a scale and a zero per group): plus zero x the group's float
// sum, exactly. int8 (a scale per group): no zero term.
// Two accumulators per row take the even and the odd groups so that consecutive groups do not wait on each other;
// each row is summed in the same order whatever the tile, so its result does not depend on the batch.
template <int R, typename Group, typename Act>
void integer_tile(const QRows& xq, int64_t m0, int64_t K, const uint8_t* codes, int64_t row_bytes,
                  const float* scale, const float* zero, int64_t n0, int64_t n1, float* y, int64_t N) {
  constexpr bool kInt4 = std::is_same_v<Group, Int4Group<Act>>;
  const int64_t G = K / kGroup;
  const Act* xc = xq.q.data_ptr<Act>() + m0 * K;
  const float *xd = xq.d.data_ptr<float>() + m0 * G, *xs = xq.sum.data_ptr<float>() + m0 * G;
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_row(codes, row_bytes, scale, kInt4 ? zero : nullptr, G, std::min(n + kAheadRows, N - 1));
    const uint8_t* c = codes + n * row_bytes;
    __m256 acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const auto group = [&](int64_t g, int a) {
      const Group w(c + g * (row_bytes / G));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 step = _mm256_set1_ps(scale[n * G + g] * xd[r * G + g]);
        acc[r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w.dot(xc + r * K + g * kGroup)), step, acc[r][a]);
      }
    };
    int64_t g = 0;
    for (; g + 1 < G; g += 2) group(g, 0), group(g + 1, 1);
    if (g < G) group(g, 0);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float t = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
      y[r * N + n] = kInt4 ? t + dot_groups(zero + n * G, xs + r * G, G) : t;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 activations with AVX512-VNNI: two weight groups per 512-bit vpdpbusd (u8 x s8, four products summed per
// int32 lane), where the AVX2 tile spends a maddubs and a madd per group. The activation side of each pair of
// groups is laid out once per call, the same for every output: the steps of the two groups spread over the lanes
// their sums land in (0-7, 8-15), and for int8 weights (taken as w + 128, unsigned) the int32 start that removes
// the 128 x sum of the lane's activation codes. Integer sums exact; the float steps and sums those of the AVX2 tile,
// added in another order. Each row independent of the others.
struct VnniRows {
  std::vector<float> step;      // [M, G / 2, 16]
  std::vector<int32_t> offset;  // [M, G / 2, 16]
};

inline VnniRows vnni_rows(const QRows& xq) {
  const int64_t M = xq.q.size(0), K = xq.q.size(1), P = K / kGroup / 2;
  VnniRows v{std::vector<float>(M * P * 16), std::vector<int32_t>(M * P * 16)};
  const int8_t* q = xq.q.data_ptr<int8_t>();
  const float* d = xq.d.data_ptr<float>();
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t i = 0; i < M * P; ++i) {  // rows' pairs are consecutive: pair i covers groups 2i, 2i + 1
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + 2 * i)));
    _mm512_storeu_ps(v.step.data() + 16 * i, _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two)));
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(char(0x80)),
                                             _mm512_loadu_si512(q + 64 * i));
    _mm512_storeu_si512(v.offset.data() + 16 * i, _mm512_sub_epi32(_mm512_setzero_si512(), sums));
  }
  return v;
}

// Rows [m0, m0 + R) of y for outputs [n0, n1), as integer_tile, a pair of groups per step. int4: the pair's 32
// code bytes (group 2p then 2p + 1, byte j = value j | value j + 16 << 4) spread to the lanes of their activations,
// [low nibbles of 2p, high of 2p, low of 2p + 1, high of 2p + 1]; int8: 64 code bytes as they are, plus 128.
template <int R, bool kInt4>
void vnni_tile(const QRows& xq, const VnniRows& xv, int64_t m0, int64_t K, const uint8_t* codes, int64_t row_bytes,
               const float* scale, const float* zero, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t G = K / kGroup, P = G / 2;
  const int8_t* xc = xq.q.data_ptr<int8_t>() + m0 * K;
  const float* xs = xq.sum.data_ptr<float>() + m0 * G;
  const float* xstep = xv.step.data() + m0 * P * 16;
  const int32_t* xoff = xv.offset.data() + m0 * P * 16;
  const __m512i spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), nibble = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(char(0x80));
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_row(codes, row_bytes, scale, kInt4 ? zero : nullptr, G, std::min(n + kAheadRows, N - 1));
    const uint8_t* c = codes + n * row_bytes;
    __m512 acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const auto pair = [&](int64_t p, int k) {
      __m512i w;
      if constexpr (kInt4) {
        const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p)));
        w = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi64(spread, b), nibble), low4);
      } else {
        w = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * p), bias);
      }
      const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scale + n * G + 2 * p)));
      const __m512 ws = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i start = kInt4 ? _mm512_setzero_si512() : _mm512_loadu_si512(xoff + (r * P + p) * 16);
        const __m512i dot = _mm512_dpbusd_epi32(start, w, _mm512_loadu_si512(xc + r * K + 64 * p));
        const __m512 step = _mm512_mul_ps(ws, _mm512_loadu_ps(xstep + (r * P + p) * 16));
        acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), step, acc[r][k]);
      }
    };
    int64_t p = 0;
    for (; p + 1 < P; p += 2) pair(p, 0), pair(p + 1, 1);
    if (p < P) pair(p, 0);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float t = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
      y[r * N + n] = kInt4 ? t + dot_groups(zero + n * G, xs + r * G, G) : t;
    }
  }
}
#endif

// x quantized to Act, then integer_tile over every row.
template <template <typename> class Group, typename Act>
torch::Tensor integer_matmul(const torch::Tensor& xf, torch::ScalarType out_dtype, const float* residual,
                             const uint8_t* codes, int64_t N, int64_t row_bytes, const float* scale,
                             const float* zero) {
  const QRows xq = quantize_groups<Act>(xf);
  const int64_t K = xf.size(1);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<Act, int8_t>) {
    if (K % (2 * kGroup) == 0) {
      constexpr bool kInt4 = std::is_same_v<Group<Act>, Int4Group<Act>>;
      const VnniRows xv = vnni_rows(xq);
      return over_rows(xf.size(0), N, out_dtype, residual, [&](int64_t R, int64_t m, int64_t n0, int64_t n1,
                                                               float* yr) {
        llmserve::with_count<4>(R, [&](auto r) {
          vnni_tile<r(), kInt4>(xq, xv, m, K, codes, row_bytes, scale, zero, n0, n1, yr, N);
        });
      });
    }
  }
#endif
  return over_rows(xf.size(0), N, out_dtype, residual, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) {
      integer_tile<r(), Group<Act>, Act>(xq, m, K, codes, row_bytes, scale, zero, n0, n1, yr, N);
    });
  });
}

}  // namespace

// y = x @ w.T for an int4 weight: codes [N, K / 2] uint8 (per 32-group, byte j = q[j] | q[j + 16] << 4), scale and
// zero [N, K / 32] float32 (w = scale * q + zero); x [M <= 16, K] float32 or bfloat16, y [M, N] in x's dtype.
// activation_bits 8 or 16: x's 32-groups made int8 / int16 first (above); 0: x as it is.
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          const torch::Tensor& zero, int64_t activation_bits,
                          const std::optional<torch::Tensor>& residual) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && K % kGroup == 0,
              "int4_matmul: codes must be [N, K / 2] uint8 contiguous with K a multiple of 32");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->size(0) == N &&
                    t->size(1) == K / kGroup,
                "int4_matmul: scale and zero must be [N, K / 32] float32 contiguous");
  TORCH_CHECK(activation_bits == 0 || activation_bits == 8 || activation_bits == 16,
              "int4_matmul: activation_bits must be 0, 8 or 16");
  const torch::Tensor xf = check_rows(x, K, "int4_matmul");
  const float* res = residual_rows(residual, x, N, "int4_matmul");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *z = zero.data_ptr<float>();
  if (activation_bits != 0) {
    return activation_bits == 16 ? integer_matmul<Int4Group, int16_t>(xf, x.scalar_type(), res, c, N, K / 2, s, z)
                                 : integer_matmul<Int4Group, int8_t>(xf, x.scalar_type(), res, c, N, K / 2, s, z);
  }
  const float* xp = xf.data_ptr<float>();
  const auto ahead = [&](int64_t n) { prefetch_row(c, K / 2, s, z, K / kGroup, n); };
#ifdef __AVX512F__
  const auto weights512 = [&](int64_t n, int64_t g, __m512 w[2]) {  // w = scale * q + zero
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + n * (K / 2) + g * 16));
    const __m128i low = _mm_set1_epi8(0x0F), high = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m512 sv = _mm512_set1_ps(s[n * (K / kGroup) + g]), zv = _mm512_set1_ps(z[n * (K / kGroup) + g]);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low))), sv, zv);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), sv, zv);
  };
  return over_rows(xf.size(0), N, x.scalar_type(), res, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) { float_tile512<r()>(xp + m * K, K, weights512, ahead, n0, n1, yr, N); });
  });
#else
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const auto weights = [&](int64_t n, int64_t g, __m256 w[4]) {  // w = scale * q + zero
    // 16 bytes: byte j holds value j (low nibble) and value j + 16 (high nibble), GGUF's own order
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + n * (K / 2) + g * 16));
    const __m256i qa = _mm256_cvtepu8_epi32(b), qb = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b));
    const __m256 sv = _mm256_set1_ps(s[n * (K / kGroup) + g]), zv = _mm256_set1_ps(z[n * (K / kGroup) + g]);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(qa, low4)), sv, zv);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(qb, low4)), sv, zv);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4)), sv, zv);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4)), sv, zv);
  };
  return over_rows(xf.size(0), N, x.scalar_type(), res, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) { float_tile<r()>(xp + m * K, K, weights, ahead, n0, n1, yr, N); });
  });
#endif
}

// y = x @ w.T for an int8 weight with a scale per 32-group: codes [N, K] int8 (K a multiple of 32), scale
// [N, K / 32] float32 (w = scale * q).
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          int64_t activation_bits, const std::optional<torch::Tensor>& residual) {
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && K % kGroup == 0,
              "int8_matmul: codes must be [N, K] int8 contiguous with K a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && scale.size(1) == K / kGroup,
              "int8_matmul: scale must be [N, K / 32] float32 contiguous");
  TORCH_CHECK(activation_bits == 0 || activation_bits == 8 || activation_bits == 16,
              "int8_matmul: activation_bits must be 0, 8 or 16");
  const torch::Tensor xf = check_rows(x, K, "int8_matmul");
  const float* res = residual_rows(residual, x, N, "int8_matmul");
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  const auto* cb = reinterpret_cast<const uint8_t*>(c);
  if (activation_bits != 0) {
    return activation_bits == 16 ? integer_matmul<Int8Group, int16_t>(xf, x.scalar_type(), res, cb, N, K, s, nullptr)
                                 : integer_matmul<Int8Group, int8_t>(xf, x.scalar_type(), res, cb, N, K, s, nullptr);
  }
  const float* xp = xf.data_ptr<float>();
  const auto ahead = [&](int64_t n) { prefetch_row(cb, K, s, nullptr, K / kGroup, n); };
#ifdef __AVX512F__
  const auto weights512 = [&](int64_t n, int64_t g, __m512 w[2]) {  // w = scale * q
    const __m128i* q = reinterpret_cast<const __m128i*>(c + n * K + g * kGroup);
    const __m512 sv = _mm512_set1_ps(s[n * (K / kGroup) + g]);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), sv);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), sv);
  };
  return over_rows(xf.size(0), N, x.scalar_type(), res, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) { float_tile512<r()>(xp + m * K, K, weights512, ahead, n0, n1, yr, N); });
  });
#else
  const auto weights = [&](int64_t n, int64_t g, __m256 w[4]) {  // w = scale * q
    const int8_t* q = c + n * K + g * kGroup;
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    const __m256 sv = _mm256_set1_ps(s[n * (K / kGroup) + g]);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0)), sv);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b0, b0))), sv);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1)), sv);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b1, b1))), sv);
  };
  return over_rows(xf.size(0), N, x.scalar_type(), res, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) { float_tile<r()>(xp + m * K, K, weights, ahead, n0, n1, yr, N); });
  });
#endif
}

// y = x @ w.T for an FP8 checkpoint's weight (worker_svc/model/hf_quant.py): codes [N, K] float8_e4m3fn read as
// bytes (K a multiple of 32), scale [N, S] float32, one per row and per `group` columns (a block's width, a power
// of two times 32; or S = 1: per channel or per tensor, the scale repeated over the rows). w = scale * float(code),
// the float32 product dequantize-then-matmul takes, exactly: e4m3's sign and low 7 bits (4 exponent, 3 mantissa)
// placed in a float16 (sign at bit 15, the 7 bits at 13..7: exponent bias 15 where e4m3's is 7, so the float16 is
// the code times 2^-8, subnormals included) made float32 by F16C without rounding, times scale x 2^8 (exact: a
// power of two). Code 0x7f / 0xff (e4m3fn's NaN) reads as +-480; a checkpoint holds none.
torch::Tensor fp8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t group,
                         const std::optional<torch::Tensor>& residual) {
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.element_size() == 1 && K % kGroup == 0,
              "fp8_matmul: codes must be [N, K] float8_e4m3fn (or its bytes) contiguous, K a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && group > 0 && scale.size(1) == (K + group - 1) / group,
              "fp8_matmul: scale must be [N, ceil(K / group)] float32 contiguous");
  // a 32-group's scale column is g >> shift: a block a power of two of 32-groups wide, or one column for all
  const int64_t S = scale.size(1);
  int shift = 31;  // S == 1: every g < 2^31 is column 0
  if (S > 1) {
    TORCH_CHECK(group % kGroup == 0 && ((group / kGroup) & (group / kGroup - 1)) == 0,
                "fp8_matmul: group must be 32 times a power of two, or cover all K columns; it is ", group);
    shift = __builtin_ctzll(group / kGroup);
  }
  const torch::Tensor xf = check_rows(x, K, "fp8_matmul");
  const float* res = residual_rows(residual, x, N, "fp8_matmul");
  const uint8_t* c = static_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scale.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
  const auto ahead = [&](int64_t n) {
    prefetch_bytes(c + n * K, K);
    prefetch_bytes(s + n * S, S * 4);
  };
  // 16 codes (u8) -> 16 float16 bit patterns of code x 2^-8
  const auto halves = [](__m128i b) {
    const __m256i v = _mm256_cvtepu8_epi16(b);
    return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(v, 8), _mm256_set1_epi16(int16_t(0x8000))),
                           _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(0x3f80)));
  };
#ifdef __AVX512F__
  const auto weights512 = [&](int64_t n, int64_t g, __m512 w[2]) {
    const __m128i* q = reinterpret_cast<const __m128i*>(c + n * K + g * kGroup);
    const __m512 sv = _mm512_set1_ps(s[n * S + (g >> shift)] * 256.0f);
    w[0] = _mm512_mul_ps(_mm512_cvtph_ps(halves(_mm_loadu_si128(q))), sv);
    w[1] = _mm512_mul_ps(_mm512_cvtph_ps(halves(_mm_loadu_si128(q + 1))), sv);
  };
  return over_rows(xf.size(0), N, x.scalar_type(), res, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) { float_tile512<r()>(xp + m * K, K, weights512, ahead, n0, n1, yr, N); });
  });
#else
  const auto weights = [&](int64_t n, int64_t g, __m256 w[4]) {
    const __m128i* q = reinterpret_cast<const __m128i*>(c + n * K + g * kGroup);
    const __m256 sv = _mm256_set1_ps(s[n * S + (g >> shift)] * 256.0f);
    const __m256i h0 = halves(_mm_loadu_si128(q)), h1 = halves(_mm_loadu_si128(q + 1));
    w[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h0)), sv);
    w[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1)), sv);
    w[2] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h1)), sv);
    w[3] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1)), sv);
  };
  return over_rows(xf.size(0), N, x.scalar_type(), res, [&](int64_t R, int64_t m, int64_t n0, int64_t n1, float* yr) {
    llmserve::with_count<4>(R, [&](auto r) { float_tile<r()>(xp + m * K, K, weights, ahead, n0, n1, yr, N); });
  });
#endif
}

// x's 32-groups as the integer paths see them: (codes int8 or int16 [M, K], step [M, K / 32], float sum
// [M, K / 32]).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0, "quantize_activations: x must be [rows, K], K a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 16, "quantize_activations: bits must be 8 or 16");
  const torch::Tensor xf = check_rows(x, x.size(1), "quantize_activations");
  const QRows q = bits == 8 ? quantize_groups<int8_t>(xf) : quantize_groups<int16_t>(xf);
  return {q.q, q.d, q.sum};
}
#endif  // AVX2 + FMA
