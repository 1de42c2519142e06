// Per-CPU-capability kernel choice, one dispatch stub per kernel, after ATen's
// DECLARE_DISPATCH / REGISTER_DISPATCH (aten/src/ATen/native/DispatchStub.h).
//
// Every csrc/cpu/*.cpp is compiled once per CPU capability (setup.py passes
// -DCPU_CAPABILITY=<name> -DCPU_CAPABILITY_<vec> and the ISA flags, like ATen's native/cpu
// kernels): DEFAULT (baseline ISA), and on x86-64 AVX2, AVX512 and AVX512_BF16 (ours: AVX512
// plus the bf16 conversion instructions). An op file
//
//   namespace vllm_ir_c {
//   VLLM_IR_C_DECLARE_DISPATCH(void (*)(const MyArgs&), my_op_stub);   // every compilation
//   namespace CPU_CAPABILITY { void my_op_kernel(const MyArgs& a) { ... } }
//   VLLM_IR_C_REGISTER_DISPATCH(my_op_stub, &CPU_CAPABILITY::my_op_kernel);  // fills this capability's slot
//   }
//   #if VLLM_IR_C_TORCH_SIDE   // the DEFAULT compilation only
//   ... my_op_stub(args); ... TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL ...
//   #endif
//
// adds nothing to any shared file. Calling the stub runs the slot of the capability
// `cpu_capability_in_use()` names (torch_bindings.cpp: the best compiled variant torch itself
// runs here, capped by VLLM_IR_C_CPU_CAPABILITY), resolved once per stub.
//
// REGISTER defines one explicit specialization of a static data member with a constant
// initializer: no code runs at load time in the ISA-specific objects (ATen's Note [Do not
// compile initializers with AVX]). For the same reason those compilations stay free of the
// Tensor API: inline functions from its headers compiled with AVX flags could be picked by
// the linker for baseline code. Only the DEFAULT compilation calls stubs, and it reads the
// slots of exactly the capabilities that compiled (the VLLM_IR_C_HAVE_<capability> macros
// setup.py defines for it), so an ISA the compiler could not target is simply absent.
#pragma once

#include <type_traits>
#include <utility>

namespace vllm_ir_c {

// Ranked: each one can run the kernels of those before it.
enum class CpuCapability : int { DEFAULT = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

// The capability every stub runs; chosen once per process (torch_bindings.cpp).
CpuCapability cpu_capability_in_use();
const char* cpu_capability_name(CpuCapability capability);

template <typename FnPtr, typename Tag>
struct CpuDispatchStub;

template <typename Ret, typename... Args, typename Tag>
struct CpuDispatchStub<Ret (*)(Args...), Tag> {
  using FnPtr = Ret (*)(Args...);

  // One slot per capability; each is defined (VLLM_IR_C_REGISTER_DISPATCH) by the compilation
  // for that capability, and only read where that compilation exists.
  static FnPtr DEFAULT;
  static FnPtr AVX2;
  static FnPtr AVX512;
  static FnPtr AVX512_BF16;

  template <typename... A>
  Ret operator()(A&&... args) const {
    return get()(std::forward<A>(args)...);
  }

  // The kernel this process runs.
  static FnPtr get() {
    static const FnPtr fn = choose(cpu_capability_in_use());
    return fn;
  }

  // The most capable compiled slot not above `capability`.
  static FnPtr choose(CpuCapability capability) {
    [[maybe_unused]] const int rank = static_cast<int>(capability);
    FnPtr fn = DEFAULT;
#ifdef VLLM_IR_C_HAVE_AVX2
    if (rank >= static_cast<int>(CpuCapability::AVX2)) {
      fn = AVX2;
    }
#endif
#ifdef VLLM_IR_C_HAVE_AVX512
    if (rank >= static_cast<int>(CpuCapability::AVX512)) {
      fn = AVX512;
    }
#endif
#ifdef VLLM_IR_C_HAVE_AVX512_BF16
    if (rank >= static_cast<int>(CpuCapability::AVX512_BF16)) {
      fn = AVX512_BF16;
    }
#endif
    return fn;
  }
};

}  // namespace vllm_ir_c

// Declares stub `name` (an object; call it like the kernel) for kernels of type `fn_type`,
// at namespace vllm_ir_c scope, in every compilation of the op's file. The slots are declared
// as explicit specializations here (declarations: no initializer), so every compilation
// sees them before any use.
#define VLLM_IR_C_DECLARE_DISPATCH(fn_type, name)                              \
  struct name##_tag;                                                           \
  using name##_type = ::vllm_ir_c::CpuDispatchStub<fn_type, name##_tag>;      \
  template <>                                                                  \
  name##_type::FnPtr name##_type::DEFAULT;                                     \
  template <>                                                                  \
  name##_type::FnPtr name##_type::AVX2;                                        \
  template <>                                                                  \
  name##_type::FnPtr name##_type::AVX512;                                      \
  template <>                                                                  \
  name##_type::FnPtr name##_type::AVX512_BF16;                                 \
  [[maybe_unused]] inline constexpr name##_type name {}

// Fills this compilation's slot of stub `name` with `fn` (a constant: no load-time code), at
// namespace vllm_ir_c scope. CPU_CAPABILITY expands to the slot's name.
#define VLLM_IR_C_REGISTER_DISPATCH(name, fn)                                  \
  static_assert(std::is_same_v<decltype(fn), name##_type::FnPtr>,              \
                #fn " does not have the type " #name " was declared with");   \
  template <>                                                                  \
  name##_type::FnPtr name##_type::CPU_CAPABILITY = fn
