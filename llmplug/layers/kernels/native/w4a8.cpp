// w4a8_matmul: x [M, K] times W^T for W [N, K] in GGUF Q4_0 / Q4_1 blocks (w = d q + m, q in 0..15, d and m
// float16 per column and 32 k), with x's rows quantized to int8 per 32 k as llama.cpp quantizes activations for
// these blocks (Q8_1): a block's scale dx = max |x| / 127, its codes qx = round(x / dx) (x times 1 / dx, rounded to
// nearest even), its sum sx = sum qx. Output (m, n) adds the blocks in k order, each as
//
//     t = fma(float(sum_k qx w_q), d, float(sx) * m);  acc = fma(t, dx, acc)   (acc from +0; then rounded to x's dtype)
//
// The block's integer dot product is exact, whichever instruction computes it (AVX512-VNNI's vpdpbusd, AVX-512's
// vpmaddubsw + vpmaddwd, AMX-INT8's tdpbsud, or a plain loop), and every float operation above is the same one in
// the same order, so an output's bits depend neither on M, nor on the path or thread that computes it, nor on the
// CPU (docs/kernels.md, "W4A8"). That is what lets a decode step of one row take the AVX-512 path and a batch the
// AMX one, each the fastest at its size, with the same bits.
//
// Layout (llmplug.layers.kernels.w4a8.W4A8.pack): packed [ceil(N / 16), K / 32, 320] uint8, for 16 columns and 32 k:
// 4 x 64 bytes of codes, where byte 4c + j of the i-th 64 holds column c's k = 4i + j in its low nibble and
// k = 16 + 4i + j in its high one (unpacked, the 8 rows of 64 bytes are AMX's B tile for 32 k: VNNI quads), then the
// 16 columns' d, then their m (float16).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "bf16.h"
#define LLMPLUG_W4A8_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include "amx.h"
#define LLMPLUG_W4A8_AMX 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;       // k a block: one d and m a column, one dx and sx a row
constexpr int64_t kColumns = 16;     // columns a group: one vector of sums
constexpr int64_t kCodeBytes = 256;  // a group's codes for a block
constexpr int64_t kGroupBytes = kCodeBytes + 2 * kColumns * 2;  // then its 16 d and 16 m, float16
constexpr int64_t kQuadRows = kBlock / 4;                       // B tile rows for a block: k in quads

// x's rows as int8 blocks: codes [M, K], and per (row, block) dx and float(sx).
struct Quantized {
  std::vector<int8_t> codes;
  std::vector<float> scale, sum;
};

// A row's block of 32 k: its scale dx and sum, codes into q (scalar, the reference for every path). A block holding
// a NaN or an infinity gets dx = NaN (codes 0): every output of its row is NaN, as a float matmul's would be. A
// block whose dx is below float32's normal range (max |x| < 127 * 2^-126) gets codes 0: 1 / dx would overflow.
template <typename T>
void quantize_block_scalar(const T* x, int8_t* q, float& scale, float& sum) {
  float amax = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) {
    const float v = std::fabs(static_cast<float>(x[k]));
    if (!(v <= FLT_MAX)) {
      std::fill(q, q + kBlock, int8_t{0});
      scale = std::numeric_limits<float>::quiet_NaN(), sum = 0.0f;
      return;
    }
    amax = std::max(amax, v);
  }
  const float d = amax / 127.0f, inverse = d >= FLT_MIN ? 1.0f / d : 0.0f;
  int32_t s = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const float v = std::nearbyint(static_cast<float>(x[k]) * inverse);  // to nearest even, as vcvtps2dq
    const int32_t c = static_cast<int32_t>(std::clamp(v, -127.0f, 127.0f));
    q[k] = static_cast<int8_t>(c);
    s += c;
  }
  scale = d, sum = static_cast<float>(s);
}

#ifdef LLMPLUG_W4A8_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return llmplug::bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// quantize_block_scalar's bits, 16 lanes at a time (max is exact in any order; the sum is of integers).
template <typename T>
void quantize_block(const T* x, int8_t* q, float& scale, float& sum) {
  const __m512 lo = _mm512_abs_ps(load16(x)), hi = _mm512_abs_ps(load16(x + 16)), largest = _mm512_set1_ps(FLT_MAX);
  if (_mm512_cmp_ps_mask(lo, largest, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(hi, largest, _CMP_NLE_UQ)) {
    return quantize_block_scalar(x, q, scale, sum);  // a NaN or an infinity: the scalar rule
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
  const float d = amax / 127.0f;
  const __m512 inverse = _mm512_set1_ps(d >= FLT_MIN ? 1.0f / d : 0.0f);
  const __m512i limit = _mm512_set1_epi32(127);
  auto codes = [&](__m512 v) {
    return _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inverse)), limit),
                            _mm512_sub_epi32(_mm512_setzero_si512(), limit));
  };
  const __m512i a = codes(load16(x)), b = codes(load16(x + 16));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(b));
  scale = d, sum = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(a, b)));
}
#else
template <typename T>
void quantize_block(const T* x, int8_t* q, float& scale, float& sum) {
  quantize_block_scalar(x, q, scale, sum);
}
#endif

template <typename T>
Quantized quantize_rows(const T* x, int64_t M, int64_t K, int64_t ldx) {
  const int64_t blocks = K / kBlock, padded = (M + 15) / 16 * 16;  // zero rows to a multiple of 16: AMX reads them
  Quantized out{std::vector<int8_t>(padded * K), std::vector<float>(padded * blocks),
                std::vector<float>(padded * blocks)};
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        quantize_block(x + m * ldx + b * kBlock, out.codes.data() + m * K + b * kBlock,
                       out.scale[m * blocks + b], out.sum[m * blocks + b]);
  });
  return out;
}

#ifdef LLMPLUG_W4A8_AVX512

// A group's block of codes as the 8 rows of 64 bytes B tiles hold: row r = k quad r of the 16 columns.
inline void unpack(const uint8_t* codes, __m512i (&w)[kQuadRows]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i packed = _mm512_loadu_si512(codes + 64 * i);
    w[i] = _mm512_and_si512(packed, nibble);
    w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
}

// The group's 16 d and m of a block as float32.
inline void params(const uint8_t* group, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kCodeBytes)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kCodeBytes + 2 * kColumns)));
}

// acc += the block's t times dx (the arithmetic every path shares).
inline __m512 add_block(__m512 acc, __m512i dot, __m512 d, __m512 m, float scale, float sum) {
  const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, _mm512_mul_ps(_mm512_set1_ps(sum), m));
  return _mm512_fmadd_ps(t, _mm512_set1_ps(scale), acc);
}

// 16 columns' exact integer dot products with a row's block of codes (x: 32 int8).
inline __m512i block_dot(const __m512i (&w)[kQuadRows], const int8_t* x) {
  int32_t quads[kQuadRows];
  std::memcpy(quads, x, kBlock);
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();  // two chains: integer sums add in any order
#if defined(__AVX512VNNI__)
  for (int i = 0; i < kQuadRows; i += 2) {
    a = _mm512_dpbusd_epi32(a, w[i], _mm512_set1_epi32(quads[i]));
    b = _mm512_dpbusd_epi32(b, w[i + 1], _mm512_set1_epi32(quads[i + 1]));
  }
#else  // u8 x s8 pairs to int16 (at most 2 * 15 * 127: no saturation), then pairs of those to int32
  const __m512i ones = _mm512_set1_epi16(1);
  for (int i = 0; i < kQuadRows; i += 2) {
    a = _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_maddubs_epi16(w[i], _mm512_set1_epi32(quads[i])), ones));
    b = _mm512_add_epi32(b, _mm512_madd_epi16(_mm512_maddubs_epi16(w[i + 1], _mm512_set1_epi32(quads[i + 1])), ones));
  }
#endif
  return _mm512_add_epi32(a, b);
}

template <typename T>
inline void store16(T* y, __m512 v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << count) - 1), v);
  } else {
    _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << count) - 1), llmplug::bf16_bits(v));
  }
}

// Rows r0 .. r0 + R - 1 of column group g: the codes unpacked once a block for the R rows.
template <int R, typename T>
void vector_rows(const uint8_t* group, int64_t blocks, const Quantized& xq, int64_t K, int64_t r0, T* y,
                 int64_t N, int64_t n0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, group += kGroupBytes) {
    __m512i w[kQuadRows];
    unpack(group, w);
    __m512 d, m;
    params(group, d, m);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + b;
      acc[r] = add_block(acc[r], block_dot(w, xq.codes.data() + (r0 + r) * K + b * kBlock), d, m, xq.scale[at],
                         xq.sum[at]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + (r0 + r) * N + n0, acc[r], std::min<int64_t>(kColumns, N - n0));
}

template <typename T>
void vector_groups(const uint8_t* packed, const Quantized& xq, int64_t M, int64_t N, int64_t K, int64_t begin,
                   int64_t end, T* y) {
  constexpr int kRowTile = 4;
  const int64_t blocks = K / kBlock;
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* group = packed + g * blocks * kGroupBytes;
    int64_t r0 = 0;
    for (; r0 + kRowTile <= M; r0 += kRowTile) vector_rows<kRowTile>(group, blocks, xq, K, r0, y, N, g * kColumns);
    switch (M - r0) {
      case 3: vector_rows<3>(group, blocks, xq, K, r0, y, N, g * kColumns); break;
      case 2: vector_rows<2>(group, blocks, xq, K, r0, y, N, g * kColumns); break;
      case 1: vector_rows<1>(group, blocks, xq, K, r0, y, N, g * kColumns); break;
      default: break;
    }
  }
}

#ifdef LLMPLUG_W4A8_AMX
// A thread takes a group of 16 columns at a time (its blocks unpacked once into a buffer as B tiles) against up to
// 16 rows of x at a time, R of them computed (a multiple of 4: the rows past M are the zeros Quantized is padded
// with). Tiles: A = the rows' 32 codes of a block, B = the group's block (8 quads x 64 bytes), C = their sums
// [rows, 16 columns] int32 from zero: a block's exact dot products, stored for the float epilogue vector_rows's
// add_block does, whose R sums stay in registers. Blocks alternate between two sets (C, A, B: tmm0, 2, 4 / tmm1, 3,
// 5), a block's epilogue issued after the next block's tile product. The epilogue (4 vector operations a row and
// block) and the tile stores bound it: at 32 rows ~1.6x the vector path, at 8 about even (docs/kernels.md).
using llmplug::TileConfig;
constexpr int64_t kAmxRows = 16;

TileConfig amx_config(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 2; ++t) {
    config.rows[t] = rows, config.colsb[t] = 4 * kColumns;    // C
    config.rows[2 + t] = rows, config.colsb[2 + t] = kBlock;  // A
    config.rows[4 + t] = kQuadRows, config.colsb[4 + t] = 64;  // B
  }
  return config;
}

// C tile C's products for block b: A (tile A) from x, B (tile B) from the group's unpacked blocks.
#define LLMPLUG_W4A8_PRODUCT(C, A, B, b)                   \
  _tile_zero(C);                                          \
  _tile_loadd(A, x + (b) * kBlock, K);                    \
  _tile_loadd(B, tiles + (b) * kQuadRows * 64, 64);       \
  _tile_dpbsud(C, A, B);

template <int R, typename T>
void amx_rows(const uint8_t* group, const uint8_t* tiles, const Quantized& xq, int64_t r0, int64_t rows,
              int64_t blocks, int64_t K, T* y, int64_t N, int64_t n0) {
  alignas(64) int32_t sums[2][kAmxRows * kColumns];  // C tiles 0 and 1's
  const int8_t* x = xq.codes.data() + r0 * K;
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  auto epilogue = [&](int64_t b, const int32_t* block_sums) {
    __m512 d, m;
    params(group + b * kGroupBytes, d, m);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + b;
      acc[r] = add_block(acc[r], _mm512_load_si512(block_sums + r * kColumns), d, m, xq.scale[at], xq.sum[at]);
    }
  };
  // block b's products (C tiles 0 and 1 in turn) are issued before block b - 1's epilogue
  auto products = [&](int64_t b) {
    if (b % 2 == 0) {
      LLMPLUG_W4A8_PRODUCT(0, 2, 4, b)
      _tile_stored(0, sums[0], 4 * kColumns);
    } else {
      LLMPLUG_W4A8_PRODUCT(1, 3, 5, b)
      _tile_stored(1, sums[1], 4 * kColumns);
    }
  };
  products(0);
  for (int64_t b = 1; b < blocks; ++b) {
    products(b);
    epilogue(b - 1, sums[(b - 1) % 2]);
  }
  epilogue(blocks - 1, sums[(blocks - 1) % 2]);
  const int64_t count = std::min<int64_t>(kColumns, N - n0);
  for (int r = 0; r < R; ++r)
    if (r < rows) store16(y + (r0 + r) * N + n0, acc[r], count);
}
#undef LLMPLUG_W4A8_PRODUCT

template <typename T>
void amx_groups(const uint8_t* packed, const Quantized& xq, int64_t M, int64_t N, int64_t K, int64_t begin,
                int64_t end, T* y) {
  const int64_t blocks = K / kBlock;
  const auto buffer = std::make_unique_for_overwrite<uint8_t[]>(blocks * kQuadRows * 64 + 64);
  uint8_t* tiles = buffer.get() + (-reinterpret_cast<uintptr_t>(buffer.get()) % 64);  // [block, 8 quads, 64 bytes]
  int64_t configured = 0;
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* group = packed + g * blocks * kGroupBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i w[kQuadRows];
      unpack(group + b * kGroupBytes, w);
      for (int i = 0; i < kQuadRows; ++i) _mm512_store_si512(tiles + (b * kQuadRows + i) * 64, w[i]);
    }
    for (int64_t r0 = 0; r0 < M; r0 += kAmxRows) {
      const int64_t rows = std::min<int64_t>(kAmxRows, M - r0), computed = (rows + 3) / 4 * 4;
      if (computed != configured) {
        llmplug::load_tile_config(amx_config(computed));
        configured = computed;
      }
      switch (computed) {
        case 4: amx_rows<4>(group, tiles, xq, r0, rows, blocks, K, y, N, g * kColumns); break;
        case 8: amx_rows<8>(group, tiles, xq, r0, rows, blocks, K, y, N, g * kColumns); break;
        case 12: amx_rows<12>(group, tiles, xq, r0, rows, blocks, K, y, N, g * kColumns); break;
        default: amx_rows<16>(group, tiles, xq, r0, rows, blocks, K, y, N, g * kColumns); break;
      }
    }
  }
  if (configured) _tile_release();
}

constexpr int64_t kAmxMinRows = 8;  // fewer rows: the vector path is as fast (measured), with the same bits
#endif

#else  // generic: the same arithmetic, one column at a time

template <typename T>
void scalar_groups(const uint8_t* packed, const Quantized& xq, int64_t M, int64_t N, int64_t K, int64_t begin,
                   int64_t end, T* y) {
  const int64_t blocks = K / kBlock;
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* group = packed + g * blocks * kGroupBytes;
    for (int64_t c = 0; c < std::min<int64_t>(kColumns, N - g * kColumns); ++c)
      for (int64_t r = 0; r < M; ++r) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* block = group + b * kGroupBytes;
          const int8_t* x = xq.codes.data() + r * K + b * kBlock;
          int32_t dot = 0;
          for (int64_t k = 0; k < kBlock; ++k) {
            const int64_t quad = k / 4 % 4, byte = 64 * quad + 4 * c + k % 4;
            dot += int32_t(k < 16 ? block[byte] & 15 : block[byte] >> 4) * x[k];
          }
          c10::Half d, m;
          std::memcpy(&d, block + kCodeBytes + 2 * c, 2);
          std::memcpy(&m, block + kCodeBytes + 2 * kColumns + 2 * c, 2);
          const int64_t at = r * blocks + b;
          const float t = std::fma(static_cast<float>(dot), static_cast<float>(d), xq.sum[at] * static_cast<float>(m));
          acc = std::fma(t, xq.scale[at], acc);
        }
        y[r * N + g * kColumns + c] = static_cast<T>(acc);
      }
  }
}
#endif

template <typename T>
void w4a8_impl(const at::Tensor& x, const uint8_t* packed, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), groups = (N + kColumns - 1) / kColumns;
  const Quantized xq = quantize_rows(reinterpret_cast<const T*>(x.data_ptr()), M, K, x.stride(0));
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int64_t work = K * kColumns * std::min<int64_t>(M, 16);
#ifdef LLMPLUG_W4A8_AMX
  if (M >= kAmxMinRows && llmplug::amx_enabled()) {
    at::parallel_for(0, groups, std::max<int64_t>(1, (1 << 15) / work), [&](int64_t begin, int64_t end) {
      amx_groups(packed, xq, M, N, K, begin, end, yp);
    });
    return;
  }
#endif
  at::parallel_for(0, groups, std::max<int64_t>(1, (1 << 15) / work), [&](int64_t begin, int64_t end) {
#ifdef LLMPLUG_W4A8_AVX512
    vector_groups(packed, xq, M, N, K, begin, end, yp);
#else
    scalar_groups(packed, xq, M, N, K, begin, end, yp);
#endif
  });
}

// x [M, K] (float32 or bfloat16; columns contiguous) . W^T -> [M, N] in x's dtype; packed [ceil(N / 16), K / 32,
// 320] uint8 (the layout above; N: out_features, the last group's columns beyond it unused).
at::Tensor w4a8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "llmplug_cpu::w4a8_matmul: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "llmplug_cpu::w4a8_matmul: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "llmplug_cpu::w4a8_matmul: packed must be contiguous uint8 [N / 16, K / 32, 320], got ", packed.sizes(),
              " ", packed.scalar_type());
  TORCH_CHECK(packed.size(1) * kBlock == x.size(1), "llmplug_cpu::w4a8_matmul: x has ", x.size(1),
              " columns, the packed weight holds ", packed.size(1) * kBlock);
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kColumns && out_features <= packed.size(0) * kColumns,
              "llmplug_cpu::w4a8_matmul: out_features ", out_features, " does not fit ", packed.size(0),
              " groups of 16 columns");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (y.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    w4a8_impl<float>(xc, packed.data_ptr<uint8_t>(), y);
  } else {
    w4a8_impl<c10::BFloat16>(xc, packed.data_ptr<uint8_t>(), y);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmplug_cpu, m) { m.def("w4a8_matmul(Tensor x, Tensor packed, int out_features) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmplug_cpu, CPU, m) { m.impl("w4a8_matmul", w4a8_matmul); }
