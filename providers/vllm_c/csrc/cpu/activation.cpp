// The activation family on CPU: the gated ops (silu_and_mul, mul_and_silu, gelu_and_mul with
// erf or tanh, fatrelu_and_mul, swigluoai_and_mul, gelu_and_mul_sparse) and the elementwise
// ones (gelu_new, gelu_fast, quick_gelu, relu2).
//
// Compiled once per CPU capability (cpu/dispatch_stub.h). Two loops serve every op: a gated
// row loop (at::parallel_for over rows, each row in steps of two fp32 vectors) and a flat
// elementwise loop over dense memory; each is instantiated with an activation functor that
// gives the fp32 math in vector and scalar form.
//
// Numerics follow the op declarations (core/ir/declarations/activation.py), and for the gated
// ops with halves also torch's own CPU kernels (F.silu, F.gelu, F.threshold) operation for
// operation, so that results are bit-identical to native's:
//  - the same formulas: ATen's vector and scalar forms, with ATen's FMA contractions (the
//    build turns contraction off, -ffp-contract=off, and fuses explicitly where ATen's build
//    does); with AVX512, ATen's vector exp and erf are inlined copies of their arithmetic
//    (act_vec.h; checked bit for bit against them over every fp32 input);
//  - the same split between them: ATen's loop runs the vector form in steps of two
//    Vectorized<T> along each row of a strided gate and the scalar form (std::exp, std::erf,
//    std::tanh: other bits) on the row's remainder;
//  - the same roundings: the activation rounded to x's dtype, then the product in fp32
//    rounded again.
// Where native's own bits depend on more than the element (oneDNN's gelu for a contiguous
// gate, i.e. one row; a parallel chunk boundary inside a row), the kernels keep to the above:
// their results never depend on the batch.

#include "../activation.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "act_vec.h"
#include "dispatch_stub.h"
#include "float_vec.h"
#include "table16.h"

namespace vllm_ir_c {

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const GatedArgs&), gated_activation_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const ElementwiseArgs&), elementwise_activation_stub);
VLLM_IR_C_DECLARE_DISPATCH(void (*)(const SparseGeluArgs&), sparse_gelu_stub);

namespace CPU_CAPABILITY {
namespace {

using float_vec::fVec;
using float_vec::kStep;
using float_vec::load_float;
using float_vec::round_float;
using float_vec::store_float;
using Pair = std::tuple<fVec, fVec>;

// Fewer elements than this per task are not worth a parallel region.
constexpr int64_t kMinElementsPerTask = 16384;

using act_vec::aten_step;  // ATen's split between its vector and scalar forms

// ---------------------------------------------------------------------------------------
// the fp32 math, vector and scalar, each as ATen computes it

using act_vec::silu;

// torch.sigmoid: 1 / (1 + exp(-x)). As a functor, its table (table16.h) serves swigluoai_and_mul,
// whose sigmoid input is rounded to x's dtype: a 16-bit value.
struct Sigmoid {
  template <typename Exp>
  static fVec math(const fVec& x, const Exp& exp) {
    return (fVec(1.0f) + exp(x.neg())).reciprocal();
  }
  fVec operator()(const fVec& x) const {
    return math(x, act_vec::AtenExp{});
  }
  float operator()(float x) const {
    return 1.0f / (1.0f + std::exp(-x));
  }
#if defined(CPU_CAPABILITY_AVX512)
  // Computed with exp_fast for |x| < 64 (bf16 0x4280): e^-x in range.
  static bool lane_values(const fVec& x0, const fVec& x1, fVec& a0, fVec& a1) {
    return act_vec::lane_values_by(x0, x1, 0x4280, [](const fVec& v) { return math(v, act_vec::FastExp{}); }, a0,
                                   a1);
  }
#endif
};

// F.gelu(approximate="none"): x * 0.5 * (1 + erf(x / sqrt(2))).
const float kSqrtHalf = static_cast<float>(M_SQRT1_2);
inline fVec gelu_erf(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const fVec erf = act_vec::erf_aten(x * fVec(kSqrtHalf));  // ATen's erf, inlined
#else
  const fVec erf = (x * fVec(kSqrtHalf)).erf();
#endif
  return x * fVec(0.5f) * (fVec(1.0f) + erf);
}
inline float gelu_erf(float x) {
  return x * 0.5f * (1.0f + std::erf(x * kSqrtHalf));
}

// F.gelu(approximate="tanh"): 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))).
const float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
const float kGeluKappa = static_cast<float>(0.044715);
// ATen's kernels are built with FMA contraction, which turns x + kappa * x^3 into one fused
// multiply-add wherever the ISA has one (AVX2, AVX512): so do these, explicitly.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kContractsToFma = true;
#else
constexpr bool kContractsToFma = false;
#endif
inline fVec gelu_tanh(const fVec& x) {
  const fVec cube = x * x * x;
  const fVec inner = fVec(kGeluBeta) * at::vec::fmadd(fVec(kGeluKappa), cube, x);
  return fVec(0.5f) * x * (fVec(1.0f) + inner.tanh());
}
inline float gelu_tanh(float x) {
  const float cube = x * x * x;
  const float inner = kGeluBeta * (kContractsToFma ? std::fma(kGeluKappa, cube, x) : x + kGeluKappa * cube);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// ---------------------------------------------------------------------------------------
// gated activations: vec<T>(gate, up) for one step (two fp32 vectors each way), scalar<T>
// for one element; both round where native does.

using act_vec::ActTimesUp;  // act(gate) rounded to T, times up, rounded (by the store) again

using SiluFn = act_vec::Silu;

template <bool kTanh>
struct GeluFn {
  fVec operator()(const fVec& x) const {
    return kTanh ? gelu_tanh(x) : gelu_erf(x);
  }
  float operator()(float x) const {
    return kTanh ? gelu_tanh(x) : gelu_erf(x);
  }
};

// F.threshold(x, threshold, 0): x <= threshold (compared in fp32) becomes 0; NaN stays.
struct FatreluFn {
  float threshold;
  fVec operator()(const fVec& x) const {
    return fVec::blendv(x, fVec(0.0f), x <= fVec(threshold));
  }
  float operator()(float x) const {
    return x <= threshold ? 0.0f : x;
  }
};

// sigmoid(z) rounded to T, for z holding T values: looked up (or computed table values) for
// 16-bit T with AVX512, computed otherwise.
template <typename T>
struct RoundedSigmoid {
  act_vec::TableOf<T, Sigmoid> table{};
  Pair operator()(const fVec& z0, const fVec& z1) const {
    if constexpr (!std::is_same_v<decltype(table), std::false_type>) {
      if (table) {
        return table.values(z0, z1);
      }
    }
    return round_float<T>(Sigmoid{}(z0), Sigmoid{}(z1));
  }
};

// GPT-OSS: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * (g * sigmoid(g * alpha)),
// each step rounded to T (native computes it op by op in x's dtype). NaN propagates.
template <typename T>
struct SwigluOai {
  float alpha;
  float limit;
  RoundedSigmoid<T> sigmoid{};
  // A T value: then clamping T values to it gives T values (NaN aside), with no rounding.
  bool limit_is_t = static_cast<float>(static_cast<T>(limit)) == limit;
  // glu of every 16-bit gate for this (alpha, limit), looked up (one gather per 16 lanes instead
  // of the clamp, three roundings and the sigmoid's lookup or math); null where T is not 16-bit,
  // without AVX512, with VLLM_IR_C_TABLES=0, or once too many (alpha, limit) have tables.
  const T* glu_table = make_glu_table();

  // round(g * round(sigmoid(round(g * alpha)))), g = min(gate, limit) rounded: a function of the gate alone.
  Pair glu(const Pair& gate) const {
    const fVec lim(limit);
    Pair g{at::vec::clamp_max(std::get<0>(gate), lim), at::vec::clamp_max(std::get<1>(gate), lim)};
    if (!limit_is_t) {
      g = round_float<T>(std::get<0>(g), std::get<1>(g));
    }
    auto [g0, g1] = g;
    auto [z0, z1] = round_float<T>(g0 * fVec(alpha), g1 * fVec(alpha));
    auto [s0, s1] = sigmoid(z0, z1);
    return round_float<T>(g0 * s0, g1 * s1);
  }

  template <typename>  // T, as gated_rows calls it
  Pair vec(const Pair& gate, const Pair& up) const {
    const fVec lim(limit);
    const fVec neg_lim(-limit);
    const fVec one(1.0f);
    Pair u{at::vec::clamp(std::get<0>(up), neg_lim, lim), at::vec::clamp(std::get<1>(up), neg_lim, lim)};
    if (!limit_is_t) {
      u = round_float<T>(std::get<0>(u), std::get<1>(u));
    }
    auto [u0, u1] = u;
    auto [glu0, glu1] = glu_table != nullptr ? looked_up_glu(gate) : glu(gate);
    auto [v0, v1] = round_float<T>(u0 + one, u1 + one);
    return {v0 * glu0, v1 * glu1};
  }
  template <typename>
  T scalar(T gate, T up) const {
    const auto r = [](float v) { return static_cast<float>(static_cast<T>(v)); };
    const float gf = static_cast<float>(gate);
    const float uf = static_cast<float>(up);
    const float g = r(std::isnan(gf) ? gf : std::min(gf, limit));
    const float u = r(std::isnan(uf) ? uf : std::min(std::max(uf, -limit), limit));
    const float glu = r(g * r(Sigmoid{}(r(g * alpha))));
    return static_cast<T>(r(u + 1.0f) * glu);
  }

 private:
  struct GluTag {};

  const T* make_glu_table() const {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (table16::kLooksUp<T>) {
      if (table16::tables_enabled()) {
        const uint64_t key = uint64_t{c10::bit_cast<uint32_t>(alpha)} << 32 | c10::bit_cast<uint32_t>(limit);
        return table16::keyed_table_of<T, GluTag>(key, [this](const fVec& g0, const fVec& g1) { return glu({g0, g1}); });
      }
    }
#endif
    return nullptr;
  }

  Pair looked_up_glu(const Pair& gate) const {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (table16::kLooksUp<T>) {
      return {table16::entry_float<T>(table16::gather_lanes(glu_table, std::get<0>(gate))),
              table16::entry_float<T>(table16::gather_lanes(glu_table, std::get<1>(gate)))};
    }
#endif
    return glu(gate);  // never: no table here
  }
};

// Gated ops whose activation, a function of the gate alone with no parameters and costly
// math, is looked up for 16-bit gates (table16.h) instead of computed.
template <typename Fn>
struct TabulatedAct : std::false_type {
  using Act = void;  // none
};
template <>
struct TabulatedAct<ActTimesUp<SiluFn>> : std::true_type {
  using Act = SiluFn;
};
template <bool kTanh>
struct TabulatedAct<ActTimesUp<GeluFn<kTanh>>> : std::true_type {
  using Act = GeluFn<kTanh>;
};

// ---------------------------------------------------------------------------------------
// the gated row loop

// Where a row's gate and up values are: the two halves (`gate_first`: gate in the first), or
// interleaved pairs (gate, up).
enum class Halves { kGateFirst, kUpFirst, kInterleaved };

// 2 kStep interleaved (gate, up) values from p, widened: gates 0..15, 16..31, ups 0..15, 16..31.
template <typename T>
std::tuple<fVec, fVec, fVec, fVec> load_interleaved(const T* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Each bf16 straight into the high half of its fp32 lane: one masked word permute per 16
    // lanes does the widening and the deinterleaving (widen, then deinterleave: two).
    const __m512i gate_words = _mm512_set_epi32(30 << 16, 28 << 16, 26 << 16, 24 << 16, 22 << 16, 20 << 16, 18 << 16,
                                                16 << 16, 14 << 16, 12 << 16, 10 << 16, 8 << 16, 6 << 16, 4 << 16,
                                                2 << 16, 0);
    const __m512i up_words = _mm512_add_epi32(gate_words, _mm512_set1_epi32(1 << 16));
    constexpr __mmask32 kHighWords = 0xAAAAAAAAu;
    const __m512i a = _mm512_loadu_si512(p);
    const __m512i b = _mm512_loadu_si512(p + kStep);
    const auto lanes = [&](const __m512i& words, const __m512i& v) {
      return fVec(_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, words, v)));
    };
    return {lanes(gate_words, a), lanes(gate_words, b), lanes(up_words, a), lanes(up_words, b)};
  }
#endif
  auto [a0, a1] = load_float(p);
  auto [b0, b1] = load_float(p + kStep);
  auto [g0, u0] = at::vec::deinterleave2(a0, a1);
  auto [g1, u1] = at::vec::deinterleave2(b0, b1);
  return {g0, g1, u0, u1};
}

template <typename T, Halves kLayout, typename Fn>
void gated_rows(const GatedArgs& a, const Fn& fn) {
  const T* input = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.out);
  const int64_t d = a.d;
  // Halves: native's vector form covers whole steps of two Vectorized<T> of each row, its
  // scalar form the rest. Interleaved: no native kernel to follow; the vector form covers
  // every whole step of ours.
  const int64_t body = kLayout == Halves::kInterleaved ? d - d % kStep : d - d % aten_step<T>();
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(d, 1));
  // The activation's table where it has one (halves layouts).
  const std::conditional_t<TabulatedAct<Fn>::value, act_vec::TableOf<T, typename TabulatedAct<Fn>::Act>,
                           std::false_type>
      table{};
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = input + a.input_rows.offset(r);
      const T* next = r + 1 < end ? input + a.input_rows.offset(r + 1) : nullptr;
      T* o = out + a.out_rows.offset(r);
      if constexpr (kLayout == Halves::kInterleaved) {
        int64_t i = 0;
        for (; i < body; i += kStep) {
          if (next != nullptr) {  // the next row's two steps
            float_vec::prefetch_step<false>(next + 2 * i);
            float_vec::prefetch_step<false>(next + 2 * i + kStep);
          }
          auto [g0, g1, u0, u1] = load_interleaved(row + 2 * i);
          auto [y0, y1] = fn.template vec<T>({g0, g1}, {u0, u1});
          store_float(o + i, y0, y1);
        }
        for (; i < d; ++i) {
          o[i] = fn.template scalar<T>(row[2 * i], row[2 * i + 1]);
        }
      } else {
        const T* gate = row + (kLayout == Halves::kGateFirst ? 0 : d);
        const T* up = row + (kLayout == Halves::kGateFirst ? d : 0);
        act_vec::gated_halves_row<T>(fn, table, gate, up, next, d, body, act_vec::StoreRow<T>{o});
      }
    }
  });
}

template <typename T>
void gated_kernel_for(const GatedArgs& a) {
  switch (a.kind) {
    case GatedKind::kSiluAndMul:
      return gated_rows<T, Halves::kGateFirst>(a, ActTimesUp<SiluFn>{});
    case GatedKind::kMulAndSilu:
      return gated_rows<T, Halves::kUpFirst>(a, ActTimesUp<SiluFn>{});
    case GatedKind::kGeluAndMul:
      return gated_rows<T, Halves::kGateFirst>(a, ActTimesUp<GeluFn<false>>{});
    case GatedKind::kGeluTanhAndMul:
      return gated_rows<T, Halves::kGateFirst>(a, ActTimesUp<GeluFn<true>>{});
    case GatedKind::kFatreluAndMul:
      return gated_rows<T, Halves::kGateFirst>(a, ActTimesUp<FatreluFn>{FatreluFn{a.p0}});
    case GatedKind::kSwigluoaiAndMul:
      return gated_rows<T, Halves::kInterleaved>(a, SwigluOai<T>{a.p0, a.p1});
  }
}

void gated_kernel(const GatedArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c gated activation (cpu)", [&] { gated_kernel_for<scalar_t>(a); });
}

// ---------------------------------------------------------------------------------------
// gelu_and_mul_sparse: per row, the gate's population std in double (as ATen's std computes
// it: Welford in double, then rounded to float and to T), the cutoff from native's mean (the
// torch side runs ATen's, whose fp32 summation order decides the rounding), then one pass:
// round(gate - cutoff), relu, gelu rounded to T (looked up for 16-bit T with AVX512: the same
// table as gelu_and_mul's), times up. The vector form covers every element (a partial step
// for a row's remainder): native's gelu runs on a contiguous [rows, d] tensor, flattened.

// The sum of double(p[i]) - center over a row, and of its squares (`kSquares`), in double:
// kStep independent lanes (the compiler vectorizes the widening adds), then the lanes in order.
template <bool kSquares, typename T>
inline double row_sum_double(const T* p, int64_t n, double center) {
  alignas(64) float lanes[kStep];
  double acc[kStep] = {};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    auto [x0, x1] = load_float(p + i);
    x0.store(lanes);
    x1.store(lanes + fVec::size());
    for (int64_t k = 0; k < kStep; ++k) {
      const double v = static_cast<double>(lanes[k]) - center;
      acc[k] += kSquares ? v * v : v;
    }
  }
  double sum = 0.0;
  for (; i < n; ++i) {
    const double v = static_cast<double>(static_cast<float>(p[i])) - center;
    sum += kSquares ? v * v : v;
  }
  for (int64_t k = 0; k < kStep; ++k) {
    sum += acc[k];
  }
  return sum;
}

// torch.std(row, unbiased=False) as T would hold it: sqrt of the double variance (two passes:
// the mean, then squared deviations from it), rounded to float, then to T.
template <typename T>
inline float row_std(const T* gate, int64_t d) {
  const double mean = row_sum_double<false>(gate, d, 0.0) / static_cast<double>(d);
  const double variance = row_sum_double<true>(gate, d, mean) / static_cast<double>(d);
  return static_cast<float>(static_cast<T>(static_cast<float>(std::sqrt(variance))));
}

template <typename T, bool kTanh>
void sparse_gelu_rows(const SparseGeluArgs& a) {
  const T* input = static_cast<const T*>(a.input);
  const T* means = static_cast<const T*>(a.means);
  T* out = static_cast<T*>(a.out);
  const int64_t d = a.d;
  const auto r = [](float v) { return static_cast<float>(static_cast<T>(v)); };  // a rounding to T
  const act_vec::TableOf<T, GeluFn<kTanh>> table{};
  const GeluFn<kTanh> gelu{};
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(d, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = input + a.input_rows.offset(row);
      const T* up = gate + d;
      T* o = out + a.out_rows.offset(row);
      const float cutoff = r(static_cast<float>(means[row]) + r(row_std(gate, d) * a.std_multiplier));
      const fVec c(cutoff);
      const fVec zero(0.0f);
      const auto step = [&](const Pair& g, const Pair& u) -> Pair {
        auto [s0, s1] = round_float<T>(std::get<0>(g) - c, std::get<1>(g) - c);
        s0 = at::vec::clamp_min(s0, zero);  // relu; NaN stays NaN
        s1 = at::vec::clamp_min(s1, zero);
        Pair act;
        if constexpr (!std::is_same_v<decltype(table), const std::false_type>) {
          if (table) {
            act = table.values(s0, s1);
          } else {
            act = round_float<T>(gelu(s0), gelu(s1));
          }
        } else {
          act = round_float<T>(gelu(s0), gelu(s1));
        }
        return {std::get<0>(act) * std::get<0>(u), std::get<1>(act) * std::get<1>(u)};
      };
      const auto sparse_gate = [&](const Pair& g) -> Pair {
        auto [s0, s1] = round_float<T>(std::get<0>(g) - c, std::get<1>(g) - c);
        return {at::vec::clamp_min(s0, zero), at::vec::clamp_min(s1, zero)};  // relu; NaN stays NaN
      };
      int64_t i = 0;
      if (a.gate_only) {
        for (; i + kStep <= d; i += kStep) {
          auto [y0, y1] = sparse_gate(load_float(gate + i));
          store_float(o + i, y0, y1);
        }
        if (i < d) {
          auto [y0, y1] = sparse_gate(load_float(gate + i, d - i));
          store_float(o + i, y0, y1, d - i);
        }
        continue;
      }
      for (; i + kStep <= d; i += kStep) {
        auto [y0, y1] = step(load_float(gate + i), load_float(up + i));
        store_float(o + i, y0, y1);
      }
      if (i < d) {
        auto [y0, y1] = step(load_float(gate + i, d - i), load_float(up + i, d - i));
        store_float(o + i, y0, y1, d - i);
      }
    }
  });
}

void sparse_gelu_kernel(const SparseGeluArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c gelu_and_mul_sparse (cpu)", [&] {
    if (a.tanh) {
      sparse_gelu_rows<scalar_t, true>(a);
    } else {
      sparse_gelu_rows<scalar_t, false>(a);
    }
  });
}

// ---------------------------------------------------------------------------------------
// elementwise activations. quick_gelu and relu2: fp32 math on x, rounded once by the store;
// gelu_new and gelu_fast: vLLM's forward_native expressions op for op, each step rounded to
// x's dtype (for fp32 x, their fp32 math). Every element runs the vector form (a partial
// step for the remainder), so an element's bits never depend on its position or the tensor's
// size: the kernels are batch-invariant. For 16-bit x, gelu_new and gelu_fast give native's
// bits (every bf16 and fp16 value is tested); fp32 results and quick_gelu are within the
// ops' tolerances: native's torch.tanh is MKL's vsTanh in x86 builds, and torch.sigmoid runs
// its scalar form on each parallel chunk's remainder.
//
// fp32 tanh GELUs use 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + exp(-2u)): one exp and
// one division instead of Sleef's tanh (which made them compute-bound at a third of copy_'s
// bandwidth), with u computed as native computes it; within a few fp32 ulp of native.

const float kSqrt2OverPi = static_cast<float>(std::sqrt(2.0 / M_PI));

template <typename Exp>
inline fVec x_sigmoid_2u(const fVec& x, const fVec& u, const Exp& exp) {
  return x / (fVec(1.0f) + exp(u * fVec(-2.0f)));
}

// v rounded to T, for each of two fp32 vectors (T = float: as is).
template <typename T>
inline Pair rounded(const fVec& a, const fVec& b) {
  return round_float<T>(a, b);
}

// The steps of 0.5 * x * (1 + tanh(u)) after u, rounded to T as native's ops round them.
template <typename T>
inline Pair half_x_one_plus_tanh(const Pair& x, const Pair& u) {
  const fVec one(1.0f);
  const fVec half(0.5f);
  auto [t0, t1] = rounded<T>(std::get<0>(u).tanh(), std::get<1>(u).tanh());
  auto [g0, g1] = rounded<T>(one + t0, one + t1);
  auto [h0, h1] = rounded<T>(half * std::get<0>(x), half * std::get<1>(x));
  return {h0 * g0, h1 * g1};  // rounded by the store (or the table)
}

// vLLM's NewGELU: 0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3.0)))), c = sqrt(2/pi) (a
// float32 scalar, as every scalar of the expression). pow(x, 3.0) is ATen's: bf16 rounds x * x
// and then its product with x; fp16 takes powf's cube, rounded once.
template <typename T>
struct GeluNew {
  Pair operator()(const fVec& x0, const fVec& x1) const {
    if constexpr (std::is_same_v<T, float>) {
      const auto u = [](const fVec& x) { return fVec(kSqrt2OverPi) * (x + fVec(kGeluKappa) * (x * x * x)); };
      return {x_sigmoid_2u(x0, u(x0), act_vec::AtenExp{}), x_sigmoid_2u(x1, u(x1), act_vec::AtenExp{})};
    } else {
      Pair cube;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        auto [s0, s1] = rounded<T>(x0 * x0, x1 * x1);
        cube = rounded<T>(s0 * x0, s1 * x1);
      } else {
        cube = rounded<T>(x0 * x0 * x0, x1 * x1 * x1);
      }
      auto [k0, k1] = rounded<T>(fVec(kGeluKappa) * std::get<0>(cube), fVec(kGeluKappa) * std::get<1>(cube));
      auto [s0, s1] = rounded<T>(x0 + k0, x1 + k1);
      return half_x_one_plus_tanh<T>({x0, x1}, rounded<T>(fVec(kSqrt2OverPi) * s0, fVec(kSqrt2OverPi) * s1));
    }
  }
};

// vLLM's FastGELU: 0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x))).
template <typename T>
struct GeluFast {
  Pair operator()(const fVec& x0, const fVec& x1) const {
    const fVec c(static_cast<float>(0.7978845608));
    const fVec one(1.0f);
    if constexpr (std::is_same_v<T, float>) {
      const auto u = [&](const fVec& x) { return x * c * (one + fVec(kGeluKappa) * x * x); };
      return {x_sigmoid_2u(x0, u(x0), act_vec::AtenExp{}), x_sigmoid_2u(x1, u(x1), act_vec::AtenExp{})};
    } else {
      auto [a0, a1] = rounded<T>(x0 * c, x1 * c);
      auto [b0, b1] = rounded<T>(fVec(kGeluKappa) * x0, fVec(kGeluKappa) * x1);
      auto [q0, q1] = rounded<T>(b0 * x0, b1 * x1);
      auto [e0, e1] = rounded<T>(one + q0, one + q1);
      return half_x_one_plus_tanh<T>({x0, x1}, rounded<T>(a0 * e0, a1 * e1));
    }
  }
};

// x sigmoid(1.702 x). math(x, exp) with ATen's exp is the vector form; with AVX512, bf16 table
// values are computed by it with act_vec::exp_fast (act_vec.h; table16::Reader checks them
// against the table once) for |x| below `kFastBelow` (bf16 bits), where e^z stays in range.
// (The step-rounded tanh GELUs have no computed form: eight roundings and a tanh per step
// cost more than the gathers on every CPU measured, so their 16-bit steps are looked up.)
struct QuickGelu {
  template <typename Exp>
  static fVec math(const fVec& x, const Exp& exp) {
    return x * (fVec(1.0f) + exp((fVec(static_cast<float>(1.702)) * x).neg())).reciprocal();
  }
  static constexpr uint16_t kFastBelow = 0x4200;  // 32
  fVec operator()(const fVec& x) const {
    return math(x, act_vec::AtenExp{});
  }
#if defined(CPU_CAPABILITY_AVX512)
  static bool table_values(const c10::BFloat16* x, fVec& a0, fVec& a1) {
    return act_vec::table_values_by(x, kFastBelow, [](const fVec& v) { return math(v, act_vec::FastExp{}); }, a0, a1);
  }
#endif
};

// relu(x)^2; NaN stays NaN.
struct Relu2 {
  fVec operator()(const fVec& x) const {
    const fVec r = at::vec::clamp_min(x, fVec(0.0f));
    return r * r;
  }
};

// Elementwise ops looked up for 16-bit inputs (table16.h); relu2 is cheaper computed.
template <typename Fn>
constexpr bool kTabulated = !std::is_same_v<Fn, Relu2>;

// fn on one step: its two-vector form (the step-rounded GELUs) or its form on each vector.
template <typename Fn>
inline Pair apply_step(const Fn& fn, const fVec& x0, const fVec& x1) {
  if constexpr (std::is_invocable_v<const Fn&, const fVec&, const fVec&>) {
    return fn(x0, x1);
  } else {
    return {fn(x0), fn(x1)};
  }
}

template <typename T, typename Fn>
void elementwise_flat(const ElementwiseArgs& a, const Fn& fn) {
  const T* input = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.out);
#if defined(CPU_CAPABILITY_AVX512)
  // Relu2 has no table (std::false_type: never read).
  const std::conditional_t<kTabulated<Fn>, table16::Reader<T, Fn>, std::false_type> table{};
#endif
  // Chunks of whole steps: only the last chunk has a partial one.
  const int64_t grain = (kMinElementsPerTask + kStep - 1) / kStep;
  at::parallel_for(0, (a.n + kStep - 1) / kStep, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * kStep; i < std::min(end * kStep, a.n); i += kStep) {
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (table16::kLooksUp<T> && kTabulated<Fn>) {
        if (table && C10_LIKELY(i + kStep <= a.n)) {
          table.store(input + i, out + i);
          continue;
        }
      }
#endif
      if (C10_LIKELY(i + kStep <= a.n)) {
        auto [x0, x1] = load_float(input + i);
        auto [y0, y1] = apply_step(fn, x0, x1);
        store_float(out + i, y0, y1);
      } else {
        auto [x0, x1] = load_float(input + i, a.n - i);
        auto [y0, y1] = apply_step(fn, x0, x1);
        store_float(out + i, y0, y1, a.n - i);
      }
    }
  });
}

template <typename T>
void elementwise_kernel_for(const ElementwiseArgs& a) {
  switch (a.kind) {
    case ElementwiseKind::kGeluNew:
      return elementwise_flat<T>(a, GeluNew<T>{});
    case ElementwiseKind::kGeluFast:
      return elementwise_flat<T>(a, GeluFast<T>{});
    case ElementwiseKind::kQuickGelu:
      return elementwise_flat<T>(a, QuickGelu{});
    case ElementwiseKind::kRelu2:
      return elementwise_flat<T>(a, Relu2{});
  }
}

void elementwise_kernel(const ElementwiseArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c elementwise activation (cpu)",
                                    [&] { elementwise_kernel_for<scalar_t>(a); });
}

}  // namespace
}  // namespace CPU_CAPABILITY

VLLM_IR_C_REGISTER_DISPATCH(gated_activation_stub, &CPU_CAPABILITY::gated_kernel);
VLLM_IR_C_REGISTER_DISPATCH(elementwise_activation_stub, &CPU_CAPABILITY::elementwise_kernel);
VLLM_IR_C_REGISTER_DISPATCH(sparse_gelu_stub, &CPU_CAPABILITY::sparse_gelu_kernel);

}  // namespace vllm_ir_c

// ---------------------------------------------------------------------------------------
// torch side: schemas and CPU implementations (the DEFAULT compilation only)

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <string>

namespace vllm_ir_c {
namespace {

void gated_cpu(const char* op, at::Tensor& out, const at::Tensor& input, GatedKind kind, double p0 = 0.0,
               double p1 = 0.0) {
  run_gated(op, out, input, kind, p0, p1, gated_activation_stub);
}

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  gated_cpu("vllm_ir_c::silu_and_mul", out, input, GatedKind::kSiluAndMul);
}

void mul_and_silu_cpu(at::Tensor& out, const at::Tensor& input) {
  gated_cpu("vllm_ir_c::mul_and_silu", out, input, GatedKind::kMulAndSilu);
}

void gelu_and_mul_cpu(at::Tensor& out, const at::Tensor& input, const std::string& approximate) {
  constexpr const char* op = "vllm_ir_c::gelu_and_mul";
  gated_cpu(op, out, input, gelu_kind(op, approximate));
}

void fatrelu_and_mul_cpu(at::Tensor& out, const at::Tensor& input, double threshold) {
  gated_cpu("vllm_ir_c::fatrelu_and_mul", out, input, GatedKind::kFatreluAndMul, threshold);
}

void swigluoai_and_mul_cpu(at::Tensor& out, const at::Tensor& input, double alpha, double limit) {
  gated_cpu("vllm_ir_c::swigluoai_and_mul", out, input, GatedKind::kSwigluoaiAndMul, alpha, limit);
}

// The row means come from ATen's own mean over the gate as the caller gave it (the layout
// native reduces): its fp32 summation order decides their rounding to x's dtype.
//
// Native's F.gelu runs on the sparse gate, a fresh contiguous tensor: there ATen takes oneDNN's
// gelu for the erf form (fp32, and bf16 where oneDNN has bf16; its own polynomial, not ATen's
// erf: 683 of 1000 N(0, 1) fp32 values and 661 of the 65536 bf16 values differ from ATen's
// kernel), and for fp32 its elementwise loop computes the last elements of each thread's chunk
// in scalar form (std::tanh for the tanh form). Neither is a function of one value that a
// table or our vector form can give for every shape, so those calls (every erf call, every
// fp32 call) write the sparse gate in x's dtype and run ATen's own gelu on it, in place, then
// multiply by up as native does: native's bits by construction, one pass over the gate and two
// over the product more than the fused kernel. 16-bit tanh calls keep the fused kernel (table
// values of ATen's vector form): native's bits except where ATen's scalar form, on the last
// (chunk length mod 2 vectors) elements of each thread's chunk of the flattened gate, rounds
// differently, which it does for 4 of the 65536 bf16 values and 26 fp16 ones
// (tests/test_provider_vllm_c.py counts them).
void gelu_and_mul_sparse_cpu(at::Tensor& out, const at::Tensor& input, double std_multiplier,
                             const std::string& approximate) {
  const auto means = [&](const at::Tensor&) {
    return at::mean(input.narrow(-1, 0, input.size(-1) / 2), {-1}).contiguous();
  };
  if (approximate == "tanh" && input.scalar_type() != at::kFloat) {
    run_sparse_gelu(out, input, std_multiplier, approximate, means, sparse_gelu_stub);
    return;
  }
  at::Tensor sparse_gate = at::empty(out.sizes(), out.options().memory_format(at::MemoryFormat::Contiguous));
  const auto gate_only = [](SparseGeluArgs args) {
    args.gate_only = true;
    sparse_gelu_stub(args);
  };
  run_sparse_gelu(sparse_gate, input, std_multiplier, approximate, means, gate_only);
  if (out.numel() == 0) {
    return;
  }
  at::gelu_(sparse_gate, approximate);
  const int64_t d = input.size(-1) / 2;
  at::mul_out(out, sparse_gate, input.narrow(-1, d, d));
}

// What table16::Reader does on this machine (doctor, providers list): fixed per process.
std::string table_path() {
  const CpuCapability capability = cpu_capability_in_use();
  if (capability < CpuCapability::AVX512) {
    return std::string("none: the ") + cpu_capability_name(capability) +
           " kernels compute every element (the tables need AVX512)";
  }
  return CPU_CAPABILITY::table16::path_description();
}

#define VLLM_IR_C_ELEMENTWISE_CPU(name, kind)                                          \
  void name##_cpu(at::Tensor& out, const at::Tensor& input) {                          \
    run_elementwise("vllm_ir_c::" #name, out, input, kind, elementwise_activation_stub); \
  }
VLLM_IR_C_ELEMENTWISE_CPU(gelu_new, ElementwiseKind::kGeluNew)
VLLM_IR_C_ELEMENTWISE_CPU(gelu_fast, ElementwiseKind::kGeluFast)
VLLM_IR_C_ELEMENTWISE_CPU(quick_gelu, ElementwiseKind::kQuickGelu)
VLLM_IR_C_ELEMENTWISE_CPU(relu2, ElementwiseKind::kRelu2)
#undef VLLM_IR_C_ELEMENTWISE_CPU

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  // Gated: out [..., d] <- act(input[..., :d]) * input[..., d:] (swigluoai: interleaved halves).
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("mul_and_silu(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_and_mul(Tensor(a!) out, Tensor input, str approximate='none') -> ()");
  m.def("fatrelu_and_mul(Tensor(a!) out, Tensor input, float threshold=0.0) -> ()");
  m.def("swigluoai_and_mul(Tensor(a!) out, Tensor input, float alpha=1.702, float limit=7.0) -> ()");
  m.def("gelu_and_mul_sparse(Tensor(a!) out, Tensor input, float std_multiplier, str approximate='none') -> ()");
  // How the 16-bit activation tables are read here ("lookup: ...", "computed: ...", "none: ...").
  m.def("table_path() -> str", &vllm_ir_c::table_path);
  // Elementwise: out <- f(input), same shape.
  m.def("gelu_new(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_fast(Tensor(a!) out, Tensor input) -> ()");
  m.def("quick_gelu(Tensor(a!) out, Tensor input) -> ()");
  m.def("relu2(Tensor(a!) out, Tensor input) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("silu_and_mul", &vllm_ir_c::silu_and_mul_cpu);
  m.impl("mul_and_silu", &vllm_ir_c::mul_and_silu_cpu);
  m.impl("gelu_and_mul", &vllm_ir_c::gelu_and_mul_cpu);
  m.impl("fatrelu_and_mul", &vllm_ir_c::fatrelu_and_mul_cpu);
  m.impl("swigluoai_and_mul", &vllm_ir_c::swigluoai_and_mul_cpu);
  m.impl("gelu_and_mul_sparse", &vllm_ir_c::gelu_and_mul_sparse_cpu);
  m.impl("gelu_new", &vllm_ir_c::gelu_new_cpu);
  m.impl("gelu_fast", &vllm_ir_c::gelu_fast_cpu);
  m.impl("quick_gelu", &vllm_ir_c::quick_gelu_cpu);
  m.impl("relu2", &vllm_ir_c::relu2_cpu);
}

#endif  // VLLM_IR_C_TORCH_SIDE
