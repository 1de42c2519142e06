// The FP8 quantization family on CPU: static_quant_fp8, dynamic_quant_fp8 (per-token and
// per-tensor) and dynamic_group_quant_fp8, into float8_e4m3fn or float8_e4m3fnuz.
//
// Compiled once per CPU capability (cpu/dispatch_stub.h). Values are widened to fp32 and
// scaled with at::vec::Vectorized; the fp8 encoding (quant.h: quantize_fp8, branch-free) runs
// over blocks of those fp32 values in a loop the compiler vectorizes for the capability's ISA.
// at::parallel_for over rows.
//
// Dynamic per-token and group quant widen each row once into a per-thread fp32 buffer while
// taking the absmax (per row or per group), then quantize from that buffer, which is in L1/L2:
// x is read from memory once. Rows longer than kRowBuffer elements are re-read instead.
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

namespace vllm_ir_c {

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const StaticQuantArgs&), static_quant_fp8_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const DynamicQuantArgs&), dynamic_per_token_quant_fp8_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const AbsmaxArgs&), absmax_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const GroupQuantArgs&), group_quant_fp8_stub);

namespace CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;

// Fewer elements than this per task are not worth a parallel region.
constexpr int64_t kMinElementsPerTask = 16384;
// fp32 values encoded per block (stays in L1).
constexpr int64_t kBlock = 256;
// Rows up to this many elements are widened once into a per-thread buffer (64 KiB).
constexpr int64_t kRowBuffer = 16384;

int64_t grain_size(int64_t hidden) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(hidden, 1));
}

// n fp32 values -> n fp8 bytes. The loop is branch-free: the compiler vectorizes it.
template <Fp8Format kFormat>
void encode(const float* __restrict src, uint8_t* __restrict dst, int64_t n, float bound) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = quantize_fp8<kFormat>(src[i], bound);
  }
}

// dst[0:n] = float(src[0:n]) * inv (inv a scalar, or per element when inv_row is set).
template <typename T>
void widen_scaled(const T* src, float* dst, int64_t n, float inv, const float* inv_row) {
  int64_t i = 0;
  const fVec vinv(inv);
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) {
      const fVec s = inv_row ? fVec::loadu(inv_row + i) : vinv;
      (fVec::loadu(src + i) * s).store(dst + i);
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vec::loadu(src + i));
      const fVec sa = inv_row ? fVec::loadu(inv_row + i) : vinv;
      const fVec sb = inv_row ? fVec::loadu(inv_row + i + fVec::size()) : vinv;
      (a * sa).store(dst + i);
      (b * sb).store(dst + i + fVec::size());
    }
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]) * (inv_row ? inv_row[i] : inv);
  }
}

// dst[0:n] = float(src[0:n]); returns max |src| (NaN if any is NaN).
template <typename T>
float widen_absmax(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  fVec m(0.0f);
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) {
      const fVec a = fVec::loadu(src + i);
      if (dst != nullptr) {
        a.store(dst + i);
      }
      m = at::vec::maximum(m, a.abs());
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vec::loadu(src + i));
      if (dst != nullptr) {
        a.store(dst + i);
        b.store(dst + i + fVec::size());
      }
      m = at::vec::maximum(m, at::vec::maximum(a.abs(), b.abs()));
    }
  }
  float result = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, m);
  for (; i < n; ++i) {
    const float v = static_cast<float>(src[i]);
    if (dst != nullptr) {
      dst[i] = v;
    }
    result = nan_max(result, std::abs(v));
  }
  return result;
}

// Max |v| over float values (NaN-propagating).
float absmax_floats(const float* src, int64_t n) {
  return widen_absmax<float>(src, nullptr, n);
}

// out[0:n] = quantize(float(src[0:n]) * inv), through L1-sized fp32 blocks.
template <Fp8Format kFormat, typename T>
void quantize_row(const T* src, uint8_t* out, int64_t n, float inv, const float* inv_row, float bound) {
  alignas(64) float block[kBlock];
  for (int64_t c = 0; c < n; c += kBlock) {
    const int64_t len = std::min(kBlock, n - c);
    widen_scaled<T>(src + c, block, len, inv, inv_row ? inv_row + c : nullptr);
    encode<kFormat>(block, out + c, len, bound);
  }
}

template <Fp8Format kFormat, typename T>
void static_quant_rows(const StaticQuantArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const float bound = fp8_bound(kFormat);
  const int64_t hidden = a.hidden;
  const bool per_column = a.col_group < hidden;  // the scale changes along a row
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> inv_row(per_column ? hidden : 0);
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
      const float inv = per_column ? 0.0f : 1.0f / srow[0];
      quantize_row<kFormat, T>(input + a.input_rows.offset(r), a.out + r * hidden, hidden, inv,
                               per_column ? inv_row.data() : nullptr, bound);
    }
  });
}

template <Fp8Format kFormat, typename T>
void dynamic_per_token_rows(const DynamicQuantArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const float bound = fp8_bound(kFormat);
  const int64_t hidden = a.hidden;
  const bool buffered = hidden <= kRowBuffer;
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(buffered ? hidden : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = input + a.input_rows.offset(r);
      const float absmax = widen_absmax<T>(x, buffered ? row.data() : nullptr, hidden);
      const float scale = dynamic_scale(absmax, a.scale_ub, kFormat);
      a.scale[r] = scale;
      const float inv = 1.0f / scale;
      if (buffered) {
        quantize_row<kFormat, float>(row.data(), a.out + r * hidden, hidden, inv, nullptr, bound);
      } else {
        quantize_row<kFormat, T>(x, a.out + r * hidden, hidden, inv, nullptr, bound);
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
          acc = nan_max(acc, widen_absmax<T>(input + a.input_rows.offset(r), nullptr, a.hidden));
        }
        return acc;
      },
      nan_max);
}

template <Fp8Format kFormat, typename T>
void group_quant_rows(const GroupQuantArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const float bound = fp8_bound(kFormat);
  const float floor = fp8_min_scale(kFormat);
  const int64_t hidden = a.hidden;
  const int64_t g = a.group_size;
  const bool buffered = hidden <= kRowBuffer;
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(buffered ? hidden : std::min(g, kRowBuffer));
    for (int64_t r = begin; r < end; ++r) {
      const T* x = input + a.input_rows.offset(r);
      uint8_t* out = a.out + r * hidden;
      float* scales = a.scales + a.scale_rows.offset(r);
      if (buffered) {
        widen_absmax<T>(x, row.data(), hidden);  // one read of x: widened into L1
      }
      for (int64_t c = 0, k = 0; c < hidden; c += g, ++k) {
        const int64_t len = std::min(g, hidden - c);
        const float absmax = buffered ? absmax_floats(row.data() + c, len) : widen_absmax<T>(x + c, nullptr, len);
        float s = absmax / bound;
        if (a.use_ue8m0) {
          s = pow2_ceil(s);
        }
        s = s != s ? s : std::max(s, floor);
        scales[k * a.scale_group_stride] = s;
        const float inv = 1.0f / s;
        if (buffered) {
          quantize_row<kFormat, float>(row.data() + c, out + c, len, inv, nullptr, bound);
        } else {
          quantize_row<kFormat, T>(x + c, out + c, len, inv, nullptr, bound);
        }
      }
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
  constexpr const char* op = "vllm_ir_c::dynamic_group_quant_fp8";
  check_quant_io(op, out, input);
  check_float_scale(op, "scales", scales, input);
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  const int64_t hidden = input.size(-1);
  const int64_t groups = (hidden + group_size - 1) / group_size;
  auto expected = input.sizes().vec();
  expected.back() = groups;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(expected), op, ": scales has shape ", scales.sizes(), ", expected ",
              at::IntArrayRef(expected));
  at::assert_no_overlap(scales, out);
  if (input.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  GroupQuantArgs a{input.scalar_type(),
                   fp8_format(op, out),
                   static_cast<uint8_t*>(out.mutable_data_ptr()),
                   x.const_data_ptr(),
                   row_layout(x),
                   input.numel() / hidden,
                   hidden,
                   group_size,
                   use_ue8m0,
                   scales.mutable_data_ptr<float>(),
                   row_layout(scales),
                   scales.stride(-1)};
  TORCH_CHECK(a.scale_rows.row_stride >= 0 || a.scale_rows.batch_dims <= RowLayout::kMaxBatchDims, op,
              ": scales layout not supported");
  group_quant_fp8_stub(a);
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
