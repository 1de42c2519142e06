// CPU RMSNorm kernels, one copy per CPU capability.
//
// rms_norm_kernels.cpp is compiled once per capability (setup.py passes -DCPU_CAPABILITY=<name>
// -DCPU_CAPABILITY_<name> and the ISA flags), exactly like ATen's native/cpu kernels; each copy
// lands in its own namespace and torch_bindings.cpp calls the one torch itself runs with.
// AVX512_BF16 is ours, not ATen's: AVX512 plus the bf16 conversion instructions, used when
// torch runs AVX512 kernels and the CPU has them.
#pragma once

#include "../rms_norm.h"

#define VLLM_IR_C_DECLARE_CPU_KERNELS(CAPABILITY)                     \
  namespace vllm_ir_c::CAPABILITY {                                   \
  void rms_norm_kernel(const RmsNormArgs& args);                      \
  void fused_add_rms_norm_kernel(const FusedAddRmsNormArgs& args);    \
  }

VLLM_IR_C_DECLARE_CPU_KERNELS(DEFAULT)
#ifdef VLLM_IR_C_HAVE_AVX2
VLLM_IR_C_DECLARE_CPU_KERNELS(AVX2)
#endif
#ifdef VLLM_IR_C_HAVE_AVX512
VLLM_IR_C_DECLARE_CPU_KERNELS(AVX512)
#endif
#ifdef VLLM_IR_C_HAVE_AVX512_BF16
VLLM_IR_C_DECLARE_CPU_KERNELS(AVX512_BF16)
#endif
