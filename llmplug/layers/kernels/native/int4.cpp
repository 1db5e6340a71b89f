// int4_matmul: x [M, K] times W^T for W [N, K] held as 4-bit groups (llmplug.layers.quantization.Int4Groups),
// w[n, k] = sum_p (q[n, p, k] - 8) * scale[n, p, g] + zero[n, p, g], g = k / group_size, q in 0..15.
//
// A thread takes 4 output columns at a time and decodes their weights once, as Int4Groups.dequantize rounds them
// (in float32 the product, then the zero added, the planes added in order), rounded once more to bfloat16 for
// bfloat16 activations; every row of x then reads those weights (decoded in registers for up to 4 rows of a one-
// or two-plane weight or int8 codes; beyond, from a small per-thread buffer, which the first 4 rows' tile fills as
// it decodes a one-plane weight, and which is filled first otherwise). Output (m, n) is one dot product in float32
// over 16 lanes (k in order per lane; with AVX512-BF16, vdpbf16ps, k in pairs), the lanes summed in a fixed tree
// (_mm512_reduce_add_ps's, computed for 16 outputs at once with AVX-512): the same arithmetic whatever M, the tile
// or the thread that computes it, so a row's bits never depend on the batch (docs/determinism.md).
// Where llmplug's kernels use AMX (amx.h: a CPU and build with AMX-BF16; LLMPLUG_CPU_AMX=0 turns it off), bfloat16
// activations take an AMX path at every M instead: the same decoded weights, each output summed by TDPBF16PS block after block in k
// order (another order than the lanes', so other bits; M-invariant as well). It is 1.0-1.8x faster at 4 rows, 2-5x
// at 32, but 1.1-1.3x slower at one (docs/kernels.md): each block's decoded weights are stored for the tile load.
//
// Layout (llmplug.layers.kernels.int4_matmul.NativeInt4.pack): qweight [N, P, K / 2] uint8, each run of 32 k in
// 16 bytes, byte b holding k = b in its low nibble and k = b + 16 in its high one; scales and zeros [N, P, G]
// float32 or bfloat16 (read exactly), or float16 scales with float16 minimums m in `zeros` (GGUF Q4_1's own pair,
// Q4_0's m = 0), zero = m + 8 * scale in float32; G = K / group_size, group_size a multiple of 32.
// Or Q8_0's two planes as one: qweight [N, K] int8, w[n, k] = q8[n, k] * scale[n, g] in float32 (one rounding, the
// planes' sum exactly where NativeInt4.pack uses this form), scales [N, G] float32, float16 or bfloat16, zeros [N, 0].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "bf16.h"
#define LLMPLUG_INT4_AVX512 1
#if defined(__AVX512BF16__)
#define LLMPLUG_INT4_AVX512_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define LLMPLUG_INT4_AMX 1
#endif
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;      // k per 16 bytes of codes
constexpr int kColumns = 4;         // output columns a tile computes together (their weights decoded once)
constexpr int kRows = 6;            // rows of x a tile of decoded weights computes together
constexpr int kFusedRows = 4;       // up to this many rows, weights are decoded in registers where they are used;
                                    // beyond, once per tile of columns into a buffer the other rows then share
// (The loops over a tile's rows, columns and planes carry `#pragma GCC unroll`: unrolled, the accumulators live in
// registers; GCC otherwise keeps them in memory, which measured 2-3x slower.)

// Where column n's codes and group parameters (Param: float, c10::BFloat16 or c10::Half, read exactly as float)
// are. float16 `zeros` hold minimums m: the zero is m + 8 * scale, rounded once in float32 (8 * scale is exact).
template <typename Param>
struct Int4Weight {
  const uint8_t* codes;  // [N, P, K / 2]
  const Param* scales;   // [N, P, G]
  const Param* zeros;    // [N, P, G]
  int64_t planes, K, groups, group_size;
  const uint8_t* code_row(int64_t n, int64_t p) const { return codes + (n * planes + p) * (K / 2); }
  int64_t group(int64_t n, int64_t p, int64_t k) const { return (n * planes + p) * groups + k / group_size; }
  float scale(int64_t g) const { return static_cast<float>(scales[g]); }
  float zero(int64_t g) const {
    if constexpr (std::is_same_v<Param, c10::Half>) {
      return static_cast<float>(zeros[g]) + 8.0f * scale(g);  // one rounding, fused or not: 8 * scale is exact
    } else {
      return static_cast<float>(zeros[g]);
    }
  }
};

// Q8_0 as int8 codes: w[n, k] = codes[n, k] * scales[n, k / group_size], the product rounded once in float32.
template <typename Param>
struct Int8Weight {
  static constexpr int64_t planes = 2;  // the two int4 planes it stands for: the decoding work of two
  const int8_t* codes;                  // [N, K]
  const Param* scales;                  // [N, G]
  int64_t K, groups, group_size;
  const int8_t* code_row(int64_t n) const { return codes + n * K; }
  float scale(int64_t g) const { return static_cast<float>(scales[g]); }
};

#ifdef LLMPLUG_INT4_AVX512

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// The 16 weights a group's codes stand for, (q - 8) * scale + zero for q = 0..15: the product rounded, then the
// zero added (the _round forms are never contracted into one fused multiply-add, which would round once).
inline __m512 group_values(float scale, float zero) {
  const __m512 steps = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_add_round_ps(_mm512_mul_round_ps(steps, _mm512_set1_ps(scale), kRound), _mm512_set1_ps(zero),
                             kRound);
}

// Up to 16 group parameters (count of them, the rest 0) as float32, exactly.
inline __mmask16 first(int64_t count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }
inline __m512 load16(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(first(count), p); }
inline __m512 load16(const c10::BFloat16* p, int64_t count) {
  return llmplug::bf16_floats(_mm256_maskz_loadu_epi16(first(count), p));
}
inline __m512 load16(const c10::Half* p, int64_t count) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(count), p));
}

// Groups at..at+count-1 (count <= 16) of w's flat group index: their scales and zeros as float32, as
// Int4Weight::scale and zero give them one at a time.
template <typename Param>
inline void params16(const Int4Weight<Param>& w, int64_t at, int64_t count, float* scales, float* zeros) {
  const __m512 s = load16(w.scales + at, count);
  __m512 z = load16(w.zeros + at, count);
  if constexpr (std::is_same_v<Param, c10::Half>) {
    z = _mm512_add_round_ps(z, _mm512_mul_round_ps(_mm512_set1_ps(8.0f), s, kRound), kRound);
  }
  _mm512_storeu_ps(scales, s);
  _mm512_storeu_ps(zeros, z);
}

// One plane's 32 weights of a block (16 bytes of codes) from its group's values: lo k..k+15, hi k+16..k+31.
inline void plane_block(const uint8_t* codes, __m512 values, __m512& lo, __m512& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  lo = _mm512_permutexvar_ps(q, values);  // vpermps reads an index's low 4 bits: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}

// A block's weights as Int4Groups.dequantize gives them: the planes added in order, each add rounded.
inline void add_plane(__m512& lo, __m512& hi, __m512 plane_lo, __m512 plane_hi) {
  lo = _mm512_add_round_ps(lo, plane_lo, kRound);
  hi = _mm512_add_round_ps(hi, plane_hi, kRound);
}

// An int8 block's 32 weights (32 bytes of codes), each code times its group's scale: lo k..k+15, hi k+16..k+31.
inline void int8_block(const int8_t* codes, __m512 scale, __m512& lo, __m512& hi) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  lo = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), scale, kRound);
  hi = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), scale, kRound);
}

// Activations for the float32-FMA path: 16 k a load, weights float32 already rounded to the activation dtype.
struct F32Act {
  using raw = float;
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static inline __m512 round(__m512 w) { return w; }
};
struct BF16Act {  // without AVX512-BF16: round to nearest even in integers (weights are finite)
  using raw = c10::BFloat16;
  static inline __m512 load(const c10::BFloat16* p) {
    return llmplug::bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline __m512 round(__m512 w) {
    const __m512i u = _mm512_castps_si512(w);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  }
};

// float32 FMAs, a block of 32 k as two steps of 16 lanes into the same accumulator
template <typename Act>
struct FmaDot {
  using raw = typename Act::raw;
  struct W {
    __m512 lo, hi;
  };
  using X = W;
  using Stored = float;  // a decoded weight in the buffer
  using Table = __m512;   // a one-plane group's 16 weights, rounded to the activation dtype
  static inline W pack(__m512 lo, __m512 hi) { return {Act::round(lo), Act::round(hi)}; }
  static inline Table table(__m512 values) { return Act::round(values); }
  static inline W lookup(const uint8_t* codes, Table t) {
    W w;
    plane_block(codes, t, w.lo, w.hi);
    return w;
  }
  static inline void store(Stored* p, const W& w) {
    _mm512_storeu_ps(p, w.lo);
    _mm512_storeu_ps(p + 16, w.hi);
  }
  static inline W load(const Stored* p) { return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; }
  static inline X load_x(const raw* p) { return {Act::load(p), Act::load(p + 16)}; }
  static inline __m512 dot(__m512 acc, const X& x, const W& w) {
    return _mm512_fmadd_ps(x.hi, w.hi, _mm512_fmadd_ps(x.lo, w.lo, acc));
  }
};

#ifdef LLMPLUG_INT4_AVX512_BF16
// bf16 activations on AVX512-BF16: a block of 32 k in one vdpbf16ps, each lane adding its pair of products
struct Bf16Dot {
  using raw = c10::BFloat16;
  using W = __m512bh;
  using X = __m512bh;
  using Stored = uint16_t;
  using Table = __m512i;  // a one-plane group's 16 weights in bf16, twice (vpermw reads 5 bits of an index)
  static inline W pack(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }  // nearest even, k in order
  static inline Table table(__m512 values) { return (__m512i)_mm512_cvtne2ps_pbh(values, values); }
  static inline W lookup(const uint8_t* codes, Table t) {  // the bits pack gives, without converting 32 floats
    // the 16 bytes twice (a broadcast load, no shuffle), as words: 0..15 the bytes (low nibble, then the bit
    // the duplicate table absorbs), 16..31 shifted right by 4 (high nibble); two shuffles a block, not three
    const __m256i twice = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                            0x0004000400040004, 0, 0, 0, 0);
    return (W)_mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(twice), shifts), t);
  }
  static inline void store(Stored* p, W w) { _mm512_storeu_si512(p, (__m512i)w); }
  static inline W load(const Stored* p) { return (W)_mm512_loadu_si512(p); }
  static inline X load_x(const raw* p) { return (X)_mm512_loadu_si512(p); }
  static inline __m512 dot(__m512 acc, X x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// acc[r][c] = 0 for every row and column of a tile (unrolled: the accumulators stay in registers)
template <int R, int C>
inline void zero_tile(__m512 (&acc)[R][C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
}

// acc[r][c] += x[r] . w[c] over one block of 32 k (R rows of x at `x`, rows ldx apart)
template <typename D, int R, int C>
inline void dot_block(__m512 (&acc)[R][C], const typename D::raw* x, int64_t ldx, const typename D::W (&w)[C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const typename D::X xv = D::load_x(x + r * ldx);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = D::dot(acc[r][c], xv, w[c]);
  }
}

// a + b, a the instruction's first source: of two NaNs the sum keeps the first source's payload, and GCC, for which
// float addition commutes, would choose the order itself.
inline __m512 add_in_order(__m512 a, __m512 b) {
  __m512 sum;
  asm("vaddps %2, %1, %0" : "=v"(sum) : "v"(a), "v"(b));
  return sum;
}

// Whether any of a[width i .. width i + width - 1] is live (bit j of `live`: a[j] holds sums, else it is zero).
constexpr bool any_live(uint32_t live, int i, int width) { return (live >> (width * i)) & ((1u << width) - 1); }

// The lane sums of 16 accumulators at once, lane 4 i + j of the result a[4 j + i]'s, in _mm512_reduce_add_ps's
// tree (GCC's avx512fintrin.h: lane j + 8 + lane j, then (j + 4) + j, (j + 2) + j, 0 + 1), each add's operands in
// the order GCC 12 compiled that to (which of two NaNs' payloads a float32 output keeps). Each step's two shuffles
// line up the halves that step adds for several accumulators, so one add does the step for 2, 4, 8 and 16 of them:
// 45 instructions for 16 sums, where one sum alone takes 8. The accumulators not in Live are zero: steps that would
// add only zeros (+0, exactly) are skipped.
template <uint32_t Live>
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // lanes 0..7: a[2 i]'s 8 + 8 lanes, 8..15: a[2 i + 1]'s
    halves[i] = any_live(Live, i, 2) ? add_in_order(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE),
                                                    _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44))
                                     : _mm512_setzero_ps();
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // 128-bit lane l: a[4 i + l]'s 4 + 4
    quarters[i] = any_live(Live, i, 4) ? add_in_order(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD),
                                                      _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88))
                                       : _mm512_setzero_ps();
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // 128-bit lane l: a[8 i + l]'s 2 + 2, then a[8 i + 4 + l]'s
    const __m512d lo = _mm512_castps_pd(quarters[2 * i]), hi = _mm512_castps_pd(quarters[2 * i + 1]);
    eighths[i] = any_live(Live, i, 8) ? add_in_order(_mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)),
                                                     _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)))
                                      : _mm512_setzero_ps();
  }
  return add_in_order(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),  // 1 + 1
                      _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD));
}

// 16 sums as the output's dtype: float32 as they are; bfloat16 rounded as c10::BFloat16(float) rounds (to nearest
// even, any NaN 0x7FC0), in integers: vcvtneps2bf16 would flush denormals.
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), llmplug::bf16_bits(v));
}

// y[r0 + i, c] = the sum of acc[r0 + i][c]'s lanes for i < Rows <= 4 (one reduce16), rounded once to raw. 3 or 4
// rows: a[4 c + i], its sum at lane 4 i + c; 1 or 2: a[c + 4 i] at lane 4 c + i, the live ones together.
template <typename D, int Rows, int R, int C>
inline void store_rows(__m512 (&acc)[R][C], int r0, typename D::raw* y, int64_t ldy) {
  constexpr bool by_column = Rows <= 2;
  constexpr uint32_t live = [] {
    uint32_t bits = 0;
    for (int i = 0; i < Rows; ++i)
      for (int c = 0; c < C; ++c) bits |= 1u << (by_column ? c + 4 * i : 4 * c + i);
    return bits;
  }();
  __m512 a[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const int i = by_column ? j / 4 : j % 4, c = by_column ? j % 4 : j / 4;
    a[j] = i < Rows && c < C ? acc[r0 + i][c] : _mm512_setzero_ps();
  }
  typename D::raw sums[16];
  store16(sums, reduce16<live>(a));
#pragma GCC unroll 4
  for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[(r0 + i) * ldy + c] = sums[by_column ? 4 * c + i : 4 * i + c];
}

// y[r, c] = the sum of acc[r][c]'s lanes (as _mm512_reduce_add_ps sums them), 4 rows at a time.
template <typename D, int R, int C>
inline void store_tile(__m512 (&acc)[R][C], typename D::raw* y, int64_t ldy) {
  static_assert(C <= 4 && R <= 8, "two reduce16 hold 4 columns of up to 8 rows");
  if constexpr (R > 4) {
    store_rows<D, 4>(acc, 0, y, ldy);
    store_rows<D, R - 4>(acc, 4, y, ldy);
  } else {
    store_rows<D, R>(acc, 0, y, ldy);
  }
}

// With Keep, a block's decoded weights of C columns also into `kept` (columns K apart), for the other rows to read.
template <typename D, bool Keep, int C>
inline void keep(typename D::Stored* kept, int64_t K, int64_t k, const typename D::W (&w)[C]) {
  if constexpr (Keep) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) D::store(kept + c * K + k, w[c]);
  }
}

// y[r, c] = x[r] . w[c] for R rows and C columns n0.., each column's weights decoded in registers block by block
// (with Keep, one plane's also stored to `kept` for buffered_tile). P planes (1 or 2: the fused path's); every
// element is the same arithmetic as in buffered_tile. Not inlined: inlined into int4_matmul_impl's loop, the kept
// tile measured 1.35x slower.
template <typename D, int P, int R, int C, bool Keep, typename Param>
[[gnu::noinline]] void fused_tile(const typename D::raw* x, int64_t ldx, const Int4Weight<Param>& w, int64_t n0,
                                  typename D::raw* y, int64_t ldy, typename D::Stored* kept) {
  static_assert(!Keep || P == 1, "only one plane's weights are kept");
  const uint8_t* codes[C][P];
  int64_t groups[C][P];  // where column c's plane p's group parameters start
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      codes[c][p] = w.code_row(n0 + c, p);
      groups[c][p] = w.group(n0 + c, p, 0);
    }
  __m512 acc[R][C];
  zero_tile(acc);
  const int64_t blocks = w.group_size / kBlock;
  // the next tile's codes and group parameters, asked for one cache line at a time while this tile computes:
  // decoding reads each weight once, from memory, in short runs per column that the hardware prefetcher misses
  const int64_t next_codes = kColumns * w.planes * (w.K / 2), next_groups = kColumns * w.planes * w.groups;
  float scales[C][P][16], zeros[C][P][16];  // 16 groups' parameters at a time, converted together
  for (int64_t g = 0, k = 0; g < w.groups; ++g) {
    __m512 values[C][P];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        if (k % 128 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes[c][p] + k / 2 + next_codes), _MM_HINT_T0);
        if (g % 16 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(w.scales + groups[c][p] + g + next_groups), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w.zeros + groups[c][p] + g + next_groups), _MM_HINT_T0);
          params16(w, groups[c][p] + g, std::min<int64_t>(16, w.groups - g), scales[c][p], zeros[c][p]);
        }
        values[c][p] = group_values(scales[c][p][g % 16], zeros[c][p][g % 16]);
      }
    if constexpr (P == 1) {  // one plane: each weight straight from its group's table in the activation dtype
      typename D::Table tables[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) tables[c] = D::table(values[c][0]);
      for (int64_t b = 0; b < blocks; ++b, k += kBlock) {
        typename D::W wv[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) wv[c] = D::lookup(codes[c][0] + k / 2, tables[c]);
        keep<D, Keep, C>(kept, w.K, k, wv);
        dot_block<D, R, C>(acc, x + k, ldx, wv);
      }
      continue;
    }
    for (int64_t b = 0; b < blocks; ++b, k += kBlock) {
      typename D::W wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        __m512 lo, hi;
        plane_block(codes[c][0] + k / 2, values[c][0], lo, hi);
#pragma GCC unroll 8
        for (int p = 1; p < P; ++p) {
          __m512 plane_lo, plane_hi;
          plane_block(codes[c][p] + k / 2, values[c][p], plane_lo, plane_hi);
          add_plane(lo, hi, plane_lo, plane_hi);
        }
        wv[c] = D::pack(lo, hi);
      }
      dot_block<D, R, C>(acc, x + k, ldx, wv);
    }
  }
  store_tile<D, R, C>(acc, y, ldy);
}

// Column n's K weights into `out` (D::Stored), any number of planes: the bits fused_tile decodes.
template <typename D, typename Param>
void decode_column(const Int4Weight<Param>& w, int64_t n, typename D::Stored* out) {
  for (int64_t k = 0; k < w.K; k += kBlock) {
    __m512 lo, hi;
    for (int64_t p = 0; p < w.planes; ++p) {
      const int64_t g = w.group(n, p, k);
      __m512 plane_lo, plane_hi;
      plane_block(w.code_row(n, p) + k / 2, group_values(w.scale(g), w.zero(g)), plane_lo, plane_hi);
      if (p == 0) {
        lo = plane_lo, hi = plane_hi;
      } else {
        add_plane(lo, hi, plane_lo, plane_hi);
      }
    }
    D::store(out + k, D::pack(lo, hi));
  }
}

// fused_tile for int8 codes: each column's weights decoded in registers block by block, as decode_column does.
template <typename D, int R, int C, typename Param>
inline void fused_tile(const typename D::raw* x, int64_t ldx, const Int8Weight<Param>& w, int64_t n0,
                       typename D::raw* y, int64_t ldy) {
  __m512 acc[R][C];
  zero_tile(acc);
  const int64_t blocks = w.group_size / kBlock, next_codes = kColumns * w.K, next_groups = kColumns * w.groups;
  float scales[C][16];  // 16 groups' scales at a time, converted together
  for (int64_t g = 0, k = 0; g < w.groups; ++g) {
    __m512 scale[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int64_t at = (n0 + c) * w.groups + g;
      if (g % 16 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + at + next_groups), _MM_HINT_T0);
        _mm512_storeu_ps(scales[c], load16(w.scales + at, std::min<int64_t>(16, w.groups - g)));
      }
      scale[c] = _mm512_set1_ps(scales[c][g % 16]);
    }
    for (int64_t b = 0; b < blocks; ++b, k += kBlock) {
      typename D::W wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const int8_t* codes = w.code_row(n0 + c) + k;
        if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + next_codes), _MM_HINT_T0);
        __m512 lo, hi;
        int8_block(codes, scale[c], lo, hi);
        wv[c] = D::pack(lo, hi);
      }
      dot_block<D, R, C>(acc, x + k, ldx, wv);
    }
  }
  store_tile<D, R, C>(acc, y, ldy);
}

// Column n's K weights into `out`, as fused_tile decodes them (16 groups' scales converted together).
template <typename D, typename Param>
void decode_column(const Int8Weight<Param>& w, int64_t n, typename D::Stored* out) {
  const int64_t blocks = w.group_size / kBlock;
  float scales[16];
  for (int64_t g = 0, k = 0; g < w.groups; ++g) {
    if (g % 16 == 0) {
      _mm512_storeu_ps(scales, load16(w.scales + n * w.groups + g, std::min<int64_t>(16, w.groups - g)));
    }
    const __m512 scale = _mm512_set1_ps(scales[g % 16]);
    for (int64_t b = 0; b < blocks; ++b, k += kBlock) {
      __m512 lo, hi;
      int8_block(w.code_row(n) + k, scale, lo, hi);
      D::store(out + k, D::pack(lo, hi));
    }
  }
}

// A tile of C columns' weights decoded in registers for R rows: an int4 weight of 1 or 2 planes, or int8 codes.
template <typename D, int R, int C, typename Param>
inline void fused_columns(const typename D::raw* x, int64_t ldx, const Int4Weight<Param>& w, int64_t n0,
                          typename D::raw* y, int64_t ldy) {
  if (w.planes == 1) {
    fused_tile<D, 1, R, C, false>(x, ldx, w, n0, y, ldy, nullptr);
  } else {
    fused_tile<D, 2, R, C, false>(x, ldx, w, n0, y, ldy, nullptr);
  }
}
template <typename D, int R, int C, typename Param>
inline void fused_columns(const typename D::raw* x, int64_t ldx, const Int8Weight<Param>& w, int64_t n0,
                          typename D::raw* y, int64_t ldy) {
  fused_tile<D, R, C>(x, ldx, w, n0, y, ldy);
}

// y[r, c] = x[r] . w[c] for R rows and C columns whose weights are decoded already (`weights`, columns K apart).
template <typename D, int R, int C>
inline void buffered_tile(const typename D::raw* x, int64_t ldx, int64_t K, const typename D::Stored* weights,
                          typename D::raw* y, int64_t ldy) {
  __m512 acc[R][C];
  zero_tile(acc);
  for (int64_t k = 0; k < K; k += kBlock) {
    typename D::W wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = D::load(weights + c * K + k);
    dot_block<D, R, C>(acc, x + k, ldx, wv);
  }
  store_tile<D, R, C>(acc, y, ldy);
}

// Whether a weight is int4 planes (Int4Weight), which a fused tile that keeps its weights can decode when it has one.
template <typename Weight>
constexpr bool kInt4Planes = false;
template <typename Param>
constexpr bool kInt4Planes<Int4Weight<Param>> = true;

// fn.template operator()<value>() for value in 1..V (the tiles at the edges are smaller).
template <int V, typename Fn>
inline void with_count(int64_t value, Fn&& fn) {
  if constexpr (V > 0) {
    if (value == V) return fn.template operator()<V>();
    with_count<V - 1>(value, fn);
  }
}

template <typename D, typename Weight>
void int4_matmul_impl(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  using raw = typename D::raw;
  const int64_t M = x.size(0), K = w.K, N = y.size(1), ldx = x.stride(0);
  const raw* xp = reinterpret_cast<const raw*>(x.data_ptr());
  raw* yp = reinterpret_cast<raw*>(y.data_ptr());
  const int64_t tiles = (N + kColumns - 1) / kColumns;
  const int64_t work = K * kColumns * (w.planes + std::min<int64_t>(M, kRows));
  const bool fused = M <= kFusedRows && w.planes <= 2;
  at::parallel_for(0, tiles, std::max<int64_t>(1, (1 << 16) / work), [&](int64_t begin, int64_t end) {
    std::vector<typename D::Stored> buffer(fused ? 0 : kColumns * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kColumns, count = std::min<int64_t>(kColumns, N - n0);
      if (fused) {  // one tile of rows: x [M, K] against `count` columns
        with_count<kFusedRows>(M, [&]<int R>() {
          with_count<kColumns>(count, [&]<int C>() { fused_columns<D, R, C>(xp, ldx, w, n0, yp + n0, N); });
        });
        continue;
      }
      int64_t m0 = 0;
      if constexpr (kInt4Planes<Weight>) {
        if (w.planes == 1) {  // the first rows as a fused tile that keeps the weights it decodes: decoding (a
                              // lookup a block), memory reads and dot products overlap
          with_count<kColumns>(count, [&]<int C>() {
            fused_tile<D, 1, kFusedRows, C, true>(xp, ldx, w, n0, yp + n0, N, buffer.data());
          });
          m0 = kFusedRows;
        }
      }
      if (m0 == 0) {  // int8 codes, planes added: heavier decoding, measured faster on its own
        for (int64_t c = 0; c < count; ++c) decode_column<D>(w, n0 + c, buffer.data() + c * K);
      }
      for (; m0 < M; m0 += kRows) {
        with_count<kRows>(std::min<int64_t>(kRows, M - m0), [&]<int R>() {
          with_count<kColumns>(count, [&]<int C>() {
            buffered_tile<D, R, C>(xp + m0 * ldx, ldx, K, buffer.data(), yp + m0 * N + n0, N);
          });
        });
      }
    }
  });
}

#ifdef LLMPLUG_INT4_AMX
// bfloat16 activations on AMX: TDPBF16PS with A = 16 output columns' decoded weights (a row: one column's 32 k of a
// block, the bits Bf16Dot::lookup / pack give), B = up to 16 rows of x in VNNI pairs, C = [16 columns, rows] float32.
// C[n][m] adds the K blocks in order, each TDPBF16PS computing each element on its own: the same arithmetic whatever
// M, the tile or the thread (checked empirically: tests/layers/kernels/test_int4_matmul.py). Threads split the
// output columns only. A thread takes a group of Tc column tiles (64, 32 or 16 columns) against 4 / Tc row tiles at a
// time: the 4 C tiles' sums are independent chains, where one tile's chain of TDPBF16PS latencies would bound a row.
constexpr int kAmxColumns = 16;  // columns a tile of decoded weights holds (A's rows)
constexpr int kAmxRows = 16;     // rows of x a B / C tile holds
constexpr int kAmxTiles = 4;     // C tiles, tmm0..3; A: tmm4, tmm5 in turn; B: tmm6, tmm7 for a pass's last row tile
constexpr int kAmxAhead = 2;     // blocks decoded ahead of the one loaded into A: a tile load waits for the stores
                                 // it reads to reach the cache (no store forwarding)
constexpr int kAmxRing = 4;      // blocks of decoded weights a thread keeps when one pass of rows reads them

using llmplug::TileConfig;

// The tile shapes for a pass of Tc column tiles over `rows` rows of x (C tile of column tile ct, row tile rt:
// ct * (4 / Tc) + rt).
template <int Tc>
TileConfig amx_config(int64_t rows) {
  TileConfig config;
  for (int ct = 0; ct < Tc; ++ct)
    for (int rt = 0; rt < kAmxTiles / Tc && rt * kAmxRows < rows; ++rt) {
      config.rows[ct * (kAmxTiles / Tc) + rt] = kAmxColumns;
      config.colsb[ct * (kAmxTiles / Tc) + rt] = 4 * std::min<int64_t>(kAmxRows, rows - rt * kAmxRows);
    }
  for (int t = 4; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  config.colsb[7] = 4 * (rows - (rows - 1) / kAmxRows * kAmxRows);
  return config;
}

// GCC's tile intrinsics take literal register numbers: these pick them from template arguments.
template <int T>
inline void tile_load(const void* p, int64_t stride) {
  if constexpr (T == 4) _tile_loadd(4, p, stride);
  if constexpr (T == 5) _tile_loadd(5, p, stride);
  if constexpr (T == 6) _tile_loadd(6, p, stride);
  if constexpr (T == 7) _tile_loadd(7, p, stride);
}
template <int C>
inline void tile_zero() {
  if constexpr (C == 0) _tile_zero(0);
  if constexpr (C == 1) _tile_zero(1);
  if constexpr (C == 2) _tile_zero(2);
  if constexpr (C == 3) _tile_zero(3);
}
template <int C>
inline void tile_store(void* p) {
  if constexpr (C == 0) _tile_stored(0, p, 64);
  if constexpr (C == 1) _tile_stored(1, p, 64);
  if constexpr (C == 2) _tile_stored(2, p, 64);
  if constexpr (C == 3) _tile_stored(3, p, 64);
}
#define LLMPLUG_AMX_DOT(c, a, b) \
  if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
template <int C, int A, int B>
inline void tile_dot() {
  LLMPLUG_AMX_DOT(0, 4, 6) LLMPLUG_AMX_DOT(0, 4, 7) LLMPLUG_AMX_DOT(0, 5, 6) LLMPLUG_AMX_DOT(0, 5, 7)
  LLMPLUG_AMX_DOT(1, 4, 6) LLMPLUG_AMX_DOT(1, 4, 7) LLMPLUG_AMX_DOT(1, 5, 6) LLMPLUG_AMX_DOT(1, 5, 7)
  LLMPLUG_AMX_DOT(2, 4, 6) LLMPLUG_AMX_DOT(2, 4, 7) LLMPLUG_AMX_DOT(2, 5, 6) LLMPLUG_AMX_DOT(2, 5, 7)
  LLMPLUG_AMX_DOT(3, 4, 6) LLMPLUG_AMX_DOT(3, 4, 7) LLMPLUG_AMX_DOT(3, 5, 6) LLMPLUG_AMX_DOT(3, 5, 7)
}
#undef LLMPLUG_AMX_DOT

// fn.template operator()<i>() for i = 0..N-1, unrolled.
template <int N, typename Fn>
inline void unrolled(Fn&& fn) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (fn.template operator()<I>(), ...); }(
      std::make_integer_sequence<int, N>{});
}

// C tile C's [column][row] for `rows` rows and `count` columns to y (rows ldy apart), transposed, rounded as store16.
template <int C>
inline void amx_store(int64_t rows, int64_t count, c10::BFloat16* y, int64_t ldy) {
  alignas(64) float c[kAmxColumns][kAmxRows];
  tile_store<C>(c);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kAmxRows));
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_i32gather_ps(column, &c[0][m], 4);
    if (count >= kAmxColumns) {
      store16(y + m * ldy, v);
    } else {
      c10::BFloat16 sums[16];
      store16(sums, v);
      std::copy(sums, sums + count, y + m * ldy);
    }
  }
}

// A group of columns' parameters as float32 (params16's), for `count` columns from n0: [column, plane, groups padded].
template <typename Param>
inline void amx_params(const Int4Weight<Param>& w, int64_t n0, int64_t count, int64_t pad, float* scales,
                       float* zeros) {
  for (int64_t c = 0; c < count; ++c)
    for (int64_t p = 0; p < w.planes; ++p)
      for (int64_t g = 0; g < w.groups; g += 16) {
        const int64_t at = (c * w.planes + p) * pad + g;
        params16(w, w.group(n0 + c, p, 0) + g, std::min<int64_t>(16, w.groups - g), scales + at, zeros + at);
      }
}
template <typename Param>
inline void amx_params(const Int8Weight<Param>& w, int64_t n0, int64_t count, int64_t pad, float* scales, float*) {
  for (int64_t c = 0; c < count; ++c)
    for (int64_t g = 0; g < w.groups; g += 16) {
      const __m512 s = load16(w.scales + (n0 + c) * w.groups + g, std::min<int64_t>(16, w.groups - g));
      _mm512_storeu_ps(scales + c * pad + g, s);
    }
}

// Block k's weights of `count` columns from n0 as bf16 rows of 32 into `out` (the bits fused_tile / decode_column
// give): P planes (1, 2, or 0: w.planes of them). The codes `next` columns on are asked for meanwhile.
template <int P, typename Param>
inline void amx_decode(const Int4Weight<Param>& w, int64_t n0, int64_t count, int64_t next, int64_t k, int64_t pad,
                       const float* scales, const float* zeros, uint16_t* out) {
  const int64_t planes = P ? P : w.planes, g = k / w.group_size, stride = planes * (w.K / 2);
  const uint8_t* codes = w.code_row(n0, 0) + k / 2;
  const bool prefetch = k % 128 == 0;
  for (int64_t c = 0; c < count; ++c, codes += stride, out += kBlock) {
    const float* s = scales + c * planes * pad + g;
    const float* z = zeros + c * planes * pad + g;
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(codes + next * stride), _MM_HINT_T0);
    if constexpr (P == 1) {
      Bf16Dot::store(out, Bf16Dot::lookup(codes, Bf16Dot::table(group_values(*s, *z))));
    } else {
      __m512 lo, hi;
      plane_block(codes, group_values(s[0], z[0]), lo, hi);
      for (int64_t p = 1; p < planes; ++p) {
        __m512 plane_lo, plane_hi;
        plane_block(codes + p * (w.K / 2), group_values(s[p * pad], z[p * pad]), plane_lo, plane_hi);
        add_plane(lo, hi, plane_lo, plane_hi);
      }
      Bf16Dot::store(out, Bf16Dot::pack(lo, hi));
    }
  }
}
template <int P, typename Param>
inline void amx_decode(const Int8Weight<Param>& w, int64_t n0, int64_t count, int64_t next, int64_t k, int64_t pad,
                       const float* scales, const float*, uint16_t* out) {
  const int64_t g = k / w.group_size;
  const int8_t* codes = w.code_row(n0) + k;
  const bool prefetch = k % 64 == 0;
  for (int64_t c = 0; c < count; ++c, codes += w.K, out += kBlock) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(codes + next * w.K), _MM_HINT_T0);
    __m512 lo, hi;
    int8_block(codes, _mm512_set1_ps(scales[c * pad + g]), lo, hi);
    Bf16Dot::store(out, Bf16Dot::pack(lo, hi));
  }
}

// y's groups begin..end-1 of Tc * 16 columns: x as [K / 2, M] pairs at xp.
template <int Tc, int P, typename Weight>
void amx_groups(const Weight& w, const uint32_t* xp, int64_t M, int64_t N, int64_t begin, int64_t end,
                c10::BFloat16* y) {
  constexpr int64_t width = Tc * kAmxColumns;
  constexpr int Tr = kAmxTiles / Tc;  // row tiles a pass holds
  const int64_t blocks = w.K / kBlock, pad = (w.groups + 15) / 16 * 16, planes = P ? P : w.planes;
  const bool keep = M > Tr * kAmxRows;  // more than one pass: every block's decoded weights kept for the others
  // not zeroed (a small shape's call would spend a tenth of its time on it)
  const auto scales = std::make_unique_for_overwrite<float[]>(width * planes * pad);
  const auto zeros = std::make_unique_for_overwrite<float[]>(kInt4Planes<Weight> ? width * planes * pad : 0);
  // [block, column, 32 k], each row a cache line (64-byte aligned: a split line costs stores and tile loads twice)
  const int64_t size = width * kBlock * (keep ? blocks : kAmxRing);
  const auto buffer = std::make_unique_for_overwrite<uint16_t[]>(size + 32);
  const std::span<uint16_t> weights(buffer.get() + (-reinterpret_cast<uintptr_t>(buffer.get()) / 2 % 32), size);
  int64_t configured = 0;  // the rows of the pass the tiles are configured for
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * width, count = std::min<int64_t>(width, N - n0);
    if (count < width) std::fill(weights.begin(), weights.end(), 0);  // A's rows beyond N
    amx_params(w, n0, count, pad, scales.get(), zeros.get());
    for (int64_t m0 = 0; m0 < M; m0 += Tr * kAmxRows) {
      const int64_t rows = std::min<int64_t>(Tr * kAmxRows, M - m0), last = (rows - 1) / kAmxRows;
      if (rows != configured) {
        llmplug::load_tile_config(amx_config<Tc>(rows));
        configured = rows;
      }
      unrolled<Tc>([&]<int Ct>() {
        unrolled<Tr>([&]<int Rt>() {
          if (Rt <= last) tile_zero<Ct * Tr + Rt>();
        });
      });
      auto block_weights = [&](int64_t b) { return weights.data() + (keep ? b : b % kAmxRing) * width * kBlock; };
      auto decode = [&](int64_t b) {
        if (m0 == 0 && b < blocks) {
          amx_decode<P>(w, n0, count, width, b * kBlock, pad, scales.get(), zeros.get(), block_weights(b));
        }
      };
      for (int64_t b = 0; b < kAmxAhead; ++b) decode(b);
      for (int64_t b = 0; b < blocks; ++b) {
        decode(b + kAmxAhead);
        const uint16_t* a = block_weights(b);
        const uint32_t* xb = xp + b * (kBlock / 2) * M + m0;
        // C tile (Ct, Rt) += A (column tile Ct's weights) . B (row tile Rt's x)
        auto column_tile = [&]<int Ct, int A>() {
          if (Ct * kAmxColumns >= count) return;
          tile_load<A>(a + Ct * kAmxColumns * kBlock, 64);
          unrolled<Tr>([&]<int Rt>() {
            if (Rt > last) return;
            // B loaded once for the column tiles: with several of them (Tr <= 2), each row tile has its register
            if (Rt == last) {
              if (Ct == 0) tile_load<7>(xb + Rt * kAmxRows, 4 * M);
              tile_dot<Ct * Tr + Rt, A, 7>();
            } else {
              if (Ct == 0) tile_load<6>(xb + Rt * kAmxRows, 4 * M);
              tile_dot<Ct * Tr + Rt, A, 6>();
            }
          });
        };
        if constexpr (Tc == 1) {  // A in turn by block
          if (b % 2 == 0) {
            column_tile.template operator()<0, 4>();
          } else {
            column_tile.template operator()<0, 5>();
          }
        } else {  // by column tile
          unrolled<Tc>([&]<int Ct>() { column_tile.template operator()<Ct, 4 + Ct % 2>(); });
        }
      }
      unrolled<Tc>([&]<int Ct>() {
        unrolled<Tr>([&]<int Rt>() {
          if (Rt <= last && Ct * kAmxColumns < count) {
            amx_store<Ct * Tr + Rt>(std::min<int64_t>(kAmxRows, rows - Rt * kAmxRows), count - Ct * kAmxColumns,
                                    y + (m0 + Rt * kAmxRows) * N + n0 + Ct * kAmxColumns, N);
          }
        });
      });
    }
  }
  if (configured) _tile_release();
}

// r[i] = column i of the 16 x 16 matrix of 32-bit elements whose row j r[j] held.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // elements 2 at a time: (r0 r1) -> lanes interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then 64-bit pairs of those
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)  // then 128-bit lanes, twice
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// x's M rows of K bfloat16 (ldx apart, which may be odd) as B tiles want them: out[p * M + m] = x[m, 2p .. 2p + 1],
// 16 x 16 blocks of pairs transposed in registers (a copy at a time took a tenth of a 32-row call, on one thread).
inline void amx_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, uint32_t* out) {
  __m512i r[16];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m0);
    const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
    for (int64_t p0 = 0; p0 < K / 2; p0 += 16) {  // K / 2 is a multiple of 16
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_loadu_si512(x + (m0 + i) * ldx + 2 * p0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_mask_storeu_epi32(out + (p0 + i) * M + m0, live, r[i]);
    }
  }
}

template <int P, typename Weight>
void amx_matmul_impl(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K, N = y.size(1), ldx = x.stride(0);
  auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
  // x as B wants it: [K / 2, M] pairs (one row of x alone already is)
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  std::vector<uint32_t> pairs;
  if (M > 1) {
    pairs.resize(K / 2 * M);
    amx_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, ldx, pairs.data());
    xp = pairs.data();
  }
  // column tiles a group takes: as many as the C tiles the rows leave (4 / row tiles), fewer where that spreads the
  // groups more evenly over the threads (the bits are the same either way)
  const int64_t threads = at::get_num_threads(), row_tiles = std::min<int64_t>((M + kAmxRows - 1) / kAmxRows, 4);
  int64_t tc = kAmxTiles / (row_tiles == 3 ? 4 : row_tiles), busiest = 0;
  for (int64_t c = tc; c >= 1; c /= 2) {
    const int64_t groups = (N + c * kAmxColumns - 1) / (c * kAmxColumns);
    const int64_t columns = (groups + threads - 1) / threads * c;  // the busiest thread's column tiles
    if (busiest == 0 || columns < busiest) tc = c, busiest = columns;
  }
  const int64_t planes = P ? P : w.planes, width = tc * kAmxColumns, groups = (N + width - 1) / width;
  const int64_t work = K * width * (planes + std::min<int64_t>(M, 16));
  at::parallel_for(0, groups, std::max<int64_t>(1, (1 << 16) / work), [&](int64_t begin, int64_t end) {
    if (tc == 4) {
      amx_groups<4, P>(w, xp, M, N, begin, end, yp);
    } else if (tc == 2) {
      amx_groups<2, P>(w, xp, M, N, begin, end, yp);
    } else {
      amx_groups<1, P>(w, xp, M, N, begin, end, yp);
    }
  });
}

template <typename Weight>
void amx_matmul(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  if constexpr (kInt4Planes<Weight>) {
    if (w.planes == 1) return amx_matmul_impl<1>(x, w, y);
    if (w.planes == 2) return amx_matmul_impl<2>(x, w, y);
  }
  amx_matmul_impl<0>(x, w, y);
}
#endif

#else  // generic: each column's weights decoded into a float buffer, then 16 float lanes per dot product

inline float mul_add(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Column n's K weights as Int4Groups.dequantize rounds them, then rounded to raw (float32: as they are).
template <typename raw, typename Param>
void decode_column(const Int4Weight<Param>& w, int64_t n, float* out) {
  float values[16];
  for (int64_t p = 0; p < w.planes; ++p) {
    const uint8_t* codes = w.code_row(n, p);
    for (int64_t k0 = 0; k0 < w.K; k0 += w.group_size) {
      const int64_t g = w.group(n, p, k0);
      for (int q = 0; q < 16; ++q) {
        volatile float product = float(q - 8) * w.scale(g);  // rounded on its own: never fused with the add
        values[q] = product + w.zero(g);
      }
      for (int64_t k = k0; k < k0 + w.group_size; ++k) {
        const int64_t b = k % kBlock;
        const uint8_t byte = codes[(k - b) / 2 + b % 16];
        const float v = values[b < 16 ? byte & 15 : byte >> 4];
        out[k] = p == 0 ? v : out[k] + v;
      }
    }
  }
  for (int64_t k = 0; k < w.K; ++k) out[k] = static_cast<float>(raw(out[k]));
}

template <typename raw, typename Param>
void decode_column(const Int8Weight<Param>& w, int64_t n, float* out) {
  const int8_t* codes = w.code_row(n);
  for (int64_t k = 0; k < w.K; ++k) {
    out[k] = static_cast<float>(raw(float(codes[k]) * w.scale(n * w.groups + k / w.group_size)));
  }
}

template <typename raw, typename Weight>
void int4_matmul_impl(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  constexpr int kLanes = 16;
  const int64_t M = x.size(0), K = w.K, N = y.size(1), ldx = x.stride(0);
  const raw* xp = reinterpret_cast<const raw*>(x.data_ptr());
  raw* yp = reinterpret_cast<raw*>(y.data_ptr());
  const int64_t tiles = (N + kColumns - 1) / kColumns;
  const int64_t work = K * kColumns * (w.planes + std::min<int64_t>(M, kRows));
  at::parallel_for(0, tiles, std::max<int64_t>(1, (1 << 16) / work), [&](int64_t begin, int64_t end) {
    std::vector<float> weights(kColumns * K), xr(K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kColumns, count = std::min<int64_t>(kColumns, N - n0);
      for (int64_t c = 0; c < count; ++c) decode_column<raw>(w, n0 + c, weights.data() + c * K);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) xr[k] = static_cast<float>(xp[m * ldx + k]);
        for (int64_t c = 0; c < count; ++c) {
          float lanes[kLanes] = {};
          const float* wc = weights.data() + c * K;
          for (int64_t k = 0; k < K; k += kLanes) {  // K is a multiple of 32
#pragma omp simd
            for (int j = 0; j < kLanes; ++j) lanes[j] = mul_add(xr[k + j], wc[k + j], lanes[j]);
          }
          for (int width = kLanes / 2; width > 0; width /= 2)
            for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
          yp[m * N + n0 + c] = raw(lanes[0]);
        }
      }
    }
  });
}

#endif

// A group parameter tensor: contiguous `shape`, float32, float16 or bfloat16.
void check_groups(const at::Tensor& t, const char* name, at::IntArrayRef shape, const char* expected) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) && t.is_contiguous(),
              "llmplug_cpu::int4_matmul: ", name, " must be contiguous float32, float16 or bfloat16, got ", dtype,
              t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(t.sizes() == shape, "llmplug_cpu::int4_matmul: ", name, " must be ", expected, " = ", shape, ", got ",
              t.sizes());
}

// Calls fn with the weight of these tensors (Int4Weight or Int8Weight, after checking them) as its group
// parameters' type.
template <typename Fn>
void with_weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros, int64_t K,
                 int64_t group_size, Fn&& fn) {
  const int64_t N = qweight.size(0), G = K / group_size;
  const bool int8 = qweight.scalar_type() == at::kChar;
  if (int8) {
    check_groups(scales, "scales", {N, G}, "[N, K / group_size] (int8 codes)");
    check_groups(zeros, "zeros", {N, 0}, "[N, 0] (int8 codes have no zeros)");
  } else {
    check_groups(scales, "scales", {N, qweight.size(1), G}, "[N, P, K / group_size]");
    check_groups(zeros, "zeros", {N, qweight.size(1), G}, "[N, P, K / group_size]");
  }
  TORCH_CHECK(scales.scalar_type() == zeros.scalar_type(), "llmplug_cpu::int4_matmul: scales are ",
              scales.scalar_type(), ", zeros ", zeros.scalar_type(), "; both must have one dtype");
  auto typed = [&]<typename Param>(Param*) {
    const Param* s = reinterpret_cast<const Param*>(scales.data_ptr());
    if (int8) {
      fn(Int8Weight<Param>{qweight.data_ptr<int8_t>(), s, K, G, group_size});
    } else {
      fn(Int4Weight<Param>{qweight.data_ptr<uint8_t>(), s, reinterpret_cast<const Param*>(zeros.data_ptr()),
                           qweight.size(1), K, G, group_size});
    }
  };
  if (scales.scalar_type() == at::kFloat) {
    typed(static_cast<float*>(nullptr));
  } else if (scales.scalar_type() == at::kHalf) {
    typed(static_cast<c10::Half*>(nullptr));
  } else {
    typed(static_cast<c10::BFloat16*>(nullptr));
  }
}

// x [M, K] (float32 or bfloat16; columns contiguous) . W^T -> [M, N] in x's dtype, W the weight of qweight
// [N, P, K / 2] uint8 (two codes a byte, see the layout above) with scales and zeros [N, P, K / group_size], or of
// qweight [N, K] int8 with scales [N, K / group_size] and zeros [N, 0]. Fewer bytes of group parameters
// (float16, bfloat16) are fewer bytes to read, which a decode step's time is.
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2, "llmplug_cpu::int4_matmul: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "llmplug_cpu::int4_matmul: x must be float32 or bfloat16, got ", x.scalar_type());
  const bool int8 = qweight.dim() == 2 && qweight.scalar_type() == at::kChar;
  TORCH_CHECK((int8 || (qweight.dim() == 3 && qweight.scalar_type() == at::kByte)) && qweight.is_contiguous(),
              "llmplug_cpu::int4_matmul: qweight must be contiguous uint8 [N, P, K / 2] or int8 [N, K], got ",
              qweight.sizes(), " ", qweight.scalar_type());
  const int64_t K = x.size(1), row_codes = int8 ? qweight.size(1) : qweight.size(2) * 2;
  TORCH_CHECK(int8 || qweight.size(1) >= 1, "llmplug_cpu::int4_matmul: qweight has no planes");
  TORCH_CHECK(row_codes == K, "llmplug_cpu::int4_matmul: x has ", K, " columns, qweight's rows hold ", row_codes);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "llmplug_cpu::int4_matmul: group_size must be a positive multiple of 32 dividing K=", K, ", got ",
              group_size);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), qweight.size(0)}, x.options());
  with_weight(qweight, scales, zeros, K, group_size, [&](const auto& w) {
    if (y.numel() == 0) return;
#ifdef LLMPLUG_INT4_AVX512
    if (x.scalar_type() == at::kFloat) {
      int4_matmul_impl<FmaDot<F32Act>>(xc, w, y);
    } else {
#ifdef LLMPLUG_INT4_AVX512_BF16
#ifdef LLMPLUG_INT4_AMX
      if (llmplug::amx_enabled()) return amx_matmul(xc, w, y);
#endif
      int4_matmul_impl<Bf16Dot>(xc, w, y);
#else
      int4_matmul_impl<FmaDot<BF16Act>>(xc, w, y);
#endif
    }
#else
    if (x.scalar_type() == at::kFloat) {
      int4_matmul_impl<float>(xc, w, y);
    } else {
      int4_matmul_impl<c10::BFloat16>(xc, w, y);
    }
#endif
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmplug_cpu, m) {
  m.def("int4_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmplug_cpu, CPU, m) { m.impl("int4_matmul", int4_matmul); }
