// The Python module of the C++ CPU kernels (kernels/cpu_ops.py builds every csrc/*.cpp into it, for one ISA tier).
// Ops that need AVX2 + FMA (the matmuls and the layer loop) exist only in builds of x86-64-v3 and up; `isa` names
// the instruction sets the build was compiled for, so a caller can tell which paths it runs.
#include <torch/extension.h>

#include <string>

#include "amx_tiles.h"
#include "cpu_ops.h"

namespace {

// The instruction sets this build's code may use (its -march tier and extra flags).
std::string compiled_isa() {
  std::string isa = "x86-64";
#ifdef __AVX2__
  isa += " avx2";
#endif
#ifdef __FMA__
  isa += " fma";
#endif
#ifdef __AVX512F__
  isa += " avx512f";
#endif
#ifdef __AVX512BW__
  isa += " avx512bw";
#endif
#ifdef __AVX512VL__
  isa += " avx512vl";
#endif
#ifdef __AVX512VNNI__
  isa += " avx512_vnni";
#endif
#ifdef __AVX512BF16__
  isa += " avx512_bf16";
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  isa += " amx_tile amx_bf16";
#endif
  return isa;
}

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
void bind_decoder_layers(pybind11::module_& m);  // decoder_layers.cpp
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = compiled_isa();
  m.def("bind_omp_threads", &bind_omp_threads);
  m.def("sample_rows", &sample_rows);
  m.def("decode_attention", &decode_attention);
  m.def("rms_norm", &rms_norm);
  m.def("rope_", &rope_);
  m.def("silu_mul_", &silu_mul_);
  m.def("write_kv", &write_kv);
#if defined(__AVX2__) && defined(__FMA__)
  m.def("int4_matmul", &int4_matmul, pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scale"),
        pybind11::arg("zero"), pybind11::arg("activation_bits") = 0, pybind11::arg("residual") = pybind11::none());
  m.def("int8_matmul", &int8_matmul, pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scale"),
        pybind11::arg("activation_bits") = 0, pybind11::arg("residual") = pybind11::none());
  m.def("quantize_activations", &quantize_activations);
  m.def("fp8_matmul", &fp8_matmul, pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scale"),
        pybind11::arg("group"), pybind11::arg("residual") = pybind11::none());
  m.def("dense_matmul", &dense_matmul, pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("N"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none());
  m.attr("dense_bfloat16") = dense_bfloat16();
  m.attr("dense_bfloat16_amx") = dense_bfloat16_amx();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.attr("attention_bfloat16_amx") = llmserve::amx_ready();  // bfloat16 attention in AMX tiles (attend_columns_amx)
#else
  m.attr("attention_bfloat16_amx") = false;
#endif
  m.def("dense_swiglu", &dense_swiglu, pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("N"));
  bind_decoder_layers(m);
#endif
}
