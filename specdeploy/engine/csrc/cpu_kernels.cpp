// Native kernels of the CPU engine for bf16 engines (see specdeploy/engine/native.py).
//
// A decode step of a small model is a chain of GEMVs (one activation row against each weight matrix)
// and a few row-wise ops, repeated per layer. torch runs each as several ops (conversions, scaling,
// quantization), so per-op overhead and a GEMV that reaches about half of the memory bandwidth bound
// the step. These kernels do one layer piece per call and stream each weight matrix once.
//
// Row invariance (what keeps greedy speculative output equal to target-only output): every output
// element (m, n) is reduced along K in the same order, with the same instructions, whatever the number
// of rows M and whichever block it falls in, and every row-wise op works on one row at a time. So a
// k+1-row verification pass gives the bits of k+1 one-row steps.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "exact_float.h"
#include "step_team.h"

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "specdeploy's native CPU kernels need AVX-512 or AVX2 with FMA (the engine falls back to torch ops without them)"
#endif

namespace specdeploy {
// csrc/int8_kernels.cpp: INT8 SmoothQuant on integer dot products (weight kind kInt8Sq, issue 25).
at::Tensor int8_sq_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t variant,
                          const std::optional<at::Tensor>& pre_quant_scale, double act_scale,
                          const std::optional<at::Tensor>& out_scale, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual);
std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, const std::optional<at::Tensor>& pre_quant_scale,
                                                 double act_scale);
}  // namespace specdeploy

namespace {

constexpr int64_t kChannelBlock = 4;  // output channels per packed block
constexpr int64_t kPrefetchBlocks = 1;  // how far ahead a tile prefetches (block_rows; 2 or 4 measured no better)
constexpr float kFp8Max = 448.0f;

enum WeightKind : int64_t { kBf16 = 0, kFp8 = 1, kInt8 = 2, kInt4 = 3, kInt8Sq = 4 };  // kInt8Sq: int8_kernels.cpp

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

using ::specdeploy::ExactFloatMode;  // exact_float.h: the FP8 decode's subnormals stay exact

// ---------------------------------------------------------------- vector primitives, one set per ISA
// Vec holds kLanes f32. Everything below the primitives is written once against them. Results differ
// between the two ISAs (16- versus 8-lane reductions), never between calls on one machine.

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // f32 lanes of a vector
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }

inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

inline __m512 load_bf16(const c10::BFloat16* p) {
  return bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// f32 -> bf16 bits, round to nearest even (as c10::BFloat16 for finite values).
inline __m256i f32_to_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline void store_bf16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16(v));
}

inline __m512 round_bf16(__m512 v) { return bf16_to_f32(f32_to_bf16(v)); }

inline Vec vround(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// e^x, 16 at a time: 2^round(x log2 e) times a degree-6 polynomial on the remainder (relative error ~2e-7).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  __m512 n = vround(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Sums of the 16 lanes of a, b, c and d, in one fixed tree (lane i + lane i+8, then i + i+4, i + i+2,
// i + i+1) for all of them. Every output element is reduced by this one function (a lone channel with
// zeros for the others), so its bits do not depend on the block it was computed in.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  __m512 v = _mm512_add_ps(u, _mm512_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  __m512 w = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w));
}

inline float hsum(Vec a) { return _mm_cvtss_f32(hsum4(a, vzero(), vzero(), vzero())); }
inline float vreduce(Vec a) { return _mm512_reduce_add_ps(a); }  // attention's dot products (heads of other sizes)

// The lane sums of kLanes vectors at once (attention's scores, kLanes keys a call): lane i of the result is the sum
// of a[kReduceSlot[i]]'s lanes only, in one fixed tree (256-bit halves, then 128-bit quarters, then pairs twice).
constexpr int kReduceSlot[kLanes] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
inline Vec reduce_lanes(const Vec* a) {
  Vec b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xee));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xdd));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x88), _mm512_shuffle_ps(c[i], c[i + 2], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

// Lanes [0, count) of p (count < kLanes: the rest 0), and the store of those lanes.
inline Vec vload_first(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(count >= kLanes ? 0xffff : static_cast<__mmask16>((1u << count) - 1), p);
}
inline Vec vkeep_first(Vec v, int64_t count) {
  return _mm512_maskz_mov_ps(count >= kLanes ? 0xffff : static_cast<__mmask16>((1u << count) - 1), v);
}
inline void vstore_first(float* p, Vec v, int64_t count) {
  _mm512_mask_storeu_ps(p, count >= kLanes ? 0xffff : static_cast<__mmask16>((1u << count) - 1), v);
}

// e4m3(v) for v in [-448, 448], round to nearest even, as torch's float -> float8_e4m3fn: normal values
// keep 3 mantissa bits (integer rounding on the f32 bits), subnormals (|v| < 2^-6) are multiples of 2^-9.
inline __m512 round_e4m3(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), lsb));
  __m512 normal = _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xfff00000u))));
  __m512 scaled = vround(_mm512_mul_ps(v, _mm512_set1_ps(512.0f)));
  __m512 subnormal = _mm512_mul_ps(scaled, _mm512_set1_ps(1.0f / 512.0f));
  __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(small, normal, subnormal);
}

#else  // AVX2 + FMA: 8 lanes
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

inline __m256 bf16_to_f32(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }

inline __m256 load_bf16(const c10::BFloat16* p) {
  return bf16_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// f32 -> bf16 bits, round to nearest even (as c10::BFloat16 for finite values).
inline __m128i f32_to_bf16(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  // values < 2^16 in each 32-bit lane: pack to 16 bits without saturation, then order the two halves.
  __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline void store_bf16(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16(v)); }

inline __m256 round_bf16(__m256 v) { return bf16_to_f32(f32_to_bf16(v)); }

inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// e^x, 8 at a time, as the AVX-512 version; 2^n built in the exponent field (n <= 127 after the clamp).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
  __m256 n = vround(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The sum of the 8 lanes in one fixed tree (lane i + lane i+4, then i + i+2, then i + i+1).
inline float hsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vreduce(Vec a) { return hsum(a); }

// As the AVX-512 version: lane i is the sum of a[kReduceSlot[i]]'s lanes (halves, then pairs twice).
constexpr int kReduceSlot[kLanes] = {0, 2, 1, 3, 4, 6, 5, 7};
inline Vec reduce_lanes(const Vec* a) {
  Vec b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[i], b[i + 2], 0x88), _mm256_shuffle_ps(b[i], b[i + 2], 0xdd));
  return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
}

inline __m256i first_mask(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, kLanes))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec vload_first(const float* p, int64_t count) { return _mm256_maskload_ps(p, first_mask(count)); }
inline Vec vkeep_first(Vec v, int64_t count) { return _mm256_and_ps(v, _mm256_castsi256_ps(first_mask(count))); }
inline void vstore_first(float* p, Vec v, int64_t count) { _mm256_maskstore_ps(p, first_mask(count), v); }

// e4m3(v) for v in [-448, 448], as the AVX-512 version.
inline __m256 round_e4m3(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), lsb));
  __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xfff00000u))));
  __m256 subnormal = _mm256_mul_ps(vround(_mm256_mul_ps(v, _mm256_set1_ps(512.0f))), _mm256_set1_ps(1.0f / 512.0f));
  __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m256 small = _mm256_cmp_ps(magnitude, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ);
  return _mm256_blendv_ps(normal, subnormal, small);
}
#endif

// Packed weights (`pack`): channels in blocks of kChannelBlock, the last N % kChannelBlock in blocks of one;
// within a block, for each step of kStep inputs, that step's chunk of each channel in turn. A thread then
// reads its part of the matrix front to back, which the hardware prefetchers follow (row-major [N, K] bf16 streams
// slower: every block jumps between rows only K elements long; docs/stages.md "Why native kernels").
//
// One policy per weight kind: kStep inputs per step (one vector), kChunk bytes per channel and step, the
// activation type it multiplies (f32 after the prologue, or bf16 as given), decode (operator(): one chunk to
// a vector) and madd: acc += x * w over one step.

#if defined(__AVX512BF16__) && defined(SPECDEPLOY_BF16_DPBF16)
// bf16 x bf16 with VDPBF16PS: 32 products per instruction, no conversion (native.bf16_kernel() == "dpbf16").
struct Bf16Weights {
  static constexpr int64_t kStep = 32, kChunk = 64;
  using Activation = c10::BFloat16;
  using XVec = __m512i;
  using WVec = __m512i;
  static XVec load_x(const Activation* x) { return _mm512_loadu_si512(x); }
  WVec operator()(const uint8_t* p, int64_t, int64_t) const { return _mm512_loadu_si512(p); }
  static __m512 madd(__m512 acc, XVec x, WVec w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
};
#elif defined(__AVX512F__)
// bf16 pairs split into f32 halves: a 32-bit lane holding bf16 weights (w[2j], w[2j+1]) is w[2j + 1]'s f32 once
// its low half is cleared and w[2j]'s once shifted left by 16, so 32 weights take two integer instructions to
// decode, shared by every row of the tile, then one FMA per 16 products and row. The activations are split the
// same way once per call (prologue_pairs: per step of 32, the 16 even then the 16 odd ones, exact in f32).
// Why not VDPBF16PS (32 products per instruction) on every AVX512-BF16 CPU: the Xeon issues it at a quarter of the
// FMA rate, so past ~2 rows, where the LM head's pass stops being memory-bound, it is the slower of the two there;
// on the AMD EPYC it is the faster (native.py BF16_ENV: the maker picks the build; docs/stages.md "Why native
// kernels").
struct Bf16Weights {
  static constexpr int64_t kStep = 2 * kLanes, kChunk = 4 * kLanes;
  using Activation = float;
  struct XVec {
    Vec even, odd;
  };
  using WVec = XVec;
  static XVec load_x(const Activation* x) { return {vload(x), vload(x + kLanes)}; }
  WVec operator()(const uint8_t* p, int64_t, int64_t) const { return split_pairs(_mm512_loadu_si512(p)); }
  static XVec split_pairs(__m512i pairs) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  // odd then even, as VDPBF16PS adds them (Intel SDM): bf16 products are exact in f32, so the sums round alike
  static Vec madd(Vec acc, XVec x, WVec w) { return vfmadd(x.even, w.even, vfmadd(x.odd, w.odd, acc)); }
};
#define SPECDEPLOY_BF16_PAIRS 1
#else
struct Bf16Weights {
  static constexpr int64_t kStep = kLanes, kChunk = 2 * kLanes;
  using Activation = float;
  using XVec = Vec;
  using WVec = Vec;
  static XVec load_x(const Activation* x) { return vload(x); }
  WVec operator()(const uint8_t* p, int64_t, int64_t) const { return load_bf16(reinterpret_cast<const c10::BFloat16*>(p)); }
  static Vec madd(Vec acc, XVec x, WVec w) { return vfmadd(x, w, acc); }
};
#endif

// The others decode kLanes weights to f32 exactly and multiply f32 activations.
struct F32Madd {
  static constexpr int64_t kStep = kLanes;
  using Activation = float;
  using XVec = Vec;
  using WVec = Vec;
  static XVec load_x(const Activation* x) { return vload(x); }
  static Vec madd(Vec acc, XVec x, WVec w) { return vfmadd(x, w, acc); }
};

// E4M3 (fn) bits b, decoded to their exact f32 value without ever making an f32 subnormal. With b
// sign-extended and shifted left by 20, the sign lands in bit 31 and b & 0x7f in bits 20..26 (E4M3's exponent
// e in f32's exponent field, its 3 mantissa bits on top of f32's); adding 120 to the exponent field rebias it
// (f32 127 - E4M3 7). An E4M3 subnormal (e = 0, value m/8 * 2^-6) gets exponent 121 instead, which reads as
// (1 + m/8) * 2^-6, and then loses its implicit one by subtracting +-2^-6: exact, both operands normal.
// Why not leave the value scaled by 2^-120 (3 instructions instead of 7) and rescale the sum at the end, or
// multiply it back at once: the products and partial sums, or the multiply's inputs, are then f32
// subnormals, which Intel cores compute through slow microcode assists (docs/stages.md "Why native kernels"). AMD
// Zen cores take no such penalty, but one decode serves both.
struct Fp8Weights : F32Madd {
  static constexpr int64_t kChunk = kLanes;
  static constexpr int kBits = static_cast<int>(0x87f00000u), kExponent = 0x07800000, kSign = static_cast<int>(0x80000000u);
  static constexpr int kRebias = 120 << 23, kOne = 1 << 23, kSubnormalOne = 121 << 23;
#if defined(__AVX512F__)
  WVec operator()(const uint8_t* p, int64_t, int64_t) const {
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512i b = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32(kBits));
    __mmask16 sub = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(kExponent));
    __m512i bits = _mm512_add_epi32(b, _mm512_set1_epi32(kRebias));
    bits = _mm512_mask_add_epi32(bits, sub, bits, _mm512_set1_epi32(kOne));
    __m512 one = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(kSign)), _mm512_set1_epi32(kSubnormalOne)));
    __m512 f = _mm512_castsi512_ps(bits);
    return _mm512_mask_sub_ps(f, sub, f, one);
  }
#else
  WVec operator()(const uint8_t* p, int64_t, int64_t) const {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m256i b = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(kBits));
    __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(kExponent)), _mm256_setzero_si256());
    __m256i bits = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(kRebias)), _mm256_and_si256(sub, _mm256_set1_epi32(kOne)));
    __m256i one = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(kSign)), _mm256_set1_epi32(kSubnormalOne));
    // elsewhere the subtrahend is +0, which leaves every value (and -0) as it is
    return _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(_mm256_and_si256(sub, one)));
  }
#endif
};

struct Int8Weights : F32Madd {
  static constexpr int64_t kChunk = kLanes;
#if defined(__AVX512F__)
  WVec operator()(const uint8_t* p, int64_t, int64_t) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
#else
  WVec operator()(const uint8_t* p, int64_t, int64_t) const {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};

// AWQ: kLanes/2 bytes per chunk, low nibble = even k, value q + 8; one scale per (n, group of 2^group_shift inputs).
struct Int4Weights : F32Madd {
  static constexpr int64_t kChunk = kLanes / 2;
  const float* scale;
  int64_t groups, group_shift;
  WVec operator()(const uint8_t* p, int64_t n, int64_t k) const {
#if defined(__AVX512F__)
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
#else
    int32_t four;
    std::memcpy(&four, p, 4);
    __m128i bytes = _mm_cvtsi32_si128(four);
#endif
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m128i nibbles = _mm_unpacklo_epi8(low, high);
#if defined(__AVX512F__)
    Vec q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles), _mm512_set1_epi32(8)));
#else
    Vec q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(nibbles), _mm256_set1_epi32(8)));
#endif
    return vmul(q, vset1(scale[n * groups + (k >> group_shift)]));
  }
};

struct Layout {
  int64_t step, chunk;
};

inline Layout layout_of(int64_t kind) {
  switch (kind) {
    case kBf16: return {Bf16Weights::kStep, Bf16Weights::kChunk};
    case kFp8: return {Fp8Weights::kStep, Fp8Weights::kChunk};
    case kInt8: return {Int8Weights::kStep, Int8Weights::kChunk};
    case kInt4: return {Int4Weights::kStep, Int4Weights::kChunk};
  }
  TORCH_CHECK(false, "unknown weight kind ", kind);
}

// The multiple of which K must be for a weight kind in this build (what NativeLinear.supports checks).
int64_t k_multiple(int64_t kind) { return layout_of(kind).step; }

// [N, K] (bf16, E4M3 bits or int8: K elements per row; AWQ int4: K/2 bytes per row) -> packed bytes.
at::Tensor pack(const at::Tensor& weight, int64_t kind, int64_t K) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: expected a contiguous [N, K] tensor");
  Layout lay = layout_of(kind);
  TORCH_CHECK(K % lay.step == 0, "K = ", K, " is not a multiple of ", lay.step);
  int64_t N = weight.size(0), steps = K / lay.step, row_bytes = steps * lay.chunk;
  TORCH_CHECK(weight.size(1) * weight.element_size() == row_bytes, "weight: ", weight.size(1), " columns do not hold K = ", K);
  at::Tensor packed = at::empty({N * row_bytes}, weight.options().dtype(at::kByte));
  const uint8_t* src = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  int64_t full = N / kChannelBlock * kChannelBlock;
  for (int64_t n0 = 0; n0 < N;) {
    int64_t width = n0 < full ? kChannelBlock : 1;
    uint8_t* block = dst + n0 * row_bytes;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t j = 0; j < width; ++j)
        std::memcpy(block + (s * width + j) * lay.chunk, src + (n0 + j) * row_bytes + s * lay.chunk, lay.chunk);
    n0 += width;
  }
  return packed;
}

// y = bf16(acc * out_scale + bias), or residual + that (each rounded to bf16).
struct Epilogue {
  const float* out_scale;          // [N] or nullptr
  const float* bias;               // [N] or nullptr
  const c10::BFloat16* residual;   // [M, N] or nullptr
  c10::BFloat16* y;                // [M, N]
  int64_t N;

  // One output from its reduced sum.
  void store1(int64_t m, int64_t n, float sum) const {
    float r = sum;
    if (out_scale) r *= out_scale[n];
    if (bias) r += bias[n];
    if (residual) r = static_cast<float>(residual[m * N + n]) + round_bf16(r);
    y[m * N + n] = c10::BFloat16(r);
  }

#if defined(__AVX512F__)
  // Four channels' sums (hsum4 of a full block), with the vector arithmetic.
  void store4(int64_t m, int64_t n, __m128 sums) const {
    __m512 v = _mm512_castps128_ps512(sums);
    __mmask16 four = 0xf;
    if (out_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(four, out_scale + n));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(four, bias + n));
    if (residual) {
      __m256i r = _mm256_maskz_loadu_epi16(four, residual + m * N + n);
      v = _mm512_add_ps(bf16_to_f32(r), round_bf16(v));
    }
    _mm256_mask_storeu_epi16(y + m * N + n, four, f32_to_bf16(v));
  }
#endif
};

// Tile shapes: CB channels (of one packed block) x RB rows share each decoded weight vector and each loaded
// activation vector. kRowTile is the most rows of a tile: a call of M rows decodes every weight chunk
// ceil(M / kRowTile) times. AVX-512 (32 registers) keeps CB = 4 (the block) x 4 rows; AVX2 (16 registers)
// runs CB = 2 x 4 rows (8 sums, 4 activation vectors, 2 weight vectors: 14 of 16 registers), or CB = 4 for
// one or two rows (where a CB = 2 tile has too few independent sums to hide the FMA latency).
#if defined(__AVX512F__)
constexpr int64_t kRowTile = 4;
template <int64_t R> constexpr int64_t kTileChannels = 4;
#else
constexpr int64_t kRowTile = 4;
template <int64_t R> constexpr int64_t kTileChannels = R <= 2 ? 4 : 2;
#endif

// Channels [n, n + CB) x rows [m, m + RB): each accumulator sums x[m, k..] * w[n, k..] one step at a time in
// k order, then the epilogue reduces its lanes. The tile shape changes which products share a register load,
// not the order in which any one (m, n) is summed: every row's bits are those of a one-row call.
// p: the tile's first chunk; stride: bytes from one step of the block to the next.
// ahead > 0: also prefetch, step by step, the `stride` bytes that far past p (the next block's same step), so that
// the next block streams in from memory while this one computes (without it a pass over several rows costs the
// memory time plus the compute time: the hardware prefetchers stop at the block's end).
template <int64_t CB, int64_t RB, class W>
inline void tile(const typename W::Activation* xa, int64_t K, const uint8_t* p, int64_t stride, const W& weights,
                 int64_t n, int64_t m, const Epilogue& out, int64_t ahead = 0) {
  // Fully unrolled (the pragmas): the accumulators must live in registers, not on the stack.
  Vec acc[CB][RB];
#pragma GCC unroll 8
  for (int64_t j = 0; j < CB; ++j)
#pragma GCC unroll 8
    for (int64_t i = 0; i < RB; ++i) acc[j][i] = vzero();
  const typename W::Activation* x0 = xa + m * K;
  for (int64_t k = 0; k < K; k += W::kStep, p += stride) {
    const typename W::Activation* xk = x0 + k;
    if (ahead > 0)
      for (int64_t c = 0; c < stride; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + c), _MM_HINT_T0);
#if defined(__AVX512F__)
    typename W::XVec x[RB];  // 32 registers: each activation vector loaded once per step
#pragma GCC unroll 8
    for (int64_t i = 0; i < RB; ++i) x[i] = W::load_x(xk + i * K);
#endif
#pragma GCC unroll 8
    for (int64_t j = 0; j < CB; ++j) {
      typename W::WVec w = weights(p + j * W::kChunk, n + j, k);
#pragma GCC unroll 8
      for (int64_t i = 0; i < RB; ++i) {
#if defined(__AVX512F__)
        acc[j][i] = W::madd(acc[j][i], x[i], w);
#else  // 16 registers: the activations as memory operands of the FMAs (GCC spilled an array of them)
        acc[j][i] = W::madd(acc[j][i], W::load_x(xk + i * K), w);
#endif
      }
    }
  }
  // Every output of a channel goes through the same reduction and arithmetic whatever the tile: AVX-512
  // reduces the four channels of a full block with hsum4 and store4 (full blocks always run CB = 4 tiles
  // there), a lone channel with hsum4 against zeros; AVX2 reduces each accumulator alone with hsum. (The
  // sums are taken here, not in a callee given the array, so that the accumulators stay in registers.)
#pragma GCC unroll 8
  for (int64_t i = 0; i < RB; ++i) {
#if defined(__AVX512F__)
    if constexpr (CB == 4) {
      out.store4(m + i, n, hsum4(acc[0][i], acc[1][i], acc[2][i], acc[3][i]));
      continue;
    }
#endif
#pragma GCC unroll 8
    for (int64_t j = 0; j < CB; ++j) out.store1(m + i, n + j, hsum(acc[j][i]));
  }
}

// Rows [m, m + rows) of one packed block of `width` channels from channel n (rows <= kRowTile).
template <int64_t R, class W>
inline void tile_rows(int64_t rows, const typename W::Activation* xa, int64_t K, const uint8_t* block, int64_t width,
                      const W& weights, int64_t n, int64_t m, const Epilogue& out, int64_t ahead) {
  if constexpr (R >= 1) {
    if (rows != R) return tile_rows<R - 1>(rows, xa, K, block, width, weights, n, m, out, ahead);
    int64_t stride = width * W::kChunk;
    if (width == 1) return tile<1, R>(xa, K, block, stride, weights, n, m, out, ahead);
    constexpr int64_t CB = kTileChannels<R>;
    for (int64_t j = 0; j < kChannelBlock; j += CB)  // the first channel tile prefetches the whole step
      tile<CB, R>(xa, K, block + j * W::kChunk, stride, weights, n + j, m, out, j == 0 ? ahead : 0);
  }
}

// y rows [m0, m0 + rows) of the packed block at channel n: tiles of kRowTile rows, then one tile of the rest.
template <class W>
inline void block_rows(const typename W::Activation* xa, int64_t m0, int64_t rows, int64_t K, const uint8_t* packed,
                       int64_t width, const W& weights, int64_t n, const Epilogue& out) {
  const uint8_t* block = packed + n * (K / W::kStep) * W::kChunk;
  // The first row tile of a full block prefetches kPrefetchBlocks blocks ahead; the others find it in cache.
  int64_t ahead = width == kChannelBlock ? kPrefetchBlocks * width * (K / W::kStep) * W::kChunk : 0;
  int64_t m = m0, end = m0 + rows;
  for (; m + kRowTile <= end; m += kRowTile, ahead = 0) tile_rows<kRowTile>(kRowTile, xa, K, block, width, weights, n, m, out, ahead);
  if (m < end) tile_rows<kRowTile>(end - m, xa, K, block, width, weights, n, m, out, ahead);
}

// All of y. Threads split the full blocks of channels; each thread walks its blocks once per chunk of rows,
// a chunk's activations sized to stay in the core's L2 cache across the blocks (prefill: hundreds of rows).
template <class W>
void gemv(const typename W::Activation* xa, int64_t M, int64_t N, int64_t K, const uint8_t* packed, const W& weights,
          const Epilogue& out) {
  int64_t blocks = N / kChannelBlock;
  int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename W::Activation));
  int64_t chunk = std::max<int64_t>(kRowTile, (int64_t{192} << 10) / row_bytes / kRowTile * kRowTile);
  specdeploy::step_team::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    ExactFloatMode exact;
    for (int64_t m0 = 0; m0 < M; m0 += chunk)
      for (int64_t b = begin; b < end; ++b)
        block_rows(xa, m0, std::min(chunk, M - m0), K, packed, kChannelBlock, weights, b * kChannelBlock, out);
  });
  ExactFloatMode exact;
  for (int64_t n = blocks * kChannelBlock; n < N; ++n) block_rows(xa, 0, M, K, packed, 1, weights, n, out);
}

const float* optional_f32(const std::optional<at::Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, name,
              ": expected a contiguous f32 tensor of ", numel, " elements");
  return t->data_ptr<float>();
}

// The activations a kernel multiplies, in f32 (xa [M, K]), after the input quantization of its format:
//   plain:                  xa = x
//   pre_quant_scale (AWQ):  xa = bf16(x * s)
//   FP8 (act_scale > 0):    xa = e4m3(clamp(x / act_scale, +-448))
//   SmoothQuant (int8 + act_scale > 0): xa = clamp(round(bf16(x * s) / act_scale), -128, 127)
std::vector<float> prologue(const at::Tensor& x, int64_t kind, const float* pre_quant_scale, double act_scale) {
  int64_t M = x.size(0), K = x.size(1);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  std::vector<float> xa(M * K);
  float act = static_cast<float>(act_scale);
  if (act > 0 && kind == kFp8 && !pre_quant_scale) {  // the FP8 GEMM's input, kLanes at a time
    Vec scale = vset1(act), hi = vset1(kFp8Max), lo = vset1(-kFp8Max);
    for (int64_t i = 0; i < M * K; i += kLanes) {
      Vec v = vmin(vmax(vdiv(load_bf16(xp + i), scale), lo), hi);
      vstore(xa.data() + i, round_e4m3(v));
    }
    return xa;
  }
  for (int64_t i = 0; i < M * K; ++i) {
    float v = static_cast<float>(xp[i]);
    if (pre_quant_scale) v = round_bf16(v * pre_quant_scale[i % K]);
    if (act > 0 && kind == kFp8) {
      v = static_cast<float>(c10::Float8_e4m3fn(std::clamp(v / act, -kFp8Max, kFp8Max)));
    } else if (act > 0 && kind == kInt8) {
      v = std::clamp(std::nearbyint(v / act), -128.0f, 127.0f);
    }
    xa[i] = v;
  }
  return xa;
}

#if defined(SPECDEPLOY_BF16_PAIRS)
// x [M, K] bf16 -> f32 in the pairs kernel's order: per step of 32 inputs, the 16 even ones, then the 16 odd ones.
std::vector<float> prologue_pairs(const at::Tensor& x) {
  int64_t MK = x.numel();
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  std::vector<float> xa(MK);
  for (int64_t i = 0; i < MK; i += Bf16Weights::kStep) {
    Bf16Weights::XVec v = Bf16Weights::split_pairs(_mm512_loadu_si512(xp + i));
    vstore(xa.data() + i, v.even);
    vstore(xa.data() + i + kLanes, v.odd);
  }
  return xa;
}
#endif

// bf16 weights take no input quantization: VDPBF16PS multiplies x as given, the f32 kernels its f32 values.
template <class W = Bf16Weights>
void gemv_bf16(const at::Tensor& x, int64_t M, int64_t N, int64_t K, const uint8_t* packed, const Epilogue& out) {
  if constexpr (std::is_same_v<typename W::Activation, c10::BFloat16>) {
    gemv(x.data_ptr<c10::BFloat16>(), M, N, K, packed, W{}, out);
  } else if constexpr (W::kStep == 2 * kLanes) {
#if defined(SPECDEPLOY_BF16_PAIRS)
    gemv(prologue_pairs(x).data(), M, N, K, packed, W{}, out);
#endif
  } else {
    gemv(prologue(x, kBf16, nullptr, 0.0).data(), M, N, K, packed, W{}, out);
  }
}

// y [M, N] bf16 = quantize_input(x) @ W^T * out_scale + bias (+ residual), W [N, K] packed by `pack`:
// bf16, E4M3 bits, int8, or AWQ int4 with group_scale [N, K/G] (f32 values of the bf16 scales).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                  const std::optional<at::Tensor>& group_scale, int64_t group_size,
                  const std::optional<at::Tensor>& pre_quant_scale, double act_scale,
                  const std::optional<at::Tensor>& out_scale, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: expected contiguous bf16 [M, K]");
  if (kind == kInt8Sq)  // packed by int8_pack; group_size carries the integer kernel's variant (native.int8_variant)
    return specdeploy::int8_sq_linear(x, packed, N, group_size, pre_quant_scale, act_scale, out_scale, bias, residual);
  int64_t M = x.size(0), K = x.size(1);
  Layout lay = layout_of(kind);
  TORCH_CHECK(K % lay.step == 0, "K = ", K, " is not a multiple of ", lay.step);
  int64_t bytes = N * (K / lay.step) * lay.chunk;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == bytes,
              "packed weight: expected ", bytes, " bytes from pack()");
  at::Tensor y = at::empty({M, N}, x.options());
  if (residual.has_value())
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() && residual->sizes() == y.sizes(),
                "residual: expected contiguous bf16 [M, N]");
  Epilogue out{optional_f32(out_scale, N, "out_scale"), optional_f32(bias, N, "bias"),
               residual.has_value() ? residual->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), N};
  const float* pqs = optional_f32(pre_quant_scale, K, "pre_quant_scale");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (kind == kBf16) {
    gemv_bf16(x, M, N, K, w, out);
    return y;
  }
  std::vector<float> xa = prologue(x, kind, pqs, act_scale);
  switch (kind) {
    case kFp8: gemv(xa.data(), M, N, K, w, Fp8Weights{}, out); break;
    case kInt8: gemv(xa.data(), M, N, K, w, Int8Weights{}, out); break;
    default: {
      int64_t shift = 0;
      while ((int64_t{1} << shift) < group_size) ++shift;
      TORCH_CHECK(group_size >= kLanes && (int64_t{1} << shift) == group_size && K % group_size == 0, "group_size ",
                  group_size, " must be a power of two >= ", kLanes, " dividing K = ", K);
      const float* scale = optional_f32(group_scale, N * (K / group_size), "group_scale");
      TORCH_CHECK(scale != nullptr, "int4 weights need group_scale");
      gemv(xa.data(), M, N, K, w, Int4Weights{{}, scale, K / group_size, shift}, out);
    }
  }
  return y;
}

// As Hugging Face's LlamaRMSNorm, one row of H: out = weight * bf16(x * rsqrt(mean(x^2) + eps)), statistics in f32.
inline void rms_norm_row(const c10::BFloat16* row, const c10::BFloat16* wp, int64_t H, double eps, c10::BFloat16* out) {
  if (H % kLanes == 0) {  // the same formula, kLanes at a time (sum of squares in lane order, then hsum)
    Vec acc = vzero();
    for (int64_t h = 0; h < H; h += kLanes) {
      Vec v = load_bf16(row + h);
      acc = vfmadd(v, v, acc);
    }
    float sum = hsum(acc);
    Vec inv = vset1(1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps)));
    for (int64_t h = 0; h < H; h += kLanes)
      store_bf16(out + h, vmul(load_bf16(wp + h), round_bf16(vmul(load_bf16(row + h), inv))));
    return;
  }
  float sum = 0.0f;
  for (int64_t h = 0; h < H; ++h) sum += static_cast<float>(row[h]) * static_cast<float>(row[h]);
  float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
  for (int64_t h = 0; h < H; ++h) out[h] = c10::BFloat16(static_cast<float>(wp[h]) * round_bf16(static_cast<float>(row[h]) * inv));
}

// rms_norm_row over the rows of x [M, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: expected contiguous bf16 [M, H]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.numel() == x.size(1), "weight: expected bf16 [H]");
  int64_t M = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x);
  const c10::BFloat16 *xp = x.data_ptr<c10::BFloat16>(), *wp = weight.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m) rms_norm_row(xp + m * H, wp, H, eps, yp + m * H);
  return y;
}

// [M, 2I] -> [M, I]: bf16(silu(gate)) * up, each rounded to bf16 as torch's bf16 ops do. With `up` ([M, I]),
// gate_up is the gate alone ([M, I]): the same products from two tensors, so a checkpoint that keeps gate and up apart
// (int8_sq) needs no [M, 2I] copy of both first.
at::Tensor swiglu(const at::Tensor& gate_up, const std::optional<at::Tensor>& up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(),
              "gate_up: expected contiguous bf16 [M, 2I]");
  TORCH_CHECK(up.has_value() || gate_up.size(1) % 2 == 0, "gate_up: expected [M, 2I]");
  TORCH_CHECK(!up.has_value() || (up->scalar_type() == at::kBFloat16 && up->is_contiguous() && up->sizes() == gate_up.sizes()),
              "up: expected contiguous bf16 of the gate's shape");
  int64_t M = gate_up.size(0), I = up.has_value() ? gate_up.size(1) : gate_up.size(1) / 2;
  int64_t stride = up.has_value() ? I : 2 * I;  // a row of the gate (and of up)
  at::Tensor y = at::empty({M, I}, gate_up.options());
  const c10::BFloat16* gp = gate_up.data_ptr<c10::BFloat16>();
  const c10::BFloat16* upp = up.has_value() ? up->data_ptr<c10::BFloat16>() : gp + I;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  if (I % kLanes == 0) {  // kLanes at a time, with exp_ps
    Vec one = vset1(1.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < I; i += kLanes) {
        Vec g = load_bf16(gp + m * stride + i), u = load_bf16(upp + m * stride + i);
        Vec silu = vdiv(g, vadd(one, exp_ps(vmul(vset1(-1.0f), g))));
        store_bf16(yp + m * I + i, vmul(round_bf16(silu), u));
      }
    return y;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      float g = static_cast<float>(gp[m * stride + i]), u = static_cast<float>(upp[m * stride + i]);
      yp[m * I + i] = c10::BFloat16(round_bf16(g / (1.0f + std::exp(-g))) * u);
    }
  return y;
}

// The candidates of a screened LM head (engine/lm_screen.py, which derives the bound): token j is one where, for some
// row i, A[i, j] + b[i, j] >= max_t (A[i, t] - b[i, t]). The W8A16 screen: A = screened[i, j] (bf16) and
// b = rounding * |A| + norms[i] * slack[j]. The int8 screen (Residual): screened holds two rows per row i, i and
// rows + i, the int8 codes of x and of its rounding residual, A = screened[i, j] + screened[rows + i, j] (f32) and
// b = rounding * (|A| + |screened[rows + i, j]|) + norms[i] * slack[j] + residuals[i] * slack_act[j]. Returns them
// sorted, each once; empty where a row holds a non-finite value or more than max_candidates qualify (the caller then
// runs the whole head). Two passes over each row, vectorized by the OpenMP simd reductions, in place of torch's max,
// comparison and nonzero (docs/stages.md "Why native kernels").
template <bool Residual>
at::Tensor screen_candidates(const at::Tensor& screened, int64_t rows, const float* norms, const float* residuals,
                             const float* s, const float* s_act, double rounding, int64_t max_candidates) {
  TORCH_CHECK(screened.dim() == 2 && screened.scalar_type() == at::kBFloat16 && screened.is_contiguous() &&
                  screened.size(0) == (Residual ? 2 : 1) * rows,
              "screened: expected contiguous bf16 [rows, vocab] (twice the rows for the int8 screen)");
  const int64_t V = screened.size(1);
  const uint16_t* a = reinterpret_cast<const uint16_t*>(screened.data_ptr<c10::BFloat16>());
  const float r = static_cast<float>(rounding);
  auto value = [](uint16_t bf16) {  // a bf16's f32 value, in a form the loops below vectorize
    uint32_t bits = static_cast<uint32_t>(bf16) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  };
  constexpr int64_t kBlock = 64;
  std::vector<int64_t> found;
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row = a + i * V;
    const uint16_t* rest = Residual ? a + (rows + i) * V : row;  // the residual's row (unused by the W8A16 screen)
    const float n = norms[i], e = Residual ? residuals[i] : 0.0f;
    // (A, b) of token j, as the comment above defines them
    auto center = [&](int64_t j) { return Residual ? value(row[j]) + value(rest[j]) : value(row[j]); };
    auto radius = [&](int64_t j, float v) {
      return Residual ? r * (std::fabs(v) + std::fabs(value(rest[j]))) + n * s[j] + e * s_act[j] : r * std::fabs(v) + n * s[j];
    };
    float best = -INFINITY;
    int bad = !std::isfinite(n) || !std::isfinite(e);
#pragma omp simd reduction(max : best) reduction(| : bad)
    for (int64_t j = 0; j < V; ++j) {
      float v = center(j);
      best = std::max(best, v - radius(j, v));
      bad |= (row[j] & 0x7f80) == 0x7f80 || (rest[j] & 0x7f80) == 0x7f80;  // NaN or infinity
    }
    if (bad) return at::empty({0}, at::kLong);
    for (int64_t j0 = 0; j0 < V; j0 += kBlock) {  // a block is scanned token by token only where it holds one
      int64_t end = std::min(V, j0 + kBlock);
      int any = 0;
#pragma omp simd reduction(| : any)
      for (int64_t j = j0; j < end; ++j) {
        float v = center(j);
        any |= v + radius(j, v) >= best;
      }
      if (!any) continue;
      for (int64_t j = j0; j < end; ++j) {
        float v = center(j);
        if (v + radius(j, v) >= best) found.push_back(j);
      }
      if (static_cast<int64_t>(found.size()) > max_candidates * rows) return at::empty({0}, at::kLong);
    }
  }
  std::sort(found.begin(), found.end());
  found.erase(std::unique(found.begin(), found.end()), found.end());
  if (static_cast<int64_t>(found.size()) > max_candidates) return at::empty({0}, at::kLong);
  at::Tensor out = at::empty({static_cast<int64_t>(found.size())}, at::kLong);
  std::copy(found.begin(), found.end(), out.data_ptr<int64_t>());
  return out;
}

void check_screen_args(const at::Tensor& x, const at::Tensor& head, const at::Tensor& slack) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: expected contiguous bf16 [rows, K]");
  TORCH_CHECK(head.dim() == 2 && head.scalar_type() == at::kBFloat16 && head.is_contiguous() && head.size(1) == x.size(1),
              "head: expected contiguous bf16 [vocab, K]");
  TORCH_CHECK(slack.scalar_type() == at::kFloat && slack.is_contiguous() && slack.numel() == head.size(0),
              "slack: expected f32 [vocab]");
}

// The screen's result: the candidates get the bf16 head's own logits, computed by `linear` on their rows packed as
// `pack` packs the head (the kernel's bits do not depend on the block a channel sits in); every other token is -inf.
// Empty where there are no candidates (the caller then runs the whole head); with the number of candidates.
std::tuple<at::Tensor, int64_t> candidate_logits(const at::Tensor& x, const at::Tensor& head, const at::Tensor& candidates) {
  const int64_t rows = x.size(0), K = x.size(1), V = head.size(0), n = candidates.numel();
  if (n == 0) return {at::empty({0, V}, at::kFloat), 0};
  const int64_t* ids = candidates.data_ptr<int64_t>();
  at::Tensor picked = at::empty({n, K}, head.options());
  for (int64_t j = 0; j < n; ++j)
    std::memcpy(picked.data_ptr<c10::BFloat16>() + j * K, head.data_ptr<c10::BFloat16>() + ids[j] * K, K * sizeof(c10::BFloat16));
  at::Tensor exact = linear(x, pack(picked, kBf16, K), kBf16, n, std::nullopt, 0, std::nullopt, 0.0, std::nullopt,
                            std::nullopt, std::nullopt);  // [rows, n] bf16
  at::Tensor out = at::empty({rows, V}, at::kFloat);
  float* op = out.data_ptr<float>();
  std::fill(op, op + rows * V, -INFINITY);
  const c10::BFloat16* ep = exact.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) op[i * V + ids[j]] = static_cast<float>(ep[i * n + j]);
  return {out, n};
}

// The logits [rows, vocab] (f32) of a screened LM head's rows (engine/lm_screen.py), the W8A16 screen: x [rows, K] bf16
// the final norm's rows, screened [rows, vocab] bf16 their int8 copy's logits, slack [vocab], head [vocab, K] bf16 the
// head's weight; the candidates (screen_candidates, with ||x|| rounded up) through candidate_logits. One call for what
// took eight torch ops (docs/benchmarks.md "A greedy step's LM head").
std::tuple<at::Tensor, int64_t> screen_logits(const at::Tensor& x, const at::Tensor& screened, const at::Tensor& slack,
                                              const at::Tensor& head, double rounding, int64_t max_candidates) {
  check_screen_args(x, head, slack);
  TORCH_CHECK(screened.size(1) == head.size(0), "screened: expected [rows, vocab]");
  const int64_t rows = x.size(0), K = x.size(1);
  std::vector<float> norms(rows);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < rows; ++i) {
    double squares = 0;
    for (int64_t k = 0; k < K; ++k) {
      double v = static_cast<float>(xp[i * K + k]);
      squares += v * v;
    }
    norms[i] = static_cast<float>(std::sqrt(squares) * (1 + 1e-6));  // ||x||, rounded up
  }
  at::Tensor candidates = screen_candidates<false>(screened, rows, norms.data(), nullptr, slack.data_ptr<float>(), nullptr,
                                                   rounding, max_candidates);
  return candidate_logits(x, head, candidates);
}

// The int8 screen (engine/lm_screen.py): each row x [rows, K] and its rounding residual run through the int8
// SmoothQuant kernel (int8_kernels.cpp, per token, no smoothing) against the head's int8 codes: packed (int8_pack of
// the codes for `variant`), out_scale [vocab] their scales. x = s1 q1 + r, where s1 q1 are the kernel's own codes of x
// (int8_quantize), r is exact in double; the second row is bf16(r), whose codes s2 q2 leave e = x - s1 q1 - s2 q2,
// also exact in double. ||x|| and ||e|| (rounded up) bound the activations' part of the error (slack_act [vocab]:
// ||s_j q_j|| of each token's codes), slack [vocab] the weights'; the candidates then through candidate_logits.
std::tuple<at::Tensor, int64_t> screen_logits_int8(const at::Tensor& x, const at::Tensor& packed, int64_t variant,
                                                   const at::Tensor& out_scale, const at::Tensor& slack,
                                                   const at::Tensor& slack_act, const at::Tensor& head, double rounding,
                                                   int64_t max_candidates) {
  check_screen_args(x, head, slack);
  TORCH_CHECK(slack_act.scalar_type() == at::kFloat && slack_act.is_contiguous() && slack_act.numel() == head.size(0),
              "slack_act: expected f32 [vocab]");
  const int64_t rows = x.size(0), K = x.size(1), V = head.size(0);
  at::Tensor stacked = at::empty({2 * rows, K}, x.options());  // x's rows, then their residuals' (bf16)
  std::memcpy(stacked.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), rows * K * sizeof(c10::BFloat16));
  auto [q1, s1] = specdeploy::int8_quantize(x, std::nullopt, 0.0);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const int8_t* c1 = q1.data_ptr<int8_t>();
  c10::BFloat16* rp = stacked.data_ptr<c10::BFloat16>() + rows * K;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < K; ++k)
      rp[i * K + k] = c10::BFloat16(static_cast<float>(static_cast<float>(xp[i * K + k]) -
                                                       static_cast<double>(s1.data_ptr<float>()[i]) * c1[i * K + k]));
  auto [q2, s2] = specdeploy::int8_quantize(stacked.narrow(0, rows, rows), std::nullopt, 0.0);
  const int8_t* c2 = q2.data_ptr<int8_t>();
  std::vector<float> norms(rows), residuals(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const double a = s1.data_ptr<float>()[i], b = s2.data_ptr<float>()[i];
    double squares = 0, errors = 0;
    for (int64_t k = 0; k < K; ++k) {
      double v = static_cast<float>(xp[i * K + k]);
      double e = v - a * c1[i * K + k] - b * c2[i * K + k];  // each product and both sums exact in double
      squares += v * v;
      errors += e * e;
    }
    norms[i] = static_cast<float>(std::sqrt(squares) * (1 + 1e-6));  // ||x||, rounded up
    residuals[i] = static_cast<float>(std::sqrt(errors) * (1 + 1e-6));  // ||e||, rounded up
  }
  at::Tensor screened = specdeploy::int8_sq_linear(stacked, packed, V, variant, std::nullopt, 0.0, out_scale, std::nullopt,
                                                   std::nullopt);  // [2 rows, vocab] bf16
  at::Tensor candidates = screen_candidates<true>(screened, rows, norms.data(), residuals.data(), slack.data_ptr<float>(),
                                                  slack_act.data_ptr<float>(), rounding, max_candidates);
  return candidate_logits(x, head, candidates);
}

// a . b for a key of the cache (bf16, read as f32: exact)
inline float dot(const float* a, const c10::BFloat16* b, int64_t D) {
  if (D % kLanes == 0) {
    Vec acc = vzero();
    for (int64_t d = 0; d < D; d += kLanes) acc = vfmadd(vload(a + d), load_bf16(b + d), acc);
    return vreduce(acc);
  }
  float s = 0.0f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * static_cast<float>(b[d]);
  return s;
}

// How far ahead of the key (value) in use the first pass over a block asks for the cache's lines: a one-row pass
// reads each KV head's keys and values once, from L3 after the rest of the step has gone through L2, and the loads
// of the FMAs alone did not keep enough of those misses in flight. A prefetch changes no bits.
constexpr int64_t kPrefetchBytes = 2048;
inline void prefetch_row(const c10::BFloat16* p, int64_t D) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(c10::BFloat16)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

// Q query heads of one row against keys j_begin..n-1 of their KV head (j_begin a multiple of kLanes), the head size
// D = C * kLanes (q in registers): p_q[j] = (q . key_j) * scale, each dot product FMA'd over the head's C vectors from
// zero, then kLanes keys' lane sums at once (reduce_lanes). A key's vectors are loaded once for the Q queries. p_q[j]'s
// bits depend on q and key j alone, never on n (a row's keys count), Q or the other keys of its block (lanes past n are
// zeros, never stored).
template <int C, int Q>
inline void head_scores(const float* const* qh, const c10::BFloat16* keys, int64_t D, int64_t j_begin, int64_t n,
                        float scale, float* const* p, bool prefetch) {
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / (D * static_cast<int64_t>(sizeof(c10::BFloat16))));
  Vec q[Q][C];
  for (int h = 0; h < Q; ++h)
    for (int c = 0; c < C; ++c) q[h][c] = vload(qh[h] + c * kLanes);
  for (int64_t j0 = j_begin; j0 < n; j0 += kLanes) {
    int64_t count = std::min<int64_t>(kLanes, n - j0);
    Vec acc[Q][kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      if (i < count) {
        const c10::BFloat16* k = keys + (j0 + i) * D;
        if (prefetch) prefetch_row(k + ahead * D, D);
        Vec key[C];
        for (int c = 0; c < C; ++c) key[c] = load_bf16(k + c * kLanes);
        for (int h = 0; h < Q; ++h) {
          Vec a = vzero();
          for (int c = 0; c < C; ++c) a = vfmadd(q[h][c], key[c], a);
          acc[h][kReduceSlot[i]] = a;
        }
      } else {
        for (int h = 0; h < Q; ++h) acc[h][kReduceSlot[i]] = vzero();
      }
    }
    for (int h = 0; h < Q; ++h) {
      Vec scores = vmul(reduce_lanes(acc[h]), vset1(scale));
      if (count == kLanes) vstore(p[h] + j0, scores);
      else vstore_first(p[h] + j0, scores, count);
    }
  }
}

// The largest of p[0..n).
inline float max_of(const float* p, int64_t n) {
  float mx = -INFINITY;
  int64_t j = 0;
  if (n >= kLanes) {
    Vec m = vload(p);
    for (j = kLanes; j + kLanes <= n; j += kLanes) m = vmax(m, vload(p + j));
    alignas(64) float lanes[kLanes];
    vstore(lanes, m);
    for (float l : lanes) mx = std::max(mx, l);
  }
  for (; j < n; ++j) mx = std::max(mx, p[j]);
  return mx;
}

// p[0..n) <- e^(p - mx), kLanes at a time (the tail masked); returns their sum (lane sums, then hsum).
inline float softmax_numerators(float* p, int64_t n, float mx) {
  Vec lanes = vzero();
  for (int64_t j = 0; j < n; j += kLanes) {
    Vec e = vkeep_first(exp_ps(vadd(vload_first(p + j, n - j), vset1(-mx))), n - j);
    vstore_first(p + j, e, n - j);
    lanes = vadd(lanes, e);
  }
  return hsum(lanes);
}

// Keys (then values) a task reads into L1 at a time; queries of a row whose values are weighed together.
constexpr int64_t kKeyBlock = 4 * kLanes;
constexpr int64_t kValueQueries = 3;
constexpr int64_t kScoreQueries = 3;  // queries of a row whose scores share each key's loads

// acc[q] += w[q][j] * value_j for keys b0..n-1 in order, Q queries with weights w + q * stride and sums acc + q * D.
template <int C, int Q>
inline void weigh_values(const float* w, int64_t stride, const c10::BFloat16* values, int64_t b0, int64_t n, float* acc,
                         bool prefetch) {
  constexpr int64_t D = C * kLanes;
  constexpr int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / (D * static_cast<int64_t>(sizeof(c10::BFloat16))));
  Vec a[Q][C];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) a[q][c] = vload(acc + q * D + c * kLanes);
  for (int64_t j = b0; j < n; ++j) {
    const c10::BFloat16* v = values + j * D;
    if (prefetch) prefetch_row(v + ahead * D, D);
    Vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_bf16(v + c * kLanes);
    for (int q = 0; q < Q; ++q) {
      Vec wj = vset1(w[q * stride + j]);
      for (int c = 0; c < C; ++c) a[q][c] = vfmadd(wj, vv[c], a[q][c]);
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) vstore(acc + q * D + c * kLanes, a[q][c]);
}

// The query heads h0..h1-1 of one KV head over rows r0..r1-1, D = C * kLanes, each query's arithmetic its own: its
// scores kLanes keys at a time (head_scores, a row's queries kScoreQueries at a time: FMAs, then reduce_lanes),
// softmax numerators, w[j] = p[j] / sum, then sum_j w[j] * value_j in key order from zero, rounded to bf16 at the
// end. A block of kKeyBlock keys (then of values) is read from the cache into L1 once and used by every query of the
// task before the next block (one query per task streamed a KV head's cache from L2 once per query: a pass of m rows
// read it 3m times for SmolLM2's groups).
//   q: [rows, H, D] f32 after RoPE; keys, values: this KV head's cache; p: queries x stride floats of scratch
//   (stride >= start + r1 + kLanes); acc: queries x D floats; out: [rows, H * D] bf16.
template <int C>
void attend_queries(const float* q, int64_t num_heads, const c10::BFloat16* keys, const c10::BFloat16* values, int64_t start, int64_t r0,
                    int64_t r1, int64_t h0, int64_t h1, float scale, float* p, int64_t stride, float* acc,
                    c10::BFloat16* out) {
  constexpr int64_t D = C * kLanes;
  int64_t heads = h1 - h0, queries = (r1 - r0) * heads, last = start + r1;  // last: keys of the last row
  auto keys_of = [&](int64_t k) { return start + r0 + k / heads + 1; };
  auto query = [&](int64_t k) { return q + ((r0 + k / heads) * num_heads + h0 + k % heads) * D; };
  for (int64_t b0 = 0; b0 < last; b0 += kKeyBlock) {
    for (int64_t k = 0; k < queries;) {
      int64_t n = std::min(keys_of(k), b0 + kKeyBlock);
      int64_t together = std::min<int64_t>({kScoreQueries, queries - k, heads - k % heads});  // same row: same n
      if (n > b0) {
        const float* qs[kScoreQueries];
        float* ps[kScoreQueries];
        for (int64_t h = 0; h < together; ++h) qs[h] = query(k + h), ps[h] = p + (k + h) * stride;
        switch (together) {
          case 3: head_scores<C, 3>(qs, keys, D, b0, n, scale, ps, k == 0); break;
          case 2: head_scores<C, 2>(qs, keys, D, b0, n, scale, ps, k == 0); break;
          default: head_scores<C, 1>(qs, keys, D, b0, n, scale, ps, k == 0);
        }
      }
      k += together;
    }
  }
  for (int64_t k = 0; k < queries; ++k) {
    float* pk = p + k * stride;
    int64_t n = keys_of(k);
    Vec sum = vset1(softmax_numerators(pk, n, max_of(pk, n)));
    for (int64_t j = 0; j < n; j += kLanes) vstore_first(pk + j, vdiv(vload_first(pk + j, n - j), sum), n - j);
  }
  // The weighted values: the queries of a row (one count of keys) kValueQueries at a time, a value's vectors loaded once
  // for all of them; each query's sums in its own registers, in key order.
  std::fill(acc, acc + queries * D, 0.0f);
  for (int64_t b0 = 0; b0 < last; b0 += kKeyBlock) {
    for (int64_t k = 0; k < queries;) {
      int64_t n = std::min(keys_of(k), b0 + kKeyBlock);
      int64_t together = std::min<int64_t>({kValueQueries, queries - k, heads - k % heads});  // same row: same n
      if (n > b0) {
        switch (together) {
          case 3: weigh_values<C, 3>(p + k * stride, stride, values, b0, n, acc + k * D, k == 0); break;
          case 2: weigh_values<C, 2>(p + k * stride, stride, values, b0, n, acc + k * D, k == 0); break;
          default: weigh_values<C, 1>(p + k * stride, stride, values, b0, n, acc + k * D, k == 0);
        }
      }
      k += together;
    }
  }
  for (int64_t k = 0; k < queries; ++k) {
    c10::BFloat16* o = out + (r0 + k / heads) * num_heads * D + (h0 + k % heads) * D;
    for (int c = 0; c < C; ++c) store_bf16(o + c * kLanes, vload(acc + k * D + c * kLanes));
  }
}

// RoPE (rotate halves) in f32 on one head, rounded to bf16: x * cos + [x2, x1] * signed_sin, two products and a
// sum each rounded to f32 (no FMA contraction here, as torch's unfused ops), kLanes at a time where half the head
// is a whole number of vectors. Out: float (a query, in f32) or c10::BFloat16 (a key, into the cache: the value is
// a bf16 already, so storing it as one is exact).
inline void store_rounded(float* p, Vec v) { vstore(p, round_bf16(v)); }
inline void store_rounded(c10::BFloat16* p, Vec v) { store_bf16(p, v); }
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <class Out>
inline void rope(const c10::BFloat16* x, const float* cos, const float* sin, int64_t D, Out* out) {
  int64_t half = D / 2;
  if (half % kLanes == 0) {
    for (int64_t d = 0; d < half; d += kLanes) {
      Vec x1 = load_bf16(x + d), x2 = load_bf16(x + half + d);
      store_rounded(out + d, vadd(vmul(x1, vload(cos + d)), vmul(x2, vload(sin + d))));
      store_rounded(out + half + d, vadd(vmul(x2, vload(cos + half + d)), vmul(x1, vload(sin + half + d))));
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    float xd = static_cast<float>(x[d]), rotated = static_cast<float>(x[(d + half) % D]);
    out[d] = static_cast<Out>(round_bf16(xd * cos[d] + rotated * sin[d]));
  }
}
#pragma GCC pop_options

// One sequence's share of a layer's attention pass (attention_batch).
struct AttentionSeq {
  const c10::BFloat16* qkv;  // its rows of the pass's qkv
  c10::BFloat16 *keys, *values;  // this layer's cache of the sequence, [KV, max_len, D]
  int64_t max_len, start, m;
  float* q;                  // [m, H, D]: its queries after RoPE
  c10::BFloat16* out;        // its rows of the output
};

// A task of attention_batch: rows r0..r1-1 of one sequence x query heads h0..h1-1 (of one KV head).
struct AttentionUnit {
  int64_t seq, r0, r1, h0, h1;
};

// One layer's attention for several sequences in one parallel loop: sequence s has sizes[s] rows at positions
// starts[s].. of its own cache (keys[s], values[s]: [layers, KV, max_len, D] bf16, of which layer `layer` is read; k
// after RoPE and v are written at those positions; the layer is picked by pointer: a select() per layer and sequence
// put two dispatcher calls on the step's path for nothing); its rows sit one after another in qkv [rows, (H + 2 KV) * D] bf16; cos, sin
// [positions, D] f32 (sin with its first half negated). Row r of a sequence attends over exactly its positions
// 0..start+r, in f32; a row's bits are its own, whatever shares the pass. Returns [rows, H * D] bf16 (rows past the
// sequences' are 0). Tasks: a row of several (verification, prefill) reads a KV head's keys once for up to
// kUnitRows rows x that head's query heads (attend_queries); a one-row sequence (decode) runs one task per query
// head, so the rows of a batched decode step share one loop over both threads (one task per KV head for the
// one-row sequences of a batch gained nothing: docs/benchmarks.md "Batched decode steps").
at::Tensor attention_batch(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                           const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes, int64_t num_heads,
                           int64_t num_kv_heads, double scale, int64_t layer, double* rope_seconds = nullptr) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(), "qkv: expected contiguous bf16");
  TORCH_CHECK(!keys.empty() && keys.size() == values.size() && keys.size() == starts.size() && keys.size() == sizes.size(),
              "attention: one cache, start and size per sequence");
  TORCH_CHECK(keys[0].dim() == 4 && layer >= 0 && layer < keys[0].size(0), "keys: expected [layers, KV, max_len, D]");
  int64_t rows = qkv.size(0), D = keys[0].size(3), groups = num_heads / num_kv_heads, width = qkv.size(1);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv/cache shapes disagree");
  int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TORCH_CHECK(total <= rows, "more rows in the sequences than in qkv");
  std::vector<float> q(total * num_heads * D);
  // every (row, head) of the sequences is written by exactly one task: only the padding rows are zeroed here
  at::Tensor out = at::empty({rows, num_heads * D}, qkv.options());
  std::memset(out.data_ptr<c10::BFloat16>() + total * num_heads * D, 0, (rows - total) * num_heads * D * sizeof(c10::BFloat16));
  std::vector<AttentionSeq> seqs;
  int64_t offset = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor &k = keys[i], &v = values[i];
    TORCH_CHECK(k.scalar_type() == at::kBFloat16 && k.is_contiguous() && v.scalar_type() == at::kBFloat16 && v.is_contiguous() &&
                    k.dim() == 4 && k.sizes() == v.sizes() && layer < k.size(0) && k.size(1) == num_kv_heads && k.size(3) == D,
                "keys, values: expected contiguous bf16 [layers, KV, max_len, D]");
    int64_t start = starts[i], m = sizes[i], max_len = k.size(2), at_layer = layer * num_kv_heads * max_len * D;
    TORCH_CHECK(start >= 0 && m >= 0 && start + m <= max_len && start + m <= cos.size(0), "positions out of range");
    seqs.push_back({qkv.data_ptr<c10::BFloat16>() + offset * width, k.data_ptr<c10::BFloat16>() + at_layer,
                    v.data_ptr<c10::BFloat16>() + at_layer, max_len, start, m, q.data() + offset * num_heads * D,
                    out.data_ptr<c10::BFloat16>() + offset * num_heads * D});
    offset += m;
  }
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  auto rope_begin = std::chrono::steady_clock::now();
  for (const AttentionSeq& a : seqs) {
    for (int64_t r = 0; r < a.m; ++r) {
      const c10::BFloat16* row = a.qkv + r * width;
      const float *c = cp + (a.start + r) * D, *s = sp + (a.start + r) * D;
      for (int64_t h = 0; h < num_heads; ++h) rope(row + h * D, c, s, D, a.q + (r * num_heads + h) * D);
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        rope(row + (num_heads + g) * D, c, s, D, a.keys + (g * a.max_len + a.start + r) * D);
        std::memcpy(a.values + (g * a.max_len + a.start + r) * D, row + (num_heads + num_kv_heads + g) * D,
                    D * sizeof(c10::BFloat16));
      }
    }
  }
  if (rope_seconds != nullptr)
    *rope_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - rope_begin).count();
  // head sizes of 1, 2, 4 or 8 vectors: attend_queries (the sums in registers); others: a dot product per key
  int64_t vectors = D % kLanes == 0 ? D / kLanes : 0;
  bool fast = vectors == 1 || vectors == 2 || vectors == 4 || vectors == 8;
  constexpr int64_t kUnitRows = 8;
  std::vector<AttentionUnit> units;
  int64_t most_queries = 1, most_keys = 0, work = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    int64_t m = seqs[i].m, start = seqs[i].start;
    most_keys = std::max(most_keys, start + m);
    work += m * num_heads * (start + m) * D;
    if (fast && m > 1) {  // about three tasks per thread at k+1 = 4..8 rows
      int64_t unit_rows = std::clamp<int64_t>(m / 2, 1, kUnitRows);
      most_queries = std::max(most_queries, unit_rows * groups);
      for (int64_t g = 0; g < num_kv_heads; ++g)
        for (int64_t r0 = 0; r0 < m; r0 += unit_rows)
          units.push_back({static_cast<int64_t>(i), r0, std::min(m, r0 + unit_rows), g * groups, (g + 1) * groups});
    } else {
      if (fast) most_queries = std::max(most_queries, groups);  // a chunk's run of one KV head's queries (below)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t h = 0; h < num_heads; ++h) units.push_back({static_cast<int64_t>(i), r, r + 1, h, h + 1});
    }
  }
  if (units.empty()) return out;
  int64_t stride = most_keys + kLanes, units_count = static_cast<int64_t>(units.size());
  int64_t grain = std::max<int64_t>(1, 32768 * units_count / std::max<int64_t>(work, 1));  // tiny passes: one thread
  float sc = static_cast<float>(scale);
  specdeploy::step_team::parallel_for(0, units_count, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(most_queries * stride), acc(most_queries * D);
    for (int64_t u = begin; u < end; ++u) {
      AttentionUnit t = units[u];
      const AttentionSeq& a = seqs[t.seq];
      int64_t g = t.h0 / groups;
      // The one-row tasks a chunk holds of one row and KV head run as one (attend_queries: their scores and values
      // share each key's and value's loads, as a pass of several rows does), instead of reading that head's cache
      // once per query head: each query's arithmetic is its own either way, so the bits are those of one task each.
      // The tasks stay one per query head so that the chunks split a decode step's heads evenly between the threads.
      if (fast && t.r1 - t.r0 == 1)
        for (; u + 1 < end && units[u + 1].seq == t.seq && units[u + 1].r0 == t.r0 && units[u + 1].h0 == t.h1 &&
               units[u + 1].h0 / groups == g;
             ++u)
          t.h1 = units[u + 1].h1;
      const c10::BFloat16* key = a.keys + g * a.max_len * D;
      const c10::BFloat16* value = a.values + g * a.max_len * D;
      switch (fast ? vectors : 0) {
        case 1: attend_queries<1>(a.q, num_heads, key, value, a.start, t.r0, t.r1, t.h0, t.h1, sc, p.data(), stride, acc.data(), a.out); break;
        case 2: attend_queries<2>(a.q, num_heads, key, value, a.start, t.r0, t.r1, t.h0, t.h1, sc, p.data(), stride, acc.data(), a.out); break;
        case 4: attend_queries<4>(a.q, num_heads, key, value, a.start, t.r0, t.r1, t.h0, t.h1, sc, p.data(), stride, acc.data(), a.out); break;
        case 8: attend_queries<8>(a.q, num_heads, key, value, a.start, t.r0, t.r1, t.h0, t.h1, sc, p.data(), stride, acc.data(), a.out); break;
        default: {  // one row, one head: a dot product per key
          int64_t r = t.r0, h = t.h0, n = a.start + r + 1;
          const float* qh = a.q + (r * num_heads + h) * D;
          float mx = -INFINITY;
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j] = dot(qh, key + j * D, D) * sc);
          float sum = softmax_numerators(p.data(), n, mx);
          std::fill(acc.begin(), acc.begin() + D, 0.0f);
          for (int64_t j = 0; j < n; ++j) {
            float w = p[j] / sum;
            const c10::BFloat16* vj = value + j * D;
            for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(vj[d]);
          }
          for (int64_t d = 0; d < D; ++d) a.out[r * num_heads * D + h * D + d] = c10::BFloat16(acc[d]);
        }
      }
    }
  });
  return out;
}

// One layer's attention for rows 0..m-1 at positions start.. of one sequence (attention_batch of one sequence;
// qkv's rows past m are padding, their output rows 0).
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                     at::Tensor& values, int64_t start, int64_t m, int64_t num_heads, int64_t num_kv_heads,
                     double scale) {
  return attention_batch(qkv, cos, sin, {keys.unsqueeze(0)}, {values.unsqueeze(0)}, {start}, {m}, num_heads, num_kv_heads,
                         scale, 0);
}

}  // namespace

namespace specdeploy {

// One linear layer's packed weight and the rest of `linear`'s arguments.
struct LinearParams {
  at::Tensor packed;
  int64_t kind = 0, n = 0, group_size = 0;
  std::optional<at::Tensor> group_scale, pre_quant_scale, out_scale, bias;
  double act_scale = 0.0;

  // the arguments of set_linear (Decoder, Eagle3Head) as Python passes them (kernels.NativeLinear.args)
  static LinearParams of(at::Tensor packed, int64_t kind, int64_t n, std::optional<at::Tensor> group_scale,
                         int64_t group_size, std::optional<at::Tensor> pre_quant_scale, double act_scale,
                         std::optional<at::Tensor> out_scale, std::optional<at::Tensor> bias) {
    return LinearParams{std::move(packed), kind, n, group_size, std::move(group_scale), std::move(pre_quant_scale),
                        std::move(out_scale), std::move(bias), act_scale};
  }

  at::Tensor operator()(const at::Tensor& x, const std::optional<at::Tensor>& residual = std::nullopt) const {
    TORCH_CHECK(packed.defined(), "a linear layer of the decoder was not set");
    return linear(x, packed, kind, n, group_scale, group_size, pre_quant_scale, act_scale, out_scale, bias, residual);
  }
};

// Per-part seconds of a native call summed since reset(true) (set_profile; bench/round_profile.py), off by default:
// then no clock is read. A call takes start() and marks each part's end.
struct PartSeconds {
  using Clock = std::chrono::steady_clock;
  bool on = false;
  std::vector<double> seconds;

  explicit PartSeconds(int64_t parts) : seconds(parts, 0.0) {}
  void reset(bool profiling) {
    on = profiling;
    std::fill(seconds.begin(), seconds.end(), 0.0);
  }
  at::Tensor tensor() const { return at::tensor(seconds, at::kDouble); }

  struct Marks {  // mark(part): the time since the last mark (or the start) goes to part
    PartSeconds& owner;
    Clock::time_point last;
    void operator()(int part) {
      if (!owner.on) return;
      Clock::time_point now = Clock::now();
      owner.seconds[part] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };
  Marks start() { return Marks{*this, on ? Clock::now() : Clock::time_point{}}; }
};

struct LayerParams {
  at::Tensor input_norm, post_norm;
  LinearParams qkv, o, gate_up, down;
  LinearParams gate, up;  // instead of gate_up where the checkpoint's scales keep them apart (int8_sq)
};

// The decoder layers of an engine in one call, with the same ops in the same order as CpuEngine's layer
// loop over the single kernels above, so without a Python round trip per op (docs/stages.md "2. build"). Python sets
// it up once, then calls forward per chunk.
struct Decoder : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads;
  double scale, eps;
  at::Tensor cos, sin;
  std::vector<LayerParams> layers;
  // per-op seconds: norms, qkv, rope+kv, attention, o, gate_up, swiglu, down, capture, calls
  PartSeconds clock{10};

  Decoder(int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, double scale, double eps, at::Tensor cos,
          at::Tensor sin)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), scale(scale), eps(eps), cos(std::move(cos)),
        sin(std::move(sin)), layers(num_layers) {}

  void set_norms(int64_t layer, at::Tensor input_norm, at::Tensor post_norm) {
    layers.at(layer).input_norm = std::move(input_norm);
    layers.at(layer).post_norm = std::move(post_norm);
  }

  void set_linear(int64_t layer, const std::string& name, at::Tensor packed, int64_t kind, int64_t n,
                  std::optional<at::Tensor> group_scale, int64_t group_size, std::optional<at::Tensor> pre_quant_scale,
                  double act_scale, std::optional<at::Tensor> out_scale, std::optional<at::Tensor> bias) {
    LayerParams& l = layers.at(layer);
    LinearParams* target = name == "qkv" ? &l.qkv : name == "o" ? &l.o : name == "gate_up" ? &l.gate_up
                           : name == "down" ? &l.down : name == "gate" ? &l.gate : name == "up" ? &l.up : nullptr;
    TORCH_CHECK(target != nullptr, "unknown linear ", name);
    *target = LinearParams::of(std::move(packed), kind, n, std::move(group_scale), group_size,
                               std::move(pre_quant_scale), act_scale, std::move(out_scale), std::move(bias));
  }

  void set_profile(bool on) { clock.reset(on); }
  at::Tensor profile() const { return clock.tensor(); }

  // x [rows, hidden] bf16 -> the hidden states after every layer; keys/values [layers, KV, max_len, D] f32.
  // The whole step on one OpenMP team (step_team.h): its parallel loops wake no sleeping thread.
  at::Tensor forward(at::Tensor x, at::Tensor keys, at::Tensor values, int64_t start, int64_t m) {
    step_team::run_step([&] { x = layers_forward_batch(x, {keys}, {values}, {start}, {m}); });
    return x;
  }

  // Several sequences' rows in one step (in-flight batching): x holds sizes[s] rows of each sequence s in turn,
  // keys[s] / values[s] its cache, starts[s] its first new position. Row-wise ops run once over all rows,
  // attention per sequence over its own cache: each sequence's bits are those of forward on it alone.
  at::Tensor forward_batch(at::Tensor x, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                           std::vector<int64_t> starts, std::vector<int64_t> sizes) {
    return std::get<0>(forward_capture(std::move(x), std::move(keys), std::move(values), std::move(starts),
                                       std::move(sizes), {}));
  }

  // forward_batch that also returns the sequences' rows (not padding) of x after each layer of `capture` (ascending
  // layer ids: an EAGLE-3 head's auxiliary layers), copied out between layers in the same step: the same bits.
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward_capture(at::Tensor x, std::vector<at::Tensor> keys,
                                                                  std::vector<at::Tensor> values, std::vector<int64_t> starts,
                                                                  std::vector<int64_t> sizes, std::vector<int64_t> capture) {
    TORCH_CHECK(keys.size() == values.size() && keys.size() == starts.size() && keys.size() == sizes.size(),
                "forward_batch: one cache, start and size per sequence");
    std::vector<at::Tensor> captured;
    step_team::run_step([&] { x = layers_forward_batch(x, keys, values, starts, sizes, &capture, &captured); });
    return {x, captured};
  }

  at::Tensor layers_forward_batch(at::Tensor x, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                  const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                                  const std::vector<int64_t>* capture = nullptr, std::vector<at::Tensor>* captured = nullptr) {
    int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    PartSeconds::Marks mark = clock.start();
    double rope_seconds = 0.0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const LayerParams& l = layers[i];
      at::Tensor normed = rms_norm(x, l.input_norm, eps);
      mark(0);
      at::Tensor qkv = l.qkv(normed);
      mark(1);
      // one sequence: its rows may include padding past sizes[0]
      at::Tensor attn = attention_batch(qkv, cos, sin, keys, values, starts, sizes, num_heads, num_kv_heads, scale,
                                        static_cast<int64_t>(i), clock.on ? &rope_seconds : nullptr);
      mark(3);  // rope_seconds moves from attention to rope+kv below
      x = l.o(attn, x);
      mark(4);
      at::Tensor h = rms_norm(x, l.post_norm, eps);
      mark(0);
      // unfused (int8_sq): swiglu of gate and up apart has the bits of torch's silu(gate) * up (CpuEngine's unfused
      // loop), with no [rows, 2I] copy of the two
      at::Tensor act;
      if (l.gate_up.packed.defined()) {
        at::Tensor gate_up = l.gate_up(h);
        mark(5);
        act = swiglu(gate_up, std::nullopt);
      } else {
        at::Tensor gate = l.gate(h), up = l.up(h);
        mark(5);
        act = swiglu(gate, up);
      }
      mark(6);
      x = l.down(act, x);
      mark(7);
      if (capture != nullptr && std::find(capture->begin(), capture->end(), static_cast<int64_t>(i)) != capture->end())
        captured->push_back(x.narrow(0, 0, total).clone());
      mark(8);
    }
    if (clock.on) {
      clock.seconds[2] += rope_seconds;
      clock.seconds[3] -= rope_seconds;
      clock.seconds[9] += 1;
    }
    return x;
  }
};

// An EAGLE-3 head's forward in one call (engine/eagle3.py Eagle3Head.forward_batch, whose ops it runs in the same
// order with the same kernels, so with the same bits; the math is in that module's docstring): the rows of several
// sequences, each with its own one-layer KV cache, through fc (the rows of a catch-up), the layer, and the final norm
// and LM head of each sequence's last row, on one step team. A round's ~12 native and torch calls per head pass, each
// with its Python and its parallel loops' wake-ups, become one.
struct Eagle3Head : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads;
  double scale, eps;
  at::Tensor cos, sin, embedding;  // rope tables [positions, D] f32; the target's embedding [vocab, hidden] bf16
  at::Tensor input_norm, hidden_norm, post_norm, final_norm;  // final_norm undefined: the head has none
  LinearParams fc, qkv, o, gate_up, down, lm_head;
  PartSeconds clock{4};  // per-part seconds: fc, layer, lm head (with the final norm), calls

  Eagle3Head(int64_t num_heads, int64_t num_kv_heads, double scale, double eps, at::Tensor cos, at::Tensor sin,
             at::Tensor embedding)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), scale(scale), eps(eps), cos(std::move(cos)),
        sin(std::move(sin)), embedding(std::move(embedding)) {
    TORCH_CHECK(this->embedding.dim() == 2 && this->embedding.scalar_type() == at::kBFloat16 && this->embedding.is_contiguous(),
                "embedding: expected contiguous bf16 [vocab, hidden]");
  }

  void set_norms(at::Tensor input, at::Tensor hidden, at::Tensor post, std::optional<at::Tensor> final) {
    int64_t H = embedding.size(1);
    for (const at::Tensor* w : {&input, &hidden, &post})
      TORCH_CHECK(w->scalar_type() == at::kBFloat16 && w->is_contiguous() && w->numel() == H, "norms: expected bf16 [hidden]");
    input_norm = std::move(input);
    hidden_norm = std::move(hidden);
    post_norm = std::move(post);
    final_norm = final.has_value() ? std::move(*final) : at::Tensor();
  }

  void set_linear(const std::string& name, at::Tensor packed, int64_t kind, int64_t n, std::optional<at::Tensor> group_scale,
                  int64_t group_size, std::optional<at::Tensor> pre_quant_scale, double act_scale,
                  std::optional<at::Tensor> out_scale, std::optional<at::Tensor> bias) {
    LinearParams* target = name == "fc" ? &fc : name == "qkv" ? &qkv : name == "o" ? &o : name == "gate_up" ? &gate_up
                           : name == "down" ? &down : name == "lm_head" ? &lm_head : nullptr;
    TORCH_CHECK(target != nullptr, "unknown linear ", name);
    *target = LinearParams::of(std::move(packed), kind, n, std::move(group_scale), group_size,
                               std::move(pre_quant_scale), act_scale, std::move(out_scale), std::move(bias));
  }

  void set_profile(bool on) { clock.reset(on); }
  at::Tensor profile() const { return clock.tensor(); }

  // inputs: the rows' features in blocks, one after the other: a block with project[i] holds the target's aux features
  // [n, L * hidden] (fc makes them head features, all such blocks in one fc call), any other the head's features
  // [n, hidden] bf16. tokens [rows] int64: the token after each row. Sequence s has sizes[s] of the rows in turn, at
  // positions starts[s].. of its cache keys[s] / values[s] ([1, KV, max_len, D] bf16). Returns the logits of each
  // sequence's last row [sequences, vocab] f32 and the prenorm states [rows, hidden] bf16; writes the caches' rows.
  std::tuple<at::Tensor, at::Tensor> forward(std::vector<at::Tensor> inputs, std::vector<int64_t> project, at::Tensor tokens,
                                             std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                             std::vector<int64_t> starts, std::vector<int64_t> sizes) {
    TORCH_CHECK(!inputs.empty() && inputs.size() == project.size(), "head forward: one project flag per input block");
    TORCH_CHECK(!keys.empty() && keys.size() == values.size() && keys.size() == starts.size() && keys.size() == sizes.size(),
                "head forward: one cache, start and size per sequence");
    int64_t rows = std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), H = embedding.size(1);
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.numel() == rows,
                "tokens: expected int64 [rows]");
    tokens = tokens.contiguous();
    const int64_t* ids = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(ids[r] >= 0 && ids[r] < embedding.size(0), "token id ", ids[r], " outside the embedding");
    at::Tensor logits, prenorm;
    step_team::run_step([&] {
      PartSeconds::Marks mark = clock.start();
      at::Tensor features = head_features(inputs, project, rows, H);  // [rows, H]
      TORCH_CHECK(features.scalar_type() == at::kBFloat16 && features.dim() == 2 && features.size(0) == rows &&
                      features.size(1) == H && features.is_contiguous(),
                  "head forward: the input blocks do not hold bf16 [rows, hidden] features");
      if (std::any_of(project.begin(), project.end(), [](int64_t p) { return p != 0; })) mark(0);  // else: the layer's
      // x = cat(input_norm(embed(token)), hidden_norm(feature)), each half normed in place
      at::Tensor x = at::empty({rows, 2 * H}, features.options());
      const c10::BFloat16 *table = embedding.data_ptr<c10::BFloat16>(), *fp = features.data_ptr<c10::BFloat16>();
      c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
      for (int64_t r = 0; r < rows; ++r) {
        rms_norm_row(table + ids[r] * H, input_norm.data_ptr<c10::BFloat16>(), H, eps, xp + r * 2 * H);
        rms_norm_row(fp + r * H, hidden_norm.data_ptr<c10::BFloat16>(), H, eps, xp + r * 2 * H + H);
      }
      at::Tensor attn = attention_batch(qkv(x), cos, sin, keys, values, starts, sizes, num_heads, num_kv_heads, scale, 0);
      at::Tensor h = o(attn, features);
      prenorm = down(swiglu(gate_up(rms_norm(h, post_norm, eps)), std::nullopt), h);  // [rows, H]
      mark(1);
      at::Tensor last_rows = at::empty({static_cast<int64_t>(sizes.size()), H}, prenorm.options());  // [sequences, H]
      int64_t end = 0;
      for (size_t s = 0; s < sizes.size(); ++s) {
        end += sizes[s];
        TORCH_CHECK(sizes[s] > 0, "head forward: a sequence without rows");
        std::memcpy(last_rows.data_ptr<c10::BFloat16>() + s * H, prenorm.data_ptr<c10::BFloat16>() + (end - 1) * H,
                    H * sizeof(c10::BFloat16));
      }
      if (final_norm.defined()) last_rows = rms_norm(last_rows, final_norm, eps);
      logits = lm_head(last_rows).to(at::kFloat);
      mark(2);
    });
    if (clock.on) clock.seconds[3] += 1;
    return {logits, prenorm};
  }

  // The head features [rows, H] of forward's input blocks: the projected blocks through fc together, in one call.
  at::Tensor head_features(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& project, int64_t rows, int64_t H) {
    std::vector<at::Tensor> aux;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (project[i]) aux.push_back(inputs[i].contiguous());
    if (aux.size() == inputs.size() && aux.size() == 1) return fc(aux[0]);  // a catch-up alone
    if (aux.empty() && inputs.size() == 1) return inputs[0].contiguous();  // a draft step alone
    at::Tensor projected = aux.empty() ? at::Tensor() : fc(aux.size() == 1 ? aux[0] : at::cat(aux));
    at::Tensor features = at::empty({rows, H}, embedding.options());
    int64_t row = 0, taken = 0;  // rows written; rows of `projected` used
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor block = project[i] ? projected.narrow(0, taken, inputs[i].size(0)) : inputs[i].contiguous();
      TORCH_CHECK(block.size(1) == H && row + block.size(0) <= rows, "head forward: input blocks do not hold the rows");
      std::memcpy(features.data_ptr<c10::BFloat16>() + row * H, block.data_ptr<c10::BFloat16>(),
                  block.numel() * sizeof(c10::BFloat16));
      row += block.size(0);
      if (project[i]) taken += block.size(0);
    }
    TORCH_CHECK(row == rows, "head forward: ", row, " input rows for ", rows, " sequence rows");
    return features;
  }
};

}  // namespace specdeploy

// A standing team around several ops (step_team::Standing): team_open() -> whether this call opened it;
// team_close() only after a team_open() that returned true, on the same thread.
static bool team_open() { return specdeploy::step_team::Standing::get().open(); }
static void team_close() { specdeploy::step_team::Standing::get().close(); }

TORCH_LIBRARY(specdeploy_cpu, ops) {
  ops.class_<specdeploy::Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>())
      .def("set_norms", &specdeploy::Decoder::set_norms)
      .def("set_linear", &specdeploy::Decoder::set_linear)
      .def("forward", &specdeploy::Decoder::forward)
      .def("forward_batch", &specdeploy::Decoder::forward_batch)
      .def("forward_capture", &specdeploy::Decoder::forward_capture)
      .def("set_profile", &specdeploy::Decoder::set_profile)
      .def("profile", &specdeploy::Decoder::profile);
  ops.class_<specdeploy::Eagle3Head>("Eagle3Head")
      .def(torch::init<int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("set_norms", &specdeploy::Eagle3Head::set_norms)
      .def("set_linear", &specdeploy::Eagle3Head::set_linear)
      .def("forward", &specdeploy::Eagle3Head::forward)
      .def("set_profile", &specdeploy::Eagle3Head::set_profile)
      .def("profile", &specdeploy::Eagle3Head::profile);
  ops.def("team_open", &team_open);
  ops.def("team_close", &team_close);
  ops.def("pack", &pack);
  ops.def("k_multiple", &k_multiple);
  ops.def("linear", &linear);
  ops.def("rms_norm", &rms_norm);
  ops.def("swiglu(Tensor gate_up, Tensor? up=None) -> Tensor", &swiglu);
  ops.def("screen_logits", &screen_logits);
  ops.def("screen_logits_int8", &screen_logits_int8);
  ops.def(
      "attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int start, int m, "
      "int num_heads, int num_kv_heads, float scale) -> Tensor",
      &attention);
}
