// llmplug's CPU kernels: RMSNorm (with the residual add), SiLU-and-mul, rotary embedding, the KV cache write,
// paged attention (alone, or after the write in one call), greedy sampling, a batched matmul whose rows do not
// depend on the batch, and a matmul with GGUF-quantized weights computed from their raw blocks (and the rows of such
// a table, an embedding lookup).
//
// Every output row is computed by one thread, by the same loops whatever else the call holds: a row's
// bits depend only on its own inputs (and, for attention, its own keys), never on the number of rows,
// the thread count or where a chunk of a prompt starts. That is the batch-invariant contract of
// docs/determinism.md, here by construction. Arithmetic is float32; results round to the input dtype
// where torch's eager ops round (the norm once, after its scale; the activation before the product).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMPLUG_AVX512 1
#include "activation.h"
#include "bf16.h"
#include "rotary.h"
#endif
#include "prompt_attention.h"

// glibc's vector variants of expf (libmvec): lets `#pragma omp simd` loops call them without -ffast-math
extern "C" __attribute__((simd("notinbranch"))) float expf(float) noexcept;

namespace {

// Element types as their raw storage, with float32 conversions the compiler can vectorize.
struct F32 {
  using raw = float;
  static inline float load(float v) { return v; }
  static inline float store(float f) { return f; }
#ifdef LLMPLUG_AVX512
  static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif
};

struct BF16 {
  using raw = uint16_t;
  static inline float load(uint16_t v) {
    uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {  // round to nearest even, as torch does; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(rounded);
  }
#ifdef LLMPLUG_AVX512
  static inline __m512 load16(const uint16_t* p) {
    return llmplug::bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
};

struct F16 {
  using raw = at::Half;
  static inline float load(at::Half v) { return static_cast<float>(v); }
  static inline at::Half store(float f) { return at::Half(f); }
#ifdef LLMPLUG_AVX512
  static inline __m512 load16(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
};

#ifdef LLMPLUG_AVX512
using llmplug::bf16_floats;

// 16 bfloat16 values' bits from memory.
inline __m256i load_bits(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

// Calls fn.template operator()<Type>() for x's dtype.
template <typename Fn>
void dispatch(const at::Tensor& x, const char* op, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn.template operator()<F32>(); break;
    case at::kBFloat16: fn.template operator()<BF16>(); break;
    case at::kHalf: fn.template operator()<F16>(); break;
    default: TORCH_CHECK(false, "llmplug_cpu::", op, ": unsupported dtype ", x.scalar_type());
  }
}

// Rows per parallel task such that a task holds at least ~`work` elements: small calls stay on one thread.
int64_t grain(int64_t elements_per_row, int64_t work = 1 << 15) {
  return std::max<int64_t>(1, work / std::max<int64_t>(1, elements_per_row));
}

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "llmplug_cpu::", op, ": ", name,
              " must be [rows, columns] with contiguous columns, got shape ", x.sizes(), " strides ", x.strides());
}

#ifdef LLMPLUG_AVX512
// One bf16 row of rms_norm_impl, 16 lanes at a time (the compiler's vectorization of the loops below took 1.15-1.25x
// as long): the residual's sum rounded as BF16::store rounds and written back, its squares summed in 16 lanes (a
// fused multiply-add each, lanes added by _mm512_reduce_add_ps's tree), then each value times the inverse root and
// the weight, rounded once. `values` (cols rounded up to 16 floats) keeps the row's values as float32
// between the passes and `weight` is float32 (zeros after cols): the second pass converts nothing, ~0.8x the time.
inline void rms_norm_row_bf16(uint16_t* row, const uint16_t* residual, const float* weight, uint16_t* out,
                              int64_t cols, float eps, float* values) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 live = c + 16 <= cols ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c)) - 1);
    __m512 v = bf16_floats(_mm256_maskz_loadu_epi16(live, row + c));
    if (residual != nullptr) {
      const __m512 r = bf16_floats(_mm256_maskz_loadu_epi16(live, residual + c));
      const __m256i sum = llmplug::bf16_bits(_mm512_add_ps(v, r));
      _mm256_mask_storeu_epi16(row + c, live, sum);
      v = bf16_floats(sum);
    }
    _mm512_storeu_ps(values + c, v);
    squares = _mm512_fmadd_ps(v, v, squares);  // masked-off lanes hold +0: they add exactly nothing
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(cols) + eps));
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 live = c + 16 <= cols ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c)) - 1);
    const __m512 v = _mm512_loadu_ps(values + c), w = _mm512_loadu_ps(weight + c);
    _mm256_mask_storeu_epi16(out + c, live, llmplug::bf16_bits(_mm512_mul_ps(_mm512_mul_ps(v, inv), w)));
  }
}
#endif

// x [N, C] (rows may be strided) -> RMSNorm(x) [N, C]; with a residual [N, C], x + residual is rounded,
// written into x, and normalized. weight [C] in x's dtype.
at::Tensor rms_norm_impl(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                         double eps) {
  check_rows(x, "rms_norm", "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == cols && weight.scalar_type() == x.scalar_type(),
              "llmplug_cpu::rms_norm: weight must be contiguous [", cols, "] in x's dtype");
  if (residual) {
    check_rows(*residual, "rms_norm", "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "llmplug_cpu::rms_norm: residual must match x");
  }
  at::Tensor out = at::empty({rows, cols}, x.options());
  dispatch(x, "rms_norm", [&]<typename T>() {
    using raw = typename T::raw;
    raw* xp = reinterpret_cast<raw*>(x.data_ptr());
    const raw* rp = residual ? reinterpret_cast<const raw*>(residual->data_ptr()) : nullptr;
    const raw* wp = reinterpret_cast<const raw*>(weight.data_ptr());
    raw* op = reinterpret_cast<raw*>(out.data_ptr());
    const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
#ifdef LLMPLUG_AVX512
      if constexpr (std::is_same_v<T, BF16>) {  // the weight as float32 and the row's values: rms_norm_row_bf16
        const int64_t padded = (cols + 15) / 16 * 16;
        std::vector<float> weight(padded, 0.f), values(padded);
        for (int64_t c = 0; c < cols; ++c) weight[c] = T::load(wp[c]);
        for (int64_t i = begin; i < end; ++i)
          rms_norm_row_bf16(xp + i * xs, rp ? rp + i * rs : nullptr, weight.data(), op + i * cols, cols, feps,
                            values.data());
        return;
      }
#endif
      for (int64_t i = begin; i < end; ++i) {
        raw* row = xp + i * xs;
        if (rp) {
          const raw* res = rp + i * rs;
#pragma omp simd
          for (int64_t c = 0; c < cols; ++c) row[c] = T::store(T::load(row[c]) + T::load(res[c]));
        }
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t c = 0; c < cols; ++c) {
          const float v = T::load(row[c]);
          squares += v * v;
        }
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(cols) + feps);
        raw* o = op + i * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) o[c] = T::store(T::load(row[c]) * inv * T::load(wp[c]));
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, std::nullopt, weight, eps);
}

at::Tensor fused_add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, residual, weight, eps);
}

// x [N, 2d] = [gate | up] (rows may be strided) -> silu(gate) * up [N, d].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul", "x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * d, "llmplug_cpu::silu_and_mul: x needs an even number of columns, got ", x.size(1));
  at::Tensor out = at::empty({rows, d}, x.options());
  dispatch(x, "silu_and_mul", [&]<typename T>() {
    using raw = typename T::raw;
    const raw* xp = reinterpret_cast<const raw*>(x.data_ptr());
    raw* op = reinterpret_cast<raw*>(out.data_ptr());
    const int64_t xs = x.stride(0);
#ifdef LLMPLUG_AVX512
    const uint16_t* silu = std::is_same_v<T, BF16> ? llmplug::silu_table() : nullptr;
#endif
    at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const raw* gate = xp + i * xs;
        const raw* up = gate + d;
        raw* o = op + i * d;
        int64_t vectorized = 0;
#ifdef LLMPLUG_AVX512
        if constexpr (std::is_same_v<T, BF16>)
          for (; vectorized + 16 <= d; vectorized += 16) {
            const __m256i product =
                llmplug::silu_and_mul_bf16(load_bits(gate + vectorized), load_bits(up + vectorized), silu);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + vectorized), product);
          }
#endif
#pragma omp simd
        for (int64_t c = vectorized; c < d; ++c) {
          const float g = T::load(gate[c]);
          o[c] = T::store(T::load(T::store(g / (1.f + expf(-g)))) * T::load(up[c]));
        }
      }
    });
  });
  return out;
}

#ifdef LLMPLUG_AVX512
// One head's rotate-half rotary in place, bf16, half a multiple of 16: the rounding of the scalar loop below
// (rotary.h), 16 lanes at a time instead of that loop's 8.
inline void rotate_half_bf16(uint16_t* y, const uint16_t* cos, const uint16_t* sin, int64_t half) {
  for (int64_t d = 0; d < half; d += 16) {
    __m256i lo, hi;
    llmplug::rotate_half_16(BF16::load16(y + d), BF16::load16(y + d + half), BF16::load16(cos + d),
                            BF16::load16(cos + d + half), BF16::load16(sin + d), BF16::load16(sin + d + half), lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d + half), hi);
  }
}
#endif

// Rotary embedding in place: x [T, H, D] (rows may be strided), its first R dims rotated by cos, sin [T, R] (the
// layout llmplug's RotaryCosSin builds: cos per dim, sin signed, pairs (i, i + R/2) rotate-half or (2i, 2i + 1)
// interleaved). x * cos rounds before its partner's term is added, as torch's mul_ then addcmul_ round.
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool neox) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "llmplug_cpu::rotary_embedding: x must be [T, H, D], D contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), rot = cos.size(-1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * rot && sin.numel() == tokens * rot &&
                  rot <= x.size(2) && rot % 2 == 0 && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "llmplug_cpu::rotary_embedding: cos and sin must be contiguous [T, R] in x's dtype, R even and <= D");
  dispatch(x, "rotary_embedding", [&]<typename T>() {
    using raw = typename T::raw;
    raw* xp = reinterpret_cast<raw*>(x.data_ptr());
    const raw* cp = reinterpret_cast<const raw*>(cos.data_ptr());
    const raw* sp = reinterpret_cast<const raw*>(sin.data_ptr());
    const int64_t half = rot / 2, ts = x.stride(0), hs = x.stride(1);
    at::parallel_for(0, tokens, grain(heads * rot), [&](int64_t begin, int64_t end) {
      std::vector<float> row(rot);
      for (int64_t t = begin; t < end; ++t) {
        const raw* c = cp + t * rot;
        const raw* s = sp + t * rot;
#ifdef LLMPLUG_AVX512
        if constexpr (std::is_same_v<T, BF16>) {
          if (neox && half % 16 == 0) {
            for (int64_t h = 0; h < heads; ++h) rotate_half_bf16(xp + t * ts + h * hs, c, s, half);
            continue;
          }
        }
#endif
        for (int64_t h = 0; h < heads; ++h) {
          raw* y = xp + t * ts + h * hs;
          float* r = row.data();
#pragma omp simd
          for (int64_t d = 0; d < rot; ++d) r[d] = T::load(y[d]);
          if (neox) {  // pairs (d, d + half)
#pragma omp simd
            for (int64_t d = 0; d < half; ++d) {
              y[d] = T::store(T::load(T::store(r[d] * T::load(c[d]))) + r[d + half] * T::load(s[d]));
              y[d + half] = T::store(T::load(T::store(r[d + half] * T::load(c[d + half]))) + r[d] * T::load(s[d + half]));
            }
          } else {  // pairs (2i, 2i + 1)
#pragma omp simd
            for (int64_t d = 0; d < rot; ++d)
              y[d] = T::store(T::load(T::store(r[d] * T::load(c[d]))) + r[d ^ 1] * T::load(s[d]));
          }
        }
      }
    });
  });
}

// Store this step's k [T, Hkv, D] and v [T, Hkv, Dv] (rows may be strided) at their slots (block * block_size +
// offset) of key_cache [Hkv, num_blocks, block_size, D] and value_cache [Hkv, num_blocks, block_size, Dv].
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.size(0) == v.size(0),
              "llmplug_cpu::reshape_and_cache: k and v must be [T, Hkv, D], D contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1 && key_cache.size(0) == k.size(1) && key_cache.size(3) == k.size(2) &&
                  value_cache.size(3) == v.size(2) && key_cache.scalar_type() == k.scalar_type() &&
                  value_cache.scalar_type() == v.scalar_type(),
              "llmplug_cpu::reshape_and_cache: the caches must be [Hkv, num_blocks, block_size, D] matching k and v");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "llmplug_cpu::reshape_and_cache: slot_mapping must be int64 [T]");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), block_size = key_cache.size(2);
  const int64_t slots = key_cache.size(1) * block_size;
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "llmplug_cpu::reshape_and_cache: slot ", slot[t], " of token ", t,
                " is outside the cache's ", slots, " slots");
  const int64_t row_bytes_k = k.size(2) * k.element_size(), row_bytes_v = v.size(2) * v.element_size();
  auto* kp = static_cast<const char*>(k.data_ptr());
  auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t es = k.element_size();
  // a prefill writes thousands of rows of 128 or 256 bytes: copies of a constant size (inlined, not libc's call),
  // tokens split between the threads (each slot is one token's)
  const auto copy = [](char* to, const char* from, int64_t bytes) {
    if (bytes == 128) {
      std::memcpy(to, from, 128);
    } else if (bytes == 256) {
      std::memcpy(to, from, 256);
    } else {
      std::memcpy(to, from, bytes);
    }
  };
  at::parallel_for(0, tokens, grain(kv_heads * (row_bytes_k + row_bytes_v), 1 << 16), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        copy(kc + (h * key_cache.stride(0) + block * key_cache.stride(1) + offset * key_cache.stride(2)) * es,
             kp + (t * k.stride(0) + h * k.stride(1)) * es, row_bytes_k);
        copy(vc + (h * value_cache.stride(0) + block * value_cache.stride(1) + offset * value_cache.stride(2)) * es,
             vp + (t * v.stride(0) + h * v.stride(1)) * es, row_bytes_v);
      }
    }
  });
}

// sum_d q[d] * k[d] over n dims: 16 lanes of partial sums added as a tree where AVX-512 runs and n is whole
// vectors (a scalar sum in order would be a chain of n dependent adds), else in order.
template <typename T>
inline float dot(const float* q, const typename T::raw* k, int64_t n) {
#ifdef LLMPLUG_AVX512
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), T::load16(k + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float sum = 0.f;
  for (int64_t d = 0; d < n; ++d) sum += q[d] * T::load(k[d]);
  return sum;
}

#ifdef LLMPLUG_AVX512
// The 16 lane sums of acc[0..16) as one vector, lane k = sum of acc[k]: a transposing tree of shuffles and adds
// (45 instructions for 16 sums, against ~8 for each alone). Every sum takes the same tree, whatever its lane.
inline __m512 sum16(__m512 acc[16]) {
  __m512 w[8], u[4], s[2];
  for (int i = 0; i < 8; ++i)  // 128-bit quarters: q0 + q2, q1 + q3
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[i], acc[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(acc[i], acc[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // then the two remaining quarters: a quarter of 4 lanes per vector
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[i], w[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // lanes 0 + 2, 1 + 3
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[i], u[i + 2]), _mm512_unpackhi_ps(u[i], u[i + 2]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),  // (0 + 2) + (1 + 3)
                                 _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // r holds the sums of acc 0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15: put them in order
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, r);
}

// out[g * stride + k] = queries[g] . keys[k] over n dims (n a multiple of 16, at most kMaxDim) for the G queries
// and k < count <= 16; each key is converted once. Every dot is the same chain of fused multiply-adds over its
// dims and the same tree (sum16), whatever `count`, G and the other keys.
constexpr int64_t kMaxDim = 512;

template <typename T>
inline void dot16(const float* queries, int64_t G, const typename T::raw* const* keys, int64_t count, int64_t n,
                  float* out, int64_t stride) {
  alignas(64) float converted[16 * kMaxDim];
  for (int64_t k = 0; k < count; ++k)
    for (int64_t d = 0; d < n; d += 16) _mm512_store_ps(converted + k * n + d, T::load16(keys[k] + d));
  __m512 acc[16];
  for (int64_t k = count; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const float* q = queries + g * n;
    for (int64_t k = 0; k < count; ++k) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t d = 0; d < n; d += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_load_ps(converted + k * n + d), sum);
      acc[k] = sum;
    }
    _mm512_mask_storeu_ps(out + g * stride, static_cast<__mmask16>((1u << count) - 1), sum16(acc));
  }
}
#endif

// max of s[0..n), n >= 1 (exact in any order).
inline float row_max(const float* s, int64_t n) {
  float top = s[0];
  int64_t j = 1;
#ifdef LLMPLUG_AVX512
  if (n >= 16) {
    __m512 tops = _mm512_loadu_ps(s);
    for (j = 16; j + 16 <= n; j += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + j));
    top = _mm512_reduce_max_ps(tops);
  }
#endif
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

// acc[d] += p * v[d] over n dims.
template <typename T>
inline void axpy(float* acc, float p, const typename T::raw* v, int64_t n) {
#ifdef LLMPLUG_AVX512
  if (n % 16 == 0) {
    const __m512 weight = _mm512_set1_ps(p);
    for (int64_t d = 0; d < n; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(weight, T::load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < n; ++d) acc[d] += p * T::load(v[d]);
}

// Head dims and the cache's layout, shared by every task of a paged_attention call. kD, kDv > 0 below fix the
// head dims at compile time (fully unrolled loops); 0 reads them from here.
struct AttentionShape {
  int64_t group, dim, dim_v, block_size, k_block_stride, k_row_stride, v_block_stride, v_row_stride;
};

// Asks the memory system for the `rows` rows of `bytes` bytes each from `first` on (`stride` elements apart): a paged
// cache's next block sits at an address the hardware prefetcher cannot guess.
template <typename raw>
inline void prefetch_rows(const raw* first, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(first + r * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
  }
}

// scores[i * n + (j - lo)] = queries[i] . key j for the `count` queries [count, D] (scaled) and keys lo..hi, read
// through the block table; n = hi + 1 - lo. A dot's value depends only on its query and key (dot16, dot).
// kPrefetch: fetch each next block's keys and values while the current one is computed on (a decode row reads them
// once, from memory: 1.25x faster decode attention at 32 rows, docs/kernels.md; a prompt's tiles find theirs
// cached, where the prefetches only cost).
template <typename T, int kD, bool kPrefetch>
void key_scores(const float* queries, int64_t count, const typename T::raw* keys, const typename T::raw* values,
                const int64_t* table, int64_t lo, int64_t hi, const AttentionShape& shape, float* scores) {
  using raw = typename T::raw;
  const int64_t D = kD ? kD : shape.dim, n = hi + 1 - lo, bs = shape.block_size;
#ifdef LLMPLUG_AVX512
  if (D % 16 == 0 && D <= kMaxDim) {  // 16 keys at a time: partial sums of 16 lanes each, reduced together
    const raw* group_keys[16];
    int64_t block = lo / bs, offset = lo % bs;
    for (int64_t j = lo; j <= hi; j += 16) {
      const int64_t count_keys = std::min<int64_t>(16, hi + 1 - j);
      for (int64_t k = 0; k < count_keys; ++k) {
        group_keys[k] = keys + table[block] * shape.k_block_stride + offset * shape.k_row_stride;
        if (++offset == bs) offset = 0, ++block;
      }
      if (kPrefetch && block + (offset > 0) <= hi / bs) {  // the block after the one the next 16 keys start in:
        // its keys, and its values, which weighted_sum reads once the scores are done
        const int64_t next = table[block + (offset > 0)];
        prefetch_rows(keys + next * shape.k_block_stride, bs, shape.k_row_stride, D * int64_t(sizeof(raw)));
        prefetch_rows(values + next * shape.v_block_stride, bs, shape.v_row_stride,
                      shape.dim_v * int64_t(sizeof(raw)));
      }
      dot16<T>(queries, count, group_keys, count_keys, D, scores + (j - lo), n);
    }
    return;
  }
#endif
  for (int64_t j = lo; j <= hi;) {  // in key order, a block at a time
    const int64_t block = j / bs, last = std::min(hi, (block + 1) * bs - 1);
    const raw* key = keys + table[block] * shape.k_block_stride + (j % bs) * shape.k_row_stride;
    for (; j <= last; ++j, key += shape.k_row_stride)
      for (int64_t i = 0; i < count; ++i) scores[i * n + (j - lo)] = dot<T>(queries + i * D, key, D);
  }
}

// Each of the G rows scores[g * n .. g * n + n) replaced by its softmax.
inline void softmax_rows(float* scores, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    const float top = row_max(s, n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = expf(s[j] - top);
      total += s[j];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
}

#ifdef LLMPLUG_AVX512
// acc[g * 16 V + d] = sum over keys j = lo..pos, in key order, of probs[g * n + (j - lo)] * value j [d] for GN rows
// and 16 V value dims, the sums in registers: each value is converted once for the GN rows. Every element is the
// same chain of fused multiply-adds as `axpy` makes.
template <typename T, int V, int GN>
void weighted_rows(const float* probs, int64_t n, const typename T::raw* values, const int64_t* table, int64_t lo,
                   int64_t pos, const AttentionShape& shape, float* acc) {
  using raw = typename T::raw;
  __m512 sums[GN][V];
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < V; ++v) sums[g][v] = _mm512_setzero_ps();
  const int64_t bs = shape.block_size;
  for (int64_t j = lo; j <= pos;) {
    const int64_t block = j / bs, last = std::min(pos, (block + 1) * bs - 1);
    const raw* value = values + table[block] * shape.v_block_stride + (j % bs) * shape.v_row_stride;
    for (; j <= last; ++j, value += shape.v_row_stride) {
      __m512 weight[GN];
      for (int g = 0; g < GN; ++g) weight[g] = _mm512_set1_ps(probs[g * n + (j - lo)]);
      for (int v = 0; v < V; ++v) {
        const __m512 x = T::load16(value + 16 * v);
        for (int g = 0; g < GN; ++g) sums[g][v] = _mm512_fmadd_ps(weight[g], x, sums[g][v]);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (g * V + v) * 16, sums[g][v]);
}
#endif

// acc[g * Dv + d] = sum over keys j = lo..pos, in key order, of probs[g * n + (j - lo)] * value j [d], g < G.
template <typename T, int kDv>
void weighted_sum(const float* probs, int64_t G, int64_t n, const typename T::raw* values, const int64_t* table,
                  int64_t lo, int64_t pos, const AttentionShape& shape, float* acc) {
  using raw = typename T::raw;
#ifdef LLMPLUG_AVX512
  if constexpr (kDv > 0 && kDv % 16 == 0 && kDv <= 128) {
    constexpr int V = kDv / 16, GC = 256 / kDv;  // 4 (2) query heads of 64 (128) dims: 16 sums in registers
    int64_t g = 0;
    for (; g + GC <= G; g += GC) weighted_rows<T, V, GC>(probs + g * n, n, values, table, lo, pos, shape, acc + g * kDv);
    float* rest = acc + g * kDv;
    probs += g * n;
    if (G - g == 3) weighted_rows<T, V, 3>(probs, n, values, table, lo, pos, shape, rest);
    if (G - g == 2) weighted_rows<T, V, 2>(probs, n, values, table, lo, pos, shape, rest);
    if (G - g == 1) weighted_rows<T, V, 1>(probs, n, values, table, lo, pos, shape, rest);
    return;
  }
#endif
  const int64_t Dv = kDv ? kDv : shape.dim_v, bs = shape.block_size;
  std::fill(acc, acc + G * Dv, 0.f);
  for (int64_t j = lo; j <= pos;) {  // in key order, a block at a time
    const int64_t block = j / bs, last = std::min(pos, (block + 1) * bs - 1);
    const raw* value = values + table[block] * shape.v_block_stride + (j % bs) * shape.v_row_stride;
    for (; j <= last; ++j, value += shape.v_row_stride)
      for (int64_t g = 0; g < G; ++g) axpy<T>(acc + g * Dv, probs[g * n + (j - lo)], value, Dv);
  }
}

// The first key a query at position `pos` sees: a sliding window W > 0 starts at pos - W + 1, a chunk C > 0 at
// floor(pos / C) * C.
inline int64_t first_key(int64_t pos, int64_t window, int64_t chunk) {
  int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  return chunk > 0 ? std::max(lo, pos / chunk * chunk) : lo;
}

// A paged_attention task: `rows` consecutive query tokens of one request from `token` on (positions pos0..) and
// one KV head.
struct AttentionTile {
  int64_t token, rows, pos0, request;
  bool prompt;  // prompt rows, computed by prompt_tile (AMX)
};

// Per-thread scratch of paged_attention, sized for the call's largest tile.
struct AttentionScratch {
  std::vector<float> queries, tile_scores, row_scores, acc;
  AttentionScratch(int64_t rows, const AttentionShape& shape, int64_t longest)
      : queries(rows * shape.group * shape.dim),
        tile_scores(rows * shape.group * longest),
        row_scores(rows > 1 ? shape.group * longest : 0),
        acc(shape.group * shape.dim_v) {}
};

// One tile and KV head: the G query heads of each row over that row's keys. The tile's rows share each key read:
// their scores come from one pass over the keys lo(first row)..last row's position; each row then takes the
// softmax and weighted sum of exactly its own keys, as a tile of one row would (the same bits).
template <typename T, int kD, int kDv>
void attend_tile(const typename T::raw* q, int64_t q_token_stride, int64_t q_head_stride, const typename T::raw* keys,
                 const typename T::raw* values, const int64_t* table, const AttentionTile& tile, int64_t window,
                 int64_t chunk, float scale, const AttentionShape& shape, AttentionScratch& scratch,
                 typename T::raw* out, int64_t out_token_stride) {
  using raw = typename T::raw;
  const int64_t D = kD ? kD : shape.dim, Dv = kDv ? kDv : shape.dim_v, G = shape.group;
  float* queries = scratch.queries.data();
  for (int64_t i = 0; i < tile.rows; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const raw* row = q + i * q_token_stride + g * q_head_stride;
      float* scaled = queries + (i * G + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) scaled[d] = T::load(row[d]) * scale;
    }
  const int64_t first = first_key(tile.pos0, window, chunk), last = tile.pos0 + tile.rows - 1;
  const int64_t width = last + 1 - first;
  float* tile_scores = scratch.tile_scores.data();
  if (tile.rows == 1)  // a decode row
    key_scores<T, kD, true>(queries, G, keys, values, table, first, last, shape, tile_scores);
  else
    key_scores<T, kD, false>(queries, tile.rows * G, keys, values, table, first, last, shape, tile_scores);
  float* acc = scratch.acc.data();
  for (int64_t i = 0; i < tile.rows; ++i) {
    const int64_t pos = tile.pos0 + i, lo = first_key(pos, window, chunk), n = pos + 1 - lo;
    float* scores = scratch.tile_scores.data();
    if (tile.rows > 1) {  // the row's G score rows, laid out as a one-row tile's
      scores = scratch.row_scores.data();
      for (int64_t g = 0; g < G; ++g)
        std::copy_n(scratch.tile_scores.data() + (i * G + g) * width + (lo - first), n, scores + g * n);
    }
    softmax_rows(scores, G, n);
    weighted_sum<T, kDv>(scores, G, n, values, table, lo, pos, shape, acc);
    raw* o = out + i * out_token_stride;
#pragma omp simd
    for (int64_t e = 0; e < G * Dv; ++e) o[e] = T::store(acc[e]);
  }
}

// Query rows per paged_attention tile: a prompt's consecutive tokens share their keys' reads (scores for up to
// 8 rows at a time), with the tile's scores kept within ~4 MiB.
int64_t tile_rows(int64_t group, int64_t longest) {
  return std::clamp<int64_t>((int64_t{1} << 20) / std::max<int64_t>(1, group * longest), 1, 8);
}

// Causal paged attention of every token of a step over its request's cached keys (this step's included).
//
// q [T, H, D] (rows may be strided); key_cache, value_cache [Hkv, num_blocks, block_size, D (Dv)] (the planes
// of llmplug's torch_sdpa cache; the values may be the keys' first Dv dims, a strided view); block_tables
// [B, max_blocks]; query_start_loc [B + 1]; seq_lens [B] (keys of each request after this step). Token i of
// request r sits at position p = seq_len - q_len + i and sees keys j <= p, with a sliding window W > 0 only
// p - W < j, with a chunk C > 0 only floor(p / C) * C <= j. -> [T, H * Dv] in q's dtype.
// One task is a tile of a request's consecutive tokens (one token when decoding) and a KV head: its G = H / Hkv
// query heads share each key read. A row's result depends only on its own query and keys, never on its tile.
// Tasks are ordered first, last, second, second to last, ... so that the threads' contiguous shares of a long
// prompt (later rows see more keys) hold as much work each. With prompt_lens [B] (each request's prompt length),
// a bf16 layer's prompt rows (positions before it) take prompt_tile where it serves (AMX; prompt_attention.h) in
// tiles of kPromptTileRows, and its generated rows the float32 rows above: a row's kernel follows from its position.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window, int64_t chunk,
                           const std::optional<at::Tensor>& prompt_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "llmplug_cpu::paged_attention: q must be [T, H, D], D contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "llmplug_cpu::paged_attention: caches must be [Hkv, num_blocks, block_size, D], D contiguous");
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() && value_cache.scalar_type() == q.scalar_type(),
              "llmplug_cpu::paged_attention: q and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && block_tables.stride(1) == 1 &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "llmplug_cpu::paged_attention: block_tables, query_start_loc and seq_lens must be int64");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = key_cache.size(0), block_size = key_cache.size(2), dim_v = value_cache.size(3);
  const int64_t num_reqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0 && query_start_loc.size(0) == num_reqs + 1,
              "llmplug_cpu::paged_attention: inconsistent shapes");
  const AttentionShape shape{heads / kv_heads, dim, dim_v, block_size, key_cache.stride(1), key_cache.stride(2),
                             value_cache.stride(1), value_cache.stride(2)};
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(qsl[num_reqs] == tokens, "llmplug_cpu::paged_attention: query_start_loc ends at ", qsl[num_reqs],
              " but q has ", tokens, " tokens");
  int64_t longest = 0, widest = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    TORCH_CHECK(q_len >= 0 && lens[r] >= q_len && lens[r] <= max_blocks * block_size,
                "llmplug_cpu::paged_attention: request ", r, " has ", q_len, " queries, ", lens[r], " keys and ",
                max_blocks, " blocks of ", block_size);
    longest = std::max(longest, lens[r]), widest = std::max(widest, q_len);
  }
  const int64_t rows = std::min(tile_rows(shape.group, longest), std::max<int64_t>(1, widest));
  TORCH_CHECK(!prompt_lens.has_value() || (prompt_lens->scalar_type() == at::kLong && prompt_lens->dim() == 1 &&
                                            prompt_lens->is_contiguous() && prompt_lens->numel() == num_reqs),
              "llmplug_cpu::paged_attention: prompt_lens must be int64 [", num_reqs, "]");
  const bool prompt_tiles = prompt_lens.has_value() && q.scalar_type() == at::kBFloat16 &&
                            llmplug::prompt_tile_supported(dim, dim_v, block_size, window, chunk);
  const int64_t* prompt_ends = prompt_tiles ? prompt_lens->data_ptr<int64_t>() : nullptr;
  std::vector<AttentionTile> tiles;
  tiles.reserve(tokens);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r], pos0 = lens[r] - q_len;
    // rows before `prompted` are prompt rows
    const int64_t prompted = prompt_ends ? std::clamp<int64_t>(prompt_ends[r] - pos0, 0, q_len) : 0;
    for (int64_t i = 0; i < prompted; i += llmplug::kPromptTileRows)
      tiles.push_back({qsl[r] + i, std::min(llmplug::kPromptTileRows, prompted - i), pos0 + i, r, true});
    for (int64_t i = prompted; i < q_len; i += rows)
      tiles.push_back({qsl[r] + i, std::min(rows, q_len - i), pos0 + i, r, false});
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::Tensor out = at::empty({tokens, heads * dim_v}, q.options());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  const float fscale = static_cast<float>(scale);
  dispatch(q, "paged_attention", [&]<typename T>() {
    using raw = typename T::raw;
    auto* attend = &attend_tile<T, 0, 0>;
    if (dim == 64 && dim_v == 64) attend = &attend_tile<T, 64, 64>;
    if (dim == 128 && dim_v == 128) attend = &attend_tile<T, 128, 128>;
    const raw* qp = reinterpret_cast<const raw*>(q.data_ptr());
    const raw* kp = reinterpret_cast<const raw*>(key_cache.data_ptr());
    const raw* vp = reinterpret_cast<const raw*>(value_cache.data_ptr());
    raw* op = reinterpret_cast<raw*>(out.data_ptr());
    const int64_t group = shape.group, tasks = num_tiles * kv_heads;
    const llmplug::PromptShape prompt_shape{group, dim, block_size, shape.k_block_stride, shape.k_row_stride,
                                            shape.v_block_stride, shape.v_row_stride};
    at::parallel_for(0, tasks, grain(rows * longest * (dim + dim_v) * group, 1 << 16), [&](int64_t begin, int64_t end) {
      AttentionScratch scratch(rows, shape, longest);
      llmplug::PromptScratch prompt_scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t order = task / kv_heads, kvh = task % kv_heads;
        const AttentionTile& tile = tiles[order % 2 ? num_tiles - 1 - order / 2 : order / 2];
        if (tile.prompt) {
          auto bits = [](const raw* p) { return reinterpret_cast<const uint16_t*>(p); };
          const raw* keys = kp + kvh * key_cache.stride(0);
          const raw* values = vp + kvh * value_cache.stride(0);
          raw* rows_out = op + (tile.token * heads + kvh * group) * dim_v;
          llmplug::prompt_tile(bits(qp + tile.token * q.stride(0) + kvh * group * q.stride(1)), q.stride(0),
                               q.stride(1), bits(keys), bits(values), tables + tile.request * table_stride,
                               prompt_shape, tile.pos0, tile.rows, fscale, prompt_scratch,
                               reinterpret_cast<uint16_t*>(rows_out), heads * dim_v);
          continue;
        }
        attend(qp + tile.token * q.stride(0) + kvh * group * q.stride(1), q.stride(0), q.stride(1),
               kp + kvh * key_cache.stride(0), vp + kvh * value_cache.stride(0),
               tables + tile.request * table_stride, tile, window, chunk, fscale, shape, scratch,
               op + (tile.token * heads + kvh * group) * dim_v, heads * dim_v);
      }
    });
  });
  return out;
}

// reshape_and_cache, then paged_attention, for a two-plane cache: q [T, H * D], k and v [T, Hkv * D] (rows may be
// strided: slices of a fused qkv output), kv_cache [2 (K, V), Hkv, num_blocks, block_size, D]. One call per layer
// and step instead of two and their views. -> [T, H * D] in q's dtype.
at::Tensor cache_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                            int64_t window, int64_t chunk, const std::optional<at::Tensor>& prompt_lens) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "llmplug_cpu::cache_and_attend: kv_cache must be [2, Hkv, num_blocks, block_size, D], got ",
              kv_cache.sizes());
  const int64_t tokens = q.size(0), kv_heads = kv_cache.size(1), dim = kv_cache.size(4);
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2 && q.size(1) % dim == 0 && k.size(1) == kv_heads * dim &&
                  v.size(1) == kv_heads * dim && k.size(0) == tokens && v.size(0) == tokens,
              "llmplug_cpu::cache_and_attend: q [T, H * D], k and v [T, Hkv * D] expected for a cache of ", kv_heads,
              " KV heads of ", dim, " dims, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const at::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  reshape_and_cache(k.view({tokens, kv_heads, dim}), v.view({tokens, kv_heads, dim}), key_cache, value_cache,
                    slot_mapping);
  return paged_attention(q.view({tokens, q.size(1) / dim, dim}), key_cache, value_cache, block_tables,
                         query_start_loc, seq_lens, scale, window, chunk, prompt_lens);
}

// Greedy choice of each row of logits [B, V] (float32, rows may be strided): the first column holding the row's
// largest value, and that value; a row holding a NaN gives NaN and some column in range. Each row is one task.
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits) {
  check_rows(logits, "greedy", "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "llmplug_cpu::greedy: logits must be float32 with at least one column");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor top = at::empty({rows}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* mp = top.data_ptr<float>();
  at::parallel_for(0, rows, grain(vocab, 1 << 16), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * stride;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t v = 0;
#ifdef LLMPLUG_AVX512
      __m512 tops = _mm512_set1_ps(best);
      __mmask16 unordered = 0;
      for (; v + 16 <= vocab; v += 16) {
        const __m512 values = _mm512_loadu_ps(x + v);
        unordered |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
        tops = _mm512_max_ps(tops, values);
      }
      best = _mm512_reduce_max_ps(tops), nan = unordered != 0;
#endif
      for (; v < vocab; ++v) best = std::max(best, x[v]), nan |= std::isnan(x[v]);
      if (nan) {
        tp[r] = 0, mp[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      v = 0;
#ifdef LLMPLUG_AVX512
      const __m512 target = _mm512_set1_ps(best);
      for (; v + 16 <= vocab; v += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + v), target, _CMP_EQ_OQ);
        if (hit) {
          v += __builtin_ctz(hit);
          break;
        }
      }
#endif
      while (v < vocab && x[v] != best) ++v;
      tp[r] = v, mp[r] = best;
    }
  });
  return {tokens, top};
}

// Batched matmul a [N, M, K] @ b [N, K, L] -> [N, M, L] in a's dtype, float32 sums, each output row on one
// thread in one fixed order whatever M (MKL's batched matmul takes other kernels for other M on some CPUs).
// b with contiguous rows: out[m] = sum over k, in order, of a[m, k] * b[k] (one fused multiply-add per k and
// element); b with contiguous columns (a transposed view): each element a dot product over K in 16 lanes
// summed in a fixed tree. a may be strided.
at::Tensor row_bmm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "llmplug_cpu::row_bmm: a [N, M, K] and b [N, K, L] expected, got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "llmplug_cpu::row_bmm: a and b must share a dtype");
  TORCH_CHECK(b.stride(2) == 1 || b.stride(1) == 1, "llmplug_cpu::row_bmm: b needs contiguous rows or columns");
  const int64_t N = a.size(0), M = a.size(1), K = a.size(2), L = b.size(2);
  at::Tensor out = at::empty({N, M, L}, a.options());
  const bool rows_contiguous = b.stride(2) == 1;
  dispatch(a, "row_bmm", [&]<typename T>() {
    using raw = typename T::raw;
    const raw* ap = reinterpret_cast<const raw*>(a.data_ptr());
    const raw* bp = reinterpret_cast<const raw*>(b.data_ptr());
    raw* op = reinterpret_cast<raw*>(out.data_ptr());
    const int64_t as0 = a.stride(0), as1 = a.stride(1), as2 = a.stride(2), bs0 = b.stride(0), bs1 = b.stride(1),
                  bs2 = b.stride(2);
    at::parallel_for(0, N * M, grain(K * L, 1 << 14), [&](int64_t begin, int64_t end) {
      std::vector<float> row(L), arow(K);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / M, m = task % M;
        for (int64_t k = 0; k < K; ++k) arow[k] = T::load(ap[n * as0 + m * as1 + k * as2]);
        if (rows_contiguous) {
          std::fill(row.begin(), row.end(), 0.f);
          for (int64_t k = 0; k < K; ++k) {
            const raw* brow = bp + n * bs0 + k * bs1;
            const float av = arow[k];
            float* r = row.data();
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) r[l] = std::fma(av, T::load(brow[l]), r[l]);
          }
        } else {
          for (int64_t l = 0; l < L; ++l) {
            const raw* bcol = bp + n * bs0 + l * bs2;
            float lanes[16] = {};
            for (int64_t k = 0; k < K; ++k) lanes[k % 16] = std::fma(arow[k], T::load(bcol[k]), lanes[k % 16]);
            for (int width = 8; width > 0; width /= 2)
              for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
            row[l] = lanes[0];
          }
        }
        raw* o = op + task * L;
        for (int64_t l = 0; l < L; ++l) o[l] = T::store(row[l]);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------- GGUF blocks: y = x dequant(W)^T from the raw bytes

// Each block decoder writes the block's weights as float32, exactly as ggml's dequantize_row_* computes them
// (ggml-quants.c): a weight is (scale * q) - min in float32, its scales the block's fp16 values.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the portable conversion is most of a 32-weight block's cost
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Q4_0 [d, 16 bytes]: weight j is the low nibble of byte j, weight j + 16 its high nibble; w = d (q - 8).
void block_q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  for (int j = 0; j < 16; ++j) y[j] = float((b[2 + j] & 0x0F) - 8) * d, y[j + 16] = float((b[2 + j] >> 4) - 8) * d;
}

// Q4_1 [d, m, 16 bytes]: w = d q + m.
void block_q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  for (int j = 0; j < 16; ++j) y[j] = float(b[4 + j] & 0x0F) * d + m, y[j + 16] = float(b[4 + j] >> 4) * d + m;
}

// The fifth bits of a Q5_0 / Q5_1 block as 16 per weight: bit j of qh belongs to weight j.
inline void high_bits(const uint8_t* p, int32_t* high) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
#pragma omp simd
  for (int j = 0; j < 32; ++j) high[j] = int32_t((qh >> j) & 1u) << 4;
}

// Q5_0 [d, 32 high bits, 16 bytes]: q = nibble | high bit << 4; w = d (q - 16).
void block_q5_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  int32_t high[32];
  high_bits(b + 2, high);
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    y[j] = float(((b[6 + j] & 0x0F) | high[j]) - 16) * d;
    y[j + 16] = float(((b[6 + j] >> 4) | high[j + 16]) - 16) * d;
  }
}

// Q5_1 [d, m, 32 high bits, 16 bytes]: w = d q + m.
void block_q5_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  int32_t high[32];
  high_bits(b + 4, high);
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    y[j] = float((b[8 + j] & 0x0F) | high[j]) * d + m;
    y[j + 16] = float((b[8 + j] >> 4) | high[j + 16]) * d + m;
  }
}

// Q8_0 [d, 32 int8]: w = d q.
void block_q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(q[j]) * d;
}

// Q2_K and Q3_K: 16 sub-blocks of 16 weights, one scale each. Each half (128 weights) has 32 bytes of 2-bit quants;
// byte l of a half holds weight l of its four runs of 32 (run j in bits 2j, 2j+1). The quants are unpacked into
// bytes first, then scaled a sub-block at a time: both loops vectorize (Q2_K 1.4x, Q3_K 2x one loop doing both).
inline void quants_2bit(const uint8_t* q, uint8_t* qi) {
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 4; ++j)
#pragma omp simd
      for (int l = 0; l < 32; ++l) qi[128 * half + 32 * j + l] = (q[32 * half + l] >> (2 * j)) & 3;
}

// Q2_K super-block [16 bytes: scale | min << 4 per sub-block, 64 bytes of quants, d, dmin]: w = d sc q - dmin m.
void block_q2_k(const uint8_t* b, float* y) {
  const uint8_t* sc = b;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  uint8_t qi[256];
  quants_2bit(b + 16, qi);
  for (int s = 0; s < 16; ++s) {
    const float dl = d * float(sc[s] & 0x0F), ml = dmin * float(sc[s] >> 4);
#pragma omp simd
    for (int l = 0; l < 16; ++l) y[16 * s + l] = dl * float(qi[16 * s + l]) - ml;
  }
}

// The signed 6-bit scale of sub-block j of a Q3_K super-block: its low 4 bits in bytes 0-7 (j < 8: low nibbles,
// else high), its high 2 bits in bytes 8-11 (byte 8 + j % 4, bits 2 (j / 4)); stored + 32.
inline int scale_k3(int j, const uint8_t* s) {
  const int low = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4;
  return (low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

// Q3_K super-block [32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of scales, d]: w = d sc (q - 4 + 4 h),
// q the 2 low bits, h the weight's high bit (weight 32 r + l of the 8 runs of 32: bit r of byte l).
void block_q3_k(const uint8_t* b, float* y) {
  const uint8_t *hm = b, *scales = b + 96;
  const float d = half_at(b + 108);
  uint8_t qi[256];
  quants_2bit(b + 32, qi);
  for (int r = 0; r < 8; ++r)
#pragma omp simd
    for (int l = 0; l < 32; ++l) qi[32 * r + l] += ((hm[l] >> r) & 1) << 2;
  for (int s = 0; s < 16; ++s) {
    const float dl = d * float(scale_k3(s, scales));
#pragma omp simd
    for (int l = 0; l < 16; ++l) y[16 * s + l] = dl * float(int(qi[16 * s + l]) - 4);
  }
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, float d, float dmin, float& scale, float& min) {
  int sc, m;
  if (j < 4) {
    sc = q[j] & 63, m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
  scale = d * float(sc), min = dmin * float(m);
}

// Q4_K super-block [d, dmin, 12 bytes of scales, 128 bytes]: 8 sub-blocks of 32, w = d sc q - dmin m.
void block_q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t *scales = b + 4, *q = b + 16;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    float d1, m1, d2, m2;
    scale_min_k4(2 * j, scales, d, dmin, d1, m1);
    scale_min_k4(2 * j + 1, scales, d, dmin, d2, m2);
#pragma omp simd
    for (int l = 0; l < 32; ++l) y[l] = d1 * float(q[l] & 0x0F) - m1, y[l + 32] = d2 * float(q[l] >> 4) - m2;
  }
}

// Q5_K super-block [d, dmin, 12 bytes of scales, 32 bytes of high bits, 128 bytes]: Q4_K with a fifth bit.
void block_q5_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    float d1, m1, d2, m2;
    scale_min_k4(2 * j, scales, d, dmin, d1, m1);
    scale_min_k4(2 * j + 1, scales, d, dmin, d2, m2);
    const uint8_t u1 = uint8_t(1u << (2 * j)), u2 = uint8_t(2u << (2 * j));
#pragma omp simd
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * float((q[l] & 0x0F) + (qh[l] & u1 ? 16 : 0)) - m1;
      y[l + 32] = d2 * float((q[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
  }
}

// Q6_K super-block [128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d]: w = d sc (q - 32), one scale
// per 16 weights.
void block_q6_k(const uint8_t* b, float* y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int is = 0; is < 2; ++is) {
      const float s1 = d * float(sc[is]), s2 = d * float(sc[is + 2]), s3 = d * float(sc[is + 4]),
                  s4 = d * float(sc[is + 6]);
#pragma omp simd
      for (int l = 16 * is; l < 16 * is + 16; ++l) {
        const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = s1 * float(q1), y[l + 32] = s2 * float(q2), y[l + 64] = s3 * float(q3), y[l + 96] = s4 * float(q4);
      }
    }
  }
}

// ---------------------------------------------------------------- the IQ types: weights looked up in a table

// An IQ type's lookup tables, gguf-py's (gguf.quants) passed in by the caller: `values` the int8 grid [entries, width]
// its indices select (IQ4: the 16 non-linear levels), `signs` ksigns [128] (the sign bits of a 7-bit sign index:
// the index and its parity bit) for the types that store sign indices.
struct Lookup {
  const int8_t* values = nullptr;
  const uint8_t* signs = nullptr;
  float levels[16] = {};  // IQ4: the 16 values as float32
};

// N weights scale * grid[j], bit j of `signs` negating weight j (ggml: db * grid[j] * (signs & kmask[j] ? -1 : 1)).
// Multiplying by -1 flips the sign bit, done here without a branch (random signs defeat prediction) over a whole
// sub-block, whose grid rows are gathered into `grid` first: the loop vectorizes (6x over 8 weights at a time).
template <int N>
inline void signed_weights(float scale, const int8_t* grid, uint32_t signs, float* y) {
#pragma omp simd
  for (int j = 0; j < N; ++j) {
    const uint32_t bits = std::bit_cast<uint32_t>(scale * float(grid[j])) ^ (((signs >> j) & 1u) << 31);
    y[j] = std::bit_cast<float>(bits);
  }
}

// 32 IQ4 weights y[j] = scale * levels[low nibble of q[j]], y[j + 16] = scale * levels[its high nibble] (j < 16).
// AVX-512 selects a level from the 16 in a register (vpermps); elsewhere a load each. The same products either way.
inline void levels_32(float scale, const uint8_t* q, const float* levels, float* y) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(levels), s = _mm512_set1_ps(scale);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), high = _mm512_srli_epi32(bytes, 4);
  _mm512_storeu_ps(y, _mm512_mul_ps(s, _mm512_permutexvar_ps(low, table)));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(s, _mm512_permutexvar_ps(high, table)));
#else
  for (int j = 0; j < 16; ++j) y[j] = scale * levels[q[j] & 0x0F], y[j + 16] = scale * levels[q[j] >> 4];
#endif
}

// IQ4_NL [d, 16 bytes]: weight j the low nibble of byte j, weight j + 16 its high nibble; w = d values[q].
void block_iq4_nl(const uint8_t* b, float* y, const Lookup& t) {
  levels_32(half_at(b), b + 2, t.levels, y);
}

// IQ4_XS super-block [d, 16 bits of high scale bits, 4 bytes of low scale nibbles, 128 bytes]: 8 sub-blocks of 32
// laid out as IQ4_NL's, each with a 6-bit scale (stored + 32); w = d (sc - 32) values[q].
void block_iq4_xs(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  const uint16_t high = uint16_t(b[2] | (b[3] << 8));
  const uint8_t *low = b + 4, *q = b + 8;
  for (int s = 0; s < 8; ++s, q += 16, y += 32) {
    const int ls = ((low[s / 2] >> (4 * (s % 2))) & 0x0F) | (((high >> (2 * s)) & 3) << 4);
    const float dl = d * float(ls - 32);
    levels_32(dl, q, t.levels, y);
  }
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IQ2_XXS super-block [d, 8 x (4 grid indices, 32 bits: 4 sign indices of 7 bits, 4-bit scale)]: each 32 weights
// four grid rows of 8; w = d (0.5 + sc) / 4 grid[i][j] with ksigns' signs.
void block_iq2_xxs(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  for (int s = 0; s < 8; ++s, y += 32) {
    const uint8_t* idx = b + 2 + 8 * s;
    const uint32_t aux = u32_at(idx + 4);
    int8_t grid[32];
    uint32_t signs = 0;
    for (int l = 0; l < 4; ++l) {
      std::memcpy(grid + 8 * l, t.values + 8 * idx[l], 8);
      signs |= uint32_t(t.signs[(aux >> (7 * l)) & 127]) << (8 * l);
    }
    signed_weights<32>(d * (0.5f + float(aux >> 28)) * 0.25f, grid, signs, y);
  }
}

// IQ2_XS super-block [d, 32 x 16 bits (9-bit grid index, 7-bit sign index), 8 bytes of 4-bit scales, one per 16]:
// w = d (0.5 + sc) / 4 grid[i][j] with ksigns' signs.
void block_iq2_xs(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  const uint8_t* scales = b + 66;
  for (int s = 0; s < 16; ++s, y += 16) {
    int8_t grid[16];
    uint32_t signs = 0;
    for (int h = 0; h < 2; ++h) {
      const uint16_t q = u16_at(b + 2 + 4 * s + 2 * h);
      std::memcpy(grid + 8 * h, t.values + 8 * (q & 511), 8);
      signs |= uint32_t(t.signs[q >> 9]) << (8 * h);
    }
    signed_weights<16>(d * (0.5f + float((scales[s / 2] >> (4 * (s % 2))) & 0x0F)) * 0.25f, grid, signs, y);
  }
}

// IQ2_S super-block [d, 32 low bytes of grid indices, 32 sign bytes, 8 bytes of the indices' 2 high bits, 8 bytes of
// 4-bit scales, one per 16]: w = d (0.5 + sc) / 4 grid[i][j], sign bit j of the group's byte.
void block_iq2_s(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
  for (int s = 0; s < 16; ++s, y += 16) {
    int8_t grid[16];
    for (int h = 0; h < 2; ++h) {
      const int g = 2 * s + h, index = qs[g] | (((qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
      std::memcpy(grid + 8 * h, t.values + 8 * index, 8);
    }
    const float db = d * (0.5f + float((scales[s / 2] >> (4 * (s % 2))) & 0x0F)) * 0.25f;
    signed_weights<16>(db, grid, u16_at(signs + 2 * s), y);
  }
}

// IQ3_XXS super-block [d, 64 grid indices (rows of 4), 8 x 32 bits (4 sign indices of 7 bits, 4-bit scale)]: each 32
// weights eight grid rows; w = d (0.5 + sc) / 2 grid[i][j] with ksigns' signs, one sign byte per 8 weights.
void block_iq3_xxs(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int s = 0; s < 8; ++s, y += 32) {
    const uint32_t aux = u32_at(b + 66 + 4 * s);
    int8_t grid[32];
    uint32_t signs = 0;
    for (int i = 0; i < 8; ++i) std::memcpy(grid + 4 * i, t.values + 4 * qs[8 * s + i], 4);
    for (int l = 0; l < 4; ++l) signs |= uint32_t(t.signs[(aux >> (7 * l)) & 127]) << (8 * l);
    signed_weights<32>(d * (0.5f + float(aux >> 28)) * 0.5f, grid, signs, y);
  }
}

// IQ3_S super-block [d, 64 low bytes of grid indices (rows of 4), 8 bytes of their high bits, 32 sign bytes, 4 bytes
// of 4-bit scales, one per 32]: w = d (1 + 2 sc) grid[i][j], sign bit j of the 8 weights' byte.
void block_iq3_s(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
  for (int s = 0; s < 8; ++s, y += 32) {
    int8_t grid[32];
    for (int i = 0; i < 8; ++i) {
      const int index = qs[8 * s + i] | (((qh[s] >> i) & 1) << 8);
      std::memcpy(grid + 4 * i, t.values + 4 * index, 4);
    }
    const float db = d * float(1 + 2 * ((scales[s / 2] >> (4 * (s % 2))) & 0x0F));
    signed_weights<32>(db, grid, u32_at(signs + 4 * s), y);
  }
}

// N IQ1 weights dl (grid[j] + delta[j / 8]), grid values -1, 0, 1, the sub-block's grid rows gathered into `grid`
// first (the loop vectorizes: 6x over 8 weights at a time).
template <int N>
inline void shifted_weights(float dl, const int8_t* grid, const float* delta, float* y) {
#pragma omp simd
  for (int j = 0; j < N; ++j) y[j] = dl * (float(grid[j]) + delta[j / 8]);
}

constexpr float kIQ1Delta = 0.125f;

// IQ1_S super-block [d, 32 low bytes of grid indices, 8 x 16 bits (4 x 3 high index bits, 3-bit scale, delta's
// sign)]: w = d (2 sc + 1) (grid[i][j] +- 1/8).
void block_iq1_s(const uint8_t* b, float* y, const Lookup& t) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int s = 0; s < 8; ++s, y += 32) {
    const uint16_t qh = u16_at(b + 34 + 2 * s);
    const float delta = qh & 0x8000 ? -kIQ1Delta : kIQ1Delta, deltas[4] = {delta, delta, delta, delta};
    int8_t grid[32];
    for (int l = 0; l < 4; ++l) {
      const int index = qs[4 * s + l] | (((qh >> (3 * l)) & 7) << 8);
      std::memcpy(grid + 8 * l, t.values + 8 * index, 8);
    }
    shifted_weights<32>(d * float(2 * ((qh >> 12) & 7) + 1), grid, deltas, y);
  }
}

// IQ1_M super-block [32 low bytes of grid indices, 16 bytes of (3 high index bits, delta's sign) nibbles, 4 x 16
// bits of 3-bit scales (one per 16 weights) whose top nibbles make the fp16 d]: w = d (2 sc + 1) (grid[i][j] +- 1/8).
void block_iq1_m(const uint8_t* b, float* y, const Lookup& t) {
  const uint8_t *qs = b, *qh = b + 32;
  uint16_t sc[4];
  std::memcpy(sc, b + 48, 8);
  const uint16_t bits = uint16_t((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
  uint8_t half[2];
  std::memcpy(half, &bits, 2);
  const float d = half_at(half);
  for (int s = 0; s < 16; ++s, y += 16) {  // a scale per 16 weights: groups 2s, 2s + 1 of 8, byte s of qh
    int8_t grid[16];
    float deltas[2];
    for (int h = 0; h < 2; ++h) {
      const int nibble = (qh[s] >> (4 * h)) & 0x0F;
      std::memcpy(grid + 8 * h, t.values + 8 * (qs[2 * s + h] | ((nibble & 7) << 8)), 8);
      deltas[h] = nibble & 8 ? -kIQ1Delta : kIQ1Delta;
    }
    shifted_weights<16>(d * float(2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1), grid, deltas, y);
  }
}

// A decoder of a type without tables, as a decoder of the table-taking signature.
template <void (*Decode)(const uint8_t*, float*)>
void plain(const uint8_t* b, float* y, const Lookup&) {
  Decode(b, y);
}

struct GGUFType {
  int64_t block_size, type_size;
  void (*decode)(const uint8_t*, float*, const Lookup&);
  int64_t values = 0;  // int8 entries of the type's grid (Lookup::values): 0 for a type without tables
  bool signs = false;  // whether it reads ksigns (Lookup::signs)
};

// ggml's type ids (GGMLQuantizationType) of the types decoded here.
GGUFType gguf_type(int64_t id) {
  switch (id) {
    case 2: return {32, 18, plain<block_q4_0>};
    case 3: return {32, 20, plain<block_q4_1>};
    case 6: return {32, 22, plain<block_q5_0>};
    case 7: return {32, 24, plain<block_q5_1>};
    case 8: return {32, 34, plain<block_q8_0>};
    case 10: return {256, 84, plain<block_q2_k>};
    case 11: return {256, 110, plain<block_q3_k>};
    case 12: return {256, 144, plain<block_q4_k>};
    case 13: return {256, 176, plain<block_q5_k>};
    case 14: return {256, 210, plain<block_q6_k>};
    case 16: return {256, 66, block_iq2_xxs, 256 * 8, true};
    case 17: return {256, 74, block_iq2_xs, 512 * 8, true};
    case 18: return {256, 98, block_iq3_xxs, 256 * 4, true};
    case 19: return {256, 50, block_iq1_s, 2048 * 8};
    case 20: return {32, 18, block_iq4_nl, 16};
    case 21: return {256, 110, block_iq3_s, 512 * 4};
    case 22: return {256, 82, block_iq2_s, 1024 * 8};
    case 23: return {256, 136, block_iq4_xs, 16};
    case 29: return {256, 56, block_iq1_m, 2048 * 8};
    default: TORCH_CHECK(false, "llmplug_cpu GGUF kernels: GGUF type ", id, " is not implemented");
  }
  return {};
}

constexpr int kLanes = 16;

// y[r, c] = x[r] . w[c] for an R x C tile (rows of K floats, stride K; y's rows `ldy` apart): each a dot product in
// 16 lanes over K (a multiple of 32), in k order per lane, summed in a fixed tree. Every tile shape does the same
// arithmetic for an element, so its bits do not depend on the tile that computed it (nor on M).
template <int R, int C>
inline void dot_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  float lanes[R][C][kLanes] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        const float *xr = x + r * K + k, *wc = w + c * K + k;
#pragma omp simd
        for (int j = 0; j < kLanes; ++j) lanes[r][c][j] = std::fma(xr[j], wc[j], lanes[r][c][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float* l = lanes[r][c];
      for (int width = kLanes / 2; width > 0; width /= 2)
        for (int j = 0; j < width; ++j) l[j] += l[j + width];
      y[r * ldy + c] = l[0];
    }
  }
}

constexpr int kTile = 4;  // rows of W decoded together, and rows of x per tile

// The type's tables from `tables` ([values int8] or [values int8, signs uint8 [128]]), checked against what it reads.
Lookup lookup(const GGUFType& type, at::TensorList tables) {
  const size_t expected = type.values == 0 ? 0 : type.signs ? 2 : 1;
  TORCH_CHECK(tables.size() == expected, "llmplug_cpu GGUF kernels: this GGUF type takes ", expected,
              " lookup tables, got ", tables.size());
  if (expected == 0) return {};
  const at::Tensor& values = tables[0];
  TORCH_CHECK(values.scalar_type() == at::kChar && values.is_contiguous() && values.numel() == type.values,
              "llmplug_cpu GGUF kernels: the grid must be ", type.values, " contiguous int8 values, got ",
              values.sizes(), " ", values.scalar_type());
  Lookup lut{values.data_ptr<int8_t>(), nullptr};
  if (type.values == 16)
    for (int i = 0; i < 16; ++i) lut.levels[i] = float(lut.values[i]);
  if (!type.signs) return lut;
  const at::Tensor& signs = tables[1];
  TORCH_CHECK(signs.scalar_type() == at::kByte && signs.is_contiguous() && signs.numel() == 128,
              "llmplug_cpu GGUF kernels: ksigns must be 128 contiguous uint8, got ", signs.sizes(), " ",
              signs.scalar_type());
  lut.signs = signs.data_ptr<uint8_t>();
  return lut;
}

// x [M, K] (float32 or bfloat16) . dequant(w)^T -> [M, N] in x's dtype; w [N, K / block * type_size] uint8: each
// row the GGUF blocks of one output feature; `tables` the IQ types' lookup tables (gguf-py's). A thread decodes four
// rows of W into float32 once and takes their dot products with the rows of x in 4 x 4 tiles (the remainder alone):
// output (m, n) is the same arithmetic whatever M.
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& w, int64_t type_id, at::TensorList tables) {
  const GGUFType type = gguf_type(type_id);
  const Lookup lut = lookup(type, tables);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "llmplug_cpu::gguf_matmul: x [M, K] and contiguous uint8 w [N, bytes] expected, got ", x.sizes(), " and ",
              w.sizes(), " ", w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % type.block_size == 0 && w.size(1) == K / type.block_size * type.type_size,
              "llmplug_cpu::gguf_matmul: K=", K, " needs ", K / type.block_size * type.type_size,
              " bytes a row in blocks of ", type.block_size, ", w has ", w.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "llmplug_cpu::gguf_matmul: x must be float32 or bfloat16, got ", x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), blocks = K / type.block_size, tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, grain(K * kTile * std::max<int64_t>(M, 4), 1 << 16), [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kTile * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, count = std::min<int64_t>(kTile, N - n0);
      for (int64_t c = 0; c < count; ++c) {
        const uint8_t* wr = wp + (n0 + c) * row_bytes;
        float* row = rows.data() + c * K;
        for (int64_t b = 0; b < blocks; ++b) type.decode(wr + b * type.type_size, row + b * type.block_size, lut);
      }
      int64_t m = 0;
      for (; m + kTile <= M; m += kTile) {
        float* y = yp + m * N + n0;
        if (count == kTile) {
          dot_tile<kTile, kTile>(xp + m * K, K, rows.data(), y, N);
        } else {
          for (int64_t c = 0; c < count; ++c) dot_tile<kTile, 1>(xp + m * K, K, rows.data() + c * K, y + c, N);
        }
      }
      for (; m < M; ++m) {
        float* y = yp + m * N + n0;
        if (count == kTile) {
          dot_tile<1, kTile>(xp + m * K, K, rows.data(), y, N);
        } else {
          for (int64_t c = 0; c < count; ++c) dot_tile<1, 1>(xp + m * K, K, rows.data() + c * K, y + c, N);
        }
      }
    }
  });
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

// out[t] = row ids[t] of dequant(w), ggml's get_rows: w [N, bytes] uint8 as gguf_matmul's, ids [T] (int32 or int64,
// each in [0, N)), out [T, K] (float32, bfloat16 or float16, rows contiguous). Only the looked-up rows are decoded,
// each exactly as gguf-py's dequantize computes it, then rounded to out's dtype (to nearest even, as torch does).
void gguf_get_rows(const at::Tensor& w, const at::Tensor& ids, int64_t type_id, at::TensorList tables, at::Tensor out) {
  const GGUFType type = gguf_type(type_id);
  const Lookup lut = lookup(type, tables);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % type.type_size == 0,
              "llmplug_cpu::gguf_get_rows: contiguous uint8 w [N, whole blocks of ", type.type_size,
              " bytes] expected, got ", w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(ids.dim() == 1 && (ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt),
              "llmplug_cpu::gguf_get_rows: ids must be [T] int64 or int32, got ", ids.sizes(), " ", ids.scalar_type());
  const int64_t N = w.size(0), blocks = w.size(1) / type.type_size, K = blocks * type.block_size, T = ids.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == K && out.stride(1) == 1,
              "llmplug_cpu::gguf_get_rows: out must be [", T, ", ", K, "] with contiguous rows, got ", out.sizes());
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rp[t] >= 0 && rp[t] < N, "llmplug_cpu::gguf_get_rows: id ", rp[t], " is outside the table's ", N,
                " rows");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  dispatch(out, "gguf_get_rows", [&]<typename E>() {
    auto* op = reinterpret_cast<typename E::raw*>(out.data_ptr());
    at::parallel_for(0, T, grain(K), [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* wr = wp + rp[t] * w.size(1);
        for (int64_t b = 0; b < blocks; ++b) type.decode(wr + b * type.type_size, row.data() + b * type.block_size, lut);
        typename E::raw* y = op + t * out.stride(0);
        for (int64_t k = 0; k < K; ++k) y[k] = E::store(row[k]);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(llmplug_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin, bool neox) -> ()");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int window, int chunk, "
      "Tensor? prompt_lens=None) -> Tensor");
  m.def(
      "cache_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int window, int chunk, "
      "Tensor? prompt_lens=None) -> Tensor");
  m.def("prompt_tile_supported(int dim, int dim_v, int block_size, int window, int chunk) -> bool",
        [](int64_t dim, int64_t dim_v, int64_t block_size, int64_t window, int64_t chunk) {
          return llmplug::prompt_tile_supported(dim, dim_v, block_size, window, chunk);
        });
  m.def("greedy(Tensor logits) -> (Tensor, Tensor)");
  m.def("row_bmm(Tensor a, Tensor b) -> Tensor");
  m.def("gguf_matmul(Tensor x, Tensor w, int type_id, Tensor[] tables) -> Tensor");
  m.def("gguf_get_rows(Tensor w, Tensor ids, int type_id, Tensor[] tables, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(llmplug_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("fused_add_rms_norm", fused_add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rotary_embedding", rotary_embedding);
  m.impl("reshape_and_cache", reshape_and_cache);
  m.impl("paged_attention", paged_attention);
  m.impl("cache_and_attend", cache_and_attend);
  m.impl("greedy", greedy);
  m.impl("row_bmm", row_bmm);
  m.impl("gguf_matmul", gguf_matmul);
  m.impl("gguf_get_rows", gguf_get_rows);
}
