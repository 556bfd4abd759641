// float32 matmuls over weights packed in panels of 16 outputs ([ceil(N / 16), K, 16]: the 16 outputs of one k
// side by side). A tile of up to 6 rows x 16 outputs lives in 12 AVX2 registers; each k adds x[r, k] * w[k, 0:16]
// into them. One decode row streams the weights once at close to the memory bandwidth (oneDNN's prepacked matmul
// reached 10-13 GB/s of ~24 on the 2-core AVX2 box at 1 row); larger tiles keep the multiply-adds busy. Every
// (row, output) sums over k in order, in one register lane, whatever the tile: a row's result does not depend on
// the other rows of the batch.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kPanel = 16;  // outputs per panel: two 8-lane vectors
constexpr int64_t kRows = 6;    // rows per tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast <= 16 registers

struct Epilogue {
  const float* bias;      // [N] or null
  const float* residual;  // [M, N] or null: y = residual + (x @ w.T + bias), the sum torch's separate add rounds
};

// y[r, n0 : n0 + width] for rows [0, R) of x, from one panel.
template <int R>
void dense_tile(const float* x, int64_t K, const float* panel, int64_t n0, int64_t width, float* y, int64_t N,
                const Epilogue& e) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6  // unrolled, the accumulators stay in registers (GCC otherwise keeps the array on the stack)
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  alignas(32) float out[R][kPanel];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out[r], acc[r][0]);
    _mm256_store_ps(out[r] + 8, acc[r][1]);
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * N + n0;
    for (int64_t j = 0; j < width; ++j) {
      float v = out[r][j];
      if (e.bias) v += e.bias[n0 + j];
      if (e.residual) v = e.residual[r * N + n0 + j] + v;
      yr[j] = v;
    }
  }
}

void dense_rows(int64_t R, const float* x, int64_t K, const float* panel, int64_t n0, int64_t width, float* y,
                int64_t N, const Epilogue& e) {
  switch (R) {
    case 1: return dense_tile<1>(x, K, panel, n0, width, y, N, e);
    case 2: return dense_tile<2>(x, K, panel, n0, width, y, N, e);
    case 3: return dense_tile<3>(x, K, panel, n0, width, y, N, e);
    case 4: return dense_tile<4>(x, K, panel, n0, width, y, N, e);
    case 5: return dense_tile<5>(x, K, panel, n0, width, y, N, e);
    default: return dense_tile<6>(x, K, panel, n0, width, y, N, e);
  }
}

}  // namespace

// y = x @ w.T (+ bias) (+ residual, as residual + product) for float32 x [M, K] and w packed by `pack_panels`
// (worker_svc/panel_linear.py: `panels` [ceil(N / 16), K, 16]); N is the unpadded output count.
torch::Tensor dense_matmul(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                           const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual) {
  TORCH_CHECK(panels.scalar_type() == torch::kFloat32 && panels.is_contiguous() && panels.dim() == 3 &&
                  panels.size(2) == kPanel && N > 0 && (N + kPanel - 1) / kPanel == panels.size(0),
              "dense_matmul: panels must be [ceil(N / 16), K, 16] float32 contiguous");
  const int64_t K = panels.size(1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.dim() == 2 && x.size(1) == K,
              "dense_matmul: x must be [rows, ", K, "] float32 on the CPU");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  Epilogue e{nullptr, nullptr};
  torch::Tensor b, res;
  if (bias) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "dense_matmul: bias must be [N] float32");
    e.bias = b.data_ptr<float>();
  }
  if (residual) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == torch::kFloat32 && res.dim() == 2 && res.size(0) == M && res.size(1) == N,
                "dense_matmul: residual must be [rows, N] float32");
    e.residual = res.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, torch::kFloat32);
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {  // one panel (K x 64 bytes) stays in L1/L2 across the row tiles
      const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
      for (int64_t m = 0; m < M; m += kRows) {
        const Epilogue tile_e{e.bias, e.residual ? e.residual + m * N : nullptr};  // the tile's rows
        dense_rows(std::min(kRows, M - m), xp + m * K, K, wp + p * K * kPanel, n0, width, yp + m * N, N, tile_e);
      }
    }
  });
  return y;
}
#endif  // AVX2 + FMA
