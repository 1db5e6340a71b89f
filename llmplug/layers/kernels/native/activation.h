// SiLU-and-mul of 16 bfloat16 lanes with AVX-512, shared by silu_and_mul (ops.cpp) and the gate_up product that
// applies it as it stores (amx_linear.cpp), so both give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "bf16.h"

// glibc's 16-lane expf (libmvec), the one `#pragma omp simd` loops call where the compiler picks 512-bit vectors
extern "C" __m512 _ZGVeN16v_expf(__m512) noexcept;

namespace llmplug {

// silu(g) = g / (1 + exp(-g)) of 16 bf16 gates (bits) in float32, rounded to bf16: the scalar loop's rounding.
inline __m256i silu_bf16(__m256i gate) {
  const __m512 g = bf16_floats(gate);
  const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
  return bf16_bits(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), _ZGVeN16v_expf(minus_g))));
}

// silu_bf16 of every bf16 value, indexed by its bits (one more entry, so that a 4-byte gather of the last stays
// inside): 128 KiB, made once. A gate has 65,536 possible values, so a lookup gives the computation's bits for
// every gate at ~1/4 of its cost (an exp and a division a lane).
inline const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> values(65536 + 1);
    for (uint32_t first = 0; first < 65536; first += 16) {
      const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(values.data() + first), silu_bf16(_mm512_cvtepi32_epi16(bits)));
    }
    return values;
  }();
  return table.data();
}

// silu(gate) * up of 16 bf16 lanes (bits) with the scalar loop's roundings: silu_bf16 (looked up), then its product
// with up rounded to bf16.
inline __m256i silu_and_mul_bf16(__m256i gate, __m256i up, const uint16_t* table) {
  const __m512i silu = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(gate), table, 2);  // low half: the entry
  return bf16_bits(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(silu, 16)), bf16_floats(up)));
}

}  // namespace llmplug
