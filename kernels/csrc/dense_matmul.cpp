// Matmuls over weights packed in panels of output columns, for the CPU forward in place of oneDNN.
//
// float32: panels of 16 outputs ([ceil(N / 16), K, 16]: the 16 outputs of one k side by side). A tile of up to 6
// rows x 16 outputs lives in 12 AVX2 registers; each k adds x[r, k] * w[k, 0:16] into them. One decode row streams
// the weights once at close to the memory bandwidth (oneDNN's prepacked matmul reached 10-13 GB/s of ~24 on the
// 2-core AVX2 box at 1 row); larger tiles keep the multiply-adds busy.
//
// bfloat16 (the AVX-512 tiers): panels of 32 outputs, inputs in pairs ([ceil(N / 32), ceil(K / 2), 32, 2]: w[n, k]
// and w[n, k + 1] side by side, the pairs of 32 outputs in two 512-bit vectors). One `vdpbf16ps` adds x[r, k] * w[k] +
// x[r, k + 1] * w[k + 1] into 16 float32 lanes (bfloat16 products are exact in float32; without AVX512-BF16 two
// multiply-adds do, see PairDot); a tile is up to 6 rows (4 without AVX512-BF16) x 64 outputs (two panels). The
// float32 sum is rounded to bfloat16 once, as torch rounds a bfloat16 matmul. With AMX
// (inputs a multiple of 32) the same panels feed `tdpbf16ps` tiles of up to 16 rows instead, at every row count.
//
// Every (row, output) sums over k in order, in one register lane or tile element, whatever the tile: a row's result
// does not depend on the other rows of the batch. (AMX and `vdpbf16ps` round a few sums differently: a CPU uses one.)
#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "amx_tiles.h"
#include "bf16_lanes.h"
#include "shared_chunks.h"
#include "with_count.h"

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

// Bytes [begin, end) of the next item's panels that a tile asks L2 for as it runs, `lines` cache lines per step of
// its loop over the inputs. At a few rows an item's panels come from memory once, to its first tile: asked for
// during the previous item's later tiles (bfloat16; float32's first tile asks too), they arrive while those compute
// (`prefetch` spread over the steps: a burst of them at the tile's start stalled its own loads).
struct Ahead {
  const char *begin = nullptr, *end = nullptr;
  int lines = 0;

  // for tile t of an item of `tiles` (tiles before `first` ask for nothing), `steps` steps a tile, the next item's
  // `bytes`
  static Ahead for_tile(const void* next, int64_t bytes, int64_t tiles, int64_t t, int64_t steps, int64_t first = 1) {
    const int64_t asking = tiles - first;
    if (next == nullptr || asking < 1 || t < first || steps == 0) return {};
    const int64_t per_tile = (bytes + asking - 1) / asking;
    const char* from = static_cast<const char*>(next) + (t - first) * per_tile;
    return {from, static_cast<const char*>(next) + std::min(bytes, (t - first + 1) * per_tile),
            static_cast<int>((per_tile + 64 * steps - 1) / (64 * steps))};
  }
  void at(int64_t step) const {
    for (int l = 0; l < lines; ++l)
      if (const char* a = begin + (step * lines + l) * 64; a < end) _mm_prefetch(a, _MM_HINT_T1);
  }
};

#ifdef __AVX512F__
constexpr int64_t kRows512 = 12;  // rows per AVX-512 tile: 12 x 2 accumulators + 2 weight vectors + 1 broadcast

// The same sums with AVX-512, two panels side by side (NP = 2; 1 for a last odd panel): per k, each 16-output lane
// adds x[r, k] * w[k] as the AVX2 tile's lanes do, so the results are the same bits. 32 registers hold 12 rows x 32
// outputs: fewer loads per multiply-add (1.4-1.6x the AVX2 tile at 4-16 rows, 1.1-1.2x at 64).
template <int R, int NP>
void dense_tile512(const float* x, int64_t K, const float* panel, int64_t panel_size, int64_t n0, int64_t width,
                   float* y, int64_t N, const Epilogue& e, const Ahead& ahead) {
  __m512 acc[R][NP];
#pragma GCC unroll 24
  for (int i = 0; i < R * NP; ++i) acc[i / NP][i % NP] = _mm512_setzero_ps();
  const float* second = panel + (NP > 1 ? panel_size : 0);
  for (int64_t k = 0; k < K; ++k) {
    ahead.at(k);
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = NP > 1 ? _mm512_loadu_ps(second + k * kPanel) : w0;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      if constexpr (NP > 1) acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t lanes = std::clamp<int64_t>(width - kPanel * j, 0, kPanel), n = n0 + kPanel * j;
    if (lanes == 0) break;
    const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 bias = e.bias ? _mm512_maskz_loadu_ps(m, e.bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 v = e.bias ? _mm512_add_ps(acc[r][j], bias) : acc[r][j];
      if (e.residual) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, e.residual + r * N + n), v);
      _mm512_mask_storeu_ps(y + r * N + n, m, v);
    }
  }
}
#endif

}  // namespace

static torch::Tensor dense_matmul_f32(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                               const std::optional<torch::Tensor>& bias,
                               const std::optional<torch::Tensor>& residual) {
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
#ifdef __AVX512F__
  const int64_t P = panels.size(0), pairs = (P + 1) / 2, panel_size = K * kPanel;
  const int64_t block = llmserve::row_block(M, 5 * kRows512, kRows512, pairs);
  llmserve::share_chunks((M + block - 1) / block * pairs, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // item i: rows [m0, m1) x panels p, p + 1 (in L1/L2 across the row tiles)
      const int64_t p = i % pairs * 2, m0 = i / pairs * block, m1 = std::min(M, m0 + block);
      const int64_t n0 = p * kPanel, width = std::min(2 * kPanel, N - n0);
      const int64_t tiles = (m1 - m0 + kRows512 - 1) / kRows512, np = (i + 1) % pairs * 2;  // next item's panels
      const float* next = i + 1 < i1 && np != p ? wp + np * panel_size : nullptr;
      for (int64_t m = m0; m < m1; m += kRows512) {
        const Epilogue tile_e{e.bias, e.residual ? e.residual + m * N : nullptr};
        // every tile asks for a share of the next item's panels, the first too: at 16 rows (a 12-row tile, then 4)
        // the short second tile alone could not hide them (decode steps of 16: 2.3-3.3% faster, of 64: 1%)
        const Ahead ahead = Ahead::for_tile(next, std::min<int64_t>(2, P - np) * panel_size * 4, tiles,
                                            (m - m0) / kRows512, K, 0);
        llmserve::with_count<kRows512>(std::min(kRows512, m1 - m), [&](auto rows) {
          if (p + 1 < P)
            dense_tile512<rows(), 2>(xp + m * K, K, wp + p * panel_size, panel_size, n0, width, yp + m * N, N, tile_e,
                                     ahead);
          else
            dense_tile512<rows(), 1>(xp + m * K, K, wp + p * panel_size, panel_size, n0, width, yp + m * N, N, tile_e,
                                     {});
        });
      }
    }
  });
  return y;
#endif
  at::parallel_for(0, panels.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {  // one panel (K x 64 bytes) stays in L1/L2 across the row tiles
      const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
      for (int64_t m = 0; m < M; m += kRows) {
        const Epilogue tile_e{e.bias, e.residual ? e.residual + m * N : nullptr};  // the tile's rows
        llmserve::with_count<kRows>(std::min(kRows, M - m), [&](auto rows) {
          dense_tile<rows()>(xp + m * K, K, wp + p * K * kPanel, n0, width, yp + m * N, N, tile_e);
        });
      }
    }
  });
  return y;
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kBFloat16Panels = true;

namespace {

constexpr int64_t kPanelBF16 = 32;  // outputs per bfloat16 panel: two 16-lane float32 accumulators
#ifdef __AVX512BF16__
constexpr int64_t kRowsBF16 = 6;  // rows per tile: 6 x 4 accumulators (two panels)
#else
constexpr int64_t kRowsBF16 = 4;  // 4 x 4 accumulators and the pairs' 8 widened halves in the 32 registers
#endif

// Per 32-bit lane: acc + x.hi * w.hi, then + x.lo * w.lo (the halves bfloat16, each product exact in float32), as
// `vdpbf16ps` orders its two adds. Without AVX512-BF16 (the x86-64-v4 tiers) the halves are widened to float32 and
// summed by two multiply-adds, each rounded once like that instruction's adds: the same bits except where a value is
// denormal (which vdpbf16ps flushes to zero). Weights stream at half of float32's bytes either way, what bounds a
// decode step's matmuls.
struct PairDot {
#ifdef __AVX512BF16__
  __m512bh w;
  PairDot() = default;
  explicit PairDot(__m512i pairs) : w((__m512bh)pairs) {}
  __m512 add(__m512 acc, int32_t x_pair) const { return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(x_pair), w); }
#else
  __m512 lo, hi;
  PairDot() = default;
  explicit PairDot(__m512i pairs)
      : lo(_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16))),
        hi(_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))))) {}
  __m512 add(__m512 acc, int32_t x_pair) const {
    const uint32_t bits = static_cast<uint32_t>(x_pair);
    float x_lo, x_hi;
    const uint32_t lo_bits = bits << 16, hi_bits = bits & 0xffff0000u;
    std::memcpy(&x_lo, &lo_bits, 4);
    std::memcpy(&x_hi, &hi_bits, 4);
    return _mm512_fmadd_ps(_mm512_set1_ps(x_lo), lo, _mm512_fmadd_ps(_mm512_set1_ps(x_hi), hi, acc));
  }
#endif
};

using llmserve::to_bf16;

// 16 bfloat16 values (masked) as float32
inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

struct EpilogueBF16 {
  const float* bias;         // [N] float32 or null: added to the float32 sum before its rounding
  const uint16_t* residual;  // [M, N] bfloat16 or null: y = residual + round(product), rounded again (torch's add)
  bool swiglu = false;       // the tile's two panels are gate's and up's: y = silu(gate) * up (see swiglu16)
};

// exp_any of cpu_math.h on 16 lanes, step for step (the same bits: no fused multiply-adds, as that file's
// -ffp-contract=off build computes it)
inline __m512 exp_any16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-87.f), x));  // std::min(std::max(x, ..))
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                        6.931472028550421e-1f, 1.f})
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c));
  const __m512i e = _mm512_slli_epi32(_mm512_cvttps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

// silu(gate) * up from the float32 sums of both, with the roundings of the unfused ops (elementwise.cpp's silu_mul_ on
// the bfloat16 matmul's output): gate and up rounded, silu rounded, the product rounded; bfloat16 bits per lane.
inline __m512i swiglu16(__m512 gate_sum, __m512 up_sum) {
  const auto widen = [](__m512i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)); };
  const __m512 g = widen(to_bf16(gate_sum)), u = widen(to_bf16(up_sum));
  const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
  const __m512 e = exp_any16(neg);  // exp(-gate)
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return to_bf16(_mm512_mul_ps(widen(to_bf16(silu)), u));
}

// A tile's float32 sums, sum(r, h) for row r < R and 16-output half h < H (halves 0-1: the first panel, 2-3: the
// second), rounded and stored as e asks into y[r, n0 : n0 + width] (bfloat16 bits).
template <int R, int H, typename Sum>
inline void finish_tile_bf16(Sum&& sum, int64_t n0, int64_t width, uint16_t* y, int64_t N, const EpilogueBF16& e) {
  if constexpr (H == 4) {
    if (e.swiglu) {  // halves 0-1: gate's 32 outputs, 2-3: up's, for the outputs [n0, n0 + width)
      for (int h = 0; h < 2; ++h) {
        const int64_t lanes = std::clamp<int64_t>(width - 16 * h, 0, 16);
        if (lanes == 0) break;
        const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1);
        for (int r = 0; r < R; ++r)
          _mm256_mask_storeu_epi16(y + r * N + n0 + 16 * h, m,
                                   _mm512_cvtepi32_epi16(swiglu16(sum(r, h), sum(r, 2 + h))));
      }
      return;
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t lanes = std::clamp<int64_t>(width - 16 * h, 0, 16);
    if (lanes == 0) break;
    const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1);
    const int64_t n = n0 + 16 * h;
    const __m512 bias = e.bias ? _mm512_maskz_loadu_ps(m, e.bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512i v = to_bf16(e.bias ? _mm512_add_ps(sum(r, h), bias) : sum(r, h));
      if (e.residual) {
        const __m512 product = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        v = to_bf16(_mm512_add_ps(load_bf16(e.residual + r * N + n, m), product));
      }
      _mm256_mask_storeu_epi16(y + r * N + n, m, _mm512_cvtepi32_epi16(v));
    }
  }
}

// y[r, n0 : n0 + width] for rows [0, R) of x (bfloat16 bits), from NP panels side by side (panel_size apart): R x 2
// NP accumulators. Two panels (64 outputs) with 6 rows: 6 broadcasts and 4 loads per 24 `vdpbf16ps`, against 8 and 2
// per 16 with one panel and 8 rows.
template <int R, int NP>
void dense_tile_bf16(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t panel_size, int64_t n0,
                     int64_t width, uint16_t* y, int64_t N, const EpilogueBF16& e, const Ahead& ahead = {}) {
  constexpr int H = 2 * NP;  // 16-lane halves of the tile's outputs
  __m512 acc[R][H];
#pragma GCC unroll 32
  for (int i = 0; i < R * H; ++i) acc[i / H][i % H] = _mm512_setzero_ps();
  const uint16_t* second = panel + (NP > 1 ? panel_size : 0);
  const auto step = [&](int64_t kp, auto&& x_pair) {
    PairDot w[H];
#pragma GCC unroll 4
    for (int j = 0; j < H; ++j)  // the pair's 32 outputs of a panel: two vectors
      w[j] = PairDot(_mm512_loadu_si512((j < 2 ? panel : second) + (2 * kp + j % 2) * kPanelBF16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t xp = x_pair(r);
#pragma GCC unroll 4
      for (int j = 0; j < H; ++j) acc[r][j] = w[j].add(acc[r][j], xp);
    }
  };
  const int64_t pairs = K / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    ahead.at(kp);
    step(kp, [&](int r) {  // x[r, 2 kp] in the low half, x[r, 2 kp + 1] in the high half
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * kp, 4);
      return pair;
    });
  }
  if (K % 2) step(pairs, [&](int r) { return static_cast<int32_t>(x[r * K + K - 1]); });  // the pad half is zero
  finish_tile_bf16<R, H>([&](int r, int h) { return acc[r][h]; }, n0, width, y, N, e);
}

// An AMX tile's rows and inputs per step (the row blocks are sized with them on every CPU).
constexpr int64_t kRowsAMX = 16;
constexpr int64_t kInputsAMX = 32;  // inputs per step: K must be a multiple

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Sapphire Rapids and later): the panels are already the layout of a `tdpbf16ps` weight tile. A pair row of a
// panel is 32 outputs x 2 inputs (128 bytes), so 16 pair rows read 128 bytes apart give outputs 0-15 of 32 inputs, and
// the same at +64 bytes outputs 16-31. A tile of up to 16 rows x 64 outputs sums in four 16 x 16 float32 tiles, 16 x 64
// x 32 multiply-adds per four instructions, where `vdpbf16ps` does 16 x 2: oneDNN's AMX matmul ran 3-8x the AVX-512
// tile at 16-256 rows on a 2-core Xeon. One row gets the same instructions (the unit's time per instruction does not
// depend on the rows), so every row count takes this path and a row's sums stay independent of the batch.

using llmserve::amx_ready;
using llmserve::BorrowedTiles;
using llmserve::TileConfig;

// Wide tiles (R <= 16 rows x 64 outputs): 0-3 R rows x 16 float32 sums; 4: R rows x 32 bfloat16 inputs of x; 5-7: 16
// pair rows x 16 outputs of weights. Tall tiles (R = 17..32 rows x 32 outputs): 0-1 rows 0-15 and 2-3 rows 16.. x 16
// sums; 4-5 the two row halves of x; 6-7 weights. `configured` keys the current one: R, or 32 + R for a tall one.
inline void configure_tiles(int key) {
  TileConfig c;
  const bool tall = key > 32;
  const int R = tall ? key - 32 : key;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(tall ? (t == 2 || t == 3 || t == 5 ? R - 16 : 16) : (t < 5 ? R : 16));
  }
  _tile_loadconfig(&c);
}

// A tile's float32 sums (16 x 64, in `sums`) waiting for their epilogue: finished a row at a time between the next
// tile's steps, so that the vector unit computes silu(gate) * up while the tile unit sums (after its own loop, that
// epilogue made a 512-row dense_swiglu 1.35x slower); each row's arithmetic is finish_tile_bf16's, the same bits.
struct PendingTile {
  const float* sums = nullptr;
  int rows = 0, done = 0;
  bool tall = false;  // a tall tile's sums: 32 x 32 (gate's 16 outputs, then up's), else 16 x 64 (gate's 32, up's 32)
  int64_t n0 = 0, width = 0, N = 0;
  uint16_t* y = nullptr;
  EpilogueBF16 e{nullptr, nullptr};

  void finish_row() {
    const int r = done++;
    const EpilogueBF16 row_e{e.bias, e.residual ? e.residual + r * N : nullptr, e.swiglu};
    if (tall)  // halves 0 and 2 (gate's and up's 16 outputs) only: width <= 16
      finish_tile_bf16<1, 4>([&](int, int h) { return _mm512_load_ps(sums + r * 32 + 16 * (h / 2)); }, n0, width,
                             y + r * N, N, row_e);
    else
      finish_tile_bf16<1, 4>([&](int, int h) { return _mm512_load_ps(sums + r * 64 + 16 * h); }, n0, width,
                             y + r * N, N, row_e);
  }
  void finish() {
    while (done < rows) finish_row();
  }
};

// dense_tile_bf16's outputs for rows [0, R) of x (R as configured), with K a multiple of kInputsAMX, left in `sums`
// (16 x 64 float32) as `pending`'s next tile; the previous one's epilogue runs between this one's steps.
template <int NP>
void amx_tile_bf16(const uint16_t* x, int R, int64_t K, const uint16_t* panel, int64_t panel_size, int64_t n0,
                   int64_t width, uint16_t* y, int64_t N, const EpilogueBF16& e, const Ahead& ahead, float* sums,
                   PendingTile& pending) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NP == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kInputsAMX) {
    ahead.at(k / kInputsAMX);
    _tile_loadd(4, x + k, K * 2);
    const uint16_t* w = panel + k * kPanelBF16;  // pair k / 2's row
    _tile_loadd(5, w, 2 * kPanelBF16 * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 32, 2 * kPanelBF16 * 2);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (NP == 2) {
      const uint16_t* w2 = w + panel_size;
      _tile_loadd(7, w2, 2 * kPanelBF16 * 2);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, w2 + 32, 2 * kPanelBF16 * 2);
      _tile_dpbf16ps(3, 4, 5);
    }
    if (pending.done < pending.rows) pending.finish_row();
  }
  pending.finish();
  _tile_stored(0, sums, 64 * 4);
  _tile_stored(1, sums + 16, 64 * 4);
  if constexpr (NP == 2) {
    _tile_stored(2, sums + 32, 64 * 4);
    _tile_stored(3, sums + 48, 64 * 4);
  }
  if (e.swiglu) {
    pending = PendingTile{sums, R, 0, false, n0, width, N, y, e};
    return;
  }
  for (int r = 0; r < R; ++r)  // a plain epilogue is light: interleaved, the matmuls ran 5-8% slower
    finish_tile_bf16<1, 2 * NP>([&](int, int h) { return _mm512_load_ps(sums + r * 64 + 16 * h); }, n0, width,
                                y + r * N, N, EpilogueBF16{e.bias, e.residual ? e.residual + r * N : nullptr});
}

// A tall tile: rows [0, R) of x, R = 17..32, x two sets of 16 outputs whose weights start at w0 and w1 (pair rows 128
// bytes apart, as in a panel). Each weight tile feeds two row halves: 4 tile loads per 4 products where the wide tile
// takes 5. Tile loads, not products, bound the loop on this Xeon: 10.4 against 14.5 ns a product with the operands in
// L2; in the kernel, 512-row matmuls over 576 inputs ran 5-8% faster, over 1,536 even. The sums (32 x 32 float32, in
// `sums`) are the wide tile's, bit for bit: a tile element sums the same products in the same order whatever the
// tile's shape. Plain: w0, w1 are one panel's outputs 0-15 and 16-31 (outputs n0 .. n0 + 31); swiglu: gate's and up's
// same 16 outputs, finished as `pending`.
void amx_tall_tile_bf16(const uint16_t* x, int R, int64_t K, const uint16_t* w0, const uint16_t* w1, int64_t n0,
                        int64_t width, uint16_t* y, int64_t N, const EpilogueBF16& e, const Ahead& ahead, float* sums,
                        PendingTile& pending) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* x1 = x + 16 * K;
  for (int64_t k = 0; k < K; k += kInputsAMX) {
    ahead.at(k / kInputsAMX);
    _tile_loadd(4, x + k, K * 2);
    _tile_loadd(6, w0 + k * kPanelBF16, 2 * kPanelBF16 * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w1 + k * kPanelBF16, 2 * kPanelBF16 * 2);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, x1 + k, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    for (int r = 0; r < 2 && pending.done < pending.rows; ++r) pending.finish_row();  // 32 rows in 16+ steps
  }
  pending.finish();
  _tile_stored(0, sums, 32 * 4);
  _tile_stored(1, sums + 16, 32 * 4);
  _tile_stored(2, sums + 16 * 32, 32 * 4);
  _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
  if (e.swiglu) {
    pending = PendingTile{sums, R, 0, true, n0, width, N, y, e};
    return;
  }
  for (int r = 0; r < R; ++r)
    finish_tile_bf16<1, 2>([&](int, int h) { return _mm512_load_ps(sums + r * 32 + 16 * h); }, n0, width, y + r * N,
                           N, EpilogueBF16{e.bias, e.residual ? e.residual + r * N : nullptr});
}

bool use_amx(int64_t K) { return K % kInputsAMX == 0 && amx_ready(); }
#else
bool use_amx(int64_t) { return false; }
#endif

const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// y [M, N] from x [M, K] over P panels (panel_stride elements apart), in items of a block of rows x a pair of panels;
// with e.swiglu each pair is gate's and up's panel of the same 32 outputs and y their silu(gate) * up.
void panel_items(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t panel_stride, int64_t P,
                 uint16_t* yp, int64_t N, const EpilogueBF16& e) {
  const int64_t duos = (P + 1) / 2, outputs = e.swiglu ? kPanelBF16 : 2 * kPanelBF16;  // per pair
  const bool amx = use_amx(K);
  // tall tiles where a slab's 32 rows of x stay in L1 (48 KB) while both of its tiles read them: over 1,536 inputs a
  // 64-row down projection ran 3.4 ms (wide) against 4.1-4.3 ms (tall) in 30 layers
  const bool tall = 32 * K * 2 <= 48 * 1024;
  const int64_t tile_rows = amx ? kRowsAMX : kRowsBF16;
  // AMX: blocks of up to 256 rows, so that a prefill chunk reads each panel from memory once and its later tiles
  // find it in L2 (64-row blocks: 512-row matmuls 1.03-1.1x slower, 256-row 1.08-1.17x, weights from memory)
  const int64_t block = llmserve::row_block(M, amx ? 16 * kRowsAMX : 8 * kRowsBF16, tile_rows, duos);
  llmserve::share_chunks((M + block - 1) / block * duos, [&](int64_t i0, int64_t i1) {
    [[maybe_unused]] int configured = 0;  // the AMX tile shape configured on this thread (configure_tiles' key)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    BorrowedTiles borrowed;
    alignas(64) float sums[2][kRowsAMX * 64];  // this tile's and the pending one's
    PendingTile pending;
#endif
    for (int64_t i = i0; i < i1; ++i) {  // item i: rows [m0, m1) x panels p, p + 1
      const int64_t p = i % duos * 2, m0 = i / duos * block, m1 = std::min(M, m0 + block);
      const int64_t n0 = p / 2 * outputs, width = std::min(outputs, N - n0);
      const int64_t tiles = (m1 - m0 + tile_rows - 1) / tile_rows, np = (i + 1) % duos * 2;  // next item's panels
      const uint16_t* next = i + 1 < i1 && np != p ? wp + np * panel_stride : nullptr;
      for (int64_t m = m0; m < m1; m += tile_rows) {
        const EpilogueBF16 tile_e{e.bias, e.residual ? e.residual + m * N : nullptr, e.swiglu};
        const auto ahead_for = [&](int64_t t) {  // the share of the next item's panels that wide tile t asks for
          return Ahead::for_tile(next, std::min<int64_t>(2, P - np) * panel_stride * 2, tiles, t,
                                 amx ? K / kInputsAMX : K / 2);
        };
        const Ahead ahead = ahead_for((m - m0) / tile_rows);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx && tall && m1 - m > kRowsAMX && p + 1 < P) {  // tall tiles of up to 32 rows: two per pair of panels
          const int rows = static_cast<int>(std::min(2 * kRowsAMX, m1 - m));
          if (32 + rows != configured) {
            borrowed.take();
            configure_tiles(configured = 32 + rows);
          }
          for (int half = 0; half < 2; ++half) {  // plain: panel p + half; swiglu: outputs 16 half .. of both
            const uint16_t* w0 = e.swiglu ? wp + p * panel_stride + 32 * half : wp + (p + half) * panel_stride;
            const uint16_t* w1 = e.swiglu ? wp + (p + 1) * panel_stride + 32 * half : w0 + 32;
            const int64_t span = e.swiglu ? 16 : 32, hn0 = n0 + span * half;
            if (hn0 - n0 >= width) break;
            float* tile_sums = sums[pending.sums == sums[0] ? 1 : 0];
            amx_tall_tile_bf16(xp + m * K, rows, K, w0, w1, hn0, std::min(span, width - span * half), yp + m * N, N,
                               tile_e, ahead_for((m - m0) / tile_rows + half), tile_sums, pending);
          }
          m += rows - tile_rows;  // the loop adds the other 16
          continue;
        }
        if (amx) {
          const int rows = static_cast<int>(std::min(kRowsAMX, m1 - m));
          if (rows != configured) {
            borrowed.take();
            configure_tiles(configured = rows);
          }
          float* tile_sums = sums[pending.sums == sums[0] ? 1 : 0];
          if (p + 1 < P)
            amx_tile_bf16<2>(xp + m * K, rows, K, wp + p * panel_stride, panel_stride, n0, width, yp + m * N, N,
                             tile_e, ahead, tile_sums, pending);
          else
            amx_tile_bf16<1>(xp + m * K, rows, K, wp + p * panel_stride, panel_stride, n0, width, yp + m * N, N,
                             tile_e, {}, tile_sums, pending);
          continue;
        }
#endif
        llmserve::with_count<kRowsBF16>(std::min(kRowsBF16, m1 - m), [&](auto rows) {
          if (p + 1 < P)
            dense_tile_bf16<rows(), 2>(xp + m * K, K, wp + p * panel_stride, panel_stride, n0, width, yp + m * N, N,
                                       tile_e, ahead);
          else
            dense_tile_bf16<rows(), 1>(xp + m * K, K, wp + p * panel_stride, panel_stride, n0, width, yp + m * N, N,
                                       tile_e);
        });
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    pending.finish();
#endif
  });
}

// The panels' layout, checked: [P, ceil(K / 2), 32, 2] with each panel contiguous (panels may lie a fixed stride
// apart: gate's and up's are every other panel of one tensor, see dense_swiglu); x [M, K] bfloat16.
void check_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t P, const char* op) {
  TORCH_CHECK(panels.scalar_type() == torch::kBFloat16 && panels.dim() == 4 && panels.size(2) == kPanelBF16 &&
                  panels.size(3) == 2 && panels.stride(3) == 1 && panels.stride(2) == 2 &&
                  panels.stride(1) == 2 * kPanelBF16 &&
                  (panels.size(0) == 1 || panels.stride(0) >= panels.size(1) * 2 * kPanelBF16) &&
                  panels.size(0) == P,
              op, ": bfloat16 panels must be [", P, ", ceil(K / 2), 32, 2], each panel contiguous");
  const int64_t K = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.device().is_cpu() && x.dim() == 2 &&
                  (K + 1) / 2 == panels.size(1),
              op, ": x must be [rows, ", 2 * panels.size(1), " or ", 2 * panels.size(1) - 1, "] bfloat16 on the CPU");
}

torch::Tensor dense_matmul_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                                const std::optional<torch::Tensor>& bias,
                                const std::optional<torch::Tensor>& residual) {
  TORCH_CHECK(N > 0, "dense_matmul: N must be positive");
  check_bf16(x, panels, (N + kPanelBF16 - 1) / kPanelBF16, "dense_matmul");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  EpilogueBF16 e{nullptr, nullptr};
  torch::Tensor b, res;
  if (bias) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == N, "dense_matmul: bias must be [N]");
    e.bias = b.data_ptr<float>();
  }
  if (residual) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == torch::kBFloat16 && res.dim() == 2 && res.size(0) == M && res.size(1) == N,
                "dense_matmul: residual must be [rows, N] bfloat16");
    e.residual = bits(res);
  }
  auto y = torch::empty({M, N}, torch::kBFloat16);
  panel_items(bits(xc), M, xc.size(1), bits(panels), panels.stride(0), panels.size(0),
              reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N, e);
  return y;
}

}  // namespace

// silu(x @ gate.T) * (x @ up.T) [M, N] bfloat16, from gate's and up's bfloat16 panels interleaved in one tensor
// [2 ceil(N / 32), ceil(K / 2), 32, 2] (gate's panel j, then up's panel j): the same bits as the two matmuls and
// silu_mul_ (elementwise.cpp), without their [M, 2 N] output and its second pass.
torch::Tensor dense_swiglu(const torch::Tensor& x, const torch::Tensor& panels, int64_t N) {
  TORCH_CHECK(N > 0, "dense_swiglu: N must be positive");
  check_bf16(x, panels, 2 * ((N + kPanelBF16 - 1) / kPanelBF16), "dense_swiglu");
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({xc.size(0), N}, torch::kBFloat16);
  panel_items(bits(xc), xc.size(0), xc.size(1), bits(panels), panels.stride(0), panels.size(0),
              reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N, EpilogueBF16{nullptr, nullptr, true});
  return y;
}
#else
constexpr bool kBFloat16Panels = false;

torch::Tensor dense_swiglu(const torch::Tensor&, const torch::Tensor&, int64_t) {
  TORCH_CHECK(false, "dense_swiglu: this build has no AVX-512 (bfloat16 panels)");
}
#endif  // AVX-512 BW + VL

// y = x @ w.T (+ bias) (+ residual, as residual + product) for x [M, K] and w packed by `pack_panels`
// (worker_svc/panel_linear.py): float32 panels [ceil(N / 16), K, 16] with float32 x, or (in the AVX-512 tiers)
// bfloat16 panels [ceil(N / 32), ceil(K / 2), 32, 2] with bfloat16 x. N is the unpadded output count.
torch::Tensor dense_matmul(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                           const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (panels.scalar_type() == torch::kBFloat16) return dense_matmul_bf16(x, panels, N, bias, residual);
#endif
  return dense_matmul_f32(x, panels, N, bias, residual);
}

bool dense_bfloat16() { return kBFloat16Panels; }

bool dense_bfloat16_amx() {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return use_amx(kInputsAMX);
#else
  return false;
#endif
}
#endif  // AVX2 + FMA
