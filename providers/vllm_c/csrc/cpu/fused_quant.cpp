// RMSNorm / SwiGLU + FP8 quant on CPU, in one pass over each row's memory:
// rms_norm_static_fp8_quant, fused_add_rms_norm_static_fp8_quant,
// rms_norm_dynamic_per_token_fp8_quant (with or without residual, optional scale_ub) and
// rms_norm_group_fp8_quant (with or without residual) are one kernel with compile-time
// switches; silu_and_mul_static_fp8_quant and silu_and_mul_group_fp8_quant are a second one.
//
// Pass 1 sums the squares of the row (x, or x + residual in fp32; memory-bound). Pass 2
// re-reads the row from L1 (prefetching the next row), stores the new residual, normalizes,
// applies the weight and keeps y in a per-thread fp32 row buffer (taking its absmax for a
// dynamic scale); pass 3 encodes that buffer (group ops: each group's absmax, scale and codes
// from the buffer, as the group quant kernel takes them from its widened row). bf16 y whose
// scale runs (the row, or groups of >= 64) go through fp8_vec.h's lookup tables is kept in bf16
// instead and encoded as the quant kernels encode it. The unfused pair writes y to memory in
// the model dtype and reads it back; here y never leaves L1. (Encoding inside the pass-2 loop measured
// slower: 464 vs 420 us at bf16 [256, 4096] on one thread, the fp8 encoding being the
// compute-bound part.)
//
// Building blocks are the norm, quant and activation kernels' own (norm_vec.h, fp8_vec.h,
// act_vec.h, float_vec.h), so values round where native rounds (see fused_quant.h).

#include "../fused_quant.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "act_vec.h"
#include "dispatch_stub.h"
#include "float_vec.h"
#include "fp8_vec.h"
#include "norm_vec.h"
#include "table16.h"

namespace vllm_ir_c {

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const RmsNormQuantArgs&), rms_norm_quant_fp8_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const SiluMulQuantArgs&), silu_and_mul_quant_fp8_stub);

namespace CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;
using float_vec::kStep;
using float_vec::load_float;
using float_vec::round_float;
using float_vec::store_float;

// Fewer elements than this per task are not worth a parallel region (as the norm kernels).
constexpr int64_t kMinElementsPerTask = 16384;

int64_t grain_size(int64_t hidden) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(hidden, 1));
}

// What scales q: a per-tensor scale, one dynamic scale per row, or one per group.
enum class QuantKind { kStatic, kPerToken, kGroup };

// Pass 3 of a group op whose y is not staged in T: each group's absmax from y (fp32, in L1),
// then its scale and codes as the group quant kernel's float path takes them (cpu/quant.cpp).
template <Fp8Format kFormat>
void quantize_buffered_groups(const float* y, uint8_t* out, int64_t n, const GroupScales& g, float* group_absmax,
                              int64_t r) {
  for (int64_t c = 0, k = 0; c < n; c += g.size, ++k) {
    group_absmax[k] = fp8_vec::widen_absmax<float>(y + c, nullptr, std::min(g.size, n - c));
  }
  fp8_vec::quantize_fp32_groups<kFormat>(y, out, n, g.size, group_absmax, g.scales + g.rows.offset(r), g.group_stride,
                                         g.use_ue8m0, fp8_bound(kFormat));
}

// How the weight enters (vLLM's `y.to(weight.dtype) * weight`, then x's dtype): norm_vec.h.
using norm_vec::WeightKind;

// Whether pass 2 keeps y in T for pass 3 to encode by RowQuantizer's table (bf16 rows: y is
// rounded to bf16 whatever the weight; runs of `run` values share a scale: the row, or a group)
// instead of in fp32.
template <typename T, Fp8Format kFormat>
bool stages_in_t(int64_t run) {
  return fp8_vec::RowQuantizer<kFormat, T>::by_table(run);
}

// One row. `buf` holds y in fp32 between pass 2 and pass 3 (or `stage` in T, see stages_in_t);
// `group_absmax` is scratch for a group op's staged row.
// Pass 2 (compute-bound) prefetches the next row's inputs (`next`), which pass 1
// (memory-bound) then finds in cache.
template <typename T, Fp8Format kFormat, bool kResidual, QuantKind kQuant, WeightKind kKind>
void row(const RmsNormQuantArgs& a, int64_t r, int64_t next, const float* w, float* buf, T* stage,
         float* group_absmax, fp8_vec::RowQuantizer<kFormat, T>& quantize_by, const norm_vec::RowSplit& split) {
  const int64_t n = a.hidden;
  const T* x = static_cast<const T*>(a.input) + a.input_rows.offset(r);
  const T* res = kResidual ? static_cast<const T*>(a.residual) + a.residual_rows.offset(r) : nullptr;
  T* res_out = kResidual ? static_cast<T*>(a.residual_out) + a.residual_out_rows.offset(r) : nullptr;
  uint8_t* out = a.out + r * n;
  const T* next_x = static_cast<const T*>(a.input) + a.input_rows.offset(next);
  const T* next_res = kResidual ? static_cast<const T*>(a.residual) + a.residual_rows.offset(next) : nullptr;
  auto load = [&](int64_t d) {
    auto [x0, x1] = load_float(x + d);
    if constexpr (kResidual) {
      auto [r0, r1] = load_float(res + d);
      return std::make_tuple(x0 + r0, x1 + r1);
    } else {
      return std::make_tuple(x0, x1);
    }
  };
  auto scalar = [&](int64_t d) {
    float v = static_cast<float>(x[d]);
    if constexpr (kResidual) {
      v += static_cast<float>(res[d]);
    }
    return v;
  };
  const float inv_rms = norm_vec::inverse_rms(norm_vec::sum_of_squares(n, load, scalar, split), n, a.epsilon);
  const fVec vinv_rms(inv_rms);
  const float bound = fp8_bound(kFormat);
  constexpr bool kDynamic = kQuant == QuantKind::kPerToken;
  const float inv_scale = kQuant == QuantKind::kStatic ? 1.0f / *a.scale : 0.0f;
  iVec absmax_bits(0);
  int64_t d = 0;
  // Step d's sum (x, or x + residual, in fp32), the new residual stored, the next row's step
  // prefetched.
  auto sum_step = [&](int64_t i) {
    norm_vec::prefetch_step<false>(next_x + i);
    if constexpr (kResidual) {
      norm_vec::prefetch_step<false>(next_res + i);
    }
    auto [s0, s1] = load(i);
    if constexpr (kResidual) {
      store_float(res_out + i, s0, s1);
    }
    return std::make_tuple(s0, s1);
  };
  if (stage != nullptr) {
    // Staged (a loop of its own): the store rounds y to T, no widening back to fp32 in
    // between (a dynamic scale's absmax is taken from the staged row afterwards).
    for (; d + kStep <= n; d += kStep) {
      auto [s0, s1] = sum_step(d);
      auto [y0, y1] = norm_vec::weighted<T, kKind>(s0 * vinv_rms, s1 * vinv_rms, w + d);
      store_float(stage + d, y0, y1);
    }
  } else {
    for (; d + kStep <= n; d += kStep) {
      auto [s0, s1] = sum_step(d);
      auto [p0, p1] = norm_vec::weighted<T, kKind>(s0 * vinv_rms, s1 * vinv_rms, w + d);
      auto [y0, y1] = round_float<T>(p0, p1);
      y0.store(buf + d);
      y1.store(buf + d + fVec::size());
      if constexpr (kDynamic) {
        absmax_bits =
            at::vec::maximum(absmax_bits, at::vec::maximum(fp8_vec::magnitude_bits(y0), fp8_vec::magnitude_bits(y1)));
      }
    }
  }
  int32_t tail_bits = 0;
  for (; d < n; ++d) {
    const float s = scalar(d);
    if constexpr (kResidual) {
      res_out[d] = static_cast<T>(s);
    }
    const float y = static_cast<float>(norm_vec::weighted<T, kKind>(s * inv_rms, w, d));
    if (stage != nullptr) {
      stage[d] = static_cast<T>(y);
    } else {
      buf[d] = y;
    }
    if constexpr (kDynamic) {
      tail_bits = std::max(tail_bits, static_cast<int32_t>(float_bits(y) & 0x7FFFFFFFu));
    }
  }
  if constexpr (kDynamic) {
    // The NaN-propagating maximum of |y|, as the quant kernels take it (integer max of magnitudes).
    int32_t lanes[iVec::size()];
    absmax_bits.store(lanes);
    for (int64_t j = 0; j < iVec::size(); ++j) {
      tail_bits = std::max(tail_bits, lanes[j]);
    }
    const float absmax = stage != nullptr ? fp8_vec::row_absmax<T>(stage, n) : fp8_vec::float_of_bits(tail_bits);
    const float scale = dynamic_scale(absmax, a.scale_ub, kFormat);
    a.scales[r] = scale;
    if (stage != nullptr) {
      quantize_by(stage, out, n, 1.0f / scale, bound);
    } else {
      fp8_vec::quantize_row<kFormat, float>(buf, out, n, 1.0f / scale, nullptr, bound);
    }
  } else if constexpr (kQuant == QuantKind::kGroup) {
    if (stage != nullptr) {
      fp8_vec::quantize_row_groups<kFormat, T>(stage, out, n, a.group.size, group_absmax,
                                               a.group.scales + a.group.rows.offset(r), a.group.group_stride,
                                               a.group.use_ue8m0, bound, quantize_by);
    } else {
      quantize_buffered_groups<kFormat>(buf, out, n, a.group, group_absmax, r);
    }
  } else if (stage != nullptr) {
    quantize_by(stage, out, n, inv_scale, bound);
  } else {
    fp8_vec::quantize_row<kFormat, float>(buf, out, n, inv_scale, nullptr, bound);
  }
}

template <typename T, Fp8Format kFormat, bool kResidual, QuantKind kQuant, WeightKind kKind>
void rows(const RmsNormQuantArgs& a) {
  const norm_vec::RowSplit split = norm_vec::aten_row_split(a.rows, a.hidden);  // outside the parallel region
  at::parallel_for(0, a.rows, grain_size(a.hidden), [&](int64_t begin, int64_t end) {
    // A weight of T widened once per task; an fp32 weight is used as is.
    const norm_vec::Fp32Weight<T> same(kKind == WeightKind::kSame ? a.weight : nullptr, a.hidden);
    const float* w = kKind == WeightKind::kSame ? same.data() : static_cast<const float*>(a.weight);
    const bool staged = stages_in_t<T, kFormat>(kQuant == QuantKind::kGroup ? a.group.size : a.hidden);
    std::vector<float> buf(staged ? 0 : a.hidden);
    std::vector<T> stage(staged ? a.hidden : 0);
    std::vector<float> group_absmax(kQuant == QuantKind::kGroup ? (a.hidden + a.group.size - 1) / a.group.size : 0);
    fp8_vec::RowQuantizer<kFormat, T> quantize_by;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t next = std::min(r + 1, end - 1);  // the last row prefetches itself: harmless
      row<T, kFormat, kResidual, kQuant, kKind>(a, r, next, w, buf.data(), staged ? stage.data() : nullptr,
                                                group_absmax.data(), quantize_by, split);
    }
  });
}

template <typename T, Fp8Format kFormat, bool kResidual, QuantKind kQuant>
void rows(const RmsNormQuantArgs& a) {
  if (a.weight == nullptr) {
    rows<T, kFormat, kResidual, kQuant, WeightKind::kNone>(a);
  } else if (a.fp32_weight || std::is_same_v<T, float>) {
    rows<T, kFormat, kResidual, kQuant, WeightKind::kFp32>(a);
  } else {
    rows<T, kFormat, kResidual, kQuant, WeightKind::kSame>(a);
  }
}

template <typename T, Fp8Format kFormat, bool kResidual>
void rows_for_quant(const RmsNormQuantArgs& a) {
  if (a.group.size > 0) {
    rows<T, kFormat, kResidual, QuantKind::kGroup>(a);
  } else if (a.scale == nullptr) {
    rows<T, kFormat, kResidual, QuantKind::kPerToken>(a);
  } else {
    rows<T, kFormat, kResidual, QuantKind::kStatic>(a);
  }
}

template <typename T, Fp8Format kFormat>
void rows_for(const RmsNormQuantArgs& a) {
  if (a.residual != nullptr) {
    rows_for_quant<T, kFormat, true>(a);
  } else {
    rows_for_quant<T, kFormat, false>(a);
  }
}

void rms_norm_quant_kernel(const RmsNormQuantArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c::rms_norm_fp8_quant (cpu)", [&] {
    if (a.format == Fp8Format::E4M3FNUZ) {
      rows_for<scalar_t, Fp8Format::E4M3FNUZ>(a);
    } else {
      rows_for<scalar_t, Fp8Format::E4M3FN>(a);
    }
  });
}

// silu_and_mul then static or group quant: each row's y (silu_and_mul's roundings, ATen's
// vector / scalar split) goes to an L1 row buffer, then is encoded; y never reaches memory.
template <typename T, Fp8Format kFormat, bool kGroup>
void silu_and_mul_quant_rows(const SiluMulQuantArgs& a) {
  const int64_t d = a.d;
  const int64_t body = d - d % act_vec::aten_step<T>();
  const float inv_scale = kGroup ? 0.0f : 1.0f / *a.scale;
  const float bound = fp8_bound(kFormat);
  // silu of 16-bit gates read from its table (table16.h), as the silu_and_mul kernel does.
  const act_vec::TableOf<T, act_vec::Silu> silu_table{};
  // bf16 keeps y in T (already rounded to it) for RowQuantizer's table (a row or a group).
  const bool staged = fp8_vec::RowQuantizer<kFormat, T>::by_table(kGroup ? a.group.size : d);
  at::parallel_for(0, a.rows, grain_size(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(staged ? 0 : d);
    std::vector<T> stage(staged ? d : 0);
    std::vector<float> group_absmax(kGroup ? (d + a.group.size - 1) / a.group.size : 0);
    fp8_vec::RowQuantizer<kFormat, T> quantize_by;
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = static_cast<const T*>(a.input) + a.input_rows.offset(r);
      const T* up = gate + d;
      const T* next = r + 1 < end ? static_cast<const T*>(a.input) + a.input_rows.offset(r + 1) : nullptr;
      // y as the silu_and_mul kernel computes it, into the stage (T) or the buffer (fp32).
      const act_vec::ActTimesUp<act_vec::Silu> silu_times_up{};
      if (staged) {
        act_vec::gated_halves_row<T>(silu_times_up, silu_table, gate, up, next, d, body,
                                     act_vec::StoreRow<T>{stage.data()});
      } else {
        act_vec::gated_halves_row<T>(silu_times_up, silu_table, gate, up, next, d, body,
                                     act_vec::StoreRowFp32<T>{buf.data()});
      }
      if constexpr (kGroup) {
        if (staged) {
          fp8_vec::quantize_row_groups<kFormat, T>(stage.data(), a.out + r * d, d, a.group.size, group_absmax.data(),
                                                   a.group.scales + a.group.rows.offset(r), a.group.group_stride,
                                                   a.group.use_ue8m0, bound, quantize_by);
        } else {
          quantize_buffered_groups<kFormat>(buf.data(), a.out + r * d, d, a.group, group_absmax.data(), r);
        }
      } else if (staged) {
        quantize_by(stage.data(), a.out + r * d, d, inv_scale, bound);
      } else {
        fp8_vec::quantize_row<kFormat, float>(buf.data(), a.out + r * d, d, inv_scale, nullptr, bound);
      }
    }
  });
}

template <typename T, Fp8Format kFormat>
void silu_and_mul_quant_for(const SiluMulQuantArgs& a) {
  if (a.group.size > 0) {
    silu_and_mul_quant_rows<T, kFormat, true>(a);
  } else {
    silu_and_mul_quant_rows<T, kFormat, false>(a);
  }
}

void silu_and_mul_quant_kernel(const SiluMulQuantArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c::silu_and_mul_fp8_quant (cpu)", [&] {
    if (a.format == Fp8Format::E4M3FNUZ) {
      silu_and_mul_quant_for<scalar_t, Fp8Format::E4M3FNUZ>(a);
    } else {
      silu_and_mul_quant_for<scalar_t, Fp8Format::E4M3FN>(a);
    }
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

VLLM_IR_C_REGISTER_DISPATCH(rms_norm_quant_fp8_stub, &CPU_CAPABILITY::rms_norm_quant_kernel);
VLLM_IR_C_REGISTER_DISPATCH(silu_and_mul_quant_fp8_stub, &CPU_CAPABILITY::silu_and_mul_quant_kernel);

}  // namespace vllm_ir_c

// ---------------------------------------------------------------------------------------
// torch side: schemas and CPU implementations (the DEFAULT compilation only)

#if VLLM_IR_C_TORCH_SIDE

#include <torch/library.h>

namespace vllm_ir_c {
namespace {

void rms_norm_static_fp8_quant_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                   const at::Tensor& scale, double epsilon) {
  run_rms_norm_quant("vllm_ir_c::rms_norm_static_fp8_quant", out, std::nullopt, std::nullopt, input, std::nullopt,
                     weight, scale, std::nullopt, epsilon, rms_norm_quant_fp8_stub);
}

void fused_add_rms_norm_static_fp8_quant_cpu(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& input,
                                             const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                                             const at::Tensor& scale, double epsilon) {
  run_rms_norm_quant("vllm_ir_c::fused_add_rms_norm_static_fp8_quant", out, std::nullopt, residual_out, input,
                     residual, weight, scale, std::nullopt, epsilon, rms_norm_quant_fp8_stub);
}

void rms_norm_dynamic_per_token_fp8_quant_cpu(at::Tensor& out, at::Tensor& scales,
                                              const std::optional<at::Tensor>& residual_out, const at::Tensor& input,
                                              const std::optional<at::Tensor>& residual,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& scale_ub, double epsilon) {
  run_rms_norm_quant("vllm_ir_c::rms_norm_dynamic_per_token_fp8_quant", out, scales, residual_out, input, residual,
                     weight, std::nullopt, scale_ub, epsilon, rms_norm_quant_fp8_stub);
}

void rms_norm_group_fp8_quant_cpu(at::Tensor& out, at::Tensor& scales, const std::optional<at::Tensor>& residual_out,
                                  const at::Tensor& input, const std::optional<at::Tensor>& residual,
                                  const std::optional<at::Tensor>& weight, int64_t group_size, bool use_ue8m0,
                                  double epsilon) {
  run_rms_norm_quant("vllm_ir_c::rms_norm_group_fp8_quant", out, scales, residual_out, input, residual, weight,
                     std::nullopt, std::nullopt, epsilon, rms_norm_quant_fp8_stub, group_size, use_ue8m0);
}

void silu_and_mul_static_fp8_quant_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  run_silu_and_mul_quant("vllm_ir_c::silu_and_mul_static_fp8_quant", out, input, scale,
                         silu_and_mul_quant_fp8_stub);
}

void silu_and_mul_group_fp8_quant_cpu(at::Tensor& out, at::Tensor& scales, const at::Tensor& input,
                                      int64_t group_size, bool use_ue8m0) {
  run_silu_and_mul_quant("vllm_ir_c::silu_and_mul_group_fp8_quant", out, input, std::nullopt,
                         silu_and_mul_quant_fp8_stub, scales, group_size, use_ue8m0);
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  // q (float8_e4m3fn or float8_e4m3fnuz: out's dtype chooses) of rms_norm(input) * weight by a
  // per-tensor scale; the weight has input's dtype or float32.
  m.def("rms_norm_static_fp8_quant(Tensor(a!) out, Tensor input, Tensor? weight, Tensor scale, float epsilon) -> ()");
  // The same of input + residual (in fp32), the sum rounded into residual_out (which may be residual).
  m.def(
      "fused_add_rms_norm_static_fp8_quant(Tensor(a!) out, Tensor(b!) residual_out, Tensor input, Tensor residual, "
      "Tensor? weight, Tensor scale, float epsilon) -> ()");
  // Per-token dynamic scales into `scales` (one per row); residual optional as above.
  m.def(
      "rms_norm_dynamic_per_token_fp8_quant(Tensor(a!) out, Tensor(b!) scales, Tensor(c!)? residual_out, "
      "Tensor input, Tensor? residual, Tensor? weight, Tensor? scale_ub, float epsilon) -> ()");
  // Per-group dynamic scales into `scales` ([..., ceil(hidden / group_size)], row- or
  // column-major), optionally rounded up to powers of two; residual optional as above.
  m.def(
      "rms_norm_group_fp8_quant(Tensor(a!) out, Tensor(b!) scales, Tensor(c!)? residual_out, Tensor input, "
      "Tensor? residual, Tensor? weight, int group_size, bool use_ue8m0, float epsilon) -> ()");
  // q of silu(input[..., :d]) * input[..., d:] by a per-tensor scale, into out [..., d].
  m.def("silu_and_mul_static_fp8_quant(Tensor(a!) out, Tensor input, Tensor scale) -> ()");
  // The same with per-group dynamic scales into `scales` ([..., ceil(d / group_size)]).
  m.def(
      "silu_and_mul_group_fp8_quant(Tensor(a!) out, Tensor(b!) scales, Tensor input, int group_size, "
      "bool use_ue8m0) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("rms_norm_static_fp8_quant", &vllm_ir_c::rms_norm_static_fp8_quant_cpu);
  m.impl("fused_add_rms_norm_static_fp8_quant", &vllm_ir_c::fused_add_rms_norm_static_fp8_quant_cpu);
  m.impl("rms_norm_dynamic_per_token_fp8_quant", &vllm_ir_c::rms_norm_dynamic_per_token_fp8_quant_cpu);
  m.impl("silu_and_mul_static_fp8_quant", &vllm_ir_c::silu_and_mul_static_fp8_quant_cpu);
  m.impl("rms_norm_group_fp8_quant", &vllm_ir_c::rms_norm_group_fp8_quant_cpu);
  m.impl("silu_and_mul_group_fp8_quant", &vllm_ir_c::silu_and_mul_group_fp8_quant_cpu);
}

#endif  // VLLM_IR_C_TORCH_SIDE
