// The FP8 quantization family (static_quant_fp8, dynamic_quant_fp8, dynamic_group_quant_fp8):
// kernel arguments and the per-element numerics shared by cpu/quant.cpp and cuda/quant.cu, and
// the torch side both devices run around their kernels (argument checks, scale classification,
// staging awkward layouts).
//
// Numerics are the op declarations' (core/ir/declarations/quant.py), rounding for rounding:
// fp32 values multiplied by the fp32 reciprocal of the scale, clamped to +-bound (448 for
// e4m3fn, 224 for e4m3fnuz), then rounded to nearest even exactly as c10's
// fp8e4m3fn_from_fp32_value / fp8e4m3fnuz_from_fp32_value do (so q is bit-identical to
// ``.clamp(...).to(fp8)``); dynamic scales are max(min(absmax, ub) / bound, 1 / (bound * 512)).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_common.h"

namespace vllm_ir_c {

// Which fp8 format q is stored in.
enum class Fp8Format : int32_t { E4M3FN = 0, E4M3FNUZ = 1 };

C10_HOST_DEVICE inline float fp8_bound(Fp8Format f) {
  return f == Fp8Format::E4M3FNUZ ? 224.0f : 448.0f;
}

// 1 / (bound * 512) in double rounded to float, as torch's clamp(min=python float) rounds it.
C10_HOST_DEVICE inline float fp8_min_scale(Fp8Format f) {
  return static_cast<float>(1.0 / (static_cast<double>(fp8_bound(f)) * 512.0));
}

C10_HOST_DEVICE inline uint32_t float_bits(float v) {
  uint32_t b;
  memcpy(&b, &v, sizeof(b));
  return b;
}

C10_HOST_DEVICE inline float bits_float(uint32_t b) {
  float v;
  memcpy(&v, &b, sizeof(v));
  return v;
}

// Constants of the fp8 encoding below (shared with the CPU kernels' vector version).
template <Fp8Format kFormat>
struct Fp8Encoding {
  // Exponent field (fp32) of the smallest normal fp8 value: 2^-6 (e4m3fn), 2^-7 (e4m3fnuz).
  static constexpr uint32_t kMinNormalExp = kFormat == Fp8Format::E4M3FNUZ ? 120u : 121u;
  static constexpr uint32_t kMinNormal = kMinNormalExp << 23;
  // 2^20 times a value's binade: adding it rounds the value to 3 mantissa bits.
  static constexpr uint32_t kShift = 20u << 23;
  static constexpr uint32_t kOffset = (20u + kMinNormalExp) << 3;
};

// clamp(v, -bound, bound) then the fp8 byte, round to nearest even, bit-identical to c10's
// fp8e4m3fn_from_fp32_value / fp8e4m3fnuz_from_fp32_value on the clamped value; NaN stays NaN
// (0x7F|sign for e4m3fn, 0x80 for e4m3fnuz, which has no negative zero).
//
// One formula covers subnormal and normal results: with c = 2^20 * max(binade(|v|), smallest
// normal), |v| + c rounds |v| to a multiple of the fp8 step of its binade (fp32 addition
// rounds to nearest even), and the bits of that sum minus c's count the steps above c's
// binade start; adding 8 codes per binade above the smallest gives the fp8 code (a rounding up
// into the next binade lands on its code too). Branch-free, so that loops over it vectorize.
template <Fp8Format kFormat>
C10_HOST_DEVICE inline uint8_t quantize_fp8(float v, float bound) {
  using E = Fp8Encoding<kFormat>;
  const uint32_t in_bits = float_bits(v);
  const bool nan = (in_bits & 0x7FFFFFFFu) > 0x7F800000u;
  v = v > bound ? bound : (v < -bound ? -bound : v);
  const uint32_t bits = float_bits(v);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const uint32_t binade = mag & 0x7F800000u;
  const uint32_t c = (binade > E::kMinNormal ? binade : E::kMinNormal) + E::kShift;
  const uint32_t steps = float_bits(bits_float(mag) + bits_float(c)) - c;
  const uint32_t code = steps + (c >> 20) - E::kOffset;
  const uint32_t sign = (bits >> 24) & 0x80u;
  if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
    return static_cast<uint8_t>(nan ? 0x80u : (code == 0u ? 0u : (code | sign)));
  } else {
    return static_cast<uint8_t>(nan ? (0x7Fu | ((in_bits >> 24) & 0x80u)) : (code | sign));
  }
}

// fmaxf/fminf drop NaN; torch's amax, minimum and clamp propagate it.
C10_HOST_DEVICE inline float nan_max(float a, float b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}

// A dynamic scale from an absmax: max(min(absmax, ub) / bound, 1 / (bound * 512)), NaN kept.
C10_HOST_DEVICE inline float dynamic_scale(float absmax, const float* scale_ub, Fp8Format f) {
  if (scale_ub != nullptr) {
    const float ub = *scale_ub;
    absmax = (absmax != absmax || ub != ub) ? absmax + ub : (absmax < ub ? absmax : ub);
  }
  const float s = absmax / fp8_bound(f);
  const float floor = fp8_min_scale(f);
  return s != s ? s : (s < floor ? floor : s);
}

// The smallest power of two >= s (s >= 0), from the bits: a UE8M0 scale. Zero stays zero,
// inf and NaN stay.
C10_HOST_DEVICE inline float pow2_ceil(float s) {
  const uint32_t bits = float_bits(s);
  if ((bits & 0x7F800000u) == 0x7F800000u) {
    return s;
  }
  return bits_float((((bits >> 23) + ((bits & 0x7FFFFFu) != 0u)) << 23));
}

// The scale of a group whose absmax is `absmax`: absmax / bound, at least the floor
// 1 / (bound * 512), then UE8M0 rounded up to a power of two if asked (vLLM's order: every
// UE8M0 scale is a power of two, 2^-17 at e4m3fn's floor); NaN kept.
C10_HOST_DEVICE inline float group_scale(float absmax, bool use_ue8m0, Fp8Format f) {
  float s = absmax / fp8_bound(f);
  const float floor = fp8_min_scale(f);
  s = s != s ? s : (s < floor ? floor : s);
  return use_ue8m0 ? pow2_ceil(s) : s;
}

// out[r, c] = quantize(x[r, c] * (1 / scale[r / row_group, c / col_group])) for r < rows:
// per-tensor (row_group = rows, col_group = hidden), per-token (1, hidden), per-channel
// (rows, 1) and 2-D group scales alike.
struct StaticQuantArgs {
  c10::ScalarType dtype;
  Fp8Format format;
  uint8_t* out;  // contiguous rows of `hidden`
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t hidden;
  const float* scale;
  int64_t scale_row_stride;  // between scale rows (r / row_group)
  int64_t scale_col_stride;  // between scale columns (c / col_group)
  int64_t row_group;         // >= 1
  int64_t col_group;         // >= 1
};

// Per-token dynamic quant: scale[r] = dynamic_scale(absmax(x[r])), out[r] = quantize(x[r] / scale[r]).
struct DynamicQuantArgs {
  c10::ScalarType dtype;
  Fp8Format format;
  uint8_t* out;
  float* scale;  // one per row, contiguous
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t hidden;
  const float* scale_ub;  // one element, or nullptr
};

// The absmax of the whole tensor (per-tensor dynamic quant's first pass).
struct AbsmaxArgs {
  c10::ScalarType dtype;
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t hidden;
  float* result;
};

// Per-group dynamic quant: for each row r and group g of `group_size` columns (the last one
// may be partial), scales[r, g] = the group's scale, written at scale_rows.offset(r) +
// g * scale_group_stride (row-major or column-major).
struct GroupQuantArgs {
  c10::ScalarType dtype;
  Fp8Format format;
  uint8_t* out;
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t hidden;
  int64_t group_size;
  bool use_ue8m0;
  float* scales;
  RowLayout scale_rows;
  int64_t scale_group_stride;
};

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>

#include "ops_common.h"

namespace vllm_ir_c {

inline Fp8Format fp8_format(const char* op, const at::Tensor& out) {
  const auto t = out.scalar_type();
  TORCH_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e4m3fnuz, op,
              ": out must be float8_e4m3fn or float8_e4m3fnuz, got ", t);
  return t == at::kFloat8_e4m3fnuz ? Fp8Format::E4M3FNUZ : Fp8Format::E4M3FN;
}

// input is [..., hidden] (1 or more dims) in a supported dtype; out is contiguous, ends in hidden,
// on input's device, and holds at least input's rows (more: padding rows, left unwritten).
inline void check_quant_io(const char* op, const at::Tensor& out, const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least one dimension");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": unsupported input dtype ", input.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  TORCH_CHECK(out.device() == input.device(), op, ": out is on ", out.device(), ", input on ", input.device());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK(out.dim() >= 1 && out.size(-1) == input.size(-1) && out.numel() >= input.numel(), op, ": out has shape ",
              out.sizes(), ", which does not hold input's ", input.sizes());
  at::assert_no_overlap(out, input);
}

inline void check_float_scale(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device() == input.device(), op, ": ", name, " is on ", t.device(), ", input on ", input.device());
}

// The static kernel's arguments, scale layout classified as the op declaration's
// broadcast_scale does (one element, [hidden] for a 1-D input, or a 2-D group scale of a 2-D
// input: [rows, 1] per token, [1, hidden] per channel, blocks). A 1-D scale of several elements
// for a 2-D input is refused as ambiguous, as the op refuses it.
inline StaticQuantArgs static_quant_args(const char* op, at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                                         const at::Tensor& input) {
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  StaticQuantArgs a{input.scalar_type(), fp8_format(op, out), static_cast<uint8_t*>(out.mutable_data_ptr()),
                    x.const_data_ptr(), row_layout(x), rows, hidden, scale.const_data_ptr<float>(),
                    0, 0, std::max<int64_t>(rows, 1), std::max<int64_t>(hidden, 1)};
  if (scale.numel() == 1) {
    return a;
  }
  if (scale.dim() == 1) {
    TORCH_CHECK(input.dim() == 1, op, ": a 1-D scale of ", scale.size(0),
                " elements is ambiguous (per token or per channel?); pass it as [T, 1] per token or [1, K] per "
                "channel");
    TORCH_CHECK(scale.size(0) == hidden, op, ": a 1-D scale of a 1-D input must have 1 or ", hidden,
                " elements, got ", scale.size(0));
    a.col_group = 1;  // one scale per element
    a.scale_col_stride = scale.stride(0);
    return a;
  }
  TORCH_CHECK(scale.dim() == 2 && input.dim() == 2, op, ": scale of shape ", scale.sizes(),
              " is not supported for input of shape ", input.sizes(),
              " (one element, 1-D, or 2-D group scales of a 2-D input)");
  for (int d = 0; d < 2; ++d) {
    const int64_t size = input.size(d);
    const int64_t groups = scale.size(d);
    TORCH_CHECK(size == groups || (groups != 0 && size % groups == 0), op, ": scale of shape ", scale.sizes(),
                " does not divide input of shape ", input.sizes(), " along dimension ", d);
  }
  if (rows > 0) {
    a.row_group = rows / scale.size(0);
  }
  if (hidden > 0) {
    a.col_group = hidden / scale.size(1);
  }
  a.scale_row_stride = scale.stride(0);
  a.scale_col_stride = scale.stride(1);
  return a;
}

// out <- static quant of input by scale.
template <typename Kernel>
void run_static_quant(const char* op, at::Tensor& out, const at::Tensor& input, const at::Tensor& scale,
                      Kernel&& kernel) {
  check_quant_io(op, out, input);
  check_float_scale(op, "scale", scale, input);
  TORCH_CHECK(scale.numel() > 0 || input.numel() == 0, op, ": scale is empty");
  const at::Tensor x = staged(input);
  const StaticQuantArgs args = static_quant_args(op, out, x, scale, input);
  if (input.numel() == 0) {
    return;
  }
  kernel(args);
}

// out, scales <- group quant of input (groups of group_size along the last dimension).
template <typename Kernel>
void run_group_quant(const char* op, at::Tensor& out, at::Tensor& scales, const at::Tensor& input,
                     int64_t group_size, bool use_ue8m0, Kernel&& kernel) {
  check_quant_io(op, out, input);
  check_float_scale(op, "scales", scales, input);
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  const int64_t hidden = input.size(-1);
  auto expected = input.sizes().vec();
  expected.back() = (hidden + group_size - 1) / group_size;
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
  kernel(a);
}

inline const float* ub_or_null(const char* op, const std::optional<at::Tensor>& scale_ub, const at::Tensor& input) {
  if (!scale_ub.has_value()) {
    return nullptr;
  }
  check_float_scale(op, "scale_ub", *scale_ub, input);
  TORCH_CHECK(scale_ub->numel() == 1, op, ": scale_ub must have one element, got ", scale_ub->sizes());
  return scale_ub->const_data_ptr<float>();
}

}  // namespace vllm_ir_c

#endif  // VLLM_IR_C_TORCH_SIDE
