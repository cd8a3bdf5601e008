// Row-wise ops that torch runs as chains of eager ops, each a pass over memory and a dispatch of its own:
// a decoder's RMSNorm (transformers: to float32, pow, mean, add, rsqrt, mul, back to the input dtype, mul
// by the weight: eight ops, on a few dozen rows per decode step), a gated MLP's SiLU and product (two
// ops, and the SiLU's output written and read again) and the rotary embedding of queries and keys (five
// ops, see rotary.py). Each is one pass here, with the arithmetic and the roundings of the ops it
// replaces: float32 inside, rounded to the input dtype where torch rounds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <type_traits>

namespace {

using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<at::BFloat16>;

// Loads and stores of up to fVec::size() values as float32, whatever the storage type.
fVec load(const float* src, int64_t count) { return fVec::loadu(src, count); }

fVec load(const at::BFloat16* src, int64_t count) {
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(bVec::loadu(src, count)));
}

void store(fVec value, float* dst, int64_t count) { value.store(dst, count); }

void store(fVec value, at::BFloat16* dst, int64_t count) {
  at::vec::convert_from_float<at::BFloat16>(value, value).store(dst, count);
}

// A value rounded to T and read back as float32: where torch's op would hand the next op a T.
fVec rounded(fVec value, const float*) { return value; }

fVec rounded(fVec value, const at::BFloat16*) {
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(value, value)));
}

// Rows per task: enough elements that a second thread pays for its wake-up.
int64_t grain(int64_t row_size) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_size, 1)); }

// With a residual: each row's sum with it is rounded to T (torch's `residual + hidden_states`), written to
// sum_out, and normalized as the norm would read that T tensor: the add and the norm in one pass.
template <typename T>
void rms_norm_rows(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, float eps,
                   const at::Tensor* residual = nullptr, at::Tensor* sum_out = nullptr) {
  const int64_t rows = input.size(0), dim = input.size(1), in_stride = input.stride(0), out_stride = out.stride(0);
  const T* in_data = input.data_ptr<T>();
  const T* weight_data = weight.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const T* residual_data = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  T* sum_data = sum_out != nullptr ? sum_out->data_ptr<T>() : nullptr;
  const int64_t residual_stride = residual != nullptr ? residual->stride(0) : 0;
  const int64_t sum_stride = sum_out != nullptr ? sum_out->stride(0) : 0;
  constexpr int64_t step = fVec::size();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in_data + r * in_stride;
      if (residual_data != nullptr) {
        // the row's sum, stored in T, becomes the row the norm reads
        const T* added = residual_data + r * residual_stride;
        T* sum = sum_data + r * sum_stride;
        for (int64_t d = 0; d < dim; d += step) {
          const int64_t count = std::min(step, dim - d);
          store(load(added + d, count) + load(x + d, count), sum + d, count);
        }
        x = sum;
      }
      T* y = out_data + r * out_stride;
      fVec squares(0.f);
      for (int64_t d = 0; d < dim; d += step) {
        const int64_t count = std::min(step, dim - d);
        const fVec v = load(x + d, count);  // lanes past count load as 0
        squares = at::vec::fmadd(v, v, squares);
      }
      const float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, squares);
      const fVec inverse(1.f / std::sqrt(sum / static_cast<float>(dim) + eps));
      for (int64_t d = 0; d < dim; d += step) {
        const int64_t count = std::min(step, dim - d);
        // torch: (x * rsqrt(variance + eps)).to(T), then weight * that, in T
        const fVec normed = rounded(load(x + d, count) * inverse, x);
        store(load(weight_data + d, count) * normed, y + d, count);
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), width = out.size(1), in_stride = gate_up.stride(0), out_stride = out.stride(0);
  const T* in_data = gate_up.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  constexpr int64_t step = fVec::size();
  const fVec one(1.f);
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in_data + r * in_stride;
      const T* up = gate + width;
      T* y = out_data + r * out_stride;
      // torch's SiLU kernel: x / (1 + exp(-x)) in float32, rounded to T; then the product, in T
      int64_t d = 0;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (; d + bVec::size() <= width; d += bVec::size()) {  // a whole bf16 vector: two float vectors
          auto [g0, g1] = at::vec::convert_to_float<T>(bVec::loadu(gate + d));
          auto [u0, u1] = at::vec::convert_to_float<T>(bVec::loadu(up + d));
          auto [a0, a1] = at::vec::convert_to_float<T>(
              at::vec::convert_from_float<T>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp())));
          at::vec::convert_from_float<T>(a0 * u0, a1 * u1).store(y + d);
        }
      }
      for (; d < width; d += step) {
        const int64_t count = std::min(step, width - d);
        const fVec g = load(gate + d, count);
        const fVec activated = rounded(g / (one + g.neg().exp()), gate);
        store(activated * load(up + d, count), y + d, count);
      }
    }
  });
}

// out (R, H, D) = x rotated: per half, x1 * cos1 - x2 * sin1 and x2 * cos2 + x1 * sin2, each product and
// each sum rounded to T as rotary.apply_rotary's eager ops round them. cos and sin may be float32 for a
// bf16 x: each value is rounded to T where it is read, as `cos.to(T)` would round it, without that copy
// (a vision tower would make it in every layer of a call, for the same cos and sin).
template <typename T, typename C>
void rotary_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const T* x_data = x.data_ptr<T>();
  const C* cos_data = cos.data_ptr<C>();
  const C* sin_data = sin.data_ptr<C>();
  T* out_data = out.data_ptr<T>();
  constexpr int64_t step = fVec::size();
  at::parallel_for(0, rows, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const C* c = cos_data + r * cos.stride(0);
      const C* s = sin_data + r * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        const T* x1 = x_data + r * x.stride(0) + h * x.stride(1);
        const T* x2 = x1 + half;
        T* y1 = out_data + r * out.stride(0) + h * out.stride(1);
        T* y2 = y1 + half;
        for (int64_t d = 0; d < half; d += step) {
          const int64_t count = std::min(step, half - d);
          const fVec a = load(x1 + d, count), b = load(x2 + d, count);
          const fVec c1 = rounded(load(c + d, count), x1), s1 = rounded(load(s + d, count), x1);
          const fVec c2 = rounded(load(c + half + d, count), x1), s2 = rounded(load(s + half + d, count), x1);
          const fVec first = rounded(a * c1, x1) - rounded(b * s1, x1);
          const fVec second = rounded(b * c2, x1) + rounded(a * s2, x1);
          store(first, y1 + d, count);
          store(second, y2 + d, count);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& out, const at::Tensor& input, const char* what) {
  TORCH_CHECK(input.dim() == 2 && out.dim() == 2 && input.stride(1) == 1 && out.stride(1) == 1,
              what, ": 2-d rows with contiguous last dims");
  TORCH_CHECK(input.scalar_type() == out.scalar_type(), what, ": one dtype");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 only, got ", input.scalar_type());
}

}  // namespace

namespace batchvl_native {

// out (R, D) = RMSNorm of input (R, D) with weight (D,), as transformers' Llama/Qwen RMSNorm modules.
void rms_norm(at::Tensor out, at::Tensor input, at::Tensor weight, double eps) {
  check_rows(out, input, "rms_norm");
  TORCH_CHECK(out.sizes() == input.sizes() && weight.dim() == 1 && weight.size(0) == input.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == input.scalar_type(),
              "rms_norm: out like input, a contiguous weight of the row size and dtype");
  if (input.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(out, input, weight, static_cast<float>(eps));
  } else {
    rms_norm_rows<at::BFloat16>(out, input, weight, static_cast<float>(eps));
  }
}

// sum_out = residual + input (rounded to their dtype) and out = RMSNorm of sum_out, all (R, D): a layer's
// residual add and the norm after it.
void add_rms_norm(at::Tensor out, at::Tensor sum_out, at::Tensor input, at::Tensor residual, at::Tensor weight,
                  double eps) {
  check_rows(out, input, "add_rms_norm");
  check_rows(sum_out, residual, "add_rms_norm");
  TORCH_CHECK(out.sizes() == input.sizes() && sum_out.sizes() == input.sizes() && residual.sizes() == input.sizes() &&
                  residual.scalar_type() == input.scalar_type() && weight.dim() == 1 &&
                  weight.size(0) == input.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == input.scalar_type(),
              "add_rms_norm: out, sum_out and residual like input, a contiguous weight of the row size and dtype");
  if (input.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(out, input, weight, static_cast<float>(eps), &residual, &sum_out);
  } else {
    rms_norm_rows<at::BFloat16>(out, input, weight, static_cast<float>(eps), &residual, &sum_out);
  }
}

// out (R, I) = silu(gate_up[:, :I]) * gate_up[:, I:], as a gated MLP with SiLU computes it.
void silu_and_mul(at::Tensor out, at::Tensor gate_up) {
  check_rows(out, gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1),
              "silu_and_mul: gate_up (R, 2I), out (R, I)");
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(out, gate_up);
  } else {
    silu_and_mul_rows<at::BFloat16>(out, gate_up);
  }
}

// out (R, H, D) = the rotary embedding of x (R, H, D) with cos and sin (R, D), as rotary.apply_rotary of x
// and cos and sin in x's dtype. cos and sin are in x's dtype or in float32.
void rotary(at::Tensor out, at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes() && x.size(2) % 2 == 0, "rotary: x and out (R, H, D), D even");
  TORCH_CHECK(x.stride(2) == 1 && out.stride(2) == 1, "rotary: contiguous head dims");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == x.size(2) && t->stride(1) == 1 &&
                    (t->scalar_type() == x.scalar_type() || t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == cos.scalar_type(),
                "rotary: cos and sin (R, D) in x's dtype or float32, contiguous rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "rotary: one dtype");
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float, float>(out, x, cos, sin);
  } else if (x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kFloat) {
    rotary_rows<at::BFloat16, float>(out, x, cos, sin);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotary_rows<at::BFloat16, at::BFloat16>(out, x, cos, sin);
  } else {
    TORCH_CHECK(false, "rotary: float32 or bfloat16 only, got ", x.scalar_type());
  }
}

}  // namespace batchvl_native
