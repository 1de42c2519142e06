// The gated-activation family on CPU: silu_and_mul, out[r] = silu(gate[r]) * up[r], where a row
// of the input is [gate | up], each half `d` wide.
//
// Compiled once per CPU capability (cpu/dispatch_stub.h): at::vec::Vectorized loops with a
// scalar tail, at::parallel_for over rows. Numerics follow the op declaration
// (core/ir/declarations/activation.py) rounding for rounding, like eager PyTorch: silu in fp32
// (x / (1 + exp(-x)), ATen's formula), rounded to the dtype, then the product in fp32 rounded
// again.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "../kernel_common.h"
#include "dispatch_stub.h"

namespace vllm_ir_c {

// out[r] = act(input[r, :d]) * input[r, d:2d] for every row r.
struct GatedArgs {
  c10::ScalarType dtype;
  void* out;
  RowLayout out_rows;
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t d;
};

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const GatedArgs&), silu_and_mul_stub);

namespace CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;

// Fewer elements than this per task are not worth a parallel region.
constexpr int64_t kMinElementsPerTask = 16384;

// One step: one Vectorized<T> (two fp32 vectors for bf16/fp16, one for fp32).
template <typename T>
constexpr int64_t kStep = at::vec::Vectorized<T>::size();

template <typename T>
std::tuple<fVec, fVec> load2(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {fVec::loadu(p), fVec(0.0f)};
  } else {
    return at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

template <typename T>
void store2(T* p, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// fp32 values rounded to T's precision (native's dtype of F.silu's result).
template <typename T>
std::tuple<fVec, fVec> rounded(const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    return {a, b};
  } else {
    return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
}

fVec silu(const fVec& x) {
  return x / (fVec(1.0f) + x.neg().exp());
}

template <typename T>
void silu_and_mul_rows(const GatedArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.out);
  const int64_t d = a.d;
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(d, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = input + a.input_rows.offset(r);
      const T* up = gate + d;
      T* o = out + a.out_rows.offset(r);
      int64_t i = 0;
      for (; i + kStep<T> <= d; i += kStep<T>) {
        auto [g0, g1] = load2(gate + i);
        auto [u0, u1] = load2(up + i);
        auto [s0, s1] = rounded<T>(silu(g0), silu(g1));
        store2(o + i, s0 * u0, s1 * u1);
      }
      for (; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = static_cast<T>(g / (1.0f + std::exp(-g)));
        o[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

void silu_and_mul_kernel(const GatedArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "silu_and_mul", [&] { silu_and_mul_rows<scalar_t>(a); });
}

}  // namespace
}  // namespace CPU_CAPABILITY

VLLM_IR_C_REGISTER_DISPATCH(silu_and_mul_stub, &CPU_CAPABILITY::silu_and_mul_kernel);

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <torch/library.h>

#include "../ops_common.h"

namespace vllm_ir_c {
namespace {

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  constexpr const char* op = "vllm_ir_c::silu_and_mul";
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op, ": input must end in an even dimension, got ",
              input.sizes());
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": unsupported dtype ", input.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  auto expected = input.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), op, ": out has shape ", out.sizes(), ", expected ",
              at::IntArrayRef(expected));
  TORCH_CHECK(out.scalar_type() == input.scalar_type() && out.device() == input.device(), op,
              ": out must have input's dtype and device");
  if (out.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  at::Tensor y = output_buffer(out);
  GatedArgs args{input.scalar_type(), y.mutable_data_ptr(), row_layout(y), x.const_data_ptr(), row_layout(x),
                 out.numel() / out.size(-1), out.size(-1)};
  silu_and_mul_stub(args);
  unstage(out, y);
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("silu_and_mul", &vllm_ir_c::silu_and_mul_cpu);
}

#endif  // VLLM_IR_C_TORCH_SIDE
