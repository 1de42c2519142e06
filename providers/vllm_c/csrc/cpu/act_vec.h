// Activation math shared by the per-capability CPU kernels (cpu/activation.cpp and the fused
// activation + quant kernel in cpu/fused_quant.cpp): ATen's vector and scalar forms (with
// AVX512, its exp and erf inlined), the split between them ATen's loops use, and the gated row
// built on them, so that every kernel built on these rounds like native.
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/Version.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>

#include "float_vec.h"
#include "table16.h"

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace act_vec {

using fVec = at::vec::Vectorized<float>;
using float_vec::kStep;

// ATen's vectorized loop runs its vector form while two Vectorized<T> fit (per row of a
// strided gate): the remainder, shorter than that, takes its scalar form. Two Vectorized<T>
// of the capability ATen itself runs at, which need not be this kernel's: a wheel built with
// fewer variants, VLLM_IR_C_CPU_CAPABILITY or ATEN_CPU_CAPABILITY make them differ (an AVX2
// kernel under AVX512 ATen once ran the vector form on rows of 16 floats that ATen computes
// in scalar form). A multiple of this kernel's step where ATen's vectors are the wider ones;
// else a kernel's last vector step may be partial.
template <typename T>
inline int64_t aten_step() {
  static const int64_t bytes = [] {
    const std::string aten = at::get_cpu_capability();
    if (aten == "AVX512") {
      return int64_t{64};
    }
#if defined(__x86_64__) || defined(_M_X64)
    return int64_t{32};  // ATen's AVX2 vectors and its generic ones (vec_base) below AVX512
#else
    return static_cast<int64_t>(sizeof(at::vec::Vectorized<float>));  // only DEFAULT is built here
#endif
  }();
  return 2 * bytes / static_cast<int64_t>(sizeof(T));
}

#if defined(CPU_CAPABILITY_AVX512)
// e^d bit for bit as ATen's AVX512 Vectorized<float>::exp computes it (Sleef_expf16_u10:
// rounding to q = rint(d / ln2), a two-part ln2 reduction, a degree-6 polynomial, a scaling
// by 2^q in two halves, 0 below -104 and inf above 100), inlined: a call into Sleef costs the
// call and the caller's vector registers around it. tests/test_provider_vllm_c.py compares
// the fp32 activations built on it with native over a sweep of every exponent.
inline fVec exp_sleef_u10(const fVec& z) {
  const __m512 d = z;
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  const auto pow2 = [](const __m512i& e) {  // 2^e for e in the normal range
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(0x7f)), 23));
  };
  const __m512i half = _mm512_srai_epi32(q, 1);
  u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(half)), pow2(_mm512_sub_epi32(q, half)));
  u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_US), u);
  return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OS),
                            _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// erf(x) bit for bit as ATen's AVX512 Vectorized<float>::erf computes it (Abramowitz and
// Stegun 7.1.26 with Sleef's exp), with the inlined exp.
inline fVec erf_aten(const fVec& x) {
  const __m512 v = x;
  const __m512 neg_zero = _mm512_set1_ps(-0.0f);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sign = _mm512_and_ps(neg_zero, v);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), _mm512_abs_ps(v), one));
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = exp_sleef_u10(_mm512_xor_ps(neg_zero, _mm512_mul_ps(v, v)));
  const __m512 one_minus = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_xor_ps(neg_zero, e), t), r, one);
  return _mm512_xor_ps(sign, one_minus);
}
#endif

// e^z as ATen's vector code computes it (Sleef; inlined with AVX512); exp_fast below is the
// cheaper one that computed table values use. The exp-based activations take either, so that
// the rest of their math is the same instructions both ways.
struct AtenExp {
  fVec operator()(const fVec& z) const {
#if defined(CPU_CAPABILITY_AVX512)
    return exp_sleef_u10(z);
#else
    return z.exp();
#endif
  }
};

template <typename Exp = AtenExp>
inline fVec silu(const fVec& x, const Exp& exp = {}) {
  return x / (fVec(1.0f) + exp(x.neg()));
}
inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

#if defined(CPU_CAPABILITY_AVX512)
// Computed table values (table16::Reader): the exp-based activations' fp32 math with a cheaper
// exp than ATen's (Sleef's), whose results are then within a few fp32 ulp of the vector form's,
// so both round to the same bf16 except near a rounding midpoint.

// e^z for |z| < 87: Cody-Waite reduction to |s| <= ln2 / 2 and a degree-6 Taylor polynomial
// (about 1 fp32 ulp).
inline fVec exp_fast(const fVec& z) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 s = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), z);  // z - n ln2, ln2 in two parts
  s = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), s);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// y rounded to bf16 (in fp32 lanes), exact for every lane whose value lies more than kMargin
// ulp from a rounding midpoint (there, rounding half up is rounding to nearest even); `near`
// flags the others, as the even 16-bit lanes of a mask.
inline fVec round_bf16_unless_near(const fVec& y, __mmask32& near) {
  constexpr int32_t kMargin = 8;
  // t's low half is y's plus 0x8000 + kMargin: at most 2 kMargin near a midpoint, and where it
  // is not, t carries into the high half exactly when y rounds up.
  const __m512i t = _mm512_add_epi32(_mm512_castps_si512(y), _mm512_set1_epi32(0x8000 + kMargin));
  near = _mm512_mask_cmple_epu16_mask(0x55555555u, t, _mm512_set1_epi16(2 * kMargin));
  return _mm512_castsi512_ps(_mm512_and_si512(t, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

struct FastExp {
  fVec operator()(const fVec& z) const {
    return exp_fast(z);
  }
};

// f(x0), f(x1) rounded to bf16 into a0, a1: false where a lane's value is near a rounding midpoint.
template <typename F>
inline bool rounded_unless_near(const fVec& x0, const fVec& x1, const F& f, fVec& a0, fVec& a1) {
  __mmask32 near0;
  __mmask32 near1;
  a0 = round_bf16_unless_near(f(x0), near0);
  a1 = round_bf16_unless_near(f(x1), near1);
  return (near0 | near1) == 0;
}

// A table's values for bf16 x[0:32] by `f` (fp32 math with exp_fast) into a0, a1: false where
// a lane's magnitude is not below `limit` (bf16 bits; inf and NaN never are) or its value is
// near a rounding midpoint.
template <typename F>
inline bool table_values_by(const c10::BFloat16* x, uint16_t limit, const F& f, fVec& a0, fVec& a1) {
  const __m512i w = _mm512_loadu_si512(x);
  const __mmask32 big = _mm512_cmpge_epu16_mask(_mm512_and_si512(w, _mm512_set1_epi16(0x7FFF)),
                                                _mm512_set1_epi16(static_cast<int16_t>(limit)));
  auto [x0, x1] = float_vec::widen<c10::BFloat16>(at::vec::Vectorized<c10::BFloat16>(w));
  return rounded_unless_near(x0, x1, f, a0, a1) && big == 0;
}

// The same for bf16 values in fp32 lanes (x0, x1).
template <typename F>
inline bool lane_values_by(const fVec& x0, const fVec& x1, uint16_t limit, const F& f, fVec& a0, fVec& a1) {
  const __m512 bound = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(uint32_t{limit} << 16)));
  const auto big = [&](const fVec& v) {  // |v| >= bound, or NaN
    return _mm512_cmp_ps_mask(_mm512_abs_ps(v), bound, _CMP_NLT_UQ);
  };
  return rounded_unless_near(x0, x1, f, a0, a1) && (big(x0) | big(x1)) == 0;
}
#endif

// silu as a functor, vector and scalar forms (one type for every kernel: table16's table of it
// is then one per process).
struct Silu {
  fVec operator()(const fVec& x) const {
    return silu(x);
  }
  float operator()(float x) const {
    return silu(x);
  }
#if defined(CPU_CAPABILITY_AVX512)
  // The table's values for x[0:32] (silu rounded to bf16), computed, for |x| < 64; false where
  // table16::Reader looks the step up. The Reader also checks, once, that this gives the
  // table's bits for every bf16 it accepts. About 1.45x fewer cycles than the two gathers of a
  // lookup (a C++ micro-benchmark: 18 vs 26 cycles per 32 lanes).
  static bool table_values(const c10::BFloat16* x, fVec& a0, fVec& a1) {
    return table_values_by(x, 0x4280, [](const fVec& v) { return silu(v, FastExp{}); }, a0, a1);
  }
#endif
};

// Asks for step i of a halves-layout gated row's gate and up (`row` and `row + d`; none when
// `row` is null). The gated steps are compute-bound (lookups or math): asking for the next row
// meanwhile made bf16 silu / gelu at [4096, 8192] ~7% faster and fatrelu ~25%.
template <typename T>
inline void prefetch_halves_step(const T* row, int64_t d, int64_t i) {
  if (row != nullptr) {
    float_vec::prefetch_step<false>(row + i);
    float_vec::prefetch_step<false>(row + d + i);
  }
}

// act(gate) rounded to T, times up (rounded to T by whoever stores it): a gated op's vector
// form, vec<T>, on one step (two fp32 vectors each way) and its scalar form, scalar<T>, on one
// element; both round where native does (F.silu and friends, then the product in x's dtype).
template <typename Act>
struct ActTimesUp {
  Act act;

  template <typename T>
  std::tuple<fVec, fVec> vec(const std::tuple<fVec, fVec>& gate, const std::tuple<fVec, fVec>& up) const {
    auto [a0, a1] = float_vec::round_float<T>(act(std::get<0>(gate)), act(std::get<1>(gate)));
    return {a0 * std::get<0>(up), a1 * std::get<1>(up)};
  }
  template <typename T>
  T scalar(T gate, T up) const {
    const T a = static_cast<T>(act(static_cast<float>(gate)));
    return static_cast<T>(static_cast<float>(a) * static_cast<float>(up));
  }
};

// act's table16 table for 16-bit T with AVX512 (see table16::Reader), else nothing.
template <typename T, typename Act>
#if defined(CPU_CAPABILITY_AVX512)
using TableOf = std::conditional_t<table16::kLooksUp<T>, table16::Reader<T, Act>, std::false_type>;
#else
using TableOf = std::false_type;
#endif

// Where a gated row's results go: `step` takes kStep of them (fp32 lanes to be rounded to T),
// `partial` the first `count`, `scalar` one element already in T.
template <typename T>
struct StoreRow {  // into a row of T (rounded by the store)
  T* out;
  void step(int64_t i, const fVec& y0, const fVec& y1) const {
    float_vec::store_float(out + i, y0, y1);
  }
  void partial(int64_t i, const fVec& y0, const fVec& y1, int64_t count) const {
    float_vec::store_float(out + i, y0, y1, count);
  }
  void scalar(int64_t i, T y) const {
    out[i] = y;
  }
};

template <typename T>
struct StoreRowFp32 {  // rounded to T, kept in fp32 (a row buffer for fp32 consumers)
  float* out;
  void step(int64_t i, const fVec& y0, const fVec& y1) const {
    auto [r0, r1] = float_vec::round_float<T>(y0, y1);
    r0.store(out + i);
    r1.store(out + i + fVec::size());
  }
  void partial(int64_t i, const fVec& y0, const fVec& y1, int64_t count) const {
    auto [r0, r1] = float_vec::round_float<T>(y0, y1);
    float_vec::store_float(out + i, r0, r1, count);
  }
  void scalar(int64_t i, T y) const {
    out[i] = static_cast<float>(y);
  }
};

// One row of a gated op whose gate and up are halves (`gate`, `up`, d elements each), as
// native computes it: `fn`'s vector form on whole steps of `body` (ATen's vector part of the
// row, see aten_step), a partial step where ATen's vectors are narrower than ours, its scalar
// form on the rest. `table` (TableOf<T, act>, may be unusable) looks the activation up on
// whole steps. Asks for the next row's steps meanwhile (`next`: its gate, or null).
template <typename T, typename Fn, typename Table, typename Sink>
inline void gated_halves_row(const Fn& fn, const Table& table, const T* gate, const T* up, const T* next, int64_t d,
                             int64_t body, const Sink& sink) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<Table, std::false_type>) {
    for (; table && i + kStep <= body; i += kStep) {
      prefetch_halves_step(next, d, i);
      auto [a0, a1] = table(gate + i);  // act(gate) rounded to T
      auto [u0, u1] = float_vec::load_float(up + i);
      sink.step(i, a0 * u0, a1 * u1);
    }
  }
  for (; i + kStep <= body; i += kStep) {
    prefetch_halves_step(next, d, i);
    auto [y0, y1] = fn.template vec<T>(float_vec::load_float(gate + i), float_vec::load_float(up + i));
    sink.step(i, y0, y1);
  }
  if (i < body) {  // ATen's vectors narrower than ours: the vector form on a partial step
    const int64_t count = body - i;
    auto [y0, y1] = fn.template vec<T>(float_vec::load_float(gate + i, count), float_vec::load_float(up + i, count));
    sink.partial(i, y0, y1, count);
    i = body;
  }
  for (; i < d; ++i) {
    sink.scalar(i, fn.template scalar<T>(gate[i], up[i]));
  }
}

}  // namespace act_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
