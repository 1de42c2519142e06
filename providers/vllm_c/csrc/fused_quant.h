// RMSNorm / SwiGLU fused with FP8 quantization (rms_norm_static_fp8_quant,
// fused_add_rms_norm_static_fp8_quant, rms_norm_dynamic_per_token_fp8_quant,
// rms_norm_group_fp8_quant, silu_and_mul_static_fp8_quant, silu_and_mul_group_fp8_quant): the
// kernel arguments, and the torch side the CPU ops run around their kernel (argument checks, staging
// awkward layouts, filling the arguments).
//
// Numerics are the op declarations' (core/ir/declarations/fused_quant.py), that is, native
// rms_norm / fused_add_rms_norm (layernorm.h) followed by native static / per-token dynamic
// quant or per-group quant (quant.h), rounding for rounding: the fp32 row (x, or x + residual) is normalized,
// the weight applied as vLLM 0.33 applies it (a weight of the input dtype multiplies the value
// rounded to that dtype and rounds again; an fp32 weight multiplies the fp32 value, rounded once:
// either way y is in the input dtype), then y is multiplied by the fp32 reciprocal of the
// scale and encoded. Group scales are quant.h's group quant's:
// max(absmax / bound, floor), first rounded up to a power of two for UE8M0.
#pragma once

#include "kernel_common.h"
#include "quant.h"

namespace vllm_ir_c {

// Per-group scales (the group ops): for row r and group k of `size` columns (the last one may
// be partial), the scale goes to scales[rows.offset(r) + k * group_stride] (row-major or
// column-major), and q = quantize(y * (1 / scale)).
struct GroupScales {
  int64_t size = 0;  // 0: not a group op
  bool use_ue8m0 = false;
  float* scales = nullptr;
  RowLayout rows;
  int64_t group_stride = 0;
};

// For every row r: s = input[r] (+ residual[r], in fp32); residual_out[r] = s rounded to
// `dtype` (with a residual); y = rms_norm(s) * weight; then either q = quantize(y / *scale)
// (static: `scale` set), scales[r] = dynamic_scale(absmax(y), scale_ub), q = quantize(y / scales[r])
// (dynamic per-token: `scales` set), or per-group scales (`group.size` > 0).
// residual_out may be residual itself (the in-place form); it overlaps nothing else.
struct RmsNormQuantArgs {
  c10::ScalarType dtype;
  bool fp32_weight;  // weight is float32 while dtype is not: one fp32 multiply, then rounded to dtype
  Fp8Format format;
  uint8_t* out;  // contiguous rows of `hidden`
  const void* input;
  RowLayout input_rows;
  const void* residual;  // nullptr: no residual
  RowLayout residual_rows;
  void* residual_out;
  RowLayout residual_out_rows;
  const void* weight;  // [hidden] in `dtype` or float32, or nullptr
  int64_t rows;
  int64_t hidden;
  float epsilon;
  const float* scale;     // static quant: the per-tensor scale; nullptr: dynamic
  float* scales;          // dynamic per-token: one per row, contiguous
  const float* scale_ub;  // dynamic per-token: one element, or nullptr
  GroupScales group = {};
};

// For every row r of a [..., 2d] input: y = silu(gate) rounded to `dtype`, times up, rounded
// again (silu_and_mul's roundings), then q[r] = quantize(y * (1 / *scale)) into [..., d], or
// with per-group scales (`group.size` > 0, `scale` nullptr).
struct SiluMulQuantArgs {
  c10::ScalarType dtype;
  Fp8Format format;
  uint8_t* out;  // contiguous rows of `d`
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t d;
  const float* scale;  // per-tensor, or nullptr (group)
  GroupScales group = {};
};

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/MemoryOverlap.h>

#include <optional>

#include "ops_common.h"

namespace vllm_ir_c {

// Checks group scales of shape [*shape[:-1], ceil(hidden / group_size)] (any layout whose
// leading dimensions RowLayout walks) and describes them.
inline GroupScales group_scales(const char* op, at::Tensor& scales, at::IntArrayRef shape, int64_t hidden,
                                int64_t group_size, bool use_ue8m0) {
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  auto expected = shape.vec();
  expected.back() = (hidden + group_size - 1) / group_size;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(expected), op, ": scales has shape ", scales.sizes(), ", expected ",
              at::IntArrayRef(expected));
  GroupScales g;
  g.size = group_size;
  g.use_ue8m0 = use_ue8m0;
  g.scales = scales.mutable_data_ptr<float>();
  g.rows = row_layout(scales);
  g.group_stride = scales.stride(-1);
  TORCH_CHECK(g.rows.row_stride >= 0 || g.rows.batch_dims <= RowLayout::kMaxBatchDims, op,
              ": scales layout not supported");
  return g;
}

// Checks every argument, stages awkward layouts, runs `kernel` and copies staged results back.
// `scale` (static) or `scales` (dynamic: per token, or per group when `group_size` > 0) is
// given, not both.
template <typename Kernel>
void run_rms_norm_quant(const char* op, at::Tensor& out, const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& residual_out, const at::Tensor& input,
                        const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& scale_ub,
                        double epsilon, Kernel&& kernel, int64_t group_size = 0, bool use_ue8m0 = false) {
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least one dimension");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": unsupported dtype ", input.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  TORCH_CHECK(out.sizes() == input.sizes(), op, ": out has shape ", out.sizes(), ", input has ", input.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK(out.device() == input.device(), op, ": out is on ", out.device(), ", input on ", input.device());
  const Fp8Format format = fp8_format(op, out);
  at::assert_no_overlap(out, input);
  std::optional<at::Tensor> w;
  bool fp32_weight = false;
  if (weight.has_value()) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == hidden, op, ": weight must have shape [", hidden, "], got ",
                weight->sizes());
    TORCH_CHECK(weight->scalar_type() == input.scalar_type() || weight->scalar_type() == at::kFloat, op,
                ": weight is ", weight->scalar_type(), ", input is ", input.scalar_type(),
                " (the weight must have the input's dtype or float32)");
    TORCH_CHECK(weight->device() == input.device(), op, ": weight is on ", weight->device(), ", input on ",
                input.device());
    w = weight->contiguous();
    fp32_weight = weight->scalar_type() != input.scalar_type();
  }
  TORCH_CHECK(residual.has_value() == residual_out.has_value(), op,
              ": residual and residual_out are given together or not at all");
  bool in_place = false;
  if (residual.has_value()) {
    check_activation(op, "residual", *residual, input);
    check_activation(op, "residual_out", *residual_out, input);
    in_place = residual_out->is_same(*residual);
    TORCH_CHECK(!input.is_same(*residual), op, ": input and residual must be different tensors");
    at::assert_no_overlap(out, *residual);
    at::assert_no_overlap(*residual_out, input);
    at::assert_no_overlap(*residual_out, out);
    if (!in_place) {
      at::assert_no_overlap(*residual_out, *residual);
    }
  }
  TORCH_CHECK(scale.has_value() != scales.has_value(), op, ": give the static scale or the dynamic scales");
  if (scale.has_value()) {
    check_float_scale(op, "scale", *scale, input);
    TORCH_CHECK(scale->numel() == 1, op, ": the static scale must have one element (per-tensor), got ",
                scale->sizes());
  } else {
    check_float_scale(op, "scales", *scales, input);
    if (group_size == 0) {
      TORCH_CHECK(scales->is_contiguous() && scales->numel() == rows, op, ": scales must be contiguous with ", rows,
                  " elements (one per row), got ", scales->sizes());
    }
    at::assert_no_overlap(*scales, out);
  }
  GroupScales group;
  if (group_size != 0) {
    TORCH_CHECK(scales.has_value(), op, ": group quant needs the scales tensor");
    at::Tensor sc = *scales;
    group = group_scales(op, sc, input.sizes(), hidden, group_size, use_ue8m0);
  }
  const float* ub = scale.has_value() ? nullptr : ub_or_null(op, scale_ub, input);
  if (rows == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  std::optional<at::Tensor> r;
  std::optional<at::Tensor> s;
  if (residual.has_value()) {
    r = staged(*residual);
    s = in_place ? *r : output_buffer(*residual_out);  // in place, the staged residual is written
  }
  RmsNormQuantArgs args{input.scalar_type(),
                        fp32_weight,
                        format,
                        static_cast<uint8_t*>(out.mutable_data_ptr()),
                        x.const_data_ptr(),
                        row_layout(x),
                        r.has_value() ? r->const_data_ptr() : nullptr,
                        r.has_value() ? row_layout(*r) : RowLayout{},
                        s.has_value() ? s->mutable_data_ptr() : nullptr,
                        s.has_value() ? row_layout(*s) : RowLayout{},
                        data_or_null(w),
                        rows,
                        hidden,
                        static_cast<float>(epsilon),
                        scale.has_value() ? scale->const_data_ptr<float>() : nullptr,
                        scales.has_value() && group_size == 0 ? scales->mutable_data_ptr<float>() : nullptr,
                        ub,
                        group};
  kernel(args);
  if (residual_out.has_value()) {
    at::Tensor dst = *residual_out;
    unstage(dst, *s);
  }
}

// out <- static quant of silu_and_mul(input) by a per-tensor scale (`scale`), or per-group
// quant into `scales` (groups of `group_size` > 0).
template <typename Kernel>
void run_silu_and_mul_quant(const char* op, at::Tensor& out, const at::Tensor& input,
                            const std::optional<at::Tensor>& scale, Kernel&& kernel,
                            std::optional<at::Tensor> scales = std::nullopt, int64_t group_size = 0,
                            bool use_ue8m0 = false) {
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least one dimension");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": unsupported dtype ", input.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  TORCH_CHECK(input.size(-1) % 2 == 0, op, ": the last dimension (", input.size(-1), ") must be even");
  const int64_t d = input.size(-1) / 2;
  auto expected = input.sizes().vec();
  expected.back() = d;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), op, ": out has shape ", out.sizes(), ", expected ",
              at::IntArrayRef(expected));
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK(out.device() == input.device(), op, ": out is on ", out.device(), ", input on ", input.device());
  const Fp8Format format = fp8_format(op, out);
  at::assert_no_overlap(out, input);
  TORCH_CHECK(scale.has_value() != scales.has_value(), op, ": give the static scale or the group scales");
  GroupScales group;
  if (scale.has_value()) {
    check_float_scale(op, "scale", *scale, input);
    TORCH_CHECK(scale->numel() == 1, op, ": the scale must have one element (per-tensor), got ", scale->sizes());
  } else {
    check_float_scale(op, "scales", *scales, input);
    at::assert_no_overlap(*scales, out);
    group = group_scales(op, *scales, out.sizes(), d, group_size, use_ue8m0);
  }
  if (out.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  SiluMulQuantArgs args{input.scalar_type(),
                        format,
                        static_cast<uint8_t*>(out.mutable_data_ptr()),
                        x.const_data_ptr(),
                        row_layout(x),
                        out.numel() / d,
                        d,
                        scale.has_value() ? scale->const_data_ptr<float>() : nullptr,
                        group};
  kernel(args);
}

}  // namespace vllm_ir_c

#endif  // VLLM_IR_C_TORCH_SIDE
