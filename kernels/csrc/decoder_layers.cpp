// A Llama-shaped model's decoder layers in one call, for a CPU step whose attention runs entirely in the decode
// kernel (decodes and short prefill chunks): the layer loop of worker_svc/model.py's `LlamaModel.forward` over the
// same kernels in the same order, so the result is bit-identical, without ~25 Python calls and ~20 torch ops per
// layer around them (about 2 ms of a 10 ms batch-1 step of SmolLM2-135M). The caller holds the GIL only to enter.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <utility>
#include <vector>

#include "cpu_ops.h"  // the kernels it calls

#if defined(__AVX2__) && defined(__FMA__)
namespace {

// x @ w.T as worker_svc.model.linear runs a bfloat16 weight: oneDNN's matmul for its prepacked copy (the op
// TorchInductor's CPU freezing uses, called through the dispatcher), F.linear for a plain tensor.
torch::Tensor torch_linear(const torch::Tensor& x, const torch::Tensor& w) {
  if (!w.is_mkldnn()) return at::linear(x, w);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One matmul weight as the model holds it: float32 or bfloat16 panels (worker_svc/panel_linear.py), int4 / int8 groups
// (worker_svc/quant.py's QuantLinear on the CPU kernels), an FP8 checkpoint's codes with their block scales (kFp8),
// or a bfloat16 tensor (oneDNN-prepacked or plain); or (kSwiGLU) gate's and up's bfloat16 panels interleaved, whose
// product is already silu(gate) * up.
struct Matmul {
  enum Kind : int64_t { kPanels = 0, kInt4 = 1, kInt8 = 2, kTorch = 3, kSwiGLU = 4, kFp8 = 5 };
  int64_t kind;
  torch::Tensor weight, scale, zero;  // panels | codes | the tensor; the groups' scales and (int4) zeros
  int64_t out_features, activation_bits;
  int64_t group = 0;  // kFp8: the input columns a scale covers

  // x @ w.T, plus `residual` when given (residual + product, as worker_svc.model.linear_add: inside the panel
  // kernels and the float32 quantized ones, which give the sum a separate add gives; else a separate in-place add,
  // which rounds a bfloat16 product first as Hugging Face does)
  torch::Tensor operator()(const torch::Tensor& x, const std::optional<torch::Tensor>& residual = std::nullopt) const {
    if (residual && (kind == kTorch || (kind != kPanels && x.scalar_type() != torch::kFloat32)))
      return residual->add_((*this)(x));
    switch (kind) {
      case kPanels: return dense_matmul(x, weight, out_features, std::nullopt, residual);
      case kInt4: return int4_matmul(x, weight, scale, zero, activation_bits, residual);
      case kInt8: return int8_matmul(x, weight, scale, activation_bits, residual);
      case kSwiGLU: return dense_swiglu(x, weight, out_features);
      case kFp8: return fp8_matmul(x, weight, scale, group, residual);
      default: return torch_linear(x, weight);
    }
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  Matmul qkv, o, gate_up, down;  // gate_up: gate's outputs, then up's (one matmul, one pass over x), or silu(gate) *
  std::optional<Matmul> up;      // up (kSwiGLU); or gate's only, with up's here (oneDNN's packed copies are not joined)
};

// silu(gate) * up in place into gate, with the ops worker_svc.model's _feed_forward runs for the dtype.
void silu_mul(torch::Tensor gate, const torch::Tensor& up) {
  if (gate.scalar_type() == torch::kBFloat16) return silu_mul_(gate, up);
  at::silu_(gate).mul_(up);  // F.silu(gate, inplace=True).mul_(up)
}

class DecoderLayers {
 public:
  DecoderLayers(double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                torch::Tensor cos, torch::Tensor sin)
      : eps_(eps), hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), scale_(scale), cos_(std::move(cos)),
        sin_(std::move(sin)) {}

  void add_layer(torch::Tensor input_norm, Matmul qkv, Matmul o, torch::Tensor post_norm, Matmul gate_up,
                 Matmul down, std::optional<Matmul> up) {
    TORCH_CHECK(qkv.out_features == (hq_ + 2 * hkv_) * d_, "DecoderLayers: qkv must have (heads + 2 kv heads) x "
                "head_dim outputs");
    TORCH_CHECK(up ? up->out_features == gate_up.out_features && gate_up.kind != Matmul::kSwiGLU
                   : gate_up.kind == Matmul::kSwiGLU || gate_up.out_features % 2 == 0,
                "DecoderLayers: gate_up must hold gate's and up's outputs (or their silu(gate) * up), or gate's with "
                "up's as `up`");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o), std::move(gate_up),
                       std::move(down), std::move(up)});
  }

  // h [T, hidden] float32 or bfloat16 (the embeddings) through every layer; attention for each row i of `rows` (all
  // T rows)
  // over tables[i] / seq_lens[i]. kv_cache [L, 2, blocks, block_size, Hkv, D]; slot_mapping [T] int64.
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& positions, const torch::Tensor& kv_cache,
                        const torch::Tensor& slot_mapping, const torch::Tensor& rows, const torch::Tensor& tables,
                        const torch::Tensor& seq_lens) const {
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == static_cast<int64_t>(layers_.size()),
                "DecoderLayers.forward: kv_cache must be [layers, 2, blocks, block_size, Hkv, D]");
    TORCH_CHECK(rows.numel() == h.size(0), "DecoderLayers.forward: every row must be a kernel row");
    const int64_t T = h.size(0), qk_heads = hq_ + hkv_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const torch::Tensor qkv = L.qkv(rms_norm(h, L.input_norm, eps_));
      const torch::Tensor qk = qkv.narrow(1, 0, qk_heads * d_).view({T, qk_heads, d_});
      rope_(qk, positions, cos_, sin_);
      const torch::Tensor key_cache = kv_cache.select(0, i).select(0, 0);
      const torch::Tensor value_cache = kv_cache.select(0, i).select(0, 1);
      write_kv(qk.narrow(1, hq_, hkv_), qkv.narrow(1, qk_heads * d_, hkv_ * d_).view({T, hkv_, d_}), key_cache,
               value_cache, slot_mapping);
      const torch::Tensor q = qk.narrow(1, 0, hq_);
      torch::Tensor o = torch::empty({T, hq_, d_}, q.options());
      decode_attention(q, rows, key_cache, value_cache, tables, seq_lens, scale_, 0, 0.0, c10::nullopt, o);
      h = L.o(o.view({T, hq_ * d_}), h);
      const torch::Tensor x = rms_norm(h, L.post_norm, eps_);
      torch::Tensor act = L.gate_up(x);  // kSwiGLU: silu(gate) * up already
      if (L.up) {
        silu_mul(act, (*L.up)(x));
      } else if (L.gate_up.kind != Matmul::kSwiGLU) {
        const int64_t inter = act.size(1) / 2;
        const torch::Tensor up = act.narrow(1, inter, inter);
        act = act.narrow(1, 0, inter);
        silu_mul(act, up);
      }
      h = L.down(act, h);
    }
    return h;
  }

 private:
  double eps_;
  int64_t hq_, hkv_, d_;
  double scale_;
  torch::Tensor cos_, sin_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decoder_layers(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Matmul>(m, "Matmul")
      .def(py::init([](int64_t kind, torch::Tensor weight, std::optional<torch::Tensor> scale,
                       std::optional<torch::Tensor> zero, int64_t out_features, int64_t activation_bits,
                       int64_t group) {
             TORCH_CHECK(kind >= Matmul::kPanels && kind <= Matmul::kFp8, "Matmul: kind 0 (panels), 1, 2, 3, 4 or 5");
             TORCH_CHECK(kind == Matmul::kPanels || kind == Matmul::kTorch || kind == Matmul::kSwiGLU || scale,
                         "Matmul: a quantized weight needs its scales");
             TORCH_CHECK(kind != Matmul::kInt4 || zero, "Matmul: an int4 weight needs its zeros");
             TORCH_CHECK(kind != Matmul::kFp8 || group > 0, "Matmul: an FP8 weight needs its scales' group");
             return Matmul{kind, std::move(weight), scale.value_or(torch::Tensor()), zero.value_or(torch::Tensor()),
                           out_features, activation_bits, group};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scale") = py::none(), py::arg("zero") = py::none(),
           py::arg("out_features"), py::arg("activation_bits") = 0, py::arg("group") = 0);
  py::class_<DecoderLayers>(m, "DecoderLayers")
      .def(py::init<double, int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor>(), py::arg("eps"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("cos"),
           py::arg("sin"))
      .def("add_layer", &DecoderLayers::add_layer, py::arg("input_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("post_norm"), py::arg("gate_up"), py::arg("down"), py::arg("up") = py::none())
      .def("forward", &DecoderLayers::forward, py::call_guard<py::gil_scoped_release>());
}
#endif  // AVX2 + FMA
