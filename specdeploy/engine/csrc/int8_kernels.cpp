// INT8 SmoothQuant (W8A8_SQ_PER_CHANNEL) on integer dot products (issue 25); see specdeploy/engine/native.py.
//
// y = bf16(f32(sum_k q_x[m, k] * q_w[n, k]) * scale + bias (+ residual)), the sum in int32 (exact), where
//   q_w   int8 weights [N, K] with a per-channel scale (the engine's weight_scale),
//   q_x   int8 activations quantized in this call (the "fused" prologue), per tensor with the engine's static
//         act_scale (what ModelOpt exports), or per token with a dynamic scale (TensorRT-LLM's per-token mode),
//   scale f32: act_scale * weight_scale[n] (static, computed once at load) or
//         token_scale[m] * weight_scale[n] (per token; this order of the two products is our choice: TensorRT-LLM's
//         CUTLASS epilogue was not checked for it).
//
// Numerics of the activation quantization, as TensorRT-LLM defines them (NVIDIA/TensorRT-LLM):
//   * rounding and clamp: cpp/tensorrt_llm/common/cudaTypeUtils.cuh, `cuda_cast<int8_t, float>` (commit 03cff08):
//     PTX `cvt.rni.sat.s8.f32`: round to nearest, ties to even, then saturate to [-128, 127] (so -128 occurs).
//   * per tensor: cpp/tensorrt_llm/kernels/quantization.cuh, `quantizedKernel` (commit 0193dbd): q = cvt(x * s)
//     with s = 1 / act_scale (the "scale_orig_quant" it is given): a multiply by the reciprocal, not a division.
//   * per token: the same file, `perTokenQuantization`: row_max = max(T(1e-6), max_k |x[k]|) in the activation
//     type T (bf16 here), token scale = row_max / 127, q = cvt(x * (127 / row_max)), both divisions in f32.
//   * smoothing: tensorrt_llm/quantization/layers.py (SmoothQuantMLP.forward: `inter / smoother` in the activation
//     dtype, then quantize_tensor / quantize_per_token); ModelOpt exports the factors as pre_quant_scale (the
//     multiplier), which this engine applies as bf16(x * pre_quant_scale) before quantizing (one bf16 rounding, as
//     TensorRT-LLM's division in bf16; the two can differ in the last bit of that bf16 value).
//
// Three variants of the dot products, one binary (functions compiled per instruction set with `#pragma GCC
// target`), chosen per call by `variant` (native.py picks it once from the CPU's flags when the engine loads):
//   0 AVX2         VPMOVSXBW (weights to int16) + VPMADDWD against int16 activations: 16 products per VPMADDWD
//   1 AVX-VNNI     VPDPBUSD ymm: u8 (q_x + 128) x s8 weights into int32, 32 products per instruction; the
//                  epilogue subtracts 128 * sum_k q_w[n, k] (computed at pack time), exact
//   2 AVX512-VNNI  the same on zmm, 64 products per instruction, with 16 channels in each accumulator (a row's
//                  4 activation bytes broadcast against 4 bytes of K of 16 channels): no lane sums to add
// Every variant reduces to the same int32 per (row, channel) and runs the same prologue, and the same epilogue
// operations per output (SSE on four outputs, `store4`; AVX-512 on sixteen, `store16`), so results are
// bit-identical across variants, tile shapes and row counts (a row never depends on the other rows: its
// quantization scale is per tensor or its own).
//
// Packed weights (`int8_pack(weight, variant)`): K padded with zeros to a multiple of kStep = 64, then N int32:
// each channel's sum of weights (for the VNNI offset). The channels:
//   AVX2, AVX-VNNI  in blocks of four (the last N % 4 alone); within a block, for each 64-byte step of K, that
//                   step's 64 bytes of each channel in turn;
//   AVX512-VNNI     in blocks of 16 (the last one padded with zero channels); within a block, for each 4 bytes of
//                   K, those 4 bytes of each of the 16 channels in turn: 64 bytes, one vector (the layout of the
//                   rows of an AMX B tile).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "exact_float.h"
#include "step_team.h"

// The epilogue's multiply and add must stay two roundings in every variant (no FMA contraction), as the
// reference computes them.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kStep = 64;   // K bytes per packed chunk
constexpr int64_t kBlock = 4;   // output channels per packed block (AVX2, AVX-VNNI)
constexpr int64_t kLanes = 16;  // output channels per packed block (AVX512-VNNI)
enum Variant : int64_t { kAvx2 = 0, kAvxVnni = 1, kAvx512Vnni = 2 };

inline int64_t padded(int64_t K) { return (K + kStep - 1) / kStep * kStep; }

// f(integral_constant<0>) .. f(integral_constant<N - 1>): a register tile's loops unrolled with constant indices from
// the start, so that GCC (12) keeps the tile's array of accumulators in registers from its first passes on (its
// early scalarization precedes `#pragma GCC unroll`, which left the array to later passes).
template <class F, std::size_t... I>
inline __attribute__((always_inline)) void unroll_each(F&& f, std::index_sequence<I...>) {
  (f(std::integral_constant<int64_t, I>{}), ...);
}
template <int64_t N, class F>
inline __attribute__((always_inline)) void unroll(F&& f) {
  unroll_each(f, std::make_index_sequence<N>{});
}

using ::specdeploy::ExactFloatMode;  // exact_float.h: scales and products stay exact IEEE f32

struct Out {
  const float* out_scale;          // [N]
  const float* row_scale;          // [M] (per token) or nullptr (per tensor: folded into out_scale)
  const int32_t* wsum;             // [N] sum of each channel's weights
  const float* bias;               // [N] or nullptr
  const c10::BFloat16* residual;   // [M, N] or nullptr
  c10::BFloat16* y;                // [M, N]
  int64_t N;
};

// f32 -> bf16 bits (round to nearest even, as c10::BFloat16 for finite values), four at a time, in the low 64 bits.
inline __m128i f32_to_bf16x4(__m128 v) {
  __m128i bits = _mm_castps_si128(v);
  __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(_mm_set1_epi32(0x7fff), lsb)), 16);
  return _mm_packus_epi32(rounded, rounded);  // values < 2^16: no saturation
}

inline __m128 bf16x4_to_f32(__m128i bits) { return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16)); }

// Outputs (m, n .. n + count) from their int32 sums, count 4 (a block) or 1 (the last N % 4 channels). Every variant
// runs this same sequence of exact-IEEE SSE operations (no FMA contraction in this file), so the float rescale
// gives the same bits whatever computed the sums.
inline void store4(const Out& o, int64_t m, int64_t n, __m128i sums, int64_t count, bool offset) {
  c10::BFloat16* y = o.y + m * o.N + n;
  const c10::BFloat16* res = o.residual ? o.residual + m * o.N + n : nullptr;
  __m128 scale, bias = _mm_setzero_ps(), resid = _mm_setzero_ps();
  __m128i ws = _mm_setzero_si128();
  if (count == 4) {
    scale = _mm_loadu_ps(o.out_scale + n);
    if (offset) ws = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o.wsum + n));
    if (o.bias) bias = _mm_loadu_ps(o.bias + n);
    if (res) resid = bf16x4_to_f32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(res)));
  } else {
    scale = _mm_set_ss(o.out_scale[n]);
    if (offset) ws = _mm_cvtsi32_si128(o.wsum[n]);
    if (o.bias) bias = _mm_set_ss(o.bias[n]);
    if (res) resid = _mm_set_ss(static_cast<float>(res[0]));
  }
  if (offset) sums = _mm_sub_epi32(sums, _mm_slli_epi32(ws, 7));  // VPDPBUSD summed (q + 128) * w
  if (o.row_scale) scale = _mm_mul_ps(_mm_set1_ps(o.row_scale[m]), scale);
  __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(sums), scale);
  if (o.bias) v = _mm_add_ps(v, bias);
  if (res) v = _mm_add_ps(resid, bf16x4_to_f32(f32_to_bf16x4(v)));
  __m128i out = f32_to_bf16x4(v);
  if (count == 4) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(y), out);
  } else {
    uint16_t bits = static_cast<uint16_t>(_mm_extract_epi16(out, 0));
    std::memcpy(y, &bits, 2);
  }
}

inline __m256 load_bf16x8(const c10::BFloat16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// f32 -> nearest bf16 (ties to even) -> f32, for finite values (as c10::BFloat16).
inline __m256 round_bf16x8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline int8_t quantize1(float v, float mult) {
  return static_cast<int8_t>(std::clamp(std::nearbyint(v * mult), -128.0f, 127.0f));  // RNE, then saturate
}

// The activation quantization of every variant: q [M, Kp] int8 (zeros past K) and, per token, row_scale [M].
// act_scale > 0: per tensor, q = sat(rne(v * (1 / act_scale))); else per token (see the file's comment), where
// v = bf16(x * pre_quant_scale) (or x without one).
void quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, const float* pqs, float act_scale,
                   int8_t* q, float* row_scale) {
  std::vector<float> v(K);
  const float tiny = static_cast<float>(c10::BFloat16(1e-6f));  // TensorRT-LLM's T(1e-6f) floor of row_max
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = x + m * K;
    int64_t k = 0;
    __m256 amax8 = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
      __m256 t = load_bf16x8(row + k);
      if (pqs) t = round_bf16x8(_mm256_mul_ps(t, _mm256_loadu_ps(pqs + k)));
      _mm256_storeu_ps(v.data() + k, t);
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax8);
    float amax = tiny;
    for (float l : lanes) amax = std::max(amax, l);
    for (; k < K; ++k) {
      float t = static_cast<float>(row[k]);
      if (pqs) t = static_cast<float>(c10::BFloat16(t * pqs[k]));
      v[k] = t;
      amax = std::max(amax, std::fabs(t));
    }
    float mult;
    if (act_scale > 0) {
      mult = 1.0f / act_scale;
    } else {
      mult = 127.0f / amax;
      row_scale[m] = amax / 127.0f;
    }
    int8_t* qr = q + m * Kp;
    __m256 vm = _mm256_set1_ps(mult), lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
    for (k = 0; k + 8 <= K; k += 8) {
      __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v.data() + k), vm), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256i i32 = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
      __m256i i16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32, i32), 0x08);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + k), _mm_packs_epi16(_mm256_castsi256_si128(i16), _mm256_castsi256_si128(i16)));
    }
    for (; k < K; ++k) qr[k] = quantize1(v[k], mult);
    std::memset(qr + K, 0, Kp - K);
  }
}

}  // namespace

// ---------------------------------------------------------------- the three instruction sets

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace avx2 {
using XType = int16_t;  // activations sign-extended once per call
using Acc = __m256i;
constexpr bool kOffset = false;
constexpr int64_t kRowTile = 4;
template <int64_t R> constexpr int64_t kTileChannels = R <= 2 ? 4 : 2;  // 16 registers: 8 sums + 2 weight vectors
inline Acc acc_zero() { return _mm256_setzero_si256(); }

template <int64_t CB, int64_t RB>
inline void madd_step(Acc (&acc)[CB][RB], const XType* x, int64_t Kp, const int8_t* p) {
  for (int64_t s = 0; s < kStep; s += 16) {
    __m256i w[CB];
    unroll<CB>([&](auto j) {
      w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * kStep + s)));
    });
    unroll<RB>([&](auto i) {
      __m256i xi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * Kp + s));
      unroll<CB>([&](auto j) { acc[j][i] = _mm256_add_epi32(acc[j][i], _mm256_madd_epi16(xi, w[j])); });
    });
  }
}

inline __m128i hsum4(Acc a, Acc b, Acc c, Acc d) {
  __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

#include "int8_gemv.inc"
}  // namespace avx2
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
namespace {
namespace avxvnni {
using XType = uint8_t;  // q + 128
using Acc = __m256i;
constexpr bool kOffset = true;
constexpr int64_t kRowTile = 4;
template <int64_t R> constexpr int64_t kTileChannels = R <= 2 ? 4 : 2;
inline Acc acc_zero() { return _mm256_setzero_si256(); }

template <int64_t CB, int64_t RB>
inline void madd_step(Acc (&acc)[CB][RB], const XType* x, int64_t Kp, const int8_t* p) {
  unroll<kStep / 32>([&](auto s) {
    __m256i w[CB];
    unroll<CB>([&](auto j) { w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * kStep + s * 32)); });
    unroll<RB>([&](auto i) {
      __m256i xi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * Kp + s * 32));
      unroll<CB>([&](auto j) { acc[j][i] = _mm256_dpbusd_avx_epi32(acc[j][i], xi, w[j]); });
    });
  });
}

inline __m128i hsum4(Acc a, Acc b, Acc c, Acc d) {
  __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

#include "int8_gemv.inc"
}  // namespace avxvnni
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
namespace {
namespace avx512vnni {
// Its own weight layout (int8_pack(weight, kAvx512Vnni), see the file's comment): per block of 16 channels, each 4
// bytes of K for all 16 channels form one 64-byte vector, and a row's 4 activation bytes, broadcast, multiply it
// (VPDPBUSD): each accumulator holds 16 channels' sums, so no lane sums follow the products and the epilogue is 16
// outputs of one row in one vector: faster than 4-channel blocks and their horizontal sums (docs/benchmarks.md "The
// AVX-512 int8 layout").

constexpr int64_t kMaxRows = 8;  // rows of one register tile
// Blocks of a tile: 16 accumulators at most (the other 16 registers: weights and broadcast activations).
template <int64_t R> constexpr int64_t kTileBlocks = R <= 4 ? 4 : 2;
// Each block's bytes requested this far ahead of its loads (past a block's end: the next block's, contiguous): 8 rows
// cost less over one than without, 1,024 bytes gained less and a whole group ahead slowed 1 row (docs/benchmarks.md
// "The AVX-512 int8 layout").
constexpr int64_t kAhead = 4096;

// The products of rows [m, m + R) with CB consecutive blocks over all of K, each accumulator stored whole to `raw`.
// Out of line for the reason int8_gemv.inc's `tile` is.
template <int64_t CB, int64_t R>
__attribute__((noinline)) void tile16(const uint8_t* xa, int64_t Kp, const int8_t* w, int64_t m, __m512i (&raw)[CB][R]) {
  __m512i acc[CB][R];
  unroll<CB>([&](auto j) { unroll<R>([&](auto i) { acc[j][i] = _mm512_setzero_si512(); }); });
  const uint8_t* x0 = xa + m * Kp;
  const int64_t block_bytes = kLanes * Kp;
  for (int64_t k = 0; k < Kp; k += 16) {  // 16 bytes of K: 4 vectors of each block
    unroll<4>([&](auto s) {
      __m512i wv[CB];
      unroll<CB>([&](auto j) {
        wv[j] = _mm512_loadu_si512(w + j * block_bytes + (k + s * 4) * kLanes);
        asm("" : "+v"(wv[j]));  // one load per vector, not one per row (int8_gemv.inc's madd_step)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * block_bytes + (k + s * 4) * kLanes + kAhead), _MM_HINT_T0);
      });
      unroll<R>([&](auto i) {
        int32_t four;
        std::memcpy(&four, x0 + i * Kp + k + s * 4, 4);
        __m512i xi = _mm512_set1_epi32(four);  // the row's 4 bytes (u8: q + 128) in every lane
        unroll<CB>([&](auto j) { acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], xi, wv[j]); });
      });
    });
  }
  unroll<CB>([&](auto j) { unroll<R>([&](auto i) { raw[j][i] = acc[j][i]; }); });
}

// Outputs (m, n .. n + count), count <= 16, from their 16 int32 sums: store4's operations, element for element, on
// a 16-lane vector (masked past count), so the same bits as the other variants.
inline void store16(const Out& o, int64_t m, int64_t n, __m512i sums, int64_t count) {
  const __mmask16 k = count >= kLanes ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  __m512i ws = _mm512_maskz_loadu_epi32(k, o.wsum + n);
  sums = _mm512_sub_epi32(sums, _mm512_slli_epi32(ws, 7));  // VPDPBUSD summed (q + 128) * w
  __m512 scale = _mm512_maskz_loadu_ps(k, o.out_scale + n);
  if (o.row_scale) scale = _mm512_mul_ps(_mm512_set1_ps(o.row_scale[m]), scale);
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scale);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, o.bias + n));
  auto to_bf16 = [](__m512 f) {  // f32 -> bf16 bits (nearest, ties to even), as f32_to_bf16x4
    __m512i bits = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  };
  if (o.residual) {
    __m256i r = _mm256_maskz_loadu_epi16(k, o.residual + m * o.N + n);
    __m512 resid = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
    v = _mm512_add_ps(resid, _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16(v), 16)));
  }
  _mm256_mask_storeu_epi16(o.y + m * o.N + n, k, _mm512_cvtepi32_epi16(to_bf16(v)));  // values < 2^16
}

// Rows [m, m + R) x blocks [b, b + CB).
template <int64_t CB, int64_t R>
inline void run_tile(const uint8_t* xa, int64_t Kp, const int8_t* packed, int64_t b, int64_t m, const Out& o) {
  __m512i raw[CB][R];
  tile16<CB, R>(xa, Kp, packed + b * kLanes * Kp, m, raw);
  for (int64_t j = 0; j < CB; ++j) {
    int64_t n = (b + j) * kLanes, count = std::min(kLanes, o.N - n);
    for (int64_t i = 0; i < R; ++i) store16(o, m + i, n, raw[j][i], count);
  }
}

// A tile of `rows` (1 .. kMaxRows) rows and `blocks` (1 .. kTileBlocks) blocks: the instantiation of that shape.
template <int64_t R = kMaxRows>
inline void tile_any(int64_t rows, int64_t blocks, const uint8_t* xa, int64_t Kp, const int8_t* packed, int64_t b,
                     int64_t m, const Out& o) {
  if constexpr (R >= 1) {
    if (rows != R) return tile_any<R - 1>(rows, blocks, xa, Kp, packed, b, m, o);
    if constexpr (kTileBlocks<R> == 4) {
      if (blocks == 4) return run_tile<4, R>(xa, Kp, packed, b, m, o);
    }
    if (blocks >= 2) {
      run_tile<2, R>(xa, Kp, packed, b, m, o);
      if (blocks == 3) run_tile<1, R>(xa, Kp, packed, b + 2, m, o);
      return;
    }
    run_tile<1, R>(xa, Kp, packed, b, m, o);
  }
}

// All of y: threads split the blocks; for each group of a tile's blocks, every row tile of an L2-sized chunk of
// rows (the group's weights stay in L1/L2 while the row tiles re-read them).
void gemv(const uint8_t* xa, int64_t M, int64_t N, int64_t Kp, const int8_t* packed, const Out& out) {
  int64_t blocks = (N + kLanes - 1) / kLanes;
  int64_t chunk = std::max<int64_t>(kMaxRows, (int64_t{192} << 10) / Kp / kMaxRows * kMaxRows);
  int64_t group = M <= 4 ? kTileBlocks<4> : kTileBlocks<kMaxRows>;
  ::specdeploy::step_team::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    ExactFloatMode exact;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      int64_t m_end = std::min(M, m0 + chunk);
      for (int64_t b = begin; b < end; b += group) {
        int64_t count = std::min(group, end - b);
        for (int64_t m = m0; m < m_end; m += kMaxRows)
          tile_any(std::min(kMaxRows, m_end - m), count, xa, Kp, packed, b, m, out);
      }
    }
  });
}

}  // namespace avx512vnni
}  // namespace
#pragma GCC pop_options

namespace {

bool variant_supported(int64_t variant) {
  __builtin_cpu_init();
  switch (variant) {
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvxVnni: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni: return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  }
  return false;
}

// The variants this CPU runs (native.py picks one; tests compare all of them).
std::vector<int64_t> int8_variants() {
  std::vector<int64_t> out;
  for (int64_t v : {kAvx2, kAvxVnni, kAvx512Vnni})
    if (variant_supported(v)) out.push_back(v);
  return out;
}

// Bytes of a packed [N, K] weight for a variant: the blocks (N rounded up to whole blocks of 16 channels for
// AVX512-VNNI) and then N int32 weight sums.
int64_t packed_bytes(int64_t N, int64_t K, int64_t variant) {
  int64_t channels = variant == kAvx512Vnni ? (N + kLanes - 1) / kLanes * kLanes : N;
  return channels * padded(K) + 4 * N;
}

// [N, K] int8 -> the variant's packed bytes (see the file's comment), K any size.
at::Tensor int8_pack(const at::Tensor& weight, int64_t variant) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "weight: expected a contiguous int8 [N, K] tensor");
  TORCH_CHECK(variant >= kAvx2 && variant <= kAvx512Vnni, "int8 kernel variant ", variant, " does not exist");
  int64_t N = weight.size(0), K = weight.size(1), Kp = padded(K);
  at::Tensor packed = at::zeros({packed_bytes(N, K, variant)}, weight.options().dtype(at::kByte));
  const int8_t* src = weight.data_ptr<int8_t>();
  int8_t* dst = reinterpret_cast<int8_t*>(packed.data_ptr<uint8_t>());
  if (variant == kAvx512Vnni) {  // block b, 4 bytes of K at k: 64 bytes, channel c's 4 at (b * Kp + k) * 16 + 4 c
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; k += 4)
        std::memcpy(dst + (n / kLanes * Kp + k) * kLanes + n % kLanes * 4, src + n * K + k, std::min<int64_t>(4, K - k));
  } else {
    int64_t full = N / kBlock * kBlock;
    for (int64_t n0 = 0; n0 < N;) {
      int64_t width = n0 < full ? kBlock : 1;
      int8_t* block = dst + n0 * Kp;
      for (int64_t s = 0; s < Kp / kStep; ++s)
        for (int64_t j = 0; j < width; ++j) {
          int64_t k0 = s * kStep, count = std::max<int64_t>(0, std::min(kStep, K - k0));
          std::memcpy(block + (s * width + j) * kStep, src + (n0 + j) * K + k0, count);
        }
      n0 += width;
    }
  }
  std::vector<int32_t> wsum(N, 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wsum[n] += src[n * K + k];
  std::memcpy(dst + packed.numel() - 4 * N, wsum.data(), N * sizeof(int32_t));
  return packed;
}

const float* f32_arg(const std::optional<at::Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, name,
              ": expected a contiguous f32 tensor of ", numel, " elements");
  return t->data_ptr<float>();
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: expected contiguous bf16 [M, K]");
}

}  // namespace

namespace specdeploy {

// The prologue alone: (q [M, K] int8, token scales [M] f32; zeros with a per-tensor scale). For tests, and for the
// int8 LM screen (cpu_kernels.cpp screen_logits_int8), which needs the codes the kernel multiplies.
std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, const std::optional<at::Tensor>& pre_quant_scale,
                                                 double act_scale) {
  check_x(x);
  int64_t M = x.size(0), K = x.size(1), Kp = padded(K);
  at::Tensor q = at::empty({M, Kp}, x.options().dtype(at::kChar));
  at::Tensor scale = at::zeros({M}, x.options().dtype(at::kFloat));
  ExactFloatMode exact;
  quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, Kp, f32_arg(pre_quant_scale, K, "pre_quant_scale"),
                static_cast<float>(act_scale), q.data_ptr<int8_t>(), scale.data_ptr<float>());
  return {q.narrow(1, 0, K).contiguous(), scale};
}

// y [M, N] bf16 (see the file's comment). act_scale > 0: per-tensor static activation scale and out_scale =
// act_scale * weight_scale; act_scale <= 0: per-token dynamic scales and out_scale = weight_scale.
at::Tensor int8_sq_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t variant,
                          const std::optional<at::Tensor>& pre_quant_scale, double act_scale,
                          const std::optional<at::Tensor>& out_scale, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual) {
  check_x(x);
  int64_t M = x.size(0), K = x.size(1), Kp = padded(K);
  TORCH_CHECK(variant_supported(variant), "int8 kernel variant ", variant, " is not supported by this CPU");
  int64_t bytes = packed_bytes(N, K, variant);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == bytes,
              "packed weight: expected ", bytes, " bytes from int8_pack(weight, ", variant, ") for N = ", N, ", K = ", K);
  TORCH_CHECK(out_scale.has_value(), "int8 SmoothQuant needs out_scale");
  at::Tensor y = at::empty({M, N}, x.options());
  if (residual.has_value())
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() && residual->sizes() == y.sizes(),
                "residual: expected contiguous bf16 [M, N]");
  if (M == 0 || N == 0) return y;
  ExactFloatMode exact;
  std::vector<int8_t> q(M * Kp);
  std::vector<float> row_scale(act_scale > 0 ? 0 : M);
  quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, Kp, f32_arg(pre_quant_scale, K, "pre_quant_scale"),
                static_cast<float>(act_scale), q.data(), row_scale.data());
  const int8_t* w = reinterpret_cast<const int8_t*>(packed.data_ptr<uint8_t>());
  Out out{f32_arg(out_scale, N, "out_scale"), act_scale > 0 ? nullptr : row_scale.data(),
          reinterpret_cast<const int32_t*>(w + bytes - 4 * N), f32_arg(bias, N, "bias"),
          residual.has_value() ? residual->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), N};
  if (variant == kAvx2) {
    std::vector<int16_t> xa(q.begin(), q.end());
    avx2::gemv(xa.data(), M, N, Kp, w, out);
  } else {
    std::vector<uint8_t> xa(M * Kp);
    for (int64_t i = 0; i < M * Kp; ++i) xa[i] = static_cast<uint8_t>(q[i] ^ 0x80);  // q + 128
    if (variant == kAvxVnni) avxvnni::gemv(xa.data(), M, N, Kp, w, out);
    else avx512vnni::gemv(xa.data(), M, N, Kp, w, out);
  }
  return y;
}

}  // namespace specdeploy

TORCH_LIBRARY_FRAGMENT(specdeploy_cpu, ops) {
  ops.def("int8_pack", &int8_pack);
  ops.def("int8_variants", &int8_variants);
  ops.def("int8_quantize", &specdeploy::int8_quantize);
  ops.def("int8_linear", &specdeploy::int8_sq_linear);
}
