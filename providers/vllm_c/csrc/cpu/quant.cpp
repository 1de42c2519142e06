// The FP8 quantization family on CPU: static_quant_fp8, dynamic_quant_fp8 (per-token and
// per-tensor) and dynamic_group_quant_fp8, into float8_e4m3fn or float8_e4m3fnuz.
//
// Compiled once per CPU capability (cpu/dispatch_stub.h). Values are widened to fp32, scaled,
// encoded (quant.h's quantize_fp8, lane by lane in at::vec::Vectorized<int32_t>) and narrowed
// to bytes in registers, one vector at a time; at::parallel_for over rows.
//
// Dynamic per-token and group quant widen each row once into a per-thread fp32 buffer while
// taking the absmax (per row or per group), then quantize from that buffer, which is in L1/L2:
// x is read from memory once. Rows longer than kRowBuffer elements are re-read instead. bf16
// rows (or groups) of >= 64 on AVX512 take the absmax from the bits and go through
// fp8_vec.h's tables, re-reading x from L1.
// Per-tensor dynamic quant needs the whole tensor's absmax first: one reduction pass, then the
// static kernel.

#include "../quant.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dispatch_stub.h"
#include "fp8_vec.h"

namespace vllm_ir_c {

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const StaticQuantArgs&), static_quant_fp8_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const DynamicQuantArgs&), dynamic_per_token_quant_fp8_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const AbsmaxArgs&), absmax_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const GroupQuantArgs&), group_quant_fp8_stub);

namespace CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;
using namespace fp8_vec;

// Fewer elements than this per task are not worth a parallel region.
constexpr int64_t kMinElementsPerTask = 16384;
// Rows up to this many elements are widened once into a per-thread buffer (64 KiB).
constexpr int64_t kRowBuffer = 16384;

int64_t grain_size(int64_t hidden) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(hidden, 1));
}

template <Fp8Format kFormat, typename T>
void static_quant_rows(const StaticQuantArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const float bound = fp8_bound(kFormat);
  const int64_t hidden = a.hidden;
  const bool per_column = a.col_group < hidden;  // the scale changes along a row
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> inv_row(per_column ? hidden : 0);
    RowQuantizer<kFormat, T> quantize_by;
    int64_t cached = -1;  // the scale row inv_row holds
    for (int64_t r = begin; r < end; ++r) {
      const int64_t scale_row = r / a.row_group;
      const float* srow = a.scale + scale_row * a.scale_row_stride;
      if (per_column && scale_row != cached) {
        for (int64_t c = 0; c < hidden; ++c) {
          inv_row[c] = 1.0f / srow[(c / a.col_group) * a.scale_col_stride];
        }
        cached = scale_row;
      }
      if (per_column) {
        quantize_row<kFormat, T>(input + a.input_rows.offset(r), a.out + r * hidden, hidden, 0.0f, inv_row.data(),
                                 bound);
      } else {
        quantize_by(input + a.input_rows.offset(r), a.out + r * hidden, hidden, 1.0f / srow[0], bound);
      }
    }
  });
}

template <Fp8Format kFormat, typename T>
void dynamic_per_token_rows(const DynamicQuantArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const float bound = fp8_bound(kFormat);
  const int64_t hidden = a.hidden;
  // bf16 rows that RowQuantizer takes through its table are read twice (absmax, then the
  // table), the second time from L1; the others are widened once into the row buffer.
  const bool buffered = hidden <= kRowBuffer && !RowQuantizer<kFormat, T>::by_table(hidden);
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(buffered ? hidden : 0);
    RowQuantizer<kFormat, T> quantize_by;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = input + a.input_rows.offset(r);
      const float absmax = buffered ? widen_absmax<T>(x, row.data(), hidden) : row_absmax<T>(x, hidden);
      const float scale = dynamic_scale(absmax, a.scale_ub, kFormat);
      a.scale[r] = scale;
      const float inv = 1.0f / scale;
      if (buffered) {
        quantize_row<kFormat, float>(row.data(), a.out + r * hidden, hidden, inv, nullptr, bound);
      } else {
        const T* next = r + 1 < end ? input + a.input_rows.offset(r + 1) : nullptr;
        quantize_by(x, a.out + r * hidden, hidden, inv, bound, next);
      }
    }
  });
}

template <typename T>
void absmax_rows(const AbsmaxArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  *a.result = at::parallel_reduce(
      0, a.rows, grain_size(a.hidden), 0.0f,
      [&](int64_t begin, int64_t end, float acc) {
        for (int64_t r = begin; r < end; ++r) {
          acc = nan_max(acc, row_absmax<T>(input + a.input_rows.offset(r), a.hidden));
        }
        return acc;
      },
      nan_max);
}

template <Fp8Format kFormat, typename T>
void group_quant_rows(const GroupQuantArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const float bound = fp8_bound(kFormat);
  const int64_t hidden = a.hidden;
  const int64_t g = a.group_size;
  const int64_t groups = (hidden + g - 1) / g;
  // Groups that RowQuantizer takes through a table (one per group) are read twice (absmax from
  // the bits, then the table), the second time from L1; the others are widened once.
  const bool buffered = hidden <= kRowBuffer && !RowQuantizer<kFormat, T>::by_table(g);
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(buffered ? hidden : 0);
    std::vector<float> absmax(groups);
    RowQuantizer<kFormat, T> quantize_by;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = input + a.input_rows.offset(r);
      uint8_t* out = a.out + r * hidden;
      float* scales = a.scales + a.scale_rows.offset(r);
      if (!buffered) {
        const T* next = r + 1 < end ? input + a.input_rows.offset(r + 1) : nullptr;
        quantize_row_groups<kFormat, T>(x, out, hidden, g, absmax.data(), scales, a.scale_group_stride, a.use_ue8m0,
                                        bound, quantize_by, next);
        continue;
      }
      for (int64_t c = 0, k = 0; c < hidden; c += g, ++k) {
        absmax[k] = widen_absmax<T>(x + c, row.data() + c, std::min(g, hidden - c));
      }
      quantize_fp32_groups<kFormat>(row.data(), out, hidden, g, absmax.data(), scales, a.scale_group_stride,
                                    a.use_ue8m0, bound);
    }
  });
}

// One switch over (input dtype, fp8 format) for each kernel entry.
#define VLLM_IR_C_QUANT_DISPATCH(ARGS, NAME, FN)                                        \
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(ARGS.dtype, NAME, [&] {                             \
    if (ARGS.format == Fp8Format::E4M3FNUZ) {                                            \
      FN<Fp8Format::E4M3FNUZ, scalar_t>(ARGS);                                           \
    } else {                                                                             \
      FN<Fp8Format::E4M3FN, scalar_t>(ARGS);                                             \
    }                                                                                    \
  })

void static_quant_kernel(const StaticQuantArgs& a) {
  VLLM_IR_C_QUANT_DISPATCH(a, "static_quant_fp8", static_quant_rows);
}

void dynamic_per_token_kernel(const DynamicQuantArgs& a) {
  VLLM_IR_C_QUANT_DISPATCH(a, "dynamic_quant_fp8", dynamic_per_token_rows);
}

void absmax_kernel(const AbsmaxArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "dynamic_quant_fp8", [&] { absmax_rows<scalar_t>(a); });
}

void group_quant_kernel(const GroupQuantArgs& a) {
  VLLM_IR_C_QUANT_DISPATCH(a, "dynamic_group_quant_fp8", group_quant_rows);
}

#undef VLLM_IR_C_QUANT_DISPATCH

}  // namespace
}  // namespace CPU_CAPABILITY

VLLM_IR_C_REGISTER_DISPATCH(static_quant_fp8_stub, &CPU_CAPABILITY::static_quant_kernel);
VLLM_IR_C_REGISTER_DISPATCH(dynamic_per_token_quant_fp8_stub, &CPU_CAPABILITY::dynamic_per_token_kernel);
VLLM_IR_C_REGISTER_DISPATCH(absmax_stub, &CPU_CAPABILITY::absmax_kernel);
VLLM_IR_C_REGISTER_DISPATCH(group_quant_fp8_stub, &CPU_CAPABILITY::group_quant_kernel);

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <torch/library.h>

namespace vllm_ir_c {
namespace {

void static_quant_fp8_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  run_static_quant("vllm_ir_c::static_quant_fp8", out, input, scale,
                   [](const StaticQuantArgs& a) { static_quant_fp8_stub(a); });
}

void dynamic_quant_fp8_cpu(at::Tensor& out, at::Tensor& scale, const at::Tensor& input,
                           const std::optional<at::Tensor>& scale_ub, bool per_token) {
  constexpr const char* op = "vllm_ir_c::dynamic_quant_fp8";
  check_quant_io(op, out, input);
  check_float_scale(op, "scale", scale, input);
  TORCH_CHECK(scale.is_contiguous(), op, ": scale must be contiguous");
  const float* ub = ub_or_null(op, scale_ub, input);
  const Fp8Format format = fp8_format(op, out);
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  TORCH_CHECK(scale.numel() == (per_token ? rows : 1), op, ": scale has ", scale.numel(), " elements, expected ",
              per_token ? rows : 1);
  const at::Tensor x = staged(input);
  if (per_token) {
    if (rows == 0 || hidden == 0) {
      return;
    }
    DynamicQuantArgs a{input.scalar_type(), format, static_cast<uint8_t*>(out.mutable_data_ptr()),
                       scale.mutable_data_ptr<float>(), x.const_data_ptr(), row_layout(x), rows, hidden, ub};
    dynamic_per_token_quant_fp8_stub(a);
    return;
  }
  float absmax = 0.0f;
  if (input.numel() > 0) {
    AbsmaxArgs m{input.scalar_type(), x.const_data_ptr(), row_layout(x), rows, hidden, &absmax};
    absmax_stub(m);
  }
  *scale.mutable_data_ptr<float>() = dynamic_scale(absmax, ub, format);
  if (input.numel() > 0) {
    static_quant_fp8_stub(static_quant_args(op, out, x, scale, input));
  }
}

void dynamic_group_quant_fp8_cpu(at::Tensor& out, at::Tensor& scales, const at::Tensor& input, int64_t group_size,
                                 bool use_ue8m0) {
  run_group_quant("vllm_ir_c::dynamic_group_quant_fp8", out, scales, input, group_size, use_ue8m0,
                  [](const GroupQuantArgs& a) { group_quant_fp8_stub(a); });
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  // q is written into `out` (float8_e4m3fn or float8_e4m3fnuz: its dtype chooses the format
  // and the clamp bound, 448 or 224); rows of `out` beyond input's are left unwritten.
  m.def("static_quant_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");
  m.def("dynamic_quant_fp8(Tensor(a!) out, Tensor(b!) scale, Tensor input, Tensor? scale_ub, bool per_token) -> ()");
  m.def(
      "dynamic_group_quant_fp8(Tensor(a!) out, Tensor(b!) scales, Tensor input, int group_size, bool use_ue8m0) -> "
      "()");
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("static_quant_fp8", &vllm_ir_c::static_quant_fp8_cpu);
  m.impl("dynamic_quant_fp8", &vllm_ir_c::dynamic_quant_fp8_cpu);
  m.impl("dynamic_group_quant_fp8", &vllm_ir_c::dynamic_group_quant_fp8_cpu);
}

#endif  // VLLM_IR_C_TORCH_SIDE
