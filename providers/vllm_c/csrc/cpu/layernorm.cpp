// The layernorm family on CPU: rms_norm, and fused residual-add + rms_norm in place and into
// fresh outputs. One file for both ops because they share almost everything below the row
// loop (the fp32 loads and rounded stores, the weight widening, the sum of squares, the
// prefetching), and their numerics must agree rounding for rounding.
//
// Compiled once per CPU capability (cpu/dispatch_stub.h). The kernels are like ATen's
// native/cpu ones: at::vec::Vectorized loops with a scalar tail, at::parallel_for over rows,
// fp32 accumulation for every dtype, one dtype switch per entry point. The kernel section has
// no static initializers and no Tensor API; the torch side at the end (schemas, checks, CPU
// registrations) is compiled only in the DEFAULT, baseline-ISA compilation.
//
// Each row is read twice: pass 1 sums squares, pass 2 scales the row, now in cache. Calls that
// fit in the last-level cache run pass 2 of a row inside pass 1 of the next (see "rows
// interleaved"); larger calls run a row's passes in turn, pass 2 prefetching the next row
// (memory is their limit). Outputs written out
// of place by a call whose activations do not fit in the last-level cache are stored
// non-temporally (stream_store): they would be evicted before any reuse, and a plain store
// first reads each output line from memory (for rms_norm at [4096, 4096], a third of the DRAM
// traffic). A row whose output is not vector-aligned is stored normally.
//
// Numerics follow the op declarations in vllm_ir (core/ir/declarations/layernorm.py), that is
// vLLM 0.33's, rounding for rounding: the row is normalized in fp32, then the weight applied in
// its own dtype (norm_vec::WeightKind): a weight of the input dtype multiplies the normalized
// value rounded to that dtype (for bf16/fp16: an fp32 product rounded again); an fp32 weight
// multiplies the fp32 value, rounded once. The fused op normalizes the fp32 sum, not the
// rounded residual it stores.

#include "../layernorm.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "dispatch_stub.h"
#include "norm_vec.h"

namespace vllm_ir_c {

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const RmsNormArgs&), rms_norm_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const FusedAddRmsNormArgs&), fused_add_rms_norm_stub);

namespace CPU_CAPABILITY {
namespace {

using float_vec::fVec;
using float_vec::kStep;
using float_vec::load_float;
using float_vec::store_float;
using norm_vec::Fp32Weight;
using norm_vec::inverse_rms;
using norm_vec::aten_row_split;
using norm_vec::prefetch_step;
using norm_vec::RowSplit;
using norm_vec::sum_of_squares;
using norm_vec::weighted;
using norm_vec::WeightKind;

// Fewer elements than this per task are not worth a parallel region (a few microseconds).
// Measured on 2 cores with hidden 4096: 8 rows already run faster on two threads
// (fp32 5.3 vs 6.8 us), 4 rows do not (3.9 us either way).
constexpr int64_t kMinElementsPerTask = 16384;

int64_t grain_size(int64_t hidden) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(hidden, 1));
}

// ---------------------------------------------------------------------------------------
// non-temporal stores (x86 AVX2 / AVX512; elsewhere plain stores)

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kCanStream = true;
#else
constexpr bool kCanStream = false;
#endif

// Whether a row at `p` can be streamed: every vector store of its steps is then aligned.
template <typename T>
bool stream_aligned(const T* p) {
  return kCanStream && reinterpret_cast<std::uintptr_t>(p) % sizeof(fVec) == 0;
}

// store_float, bypassing the caches (`p` aligned as stream_aligned says). The values are the
// same; only where they go differs.
template <typename T>
inline void stream_store(T* p, const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    _mm512_stream_ps(p, a);
    _mm512_stream_ps(p + fVec::size(), b);
  } else {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), float_vec::narrow<T>(a, b));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    _mm256_stream_ps(p, a);
    _mm256_stream_ps(p + fVec::size(), b);
  } else {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), float_vec::narrow<T>(a, b));
  }
#else
  store_float(p, a, b);
#endif
}

// Orders a task's streamed stores before whatever follows it (they are weakly ordered).
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  _mm_sfence();
#endif
}

// A step's store, streamed or not.
template <bool kStream, typename T>
inline void store_step(T* p, const fVec& a, const fVec& b) {
  if constexpr (kStream) {
    stream_store(p, a, b);
  } else {
    store_float(p, a, b);
  }
}

// ---------------------------------------------------------------------------------------
// rows

// A streamed output is not prefetched (its stores read nothing), and a streamed row prefetches
// the next one into L2 only: into L1 it evicted the weight, which every row reads (bf16 x with
// an fp32 weight at [4096, 4096], one thread, the row loop alone in paired rounds: 3581 us with
// L1 prefetches, 2585 us with L2 ones).
template <typename T, WeightKind kKind, bool kStream>
void rms_norm_row(T* out, const T* x, const float* w, int64_t n, float epsilon, const T* next_x, T* next_out,
                  const RowSplit& split) {
  const float sum = sum_of_squares(
      n, [&](int64_t d) { return load_float(x + d); }, [&](int64_t d) { return static_cast<float>(x[d]); }, split);

  const float scale = inverse_rms(sum, n, epsilon);
  int64_t d = 0;
  const fVec scale_vec(scale);
  for (; d + kStep <= n; d += kStep) {
    if constexpr (kStream) {
      prefetch_step<false, 2>(next_x + d);
    } else {
      prefetch_step<false>(next_x + d);
      prefetch_step<true>(next_out + d);
    }
    auto [x0, x1] = load_float(x + d);
    auto [y0, y1] = weighted<T, kKind>(x0 * scale_vec, x1 * scale_vec, w + d);
    store_step<kStream>(out + d, y0, y1);
  }
  for (; d < n; ++d) {
    out[d] = weighted<T, kKind>(static_cast<float>(x[d]) * scale, w, d);
  }
}

// In place (`out` is `x`, `residual_out` is `residual`) or not: each step reads both inputs
// before it writes, so aliasing them is safe. Pass 2 prefetches the next row's outputs for
// writing (in place, they are its inputs); the inputs of the next row are read first by its
// pass 1, a stream the hardware prefetcher follows (prefetching them here as well measured no
// faster, and slower out of place at fp32 [256, 4096]: 214 vs 179-200 us on the 2-core VM).
template <typename T, WeightKind kKind, bool kStream>
void fused_add_rms_norm_row(T* out, T* residual_out, const T* x, const T* residual, const float* w, int64_t n,
                            float epsilon, T* next_out, T* next_residual_out, const RowSplit& split) {
  // Pass 1 only reads; pass 2 recomputes the fp32 sum from both rows (now in cache) rather
  // than from the stored residual, which is rounded: the norm is of the fp32 sum.
  const float sum = sum_of_squares(
      n,
      [&](int64_t d) {
        auto [x0, x1] = load_float(x + d);
        auto [r0, r1] = load_float(residual + d);
        return std::make_tuple(x0 + r0, x1 + r1);
      },
      [&](int64_t d) { return static_cast<float>(x[d]) + static_cast<float>(residual[d]); }, split);

  const float scale = inverse_rms(sum, n, epsilon);
  const fVec scale_vec(scale);
  int64_t d = 0;
  for (; d + kStep <= n; d += kStep) {
    if constexpr (!kStream) {
      prefetch_step<true>(next_out + d);
      prefetch_step<true>(next_residual_out + d);
    }
    auto [x0, x1] = load_float(x + d);
    auto [r0, r1] = load_float(residual + d);
    const fVec s0 = x0 + r0;
    const fVec s1 = x1 + r1;
    store_step<kStream>(residual_out + d, s0, s1);
    auto [y0, y1] = weighted<T, kKind>(s0 * scale_vec, s1 * scale_vec, w + d);
    store_step<kStream>(out + d, y0, y1);
  }
  for (; d < n; ++d) {
    const float s = static_cast<float>(x[d]) + static_cast<float>(residual[d]);
    residual_out[d] = static_cast<T>(s);
    out[d] = weighted<T, kKind>(s * scale, w, d);
  }
}

// ---------------------------------------------------------------------------------------
// rows interleaved: pass 2 of row r inside pass 1 of row r + 1
//
// In cache, a row's pass 1 is a chain of dependent adds (ATen's order leaves 2 to 4 vectors of
// independent sums, each add waiting on the last) and pass 2 is independent arithmetic, so a
// row's passes run one after the other at neither unit's rate. Interleaving them, group by group
// of pass 1, fills the adds' latency with pass 2's work; the adds are the same, in the same
// order, so every output keeps its bits. Calls beyond the last-level cache (streamed, or in
// place) keep the row-by-row loop above: there memory is the limit, and interleaving measured
// slower (fused in place, bf16 x, fp32 weight, [4096, 4096], one thread: 0.95-1.04x copy_
// against 1.26-1.37x row by row, paired rounds on the loaded 2-core VM).

// Pass 2 of rms_norm on the whole steps of [d, end): out = the weighted x * scale.
template <typename T, WeightKind kKind>
inline void normalize_steps(T* out, const T* x, const float* w, const fVec& scale, int64_t d, int64_t end) {
  for (; d < end; d += kStep) {
    auto [x0, x1] = load_float(x + d);
    auto [y0, y1] = weighted<T, kKind>(x0 * scale, x1 * scale, w + d);
    store_float(out + d, y0, y1);
  }
}

// The same from element d (a step boundary) to the row's end n, tail included.
template <typename T, WeightKind kKind>
inline void normalize_rest(T* out, const T* x, const float* w, float scale, int64_t d, int64_t n) {
  const int64_t steps_end = d + (n - d) / kStep * kStep;
  normalize_steps<T, kKind>(out, x, w, fVec(scale), d, steps_end);
  for (d = steps_end; d < n; ++d) {
    out[d] = weighted<T, kKind>(static_cast<float>(x[d]) * scale, w, d);
  }
}

template <typename T, WeightKind kKind>
void rms_norm_rows_interleaved(const RmsNormArgs& a, const float* w, int64_t begin, int64_t end) {
  auto* out = static_cast<T*>(a.out);
  const auto* x = static_cast<const T*>(a.input);
  const int64_t n = a.hidden;
  const auto row_sum = [n](const T* row, const auto& side) {
    return norm_vec::sum_of_squares_beside(
        n, [row](int64_t d) { return load_float(row + d); }, [row](int64_t d) { return static_cast<float>(row[d]); },
        side);
  };
  const int64_t covered = norm_vec::whole_groups(n) * norm_vec::kAtenGroup;  // what side() normalizes
  const T* prev_x = x + a.input_rows.offset(begin);
  T* prev_out = out + a.out_rows.offset(begin);
  float prev_scale = inverse_rms(row_sum(prev_x, norm_vec::NoSideWork{}), n, a.epsilon);
  for (int64_t r = begin + 1; r < end; ++r) {
    const T* row_x = x + a.input_rows.offset(r);
    const fVec scale_vec(prev_scale);
    const float sum = row_sum(row_x, [&](int64_t g) {
      normalize_steps<T, kKind>(prev_out, prev_x, w, scale_vec, g * norm_vec::kAtenGroup,
                                (g + 1) * norm_vec::kAtenGroup);
    });
    normalize_rest<T, kKind>(prev_out, prev_x, w, prev_scale, covered, n);
    prev_x = row_x;
    prev_out = out + a.out_rows.offset(r);
    prev_scale = inverse_rms(sum, n, a.epsilon);
  }
  normalize_rest<T, kKind>(prev_out, prev_x, w, prev_scale, 0, n);
}

// Pass 2 of fused_add_rms_norm on the whole steps of [d, end): the fp32 sum stored rounded as
// the residual, and normalized. Both inputs are read before the step is written (in place safe).
template <typename T, WeightKind kKind>
inline void add_normalize_steps(T* out, T* residual_out, const T* x, const T* residual, const float* w,
                                const fVec& scale, int64_t d, int64_t end) {
  for (; d < end; d += kStep) {
    auto [x0, x1] = load_float(x + d);
    auto [r0, r1] = load_float(residual + d);
    const fVec s0 = x0 + r0;
    const fVec s1 = x1 + r1;
    store_float(residual_out + d, s0, s1);
    auto [y0, y1] = weighted<T, kKind>(s0 * scale, s1 * scale, w + d);
    store_float(out + d, y0, y1);
  }
}

template <typename T, WeightKind kKind>
inline void add_normalize_rest(T* out, T* residual_out, const T* x, const T* residual, const float* w, float scale,
                               int64_t d, int64_t n) {
  const int64_t steps_end = d + (n - d) / kStep * kStep;
  add_normalize_steps<T, kKind>(out, residual_out, x, residual, w, fVec(scale), d, steps_end);
  for (d = steps_end; d < n; ++d) {
    const float s = static_cast<float>(x[d]) + static_cast<float>(residual[d]);
    residual_out[d] = static_cast<T>(s);
    out[d] = weighted<T, kKind>(s * scale, w, d);
  }
}

template <typename T, WeightKind kKind>
void fused_add_rms_norm_rows_interleaved(const FusedAddRmsNormArgs& a, const float* w, int64_t begin, int64_t end) {
  auto* out = static_cast<T*>(a.out);
  auto* residual_out = static_cast<T*>(a.residual_out);
  const auto* x = static_cast<const T*>(a.input);
  const auto* residual = static_cast<const T*>(a.residual);
  const int64_t n = a.hidden;
  const auto row_sum = [n](const T* row_x, const T* row_residual, const auto& side) {
    return norm_vec::sum_of_squares_beside(
        n,
        [row_x, row_residual](int64_t d) {
          auto [x0, x1] = load_float(row_x + d);
          auto [r0, r1] = load_float(row_residual + d);
          return std::make_tuple(x0 + r0, x1 + r1);
        },
        [row_x, row_residual](int64_t d) { return static_cast<float>(row_x[d]) + static_cast<float>(row_residual[d]); },
        side);
  };
  const int64_t covered = norm_vec::whole_groups(n) * norm_vec::kAtenGroup;
  const T* prev_x = x + a.input_rows.offset(begin);
  const T* prev_residual = residual + a.residual_rows.offset(begin);
  T* prev_out = out + a.out_rows.offset(begin);
  T* prev_residual_out = residual_out + a.residual_out_rows.offset(begin);
  float prev_scale = inverse_rms(row_sum(prev_x, prev_residual, norm_vec::NoSideWork{}), n, a.epsilon);
  for (int64_t r = begin + 1; r < end; ++r) {
    const T* row_x = x + a.input_rows.offset(r);
    const T* row_residual = residual + a.residual_rows.offset(r);
    const fVec scale_vec(prev_scale);
    const float sum = row_sum(row_x, row_residual, [&](int64_t g) {
      add_normalize_steps<T, kKind>(prev_out, prev_residual_out, prev_x, prev_residual, w, scale_vec,
                                    g * norm_vec::kAtenGroup, (g + 1) * norm_vec::kAtenGroup);
    });
    add_normalize_rest<T, kKind>(prev_out, prev_residual_out, prev_x, prev_residual, w, prev_scale, covered, n);
    prev_x = row_x;
    prev_residual = row_residual;
    prev_out = out + a.out_rows.offset(r);
    prev_residual_out = residual_out + a.residual_out_rows.offset(r);
    prev_scale = inverse_rms(sum, n, a.epsilon);
  }
  add_normalize_rest<T, kKind>(prev_out, prev_residual_out, prev_x, prev_residual, w, prev_scale, 0, n);
}

// ---------------------------------------------------------------------------------------
// chunks of rows (one at::parallel_for task each)

// The weight in fp32 for a chunk of rows: a weight of T widened once (exactly), an fp32 one as is.
template <typename T, WeightKind kKind>
class ChunkWeight {
 public:
  ChunkWeight(const void* weight, int64_t n) : same_(kKind == WeightKind::kSame ? weight : nullptr, n) {
    data_ = kKind == WeightKind::kFp32 ? static_cast<const float*>(weight) : same_.data();
  }
  const float* data() const {
    return data_;
  }

 private:
  Fp32Weight<T> same_;
  const float* data_;
};

template <typename T, WeightKind kKind>
void rms_norm_rows(const RmsNormArgs& a, int64_t begin, int64_t end, const RowSplit& split) {
  auto* out = static_cast<T*>(a.out);
  const auto* x = static_cast<const T*>(a.input);
  const ChunkWeight<T, kKind> w(a.weight, a.hidden);
  if (a.in_cache && split.chunks <= 1) {
    rms_norm_rows_interleaved<T, kKind>(a, w.data(), begin, end);
    return;
  }
  for (const auto r : c10::irange(begin, end)) {
    const int64_t next = std::min(r + 1, end - 1);  // the last row prefetches itself: harmless
    T* row_out = out + a.out_rows.offset(r);
    const auto run = [&](auto stream) {
      rms_norm_row<T, kKind, decltype(stream)::value>(row_out, x + a.input_rows.offset(r), w.data(), a.hidden,
                                                      a.epsilon, x + a.input_rows.offset(next),
                                                      out + a.out_rows.offset(next), split);
    };
    if (a.stream_out && stream_aligned(row_out)) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  }
  if (a.stream_out) {
    stream_fence();
  }
}

template <typename T, WeightKind kKind>
void fused_add_rms_norm_rows(const FusedAddRmsNormArgs& a, int64_t begin, int64_t end, const RowSplit& split) {
  auto* out = static_cast<T*>(a.out);
  auto* residual_out = static_cast<T*>(a.residual_out);
  const auto* x = static_cast<const T*>(a.input);
  const auto* residual = static_cast<const T*>(a.residual);
  const ChunkWeight<T, kKind> w(a.weight, a.hidden);
  if (a.in_cache && split.chunks <= 1) {
    fused_add_rms_norm_rows_interleaved<T, kKind>(a, w.data(), begin, end);
    return;
  }
  for (const auto r : c10::irange(begin, end)) {
    const int64_t next = std::min(r + 1, end - 1);
    T* row_out = out + a.out_rows.offset(r);
    T* row_residual_out = residual_out + a.residual_out_rows.offset(r);
    const auto run = [&](auto stream) {
      fused_add_rms_norm_row<T, kKind, decltype(stream)::value>(
          row_out, row_residual_out, x + a.input_rows.offset(r), residual + a.residual_rows.offset(r), w.data(),
          a.hidden, a.epsilon, out + a.out_rows.offset(next), residual_out + a.residual_out_rows.offset(next), split);
    };
    if (a.stream_out && stream_aligned(row_out) && stream_aligned(row_residual_out)) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  }
  if (a.stream_out) {
    stream_fence();
  }
}

// The rows of [begin, end) with the weight kind of `a` (an fp32 weight of fp32 rows is of T).
template <typename T, typename Args, typename Rows>
void with_weight_kind(const Args& a, const Rows& rows) {
  if (a.weight == nullptr) {
    rows(std::integral_constant<WeightKind, WeightKind::kNone>{});
  } else if (a.fp32_weight && !std::is_same_v<T, float>) {
    rows(std::integral_constant<WeightKind, WeightKind::kFp32>{});
  } else {
    rows(std::integral_constant<WeightKind, WeightKind::kSame>{});
  }
}

// ---------------------------------------------------------------------------------------
// entry points: this capability's slots of the stubs

void rms_norm_kernel(const RmsNormArgs& args) {
  const RowSplit split = aten_row_split(args.rows, args.hidden);  // outside the parallel region
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(args.dtype, "vllm_ir_c::rms_norm (cpu)", [&] {
    at::parallel_for(0, args.rows, grain_size(args.hidden), [&](int64_t begin, int64_t end) {
      with_weight_kind<scalar_t>(
          args, [&](auto kind) { rms_norm_rows<scalar_t, decltype(kind)::value>(args, begin, end, split); });
    });
  });
}

void fused_add_rms_norm_kernel(const FusedAddRmsNormArgs& args) {
  const RowSplit split = aten_row_split(args.rows, args.hidden);
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(args.dtype, "vllm_ir_c::fused_add_rms_norm (cpu)", [&] {
    at::parallel_for(0, args.rows, grain_size(args.hidden), [&](int64_t begin, int64_t end) {
      with_weight_kind<scalar_t>(args, [&](auto kind) {
        fused_add_rms_norm_rows<scalar_t, decltype(kind)::value>(args, begin, end, split);
      });
    });
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

VLLM_IR_C_REGISTER_DISPATCH(rms_norm_stub, &CPU_CAPABILITY::rms_norm_kernel);
VLLM_IR_C_REGISTER_DISPATCH(fused_add_rms_norm_stub, &CPU_CAPABILITY::fused_add_rms_norm_kernel);

}  // namespace vllm_ir_c

// ---------------------------------------------------------------------------------------
// torch side: schemas and CPU implementations (the DEFAULT compilation only)

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <fstream>
#include <string>

namespace vllm_ir_c {

static_assert(CPU_CAPABILITY::norm_vec::kAtenGrainSize == at::internal::GRAIN_SIZE,
              "norm_vec's copy of ATen's grain size (which decides how ATen splits a lone row's sum)");

namespace {

// The last-level cache's size in bytes: the largest cache Linux lists for CPU 0 (sysfs; glibc's
// sysconf(_SC_LEVEL3_CACHE_SIZE) reported 320 MiB for this VM's 32 MiB L3), else 32 MiB.
int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t largest = 0;
    for (int index = 0; index < 8; ++index) {
      std::ifstream file("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
      int64_t size = 0;
      std::string unit;
      if (file >> size) {
        file >> unit;  // "K" or "M" where given
        largest = std::max(largest, size << (unit == "M" ? 20 : unit == "K" ? 10 : 0));
      }
    }
    return largest > 0 ? largest : int64_t{32} << 20;
  }();
  return bytes;
}

// Whether a call reading and writing `activations` tensors of `rows` x `hidden` elements of
// `dtype` (inputs and outputs together) streams its outputs: when they exceed the last-level
// cache, so the outputs would not stay cached anyway.
bool stream_outputs(int activations, int64_t rows, int64_t hidden, c10::ScalarType dtype) {
  return activations * rows * hidden * static_cast<int64_t>(c10::elementSize(dtype)) > last_level_cache_bytes();
}

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  double epsilon) {
  run_rms_norm("vllm_ir_c::rms_norm", out, input, weight, epsilon, [](const RmsNormArgs& args) {
    RmsNormArgs a = args;
    a.stream_out = stream_outputs(2, a.rows, a.hidden, a.dtype);
    a.in_cache = !a.stream_out;
    rms_norm_stub(a);
  });
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                            double epsilon) {
  // In place: the output lines were just read, so plain stores find them cached.
  run_fused_add_rms_norm("vllm_ir_c::fused_add_rms_norm", input, residual, input, residual, weight, epsilon,
                         [](const FusedAddRmsNormArgs& args) {
                           FusedAddRmsNormArgs a = args;
                           a.in_cache = !stream_outputs(4, a.rows, a.hidden, a.dtype);
                           fused_add_rms_norm_stub(a);
                         });
}

void fused_add_rms_norm_out_cpu(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& input,
                                const at::Tensor& residual, const std::optional<at::Tensor>& weight, double epsilon) {
  run_fused_add_rms_norm("vllm_ir_c::fused_add_rms_norm_out", out, residual_out, input, residual, weight, epsilon,
                         [](const FusedAddRmsNormArgs& args) {
                           FusedAddRmsNormArgs a = args;
                           a.in_cache = !stream_outputs(4, a.rows, a.hidden, a.dtype);
                           a.stream_out = a.out != a.input && !a.in_cache;
                           fused_add_rms_norm_stub(a);
                         });
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  // out <- rms_norm(input, weight) (weight: input's dtype or float32, applied as vLLM 0.33 does).
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor? weight, float epsilon) -> ()");
  // In place: residual <- input + residual, input <- rms_norm(that sum, in fp32) * weight.
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float epsilon) -> ()");
  // The same into two other tensors: residual_out <- input + residual, out <- rms_norm(...) * weight.
  m.def(
      "fused_add_rms_norm_out(Tensor(a!) out, Tensor(b!) residual_out, Tensor input, Tensor residual, "
      "Tensor? weight, float epsilon) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("rms_norm", &vllm_ir_c::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &vllm_ir_c::fused_add_rms_norm_cpu);
  m.impl("fused_add_rms_norm_out", &vllm_ir_c::fused_add_rms_norm_out_cpu);
}

#endif  // VLLM_IR_C_TORCH_SIDE
