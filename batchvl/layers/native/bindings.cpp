// The Python module of batchvl's native kernels (see native_kernels.py): one module for all sources, each
// function called without the GIL, as torch's own ops are.

#include <torch/extension.h>

namespace batchvl_native {
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor kv, at::Tensor rows, at::Tensor pages,
                            at::Tensor starts, at::Tensor lengths, double scale, int64_t page_size);
void rms_norm(at::Tensor out, at::Tensor input, at::Tensor weight, double eps);
void add_rms_norm(at::Tensor out, at::Tensor sum_out, at::Tensor input, at::Tensor residual, at::Tensor weight,
                  double eps);
void silu_and_mul(at::Tensor out, at::Tensor gate_up);
void rotary(at::Tensor out, at::Tensor x, at::Tensor cos, at::Tensor sin);
bool bf16_dot_products();
void varlen_attention(at::Tensor out, at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                      double scale);
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor kv, at::Tensor query_starts,
                             at::Tensor query_counts, at::Tensor slots, at::Tensor lengths, double scale);
}  // namespace batchvl_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &batchvl_native::paged_decode_attention,
        "Decode attention over the paged KV cache", release());
  m.def("rms_norm", &batchvl_native::rms_norm, "RMSNorm of rows, as transformers' Llama/Qwen modules", release());
  m.def("add_rms_norm", &batchvl_native::add_rms_norm, "A residual add and the RMSNorm of its sum, in one pass",
        release());
  m.def("silu_and_mul", &batchvl_native::silu_and_mul, "silu(gate) * up of a fused gate/up output", release());
  m.def("rotary", &batchvl_native::rotary, "Rotary embedding of (R, H, D) rows, as rotary.apply_rotary", release());
  m.def("bf16_dot_products", &batchvl_native::bf16_dot_products, "Whether this CPU has AVX512-BF16 dot products");
  m.def("varlen_attention", &batchvl_native::varlen_attention,
        "Non-causal bf16 attention of packed variable-length sequences (AVX512-BF16)", release());
  m.def("paged_prefill_attention", &batchvl_native::paged_prefill_attention,
        "Causal bf16 attention of prefill chunks over the paged KV cache (AVX512-BF16)", release());
}
