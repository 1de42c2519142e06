// Tables of a function over every value of a 16-bit float type (bf16, fp16), for the
// per-capability CPU kernels: an activation whose fp32 math costs tens of vector instructions
// per element (exp, erf, a division) is, for 16-bit inputs, a pure function of 65536 values.
// Its table is built once per process, by the same vector code the kernels run, so looking an
// element up gives the bits computing it would (a 128 KiB table: the hot binades stay in L1).
//
// Lookups use AVX512 gathers (32-bit lanes reading each entry's 2 bytes plus the next two,
// hence the padding); other capabilities compute.
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "float_vec.h"

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace table16 {

using float_vec::fVec;
using float_vec::kStep;

// VLLM_IR_C_TABLES, read once (a switch for sites and for differential tests and
// measurements, which compare the paths): "0" makes kernels compute every element, here and
// in fp8_vec.h's FP8 encoding tables; "lookup" makes Reader look every step up (no computed
// table values); "computed" makes it compute every step it can vouch for; "measure" makes it
// time both once per function and process and take the faster (not reproducible between
// processes: a diagnostic). Unset (or "1"): Reader's path is fixed per machine, by CPU vendor
// (computed_by_default below).
inline std::string_view tables_setting() {
  static const std::string_view setting = [] {
    const char* v = std::getenv("VLLM_IR_C_TABLES");
    return std::string_view(v == nullptr ? "1" : v);
  }();
  return setting;
}

// The CPU's vendor string (CPUID leaf 0: "AuthenticAMD", "GenuineIntel"), or "" off x86.
inline std::string cpu_vendor() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int eax = 0;
  unsigned int ebx = 0;
  unsigned int ecx = 0;
  unsigned int edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) {
    return "";
  }
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return vendor;
#else
  return "";
#endif
}

// Whether Reader computes table values (where it can vouch for them) with no setting: on AMD
// CPUs, whose AVX512 gathers are slow (Zen 4: silu's computed step ~0.7x the cycles of its two
// gathers, 18 vs 26 per 32 lanes), not elsewhere (an Intel Xeon of the Emerald Rapids
// generation: ~2x, its gathers are cheap). Fixed per machine, so every process reads the same
// way; the bits are the same either way.
inline bool computed_by_default() {
  static const bool computed = cpu_vendor() == "AuthenticAMD";
  return computed;
}

// What Reader does with the tables of functions that have a computed form, and why: one line
// for `vllm_ir_provider_vllm_c.table_path()` (doctor, providers list).
inline std::string path_description() {
  const std::string_view setting = tables_setting();
  if (setting == "0") {
    return "off: every element computed (VLLM_IR_C_TABLES=0)";
  }
  if (setting == "lookup" || setting == "computed") {
    return std::string(setting) + ": VLLM_IR_C_TABLES=" + std::string(setting);
  }
  if (setting == "measure") {
    return "measure: the faster path per function, timed once per process (VLLM_IR_C_TABLES=measure)";
  }
  const std::string vendor = cpu_vendor();
  const std::string who = vendor.empty() ? "this CPU" : vendor;
  return computed_by_default()
             ? "computed: " + who + " (AMD's AVX512 gathers are slow: computing measured ~1.45x faster on Zen 4)"
             : "lookup: " + who + " (gathers measured ~2x faster than computing on an Intel Xeon)";
}

inline bool tables_enabled() {
  return tables_setting() != "0";
}

// Whether kernels for T may look values up here rather than compute them.
template <typename T>
constexpr bool kLooksUp =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
#else
    false;
#endif

// A table's entries: t[v] = f(x0, x1) (one step: fp32 lanes holding T values, two fp32
// vectors back) rounded to T by store_float, for every bit pattern v of T; what the vector
// path stores for v. 65536 entries and the padding that gathers read past the last.
template <typename T>
std::vector<T> tabulate(const std::function<std::tuple<fVec, fVec>(const fVec&, const fVec&)>& f) {
  std::vector<T> t(65536 + kStep);  // gathers read 2 bytes past an entry
  alignas(64) uint16_t bits[kStep];
  for (int32_t base = 0; base < 65536; base += kStep) {
    for (int32_t j = 0; j < kStep; ++j) {
      bits[j] = static_cast<uint16_t>(base + j);
    }
    auto [x0, x1] = float_vec::load_float(reinterpret_cast<const T*>(bits));
    auto [y0, y1] = f(x0, x1);
    float_vec::store_float(t.data() + base, y0, y1);
  }
  return t;
}

// Fn{}'s table, built on first use (thread-safe), kept for the process. Fn maps one fp32
// vector, or a step's two at once (a function that rounds to T between its steps).
template <typename T, typename Fn>
const T* table_of() {
  static const std::vector<T> table = tabulate<T>([fn = Fn{}](const fVec& x0, const fVec& x1) {
    if constexpr (std::is_invocable_v<const Fn&, const fVec&, const fVec&>) {
      return std::tuple<fVec, fVec>(fn(x0, x1));
    } else {
      return std::tuple<fVec, fVec>{fn(x0), fn(x1)};
    }
  });
  return table.data();
}

// The table of a function with parameters (swigluoai's alpha and limit), one per `key` (the
// parameters' bits) and per Tag: built by tabulate<T>(f) on the key's first use, kept for the
// process. Null once kMaxKeyedTables keys have tables (128 KiB each; a model has one or two):
// the caller then computes.
constexpr size_t kMaxKeyedTables = 16;
template <typename T, typename Tag>
const T* keyed_table_of(uint64_t key, const std::function<std::tuple<fVec, fVec>(const fVec&, const fVec&)>& f) {
  static std::mutex mutex;
  static std::map<uint64_t, std::vector<T>> tables;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = tables.find(key);
  if (it == tables.end()) {
    if (tables.size() >= kMaxKeyedTables) {
      return nullptr;
    }
    it = tables.emplace(key, tabulate<T>(f)).first;
  }
  return it->second.data();
}

#if defined(CPU_CAPABILITY_AVX512)
// The entries for x[0:32], as 32-bit lanes whose low halves hold them (elements 0..15, 16..31).
template <typename T>
inline std::tuple<__m512i, __m512i> gather(const T* table, const T* x) {
  const __m512i w = _mm512_loadu_si512(x);
  const __m512i i0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(w));
  const __m512i i1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1));
  return {_mm512_i32gather_epi32(i0, table, 2), _mm512_i32gather_epi32(i1, table, 2)};
}

// A gathered entry (the low half of a 32-bit lane) widened to fp32.
template <typename T>
inline fVec entry_float(const __m512i& e) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(e));
  }
}

// table[x[0:32]] widened to two fp32 vectors (one kStep, as load_float gives it).
template <typename T>
inline std::tuple<fVec, fVec> lookup_float(const T* table, const T* x) {
  auto [e0, e1] = gather(table, x);
  return {entry_float<T>(e0), entry_float<T>(e1)};
}

// out[0:32] = table[x[0:32]].
template <typename T>
inline void lookup_store(const T* table, const T* x, T* out) {
  auto [e0, e1] = gather(table, x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(e0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm512_cvtepi32_epi16(e1));
}

// Reads table_of<T, Fn>() for steps of kStep inputs, given in memory (`operator()`, `store`) or
// as fp32 lanes holding T values (`values`). Where Fn has a computed form of the table's bf16
// values and this machine computes (computed_by_default: by CPU vendor; or VLLM_IR_C_TABLES),
// steps are computed and only the declined ones looked up; otherwise every step is looked up.
// Either way the same bits. The computed forms, each false for a step it cannot vouch for:
//   `static bool table_values(const BFloat16* x, fVec& a0, fVec& a1)` for inputs in memory,
//   `static bool lane_values(const fVec& x0, const fVec& x1, fVec& a0, fVec& a1)` for lanes;
// each must give the table's bits for every bf16 it accepts (checked once per process, each
// value alone in a step, before any is used).
template <typename Fn, typename = void>
struct HasTableValues : std::false_type {};
template <typename Fn>
struct HasTableValues<Fn, std::void_t<decltype(&Fn::table_values)>> : std::true_type {};
template <typename Fn, typename = void>
struct HasLaneValues : std::false_type {};
template <typename Fn>
struct HasLaneValues<Fn, std::void_t<decltype(&Fn::lane_values)>> : std::true_type {};

// Whether every computed form Fn has gives the table's bits for every bf16 value it accepts.
template <typename T, typename Fn>
bool computed_values_agree() {
  static const bool agree = [] {
    const T* table = table_of<T, Fn>();
    alignas(64) uint16_t bits[kStep];
    const auto matches = [&](int32_t v, const fVec& a0, const fVec& a1) {
      alignas(64) uint32_t lanes[kStep];
      a0.store(lanes);
      a1.store(lanes + fVec::size());
      return std::all_of(lanes, lanes + kStep,
                         [&](uint32_t lane) { return lane == static_cast<uint32_t>(table[v].x) << 16; });
    };
    for (int32_t v = 0; v < 65536; ++v) {
      std::fill(bits, bits + kStep, static_cast<uint16_t>(v));
      const T* x = reinterpret_cast<const T*>(bits);
      fVec a0;
      fVec a1;
      if constexpr (HasTableValues<Fn>::value) {
        if (Fn::table_values(x, a0, a1) && !matches(v, a0, a1)) {
          return false;
        }
      }
      if constexpr (HasLaneValues<Fn>::value) {
        auto [x0, x1] = float_vec::load_float(x);
        if (Fn::lane_values(x0, x1, a0, a1) && !matches(v, a0, a1)) {
          return false;
        }
      }
    }
    return true;
  }();
  return agree;
}

// table[x] for fp32 lanes x holding T values (16 lanes): the 32-bit lane whose low half holds it.
template <typename T>
inline __m512i gather_lanes(const T* table, const fVec& x) {
  __m512i index;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    index = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  } else {  // exact: x holds fp16 values
    index = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return _mm512_i32gather_epi32(index, table, 2);
}

template <typename T, typename Fn>
class Reader {
 public:
  Reader() {
    if constexpr (kLooksUp<T>) {
      if (tables_enabled()) {
        table_ = table_of<T, Fn>();
        if constexpr (kHasComputedForm) {
          computed_ = tables_setting() != "lookup" && computed_values_agree<T, Fn>() &&
                      (tables_setting() == "computed" ||
                       (tables_setting() == "measure" ? computing_is_faster() : computed_by_default()));
        }
      }
    }
  }

  // False when VLLM_IR_C_TABLES=0 or T is not 16-bit: the caller computes every element.
  explicit operator bool() const {
    return table_ != nullptr;
  }

  // table[x[0:32]] widened to two fp32 vectors.
  std::tuple<fVec, fVec> operator()(const T* x) const {
    if constexpr (std::is_same_v<T, c10::BFloat16> && HasTableValues<Fn>::value) {
      fVec a0;
      fVec a1;
      if (computed_ && Fn::table_values(x, a0, a1)) {
        return {a0, a1};
      }
    }
    return lookup_float(table_, x);
  }

  // table[x0, x1] for fp32 lanes holding T values (32 of them, as load_float gives them).
  std::tuple<fVec, fVec> values(const fVec& x0, const fVec& x1) const {
    if constexpr (std::is_same_v<T, c10::BFloat16> && HasLaneValues<Fn>::value) {
      fVec a0;
      fVec a1;
      if (computed_ && Fn::lane_values(x0, x1, a0, a1)) {
        return {a0, a1};
      }
    }
    return {entry_float<T>(gather_lanes(table_, x0)), entry_float<T>(gather_lanes(table_, x1))};
  }

  // out[0:32] = table[x[0:32]].
  void store(const T* x, T* out) const {
    if constexpr (std::is_same_v<T, c10::BFloat16> && HasTableValues<Fn>::value) {
      fVec a0;
      fVec a1;
      if (computed_ && Fn::table_values(x, a0, a1)) {
        // The values are bf16 already: their high halves, packed (no rounding, so no flushing).
        const __m512i high_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31,
                                                     29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(_mm512_castps_si512(a0), high_halves,
                                                           _mm512_castps_si512(a1)));
        return;
      }
    }
    lookup_store(table_, x, out);
  }

 private:
  static constexpr bool kHasComputedForm =
      std::is_same_v<T, c10::BFloat16> && (HasTableValues<Fn>::value || HasLaneValues<Fn>::value);

  // A reader of one path, for measuring it.
  explicit Reader(bool computed) : table_(table_of<T, Fn>()), computed_(computed) {}

  // VLLM_IR_C_TABLES=measure: whether computed steps (with their declined ones looked up)
  // take less time than looking every step up, on inputs spread like activations (bf16,
  // roughly normal, sd ~2): the best of five interleaved timings of each path, each 8 passes
  // over 4096 of them (~0.5 ms, once per function and process).
  static bool computing_is_faster() {
    static const bool faster = [] {
      constexpr int64_t kCount = 4096;
      alignas(64) T x[kCount];
      uint32_t state = 12345;
      for (auto& v : x) {
        float sum = 0.0f;
        for (int k = 0; k < 4; ++k) {  // the sum of four uniforms on [0, 1): sd 0.58
          state = state * 1664525u + 1013904223u;
          sum += static_cast<float>(state >> 8) * 0x1p-24f;
        }
        v = static_cast<T>((sum - 2.0f) * 3.5f);
      }
      volatile float kept = 0.0f;
      const auto seconds = [&](const Reader& reader) {
        fVec sink(0.0f);
        const auto start = std::chrono::steady_clock::now();
        for (int pass = 0; pass < 8; ++pass) {
          for (int64_t i = 0; i < kCount; i += kStep) {
            std::tuple<fVec, fVec> a;
            if constexpr (HasTableValues<Fn>::value) {
              a = reader(x + i);
            } else {
              auto [x0, x1] = float_vec::load_float(x + i);
              a = reader.values(x0, x1);
            }
            sink = sink + std::get<0>(a) + std::get<1>(a);
          }
        }
        alignas(64) float lanes[fVec::size()];
        sink.store(lanes);
        kept = lanes[0];  // the sums are live
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      };
      const Reader computing(true);
      const Reader looking_up(false);
      double computed = std::numeric_limits<double>::infinity();
      double looked_up = std::numeric_limits<double>::infinity();
      for (int round = 0; round < 5; ++round) {
        computed = std::min(computed, seconds(computing));
        looked_up = std::min(looked_up, seconds(looking_up));
      }
      return computed < looked_up;
    }();
    return faster;
  }

  const T* table_ = nullptr;
  bool computed_ = false;
};
#endif

}  // namespace table16
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
