// bfloat16 <-> float32 with AVX-512 for llmplug's kernels: widening (exact), and rounding as c10::BFloat16(float)
// rounds: to nearest even, in integers (vcvtneps2bf16 would flush denormals), any NaN 0x7FC0.
#pragma once

#include <immintrin.h>

namespace llmplug {

// 16 bfloat16 values (their bits) as float32, exactly: each shifted into a float's high half.
inline __m512 bf16_floats(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The 16 lanes of v as bfloat16 bits.
inline __m256i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

}  // namespace llmplug
