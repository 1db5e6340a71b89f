// bfloat16 <-> float32 with AVX-512 for llmplug's kernels: widening (exact), and rounding as c10::BFloat16(float)
// rounds: to nearest even, any NaN 0x7FC0, denormals kept (vcvtneps2bf16 alone would flush them).
#pragma once

#include <immintrin.h>

namespace llmplug {

// 16 bfloat16 values (their bits) as float32, exactly: each shifted into a float's high half.
inline __m512 bf16_floats(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The 16 lanes of v as bfloat16 bits, in integers.
inline __m256i bf16_bits_exact(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// The 16 lanes of v as bfloat16 bits. With AVX512-BF16, vcvtneps2bf16 rounds every normal, zero and infinite lane
// to nearest even as the integers do; a vector with a denormal or NaN lane (which it would flush or keep the payload
// of) takes the integers (fpclass: 0x01 quiet NaN, 0x20 denormal, 0x80 signalling NaN).
inline __m256i bf16_bits(__m512 v) {
#ifdef __AVX512BF16__
  if (_mm512_fpclass_ps_mask(v, 0xA1) == 0) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
  return bf16_bits_exact(v);
}

}  // namespace llmplug
