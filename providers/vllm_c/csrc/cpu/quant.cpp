// The FP8 quantization family on CPU: static_quant_fp8, dynamic_quant_fp8 (per-token and
// per-tensor) and dynamic_group_quant_fp8, into float8_e4m3fn or float8_e4m3fnuz.
//
// Compiled once per CPU capability (cpu/dispatch_stub.h). Values are widened to fp32, scaled,
// encoded (quant.h's quantize_fp8, lane by lane in at::vec::Vectorized<int32_t>) and narrowed
// to bytes in registers, one vector at a time; at::parallel_for over rows.
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
// Rows up to this many elements are widened once into a per-thread buffer (64 KiB).
constexpr int64_t kRowBuffer = 16384;

int64_t grain_size(int64_t hidden) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(hidden, 1));
}

using iVec = at::vec::Vectorized<int32_t>;

// quantize_fp8 (quant.h) on a vector: the same operations, lane by lane, as codes in int32 lanes.
template <Fp8Format kFormat>
iVec encode(const fVec& v, const fVec& bound) {
  using E = Fp8Encoding<kFormat>;
  const fVec clamped = at::vec::clamp(v, fVec(0.0f) - bound, bound);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // ATen's clamp is max then min there, which return a NaN operand as is: NaN lanes stay NaN.
  const iVec bits = at::vec::cast<int32_t>(clamped);
#else
  // The generic clamp may turn NaN into a bound: NaN lanes (with their sign) come from v.
  const iVec in_bits = at::vec::cast<int32_t>(v);
  const iVec bits = iVec::blendv(at::vec::cast<int32_t>(clamped), in_bits,
                                 (in_bits & iVec(0x7FFFFFFF)) > iVec(0x7F800000));
#endif
  const iVec mag = bits & iVec(0x7FFFFFFF);
  const iVec nan = mag > iVec(0x7F800000);
  const iVec c = at::vec::maximum(mag & iVec(0x7F800000), iVec(E::kMinNormal)) + iVec(E::kShift);
  const iVec steps = at::vec::cast<int32_t>(at::vec::cast<float>(mag) + at::vec::cast<float>(c)) - c;
  const iVec code = steps + (c >> iVec(20)) - iVec(E::kOffset);
  const iVec sign = (bits >> iVec(24)) & iVec(0x80);
  if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
    const iVec signed_code = iVec::blendv(code | sign, iVec(0), code == iVec(0));
    return iVec::blendv(signed_code, iVec(0x80), nan);
  } else {
    return iVec::blendv(code, iVec(0x7F), nan) | sign;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// encode() in AVX512 intrinsics, with what at::vec does not expose: compare masks, masked moves
// and a ternary-logic merge of the sign (about a quarter fewer instructions per vector).
template <Fp8Format kFormat>
__m128i encode_bytes(const __m512 v, const __m512 bound) {
  using E = Fp8Encoding<kFormat>;
  // max(a, b) and min(a, b) return b when either is NaN: NaN lanes stay NaN, with their sign.
  const __m512 clamped = _mm512_min_ps(bound, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), bound), v));
  const __m512i bits = _mm512_castps_si512(clamped);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7F800000));
  const __m512i c = _mm512_add_epi32(
      _mm512_max_epi32(_mm512_and_si512(mag, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(E::kMinNormal)),
      _mm512_set1_epi32(E::kShift));
  const __m512i sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_castsi512_ps(c)));
  __m512i code = _mm512_add_epi32(_mm512_sub_epi32(sum, c),
                                  _mm512_sub_epi32(_mm512_srli_epi32(c, 20), _mm512_set1_epi32(E::kOffset)));
  const __m512i high = _mm512_srli_epi32(bits, 24);  // the sign at bit 7
  const __m512i sign_bit = _mm512_set1_epi32(0x80);
  if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(code, _mm512_setzero_si512());
    code = _mm512_ternarylogic_epi32(code, high, sign_bit, 0xF8);  // code | (high & 0x80)
    code = _mm512_mask_mov_epi32(code, zero, _mm512_setzero_si512());
    code = _mm512_mask_mov_epi32(code, nan, sign_bit);
  } else {
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
    code = _mm512_ternarylogic_epi32(code, high, sign_bit, 0xF8);
  }
  return _mm512_cvtepi32_epi8(code);
}

template <Fp8Format kFormat>
void encode_store(const fVec& v, const fVec& bound, uint8_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), encode_bytes<kFormat>(v, bound));
}
#else
// Narrows codes (0..255 in int32 lanes) to bytes at dst.
void store_bytes(const iVec& codes, uint8_t* dst) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256i v = codes;
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
#else
  int32_t lanes[iVec::size()];
  codes.store(lanes);
  for (int64_t j = 0; j < iVec::size(); ++j) {
    dst[j] = static_cast<uint8_t>(lanes[j]);
  }
#endif
}

template <Fp8Format kFormat>
void encode_store(const fVec& v, const fVec& bound, uint8_t* dst) {
  store_bytes(encode<kFormat>(v, bound), dst);
}
#endif

// The magnitude bits of v: non-negative floats (NaN above inf) order like these integers, so
// their integer maximum is the NaN-propagating float maximum, one instruction per vector.
iVec magnitude_bits(const fVec& v) {
  return at::vec::cast<int32_t>(v) & iVec(0x7FFFFFFF);
}

float float_of_bits(int32_t b) {
  return bits_float(static_cast<uint32_t>(b));
}

// dst[0:n] = float(src[0:n]) (unless dst is null); returns max |src| (NaN if any is NaN).
template <typename T>
float widen_absmax(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  iVec m(0);
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) {
      const fVec a = fVec::loadu(src + i);
      if (dst != nullptr) {
        a.store(dst + i);
      }
      m = at::vec::maximum(m, magnitude_bits(a));
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vec::loadu(src + i));
      if (dst != nullptr) {
        a.store(dst + i);
        b.store(dst + i + fVec::size());
      }
      m = at::vec::maximum(m, at::vec::maximum(magnitude_bits(a), magnitude_bits(b)));
    }
  }
  // Reduced as floats (ATen's shuffle-based reduction) with the integer maximum.
  const float lanes_max = at::vec::vec_reduce_all<float>(
      [](fVec& x, fVec& y) {
        return at::vec::cast<float>(at::vec::maximum(at::vec::cast<int32_t>(x), at::vec::cast<int32_t>(y)));
      },
      at::vec::cast<float>(m));
  int32_t result = static_cast<int32_t>(float_bits(lanes_max));
  for (; i < n; ++i) {
    const float v = static_cast<float>(src[i]);
    if (dst != nullptr) {
      dst[i] = v;
    }
    result = std::max(result, static_cast<int32_t>(float_bits(v) & 0x7FFFFFFFu));
  }
  return float_of_bits(result);
}

// out[0:n] = quantize(float(src[0:n]) * inv) (inv per element where inv_row is set), one
// vector at a time: widened, scaled, encoded and narrowed in registers.
template <Fp8Format kFormat, typename T>
void quantize_row(const T* src, uint8_t* out, int64_t n, float inv, const float* inv_row, float bound) {
  static_assert(iVec::size() == fVec::size());
  const fVec vinv(inv);
  const fVec vbound(bound);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) {
      const fVec s = inv_row ? fVec::loadu(inv_row + i) : vinv;
      encode_store<kFormat>(fVec::loadu(src + i) * s, vbound, out + i);
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vec::loadu(src + i));
      const fVec sa = inv_row ? fVec::loadu(inv_row + i) : vinv;
      const fVec sb = inv_row ? fVec::loadu(inv_row + i + fVec::size()) : vinv;
      encode_store<kFormat>(a * sa, vbound, out + i);
      encode_store<kFormat>(b * sb, vbound, out + i + fVec::size());
    }
  }
  for (; i < n; ++i) {
    out[i] = quantize_fp8<kFormat>(static_cast<float>(src[i]) * (inv_row ? inv_row[i] : inv), bound);
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
  const int64_t groups = (hidden + g - 1) / g;
  const bool buffered = hidden <= kRowBuffer;
  at::parallel_for(0, a.rows, grain_size(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(buffered ? hidden : 0);
    std::vector<float> absmax(groups);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = input + a.input_rows.offset(r);
      uint8_t* out = a.out + r * hidden;
      float* scales = a.scales + a.scale_rows.offset(r);
      // One read of x: each group widened into the row buffer (L1) while taking its absmax.
      for (int64_t c = 0, k = 0; c < hidden; c += g, ++k) {
        absmax[k] = widen_absmax<T>(x + c, buffered ? row.data() + c : nullptr, std::min(g, hidden - c));
      }
      for (int64_t c = 0, k = 0; c < hidden; c += g, ++k) {
        float s = absmax[k] / bound;
        if (a.use_ue8m0) {
          s = pow2_ceil(s);
        }
        s = s != s ? s : std::max(s, floor);
        scales[k * a.scale_group_stride] = s;
        const int64_t len = std::min(g, hidden - c);
        if (buffered) {
          quantize_row<kFormat, float>(row.data() + c, out + c, len, 1.0f / s, nullptr, bound);
        } else {
          quantize_row<kFormat, T>(x + c, out + c, len, 1.0f / s, nullptr, bound);
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
