// Rotate-half rotary of 16 bfloat16 dim pairs with AVX-512, shared by rotary_embedding (ops.cpp) and the qkv product
// that rotates as it stores (amx_linear.cpp), so both give the same bits.
#pragma once

#include <immintrin.h>

#include "bf16.h"

namespace llmplug {

// Dims d (lo) and d + half (hi) of 16 pairs, as float32 values of bf16, with cos and sin of both (the sin signed, as
// RotaryCosSin lays it out) -> the rotated pair's bf16 bits: x * cos rounded to bf16, then the partner times sin
// added in one fused multiply-add and rounded (the scalar loop's rounding as GCC compiles it).
inline void rotate_half_16(__m512 lo, __m512 hi, __m512 cos_lo, __m512 cos_hi, __m512 sin_lo, __m512 sin_hi,
                           __m256i& out_lo, __m256i& out_hi) {
  const __m512 lo_cos = bf16_floats(bf16_bits(_mm512_mul_ps(lo, cos_lo)));
  const __m512 hi_cos = bf16_floats(bf16_bits(_mm512_mul_ps(hi, cos_hi)));
  out_lo = bf16_bits(_mm512_fmadd_ps(hi, sin_lo, lo_cos));
  out_hi = bf16_bits(_mm512_fmadd_ps(lo, sin_hi, hi_cos));
}

}  // namespace llmplug
