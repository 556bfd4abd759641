// Every op of the C++ CPU kernels, as module.cpp binds them and decoder_layers.cpp calls them; each is defined in
// the file named beside it.
#pragma once

#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// paged_attention.cpp
void decode_attention(const torch::Tensor& query, const torch::Tensor& rows, const torch::Tensor& key_cache,
                      const torch::Tensor& value_cache, const torch::Tensor& tables, const torch::Tensor& seq_lens,
                      double scale, int64_t window, double softcap, const c10::optional<torch::Tensor>& sinks,
                      torch::Tensor out);

// elementwise.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
void rope_(torch::Tensor x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin);
void silu_mul_(torch::Tensor gate, const torch::Tensor& up);
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor key_cache, torch::Tensor value_cache,
              const torch::Tensor& slot_mapping);

// sampling.cpp
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& keys);

// thread_binding.cpp
std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);

#if defined(__AVX2__) && defined(__FMA__)
// quant_matmul.cpp
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          const torch::Tensor& zero, int64_t activation_bits,
                          const std::optional<torch::Tensor>& residual);
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          int64_t activation_bits, const std::optional<torch::Tensor>& residual);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t bits);
torch::Tensor fp8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t group,
                         const std::optional<torch::Tensor>& residual);

// dense_matmul.cpp
torch::Tensor dense_matmul(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                           const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual);
torch::Tensor dense_swiglu(const torch::Tensor& x, const torch::Tensor& panels, int64_t N);
bool dense_bfloat16();      // whether dense_matmul takes bfloat16 panels (the AVX-512 tiers)
bool dense_bfloat16_amx();  // whether it sums them with AMX tiles (inputs a multiple of 32)
#endif
