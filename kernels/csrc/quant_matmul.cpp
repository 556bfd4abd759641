// Weight-only quantized matmuls for a few activation rows (decode steps), memory-bound by design: each weight group
// is read once, turned into float32 in registers (w = scale * q + zero, the file's values exactly) and multiplied
// into every row. torch's int4 and int8 weight-packed CPU kernels run these shapes at a fraction of the memory
// bandwidth; they keep the larger row counts (worker_svc/quant.py picks).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_sum.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kGroup = 32;  // int4 values per (scale, zero) pair, packed in 16 bytes

using llmserve::sum8;

// x [M, K] (float32 or bfloat16) checked, as float32 row-major: the activations are tiny next to the weights.
torch::Tensor check_rows(const torch::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, op, ": x must be [rows, ", K, "] on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, op,
              ": x must be float32 or bfloat16");
  return x.to(torch::kFloat32).contiguous();
}

// Rows [m0, m0 + R) of y for outputs [n0, n1), in AVX2 (8 float32 lanes; every x86-64 CPU of the last decade).
// Per group the weights are made float32 (w = scale * q + zero) and multiplied into every row; two accumulators
// per row so that consecutive multiply-adds do not wait on each other (AVX2 has 16 vector registers: 4 rows x 2
// next to the 4 weight vectors). Every row is summed in the same order whatever the tile size, so a row's result
// does not depend on the other rows of the batch.
template <int R>
void int4_tile(const float* x, int64_t K, const uint8_t* codes, const float* scale, const float* zero, int64_t n0,
               int64_t n1, float* y, int64_t N) {
  constexpr int A = 2;
  const int64_t G = K / kGroup;
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const float* s = scale + n * G;
    const float* z = zero + n * G;
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      // 16 bytes: byte j holds value j (low nibble) and value j + 16 (high nibble), GGUF's own order
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + g * 16));
      const __m256i qa = _mm256_cvtepu8_epi32(b), qb = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b));
      const __m256 sv = _mm256_set1_ps(s[g]), zv = _mm256_set1_ps(z[g]);
      const __m256 w[4] = {  // values 0-7, 8-15, 16-23, 24-31
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(qa, low4)), sv, zv),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(qb, low4)), sv, zv),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4)), sv, zv),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4)), sv, zv)};
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + g * kGroup;
        for (int i = 0; i < 4; ++i) acc[r][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 t = acc[r][0];
      for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
      y[r * N + n] = sum8(t);
    }
  }
}

template <int R>
void int8_tile(const float* x, int64_t K, const int8_t* codes, const float* scale, int64_t n0, int64_t n1, float* y,
               int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* c = codes + n * K;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = scale[n] * sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
}

// Runs `tile<R>` over every row of x in tiles of at most 4 rows (4 rows x 2 accumulators + the weights stay in
// registers), the outputs split between the threads and walked 32 at a time.
template <typename Tile>
torch::Tensor over_rows(const torch::Tensor& xf, int64_t N, torch::ScalarType out_dtype, Tile tile) {
  const int64_t M = xf.size(0), K = xf.size(1);
  auto y = torch::empty({M, N}, torch::kFloat32);
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += 32)  // 32 outputs' weights stay in L1 across the row tiles
      for (int64_t m = 0; m < M; m += 4)
        tile(std::min<int64_t>(4, M - m), xp + m * K, b, std::min(b + 32, n1), yp + m * N);
  });
  return out_dtype == torch::kFloat32 ? y : y.to(out_dtype);  // round once, as a bfloat16 matmul does
}

}  // namespace

// y = x @ w.T for an int4 weight: codes [N, K / 2] uint8 (per 32-group, byte j = q[j] | q[j + 16] << 4), scale and
// zero [N, K / 32] float32 (w = scale * q + zero); x [M <= 16, K] float32 or bfloat16, y [M, N] in x's dtype.
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          const torch::Tensor& zero) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && K % kGroup == 0,
              "int4_matmul: codes must be [N, K / 2] uint8 contiguous with K a multiple of 32");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->size(0) == N &&
                    t->size(1) == K / kGroup,
                "int4_matmul: scale and zero must be [N, K / 32] float32 contiguous");
  const torch::Tensor xf = check_rows(x, K, "int4_matmul");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *z = zero.data_ptr<float>();
  return over_rows(xf, N, x.scalar_type(), [&](int64_t R, const float* xr, int64_t n0, int64_t n1, float* yr) {
    switch (R) {
      case 1: return int4_tile<1>(xr, K, c, s, z, n0, n1, yr, N);
      case 2: return int4_tile<2>(xr, K, c, s, z, n0, n1, yr, N);
      case 3: return int4_tile<3>(xr, K, c, s, z, n0, n1, yr, N);
      default: return int4_tile<4>(xr, K, c, s, z, n0, n1, yr, N);
    }
  });
}

// y = x @ w.T for an int8 weight with one scale per output: codes [N, K] int8 (K a multiple of 16), scale [N] float32.
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale) {
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && K % 16 == 0,
              "int8_matmul: codes must be [N, K] int8 contiguous with K a multiple of 16");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == N,
              "int8_matmul: scale must be [N] float32");
  const torch::Tensor xf = check_rows(x, K, "int8_matmul");
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  return over_rows(xf, N, x.scalar_type(), [&](int64_t R, const float* xr, int64_t n0, int64_t n1, float* yr) {
    switch (R) {
      case 1: return int8_tile<1>(xr, K, c, s, n0, n1, yr, N);
      case 2: return int8_tile<2>(xr, K, c, s, n0, n1, yr, N);
      case 3: return int8_tile<3>(xr, K, c, s, n0, n1, yr, N);
      default: return int8_tile<4>(xr, K, c, s, n0, n1, yr, N);
    }
  });
}
#endif  // AVX2 + FMA
