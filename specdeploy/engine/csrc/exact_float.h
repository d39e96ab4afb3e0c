// The floating-point mode both kernel files compute in, shared by cpu_kernels.cpp and int8_kernels.cpp.
#pragma once

#include <immintrin.h>

namespace specdeploy {

// Clears flush-to-zero and denormals-are-zero in MXCSR for the guard's lifetime (per thread), restoring them
// after: the FP8 decode makes f32 subnormals (E4M3 subnormals, and products of small values), and the int8 kernels'
// scales and products must stay exact IEEE f32, whatever mode the process runs in (torch.set_flush_denormal(True)
// sets both bits).
struct ExactFloatMode {
  static constexpr unsigned kFtzDaz = 0x8040;
  unsigned saved;
  ExactFloatMode() : saved(_mm_getcsr()) {
    if (saved & kFtzDaz) _mm_setcsr(saved & ~kFtzDaz);
  }
  ~ExactFloatMode() {
    if (saved & kFtzDaz) _mm_setcsr(saved);
  }
};

}  // namespace specdeploy
