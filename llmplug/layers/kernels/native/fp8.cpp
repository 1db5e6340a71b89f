// fp8_matmul: x [M, K] times W^T for W [N, K] float8_e4m3fn with float32 scales (llmplug.quantization.fp8), the
// weight read as one byte and decoded in registers, never held dense.
//
// Each weight is decoded exactly, multiplied by its scale in float32 and rounded once to x's dtype: the weights
// transformers' (and DeepSeek's) dequantization gives. Output (m, n) is then one dot product in float32 over 16
// lanes (32 with AVX512-BF16: vdpbf16ps, k in pairs), k in order per lane and the lanes summed in a fixed tree,
// by the same instructions whatever M, the tile or the thread that computes it: a row's bits never depend on the
// batch (docs/determinism.md). Threads split the output columns.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "bf16.h"
#define LLMPLUG_FP8_AVX512 1
#if defined(__AVX512BF16__)
#define LLMPLUG_FP8_AVX512_BF16 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 128;      // the scale blocks' width (and height)
constexpr int kColumns = 4;          // output columns a tile computes together (their weights decoded once)
constexpr int kRows = 4;             // rows of x a tile computes together
constexpr int64_t kPrefetch = 1024;  // bytes ahead of a weight row's decoding
constexpr int64_t kFusedRows = 4;    // up to this many rows, weights are decoded in registers at every use;
                                     // beyond, once per tile of columns into a buffer the rows then share

// Where a weight's scale is: scale[n / row_div, k / 128] (or column 0 when the scale has one column).
struct Scales {
  const float* data;
  int64_t row_div, columns;
  const float* row(int64_t n) const { return data + n / row_div * columns; }
  int64_t column(int64_t k) const { return columns > 1 ? k / kBlock : 0; }
};

#ifdef LLMPLUG_FP8_AVX512

// 16 e4m3fn codes -> their values times 2^-8, exactly: the code's bits placed in a float16 (sign to bit 15, exponent
// and mantissa shifted by 7) are the same number times 2^-8 (biases 7 and 15), subnormals included; float16 -> float32
// is exact. The 2^8 is folded into the scale.
inline __m512 decode16(__m128i codes) {
  __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
  h = _mm256_and_si256(h, _mm256_set1_epi16(int16_t(0xBFFF)));
  return _mm512_cvtph_ps(h);
}

// Activation types for the float32-FMA path: 16 k a step, weights float32 already rounded to the activation dtype.
struct F32Act {
  using raw = float;
  static inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static inline __m512 round(__m512 w) { return w; }
};
struct F16Act {
  using raw = c10::Half;
  static inline __m512 load(const c10::Half* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  static inline __m512 round(__m512 w) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
struct BF16Act {  // without AVX512-BF16: round to nearest even in integers (weights are finite)
  using raw = c10::BFloat16;
  static inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
    return llmplug::bf16_floats(_mm256_maskz_loadu_epi16(m, p));
  }
  static inline __m512 round(__m512 w) {
    const __m512i u = _mm512_castps_si512(w);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  }
};

template <typename Act>
struct FmaDot {
  using raw = typename Act::raw;
  using W = __m512;
  using X = __m512;
  using Mask = __mmask16;
  using Stored = float;  // a decoded weight in the buffer
  static constexpr int kStep = 16;
  static inline Mask mask(int64_t left) { return left >= kStep ? Mask(0xFFFF) : Mask((1u << left) - 1); }
  static inline W decode(const uint8_t* q, float scale, Mask m) {
    const __m512 v = decode16(_mm_maskz_loadu_epi8(m, q));
    return Act::round(_mm512_mul_ps(v, _mm512_set1_ps(scale * 256.0f)));
  }
  static inline X load_x(const raw* p, Mask m) { return Act::load(p, m); }
  static inline void store(Stored* p, W w) { _mm512_storeu_ps(p, w); }
  static inline W load(const Stored* p) { return _mm512_loadu_ps(p); }
  static inline __m512 dot(__m512 acc, X x, W w) { return _mm512_fmadd_ps(x, w, acc); }
};

#ifdef LLMPLUG_FP8_AVX512_BF16
// bf16 activations on AVX512-BF16: 32 k a step; vdpbf16ps adds each lane's pair of products to it
struct Bf16Dot {
  using raw = c10::BFloat16;
  using W = __m512bh;
  using X = __m512bh;
  using Mask = __mmask32;
  using Stored = uint16_t;
  static constexpr int kStep = 32;
  static inline Mask mask(int64_t left) { return left >= kStep ? Mask(0xFFFFFFFFu) : Mask((1u << left) - 1); }
  static inline W decode(const uint8_t* q, float scale, Mask m) {  // decode16's steps, 32 codes at a time
    __m512i h = _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, q)), 7);
    h = _mm512_and_si512(h, _mm512_set1_epi16(int16_t(0xBFFF)));
    const __m512 s = _mm512_set1_ps(scale * 256.0f);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
    return _mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even, k in memory order
  }
  static inline X load_x(const raw* p, Mask m) { return (X)_mm512_maskz_loadu_epi16(m, p); }
  static inline void store(Stored* p, W w) { _mm512_storeu_si512(p, (__m512i)w); }
  static inline W load(const Stored* p) { return (W)_mm512_loadu_si512(p); }
  static inline __m512 dot(__m512 acc, X x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// y[r, c] = x[r] . w[c] for R rows and C columns, k in steps of D::kStep; `weight(c, k, mask)` gives column c's
// weights at k (decoded in place or read from the buffer: the same bits). Every element is the same arithmetic
// whatever R and C.
template <typename D, int R, int C, typename Weight>
inline void dot_tile(const typename D::raw* x, int64_t ldx, int64_t K, Weight&& weight, typename D::raw* y,
                     int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += D::kStep) {
    const typename D::Mask m = D::mask(K - k);
    typename D::W w[C];
    for (int c = 0; c < C; ++c) w[c] = weight(c, k, m);
    for (int r = 0; r < R; ++r) {
      const typename D::X xv = D::load_x(x + r * ldx + k, m);
      for (int c = 0; c < C; ++c) acc[r][c] = D::dot(acc[r][c], xv, w[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = typename D::raw(_mm512_reduce_add_ps(acc[r][c]));
}

#else  // generic: a 256-entry table, the products rounded by torch's own conversions, 16 float lanes

template <typename T>
struct GenericDot {
  using raw = T;
  static constexpr int kStep = 16;
};

inline float mul_add(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

#endif

// fn.template operator()<rows>() for rows in 1..R (the tile of x's last rows is smaller).
template <int R, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (R > 0) {
    if (rows == R) return fn.template operator()<R>();
    with_rows<R - 1>(rows, fn);
  }
}

template <typename D>
void fp8_matmul_impl(const at::Tensor& x, const at::Tensor& w, const Scales& scales, at::Tensor& y) {
  using raw = typename D::raw;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = x.stride(0);
  const raw* xp = reinterpret_cast<const raw*>(x.data_ptr());
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  raw* yp = reinterpret_cast<raw*>(y.data_ptr());
  const int64_t tiles = (N + kColumns - 1) / kColumns;
  const int64_t padded = (K + D::kStep - 1) / D::kStep * D::kStep;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (K * kColumns * std::min<int64_t>(M, kRows)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
#ifdef LLMPLUG_FP8_AVX512
    std::vector<typename D::Stored> buffer(M > kFusedRows ? kColumns * padded : 0);
    typename D::Stored* const decoded_tile = buffer.data();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kColumns, count = std::min<int64_t>(kColumns, N - n0);
      const float* rows_scales[kColumns];
      const uint8_t* rows_codes[kColumns];
      for (int64_t c = 0; c < count; ++c) rows_scales[c] = scales.row(n0 + c), rows_codes[c] = wp + (n0 + c) * K;
      const bool blocked = scales.columns > 1;
      auto decoded = [&](int c, int64_t k, typename D::Mask m) {
        // decoding reads each weight once, from memory: ask for it a few steps ahead (the 4 rows' streams)
        _mm_prefetch(reinterpret_cast<const char*>(rows_codes[c] + k + kPrefetch), _MM_HINT_T0);
        return D::decode(rows_codes[c] + k, rows_scales[c][blocked ? k / kBlock : 0], m);
      };
      if (M > kFusedRows) {
        for (int64_t c = 0; c < count; ++c)
          for (int64_t k = 0; k < K; k += D::kStep)
            D::store(decoded_tile + c * padded + k, decoded(int(c), k, D::mask(K - k)));
      }
      auto weight = [&](int c, int64_t k, typename D::Mask m) {  // the same bits either way
        return M > kFusedRows ? D::load(decoded_tile + c * padded + k) : decoded(c, k, m);
      };
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        with_rows<kRows>(std::min<int64_t>(kRows, M - m0), [&]<int R>() {
          const raw* xr = xp + m0 * ldx;
          raw* yr = yp + m0 * N + n0;
          if (count == kColumns) {
            dot_tile<D, R, kColumns>(xr, ldx, K, weight, yr, N);
          } else {
            for (int64_t c = 0; c < count; ++c) {
              auto one = [&](int, int64_t k, typename D::Mask m) { return weight(int(c), k, m); };
              dot_tile<D, R, 1>(xr, ldx, K, one, yr + c, N);
            }
          }
        });
      }
    }
#else
    static const std::array<float, 256> table = [] {
      std::array<float, 256> values{};
      for (int code = 0; code < 256; ++code)
        values[code] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(code), c10::Float8_e4m3fn::from_bits()));
      return values;
    }();
    std::vector<float> weights(kColumns * padded, 0.0f);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kColumns, count = std::min<int64_t>(kColumns, N - n0);
      for (int64_t c = 0; c < count; ++c) {
        const float* row_scales = scales.row(n0 + c);
        for (int64_t k = 0; k < K; ++k)  // the product rounded once to x's dtype (float32: as it is)
          weights[c * padded + k] =
              static_cast<float>(raw(table[wp[(n0 + c) * K + k]] * row_scales[scales.column(k)]));
      }
      for (int64_t m = 0; m < M; ++m) {
        float xr[D::kStep];
        for (int64_t c = 0; c < count; ++c) {
          float lanes[D::kStep] = {};
          const float* wc = weights.data() + c * padded;
          for (int64_t k = 0; k < K; k += D::kStep) {
            for (int j = 0; j < D::kStep; ++j) xr[j] = k + j < K ? static_cast<float>(xp[m * ldx + k + j]) : 0.0f;
#pragma omp simd
            for (int j = 0; j < D::kStep; ++j) lanes[j] = mul_add(xr[j], wc[k + j], lanes[j]);
          }
          for (int width = D::kStep / 2; width > 0; width /= 2)
            for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
          yp[m * N + n0 + c] = raw(lanes[0]);
        }
      }
    }
#endif
  });
}

// The scale's layout: [N or ceil(N/128) or 1, ceil(K/128) or 1] float32.
Scales scales_of(const at::Tensor& scale, int64_t N, int64_t K) {
  const int64_t row_blocks = (N + kBlock - 1) / kBlock, column_blocks = (K + kBlock - 1) / kBlock;
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "llmplug_cpu::fp8_matmul: scale must be contiguous float32 [rows, columns], got ", scale.sizes(), " ",
              scale.scalar_type());
  const int64_t rows = scale.size(0), columns = scale.size(1);
  TORCH_CHECK(rows == N || rows == row_blocks || rows == 1,
              "llmplug_cpu::fp8_matmul: scale has ", rows, " rows; a weight of ", N, " rows takes ", N,
              " (per row), ", row_blocks, " (per 128-row block) or 1");
  TORCH_CHECK(columns == column_blocks || columns == 1, "llmplug_cpu::fp8_matmul: scale has ", columns,
              " columns; a weight of ", K, " columns takes ", column_blocks, " (per 128-column block) or 1");
  const int64_t row_div = rows == N ? 1 : rows == row_blocks ? kBlock : std::max<int64_t>(N, 1);
  return {scale.data_ptr<float>(), row_div, columns};
}

// x [M, K] (float32, bfloat16 or float16; columns contiguous) . dequant(w)^T -> [M, N] in x's dtype, with w [N, K]
// contiguous float8_e4m3fn and scale float32 (see scales_of): w[n, k] = float32(q) * scale, rounded to x's dtype.
at::Tensor fp8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kFloat8_e4m3fn && w.is_contiguous(),
              "llmplug_cpu::fp8_matmul: x [M, K] and contiguous float8_e4m3fn w [N, K] expected, got ", x.sizes(),
              " and ", w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "llmplug_cpu::fp8_matmul: x has ", x.size(1), " columns, w ", w.size(1));
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const Scales scales = scales_of(scale, w.size(0), w.size(1));
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (y.numel() == 0) return y;
  switch (x.scalar_type()) {
#ifdef LLMPLUG_FP8_AVX512
    case at::kFloat: fp8_matmul_impl<FmaDot<F32Act>>(xc, w, scales, y); break;
    case at::kHalf: fp8_matmul_impl<FmaDot<F16Act>>(xc, w, scales, y); break;
#ifdef LLMPLUG_FP8_AVX512_BF16
    case at::kBFloat16: fp8_matmul_impl<Bf16Dot>(xc, w, scales, y); break;
#else
    case at::kBFloat16: fp8_matmul_impl<FmaDot<BF16Act>>(xc, w, scales, y); break;
#endif
#else
    case at::kFloat: fp8_matmul_impl<GenericDot<float>>(xc, w, scales, y); break;
    case at::kHalf: fp8_matmul_impl<GenericDot<c10::Half>>(xc, w, scales, y); break;
    case at::kBFloat16: fp8_matmul_impl<GenericDot<c10::BFloat16>>(xc, w, scales, y); break;
#endif
    default: TORCH_CHECK(false, "llmplug_cpu::fp8_matmul: x must be float32, bfloat16 or float16, got ",
                         x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmplug_cpu, m) { m.def("fp8_matmul(Tensor x, Tensor w, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmplug_cpu, CPU, m) { m.impl("fp8_matmul", fp8_matmul); }
