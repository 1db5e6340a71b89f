// amx_linear: y = x W^T (+ bias) for bfloat16 x [M, K] and a bfloat16 weight packed into AMX tiles
// (llmplug.layers.kernels.amx_linear.pack_weight), with Intel AMX's TDPBF16PS.
//
// Output (m, n) is one float32 sum over k in order: 32 k a tile product, and within it the 16 pairs in the order
// TDPBF16PS adds them; then the bias added, and one rounding to bfloat16 (to nearest even, any NaN 0x7FC0, as
// c10::BFloat16(float)). A tile product computes each output from its own row of x and column of W only, so every
// element is the same arithmetic whatever M, the tile or the thread that computes it: batch invariant by
// construction (docs/determinism.md). oneDNN's AMX kernels sum in an order that depends on M, and the row plans
// that fix them there are tiles of 32 rows, 4-27x slower than one call at prefill sizes (docs/kernels.md).
//
// Layout: packed [N' / 16, K / 32, 16, 32] bfloat16, N' = N rounded up to 32 (zero rows): tile (j, t) holds outputs
// 16 j.. and k = 32 t..; its row p holds the pair k = 32 t + 2 p, + 1 of each of the 16 outputs (AMX's "VNNI"
// layout of a B tile). x's rows are A tiles as they are (columns contiguous); K a multiple of 32.
//
// amx_int8_linear: quantization: int8's W8A8 product (llmplug.layers.int8_linear) with TDPBSSD: x's rows quantized
// to int8 with a scale each, summed against int8 codes packed the same way ([N' / 16, K / 64, 16, 64], 4 k to a
// word) exactly in int32, then scaled in float32 and rounded once to x's dtype, as the torch ops it replaces do.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "activation.h"
#include "bf16.h"
#include "rotary.h"
#define LLMPLUG_AMX 1
#endif

#include "amx.h"

namespace llmplug {

bool amx_enabled() {
  static const bool enabled = [] {
#ifdef LLMPLUG_AMX
    const char* choice = std::getenv("LLMPLUG_CPU_AMX");
    if (choice != nullptr && std::string_view(choice) == "0") return false;
    for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
      const char* cap = std::getenv(name);
      if (cap == nullptr || *cap == '\0') continue;
      std::string upper(cap);
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      if (upper.find("AMX") == std::string::npos && upper != "ALL" && upper != "DEFAULT") return false;  // no AMX
      break;  // the first one set is the cap, as oneDNN reads them
    }
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux lends the tile state on request
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return enabled;
}

}  // namespace llmplug

namespace {

constexpr int64_t kTileRows = 16;   // rows of x (and outputs) a tile
constexpr int64_t kOutputs = 32;    // outputs a pair of B tiles holds
constexpr int64_t kBf16Depth = 32;  // k a row of a tile holds (64 bytes): bf16
constexpr int64_t kInt8Depth = 64;  // and int8

#ifdef LLMPLUG_AMX

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What a tile product multiplies: bf16 pairs summed into float32 (TDPBF16PS), or int8 quads into int32 (TDPBSSD,
// exact). A tile row is 64 bytes: kDepth k of x, or of one output's weights.
struct Bf16Tiles {
  using Element = c10::BFloat16;
  using Sum = float;
  static constexpr int64_t kDepth = kBf16Depth;
};

struct Int8Tiles {
  using Element = int8_t;
  using Sum = int32_t;
  static constexpr int64_t kDepth = kInt8Depth;
};

// C += A B for Tiles' kind (the intrinsics name their tiles in the instruction's text: numbers, not values)
#define LLMPLUG_TILE_PRODUCT(C, A, B)                           \
  do {                                                          \
    if constexpr (std::is_same_v<Tiles, Int8Tiles>) {           \
      _tile_dpbssd(C, A, B);                                    \
    } else {                                                    \
      _tile_dpbf16ps(C, A, B);                                  \
    }                                                           \
  } while (0)

// out[i] = c10::BFloat16(in[i] + bias[i]) for the first `count` (<= 16) of 16 lanes (bf16.h).
inline void round_store(c10::BFloat16* out, const float* in, const float* bias, int64_t count) {
  const __mmask16 live = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  __m512 v = _mm512_maskz_loadu_ps(live, in);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias));
  _mm256_mask_storeu_epi16(out, live, llmplug::bf16_bits(v));
}

// Adds k tiles [t0, t1) of x's rows `a` (ldx apart; Rows x 16 rows) against the packed weight's two column tiles
// `b0`, `b1` (1 KB a k tile) to the sums [Rows x 16][32 outputs] in `sums` (zeros first where t0 == 0). The sums
// leave the tiles exactly as they are, so a sum made in chunks of k is the one a single pass makes. After each k
// tile's products it calls between(): vector work placed there (the previous pair's stores) runs while the tile
// unit computes, instead of after it.
template <typename Tiles, int Rows, typename Between>
void tile_sums(const typename Tiles::Element* a, int64_t ldx, const typename Tiles::Element* b0,
               const typename Tiles::Element* b1, int64_t t0, int64_t t1, typename Tiles::Sum* sums,
               const Between& between) {
  constexpr int64_t kDepth = Tiles::kDepth, kTileElements = kTileRows * kDepth;  // elements of a packed tile
  constexpr int64_t stride = kOutputs * 4;                                        // bytes a row of sums
  const int64_t lda = ldx * int64_t(sizeof(typename Tiles::Element));
  typename Tiles::Sum* const lower = sums + kTileRows * kOutputs;  // the second row tile's sums
  if (t0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (Rows == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, sums, stride);
    _tile_loadd(1, sums + kTileRows, stride);
    if constexpr (Rows == 2) {
      _tile_loadd(2, lower, stride);
      _tile_loadd(3, lower + kTileRows, stride);
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    _tile_stream_loadd(6, b0 + t * kTileElements, 64);  // the weight's tiles: not kept in L1, which holds x's
    _tile_stream_loadd(7, b1 + t * kTileElements, 64);
    _tile_loadd(4, a + t * kDepth, lda);
    LLMPLUG_TILE_PRODUCT(0, 4, 6);
    LLMPLUG_TILE_PRODUCT(1, 4, 7);
    if constexpr (Rows == 2) {
      _tile_loadd(5, a + kTileRows * ldx + t * kDepth, lda);
      LLMPLUG_TILE_PRODUCT(2, 5, 6);
      LLMPLUG_TILE_PRODUCT(3, 5, 7);
    }
    between();
  }
  _tile_stored(0, sums, stride);
  _tile_stored(1, sums + kTileRows, stride);
  if constexpr (Rows == 2) {
    _tile_stored(2, lower, stride);
    _tile_stored(3, lower + kTileRows, stride);
  }
}

#undef LLMPLUG_TILE_PRODUCT

// Cache blocking. A tile load that misses L1 costs several times a tile product here (an L2 tile ~4x an L1 one), so
// a task takes one block of x's rows against a group of column pairs, k in chunks: a block's chunk of x (32 rows x
// up to 1,152 bytes, 36 KiB) stays in L1 while the group's pairs pass, their tiles loaded with TILELOADDT1 so that
// they stream through without evicting it, and a group's packed weight (<= ~1 MiB) stays in L2 while the blocks
// pass. Each chunk boundary stores and reloads the pairs' sums, so chunks are as long as L1 allows: one for K = 576
// (docs/kernels.md).
constexpr int64_t kChunkTiles = 18;       // k tiles a chunk, at most
constexpr int64_t kGroupBytes = 1 << 20;  // a group's packed weight, at most (unless one pair is more)

// Pair p of column tiles: 2 p and 2 p + 1 (outputs 32 p..).
struct ConsecutiveTiles {
  std::pair<int64_t, int64_t> operator()(int64_t pair) const { return {2 * pair, 2 * pair + 1}; }
};

// x [M, K] (rows ldx apart) times the packed weight ([column tiles of 16 outputs, K / kDepth, 16, 64 bytes]):
// calls store(m0, r0, r1, pair, sums) for rows r0 .. r1 - 1 of each block of rows (from row m0) and pair of column
// tiles with their finished sums, row r's 32 outputs at sums + 32 r: a pair's rows a few at a time between the next
// pair's k tiles (the stores overlap its tile products), the block's last pair's at its end. column_tiles(p) names
// pair p's two column tiles: consecutive ones, or two outputs that one store combines (a gate and its up for
// SiLU-and-mul, a head's dims d and d + half for the rotary). Every sum is its output's tile products over K in
// order, whatever M and the pairing.
template <typename Tiles, typename Store, typename ColumnTiles = ConsecutiveTiles>
void tile_product(const typename Tiles::Element* xp, int64_t M, int64_t K, int64_t ldx,
                  const typename Tiles::Element* wp, int64_t pairs, const Store& store,
                  const ColumnTiles& column_tiles = {}) {
  using Element = typename Tiles::Element;
  const int64_t depth_tiles = K / Tiles::kDepth;
  const int64_t chunk_tiles = ceil_div(depth_tiles, ceil_div(depth_tiles, kChunkTiles));  // K's chunks, even
  // a block: 32 rows (16 where M is at most 16: a decode step computes no padding rows it need not)
  const int64_t block_rows = M <= kTileRows ? kTileRows : 2 * kTileRows;
  const int64_t blocks = ceil_div(M, block_rows);
  const int64_t column_tile = depth_tiles * kTileRows * Tiles::kDepth;  // elements per packed column of tiles
  // groups of pairs: within kGroupBytes, and enough tasks (4 a thread) for the threads where blocks are few
  const int64_t fit = std::max<int64_t>(1, kGroupBytes / (2 * column_tile * int64_t(sizeof(Element))));
  const int64_t wanted = std::max(ceil_div(pairs, fit), std::min(pairs, ceil_div(4 * at::get_num_threads(), blocks)));
  const int64_t per_group = ceil_div(pairs, wanted), groups = ceil_div(pairs, per_group);
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    llmplug::configure_full_tiles();  // per thread and chunk: oneDNN's kernels, on the same thread, configure their own
    // the last block's rows, zero rows after them (whole tiles of x), made once per chunk: only the last is short
    std::vector<Element> padded;
    // each pair's sums between k chunks, 64-byte aligned (a tile load or store across cache lines costs ~3x)
    constexpr int64_t kSums = 2 * kTileRows * kOutputs;
    std::vector<typename Tiles::Sum> storage(per_group * kSums + 16);
    auto* const sums = reinterpret_cast<typename Tiles::Sum*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = task / blocks, m0 = task % blocks * block_rows;
      const int64_t rows = std::min(block_rows, M - m0);
      const int64_t first = group * per_group, last = std::min(pairs, first + per_group);
      const Element* a = xp + m0 * ldx;
      int64_t lda = ldx;
      if (rows < block_rows) {
        if (padded.empty()) {
          padded.assign(block_rows * K, Element{});
          for (int64_t r = 0; r < rows; ++r) std::memcpy(&padded[r * K], a + r * ldx, K * sizeof(Element));
        }
        a = padded.data(), lda = K;
      }
      // the finished pair whose rows are being stored (-1: none), rows stored so far, and rows a k tile
      int64_t pending = -1, stored = 0, per_step = rows;
      auto store_rows = [&](int64_t upto) {
        if (pending >= 0 && upto > stored) store(m0, stored, upto, pending, sums + (pending - first) * kSums);
        stored = std::max(stored, upto);
      };
      auto between = [&] { store_rows(std::min(rows, stored + per_step)); };
      for (int64_t t0 = 0; t0 < depth_tiles; t0 += chunk_tiles) {
        const int64_t t1 = std::min(depth_tiles, t0 + chunk_tiles);
        per_step = ceil_div(rows, t1 - t0);
        for (int64_t pair = first; pair < last; ++pair) {
          auto* pair_sums = sums + (pair - first) * kSums;
          const auto [tile0, tile1] = column_tiles(pair);
          const Element* b0 = wp + tile0 * column_tile;
          const Element* b1 = wp + tile1 * column_tile;
          if (block_rows == kTileRows) {
            tile_sums<Tiles, 1>(a, lda, b0, b1, t0, t1, pair_sums, between);
          } else {
            tile_sums<Tiles, 2>(a, lda, b0, b1, t0, t1, pair_sums, between);
          }
          if (t1 == depth_tiles) {
            store_rows(rows);
            pending = pair, stored = 0;
          }
        }
      }
      store_rows(rows);
    }
    _tile_release();
  });
}

// Rows m0 + r0 .. m0 + r1 - 1 of y [M, N] at outputs n0 .. (up to 32), rounded from their sums (+ bias).
void store_outputs(c10::BFloat16* y, int64_t N, int64_t m0, int64_t r0, int64_t r1, int64_t n0, const float* sums,
                   const float* bias) {
  const int64_t outputs = std::min(kOutputs, N - n0);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < outputs; c += 16)
      round_store(y + (m0 + r) * N + n0 + c, sums + r * kOutputs + c, bias ? bias + n0 + c : nullptr,
                  std::min<int64_t>(16, outputs - c));
}

void amx_linear_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y) {
  const int64_t N = y.size(1);
  auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
  tile_product<Bf16Tiles>(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), x.size(0), x.size(1), x.stride(0),
                          reinterpret_cast<const c10::BFloat16*>(packed.data_ptr()), packed.size(0) / 2,
                          [&](int64_t m0, int64_t r0, int64_t r1, int64_t pair, const float* sums) {
                            store_outputs(yp, N, m0, r0, r1, pair * kOutputs, sums, bias);
                          });
}

// The pairs of a qkv product stored through the rotary: the first `rotary_pairs` pair dims d and d + half of a
// head (16 dims each: tiles j and j + half_tiles of head h), the others consecutive tiles from `first_plain` on.
struct HeadHalves {
  int64_t rotary_pairs, half_tiles, first_plain;
  std::pair<int64_t, int64_t> operator()(int64_t pair) const {
    if (pair >= rotary_pairs) {
      const int64_t tile = first_plain + 2 * (pair - rotary_pairs);
      return {tile, tile + 1};
    }
    const int64_t lo = pair / half_tiles * 2 * half_tiles + pair % half_tiles;
    return {lo, lo + half_tiles};
  }
};

// y = x W^T (+ bias) with the first `rotary_columns` outputs (heads of head_dim) rotated rotate-half by cos and sin
// [M, head_dim] (bf16, RotaryCosSin's layout): each output rounded to bf16 as amx_linear_impl rounds it, then
// rotary_embedding's arithmetic (rotary.h) on a head's dims d and d + half, which one pair of tiles computes
// together -- the bits of the two calls, without writing the q and k heads and reading them back.
void amx_linear_rotary_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, const uint16_t* cos,
                            const uint16_t* sin, int64_t rotary_columns, int64_t head_dim, at::Tensor& y) {
  const int64_t N = y.size(1), half = head_dim / 2;
  const HeadHalves halves{rotary_columns / kOutputs, half / kTileRows, rotary_columns / kTileRows};
  auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
  auto* bits = reinterpret_cast<uint16_t*>(y.data_ptr());
  // an output as amx_linear_impl stores it: its sum (+ bias) rounded to bf16, as float32
  auto rounded = [&](const float* sum, int64_t n) {
    const __m512 v = _mm512_loadu_ps(sum);
    return llmplug::bf16_floats(llmplug::bf16_bits(bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias + n)) : v));
  };
  tile_product<Bf16Tiles>(
      reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), x.size(0), x.size(1), x.stride(0),
      reinterpret_cast<const c10::BFloat16*>(packed.data_ptr()), packed.size(0) / 2,
      [&](int64_t m0, int64_t r0, int64_t r1, int64_t pair, const float* sums) {
        if (pair >= halves.rotary_pairs) {
          store_outputs(yp, N, m0, r0, r1, rotary_columns + (pair - halves.rotary_pairs) * kOutputs, sums, bias);
          return;
        }
        const auto [lo_tile, hi_tile] = halves(pair);
        const int64_t lo_n = lo_tile * kTileRows, hi_n = hi_tile * kTileRows, d = lo_n % head_dim;
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t m = m0 + r;
          const __m512 lo = rounded(sums + r * kOutputs, lo_n), hi = rounded(sums + r * kOutputs + kTileRows, hi_n);
          auto table = [&](const uint16_t* t, int64_t dim) {
            return llmplug::bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + m * head_dim + dim)));
          };
          __m256i out_lo, out_hi;
          llmplug::rotate_half_16(lo, hi, table(cos, d), table(cos, d + half), table(sin, d), table(sin, d + half),
                                  out_lo, out_hi);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + m * N + lo_n), out_lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + m * N + hi_n), out_hi);
        }
      },
      halves);
}

// silu(x W_gate^T + b_gate) * (x W_up^T + b_up) -> y [M, d] for gate_up's packed weight (2 d outputs: the gate's d,
// then the up's; d a multiple of 16): each output's two sums are amx_linear_impl's (its tile products, the bias,
// one rounding to bf16), then silu_and_mul's arithmetic (activation.h), as the two calls give, without writing the
// [M, 2 d] product and reading it back.
void amx_linear_silu_and_mul_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y) {
  const int64_t d = y.size(1), tiles = d / kTileRows;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const uint16_t* silu = llmplug::silu_table();
  tile_product<Bf16Tiles>(
      reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), x.size(0), x.size(1), x.stride(0),
      reinterpret_cast<const c10::BFloat16*>(packed.data_ptr()), tiles,
      [&](int64_t m0, int64_t r0, int64_t r1, int64_t pair, const float* sums) {
        const int64_t n0 = pair * kTileRows;
        for (int64_t r = r0; r < r1; ++r) {
          __m512 gate = _mm512_loadu_ps(sums + r * kOutputs), up = _mm512_loadu_ps(sums + r * kOutputs + kTileRows);
          if (bias != nullptr) {
            gate = _mm512_add_ps(gate, _mm512_loadu_ps(bias + n0));
            up = _mm512_add_ps(up, _mm512_loadu_ps(bias + d + n0));
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (m0 + r) * d + n0),
                              llmplug::silu_and_mul_bf16(llmplug::bf16_bits(gate), llmplug::bf16_bits(up), silu));
        }
      },
      [tiles](int64_t pair) { return std::pair<int64_t, int64_t>{pair, pair + tiles}; });
}

// 16 values of x as float32: bf16 widened, float32 as they are.
inline __m512 load16(const c10::BFloat16* p) {
  return llmplug::bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 live) {
  _mm256_mask_storeu_epi16(p, live, llmplug::bf16_bits(v));
}
inline void store16(float* p, __m512 v, __mmask16 live) { _mm512_mask_storeu_ps(p, live, v); }

// Each row of x [M, K] (K a multiple of 16) as int8 codes and a float32 scale, int8_linear.quantize_rows's
// arithmetic: scale = max(max |x|, 1e-30) / 127, code = x / scale rounded half to even (within -127..127).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t ldx, int8_t* codes, float* scales) {
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * ldx;
      __m512 top = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(row + k)));
      const float scale = std::max(_mm512_reduce_max_ps(top), 1e-30f) / 127.0f;
      scales[m] = scale;
      const __m512 divisor = _mm512_set1_ps(scale);
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k), divisor),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + m * K + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
      }
    }
  });
}

// y = x W^T for int8 W (packed) with per-output scales: x's rows quantized (quantize_rows), summed exactly in int32
// by TDPBSSD, then float(sum) * x's scale * w's scale (+ bias), each step rounded in float32 as Int8LinearMethod's
// torch ops round, and rounded once to y's dtype.
template <typename T>
void amx_int8_impl(const at::Tensor& x, const at::Tensor& packed, const float* weight_scale, const float* bias,
                   at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  at::Tensor codes = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M}, x.options().dtype(at::kFloat));
  quantize_rows(reinterpret_cast<const T*>(x.data_ptr()), M, K, x.stride(0), codes.data_ptr<int8_t>(),
                scales.data_ptr<float>());
  const float* sx = scales.data_ptr<float>();
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  tile_product<Int8Tiles>(codes.data_ptr<int8_t>(), M, K, K, packed.data_ptr<int8_t>(), packed.size(0) / 2,
                          [&](int64_t m0, int64_t r0, int64_t r1, int64_t pair, const int32_t* sums) {
                            const int64_t n0 = pair * kOutputs, outputs = std::min(kOutputs, N - n0);
                            for (int64_t r = r0; r < r1; ++r) {
                              const __m512 row_scale = _mm512_set1_ps(sx[m0 + r]);
                              for (int64_t c = 0; c < outputs; c += 16) {
                                const int64_t count = std::min<int64_t>(16, outputs - c);
                                const __mmask16 live = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
                                const __m512i sum = _mm512_maskz_loadu_epi32(live, sums + r * kOutputs + c);
                                __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), row_scale),
                                                         _mm512_maskz_loadu_ps(live, weight_scale + n0 + c));
                                if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + n0 + c));
                                store16(yp + (m0 + r) * N + n0 + c, v, live);
                              }
                            }
                          });
}
#endif

// A kernel's bias [N] (any float dtype) as float32, or an undefined tensor for none.
at::Tensor float32_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "llmplug_cpu::", op, ": bias must be [",
              out_features, "], got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// amx_linear's checks of its arguments, for `op`.
void check_amx_linear(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(llmplug::amx_enabled(), "llmplug_cpu::", op, ": AMX is not available here (",
#ifdef LLMPLUG_AMX
              "LLMPLUG_CPU_AMX=0, an ISA cap below AMX, or the OS refused the tile state)"
#else
              "built without AMX-BF16 and AMX-INT8)"
#endif
  );
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "llmplug_cpu::", op, ": x must be bfloat16 [M, K], "
              "got ", x.scalar_type(), " ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(0) % 2 == 0 && packed.size(2) == kTileRows && packed.size(3) == kBf16Depth,
              "llmplug_cpu::", op, ": packed must be contiguous bfloat16 [N' / 16, K / 32, 16, 32] (N' even tiles), "
              "got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.size(1) * kBf16Depth == K, "llmplug_cpu::", op, ": x has ", K, " columns, the packed weight ",
              packed.size(1) * kBf16Depth);
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kTileRows &&
                  out_features > (packed.size(0) - 2) * kTileRows,
              "llmplug_cpu::", op, ": out_features ", out_features, " does not fit the packed weight's ",
              packed.size(0) * kTileRows, " rows");
}

// x [M, K] bfloat16 (columns contiguous) times the packed weight of `out_features` outputs, plus bias [N] (bfloat16
// or float32) where given -> [M, N] bfloat16.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features) {
  check_amx_linear("amx_linear", x, packed, out_features);
  const at::Tensor bias_f32 = float32_bias("amx_linear", bias, out_features);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
#ifdef LLMPLUG_AMX
  if (y.numel() > 0) amx_linear_impl(xc, packed, bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, y);
#endif
  return y;
}

// amx_linear's product of gate_up's weight (out_features = 2 d: the gate's d outputs, then the up's; d a multiple of
// 16) through SiLU-and-mul -> [M, d] bfloat16: the bits of silu_and_mul(amx_linear(x, packed, bias, 2 d)).
at::Tensor amx_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                   int64_t out_features) {
  TORCH_CHECK(out_features % (2 * kTileRows) == 0, "llmplug_cpu::amx_linear_silu_and_mul: out_features (gate and up) "
              "must be a multiple of 32, got ", out_features);
  check_amx_linear("amx_linear_silu_and_mul", x, packed, out_features);
  const at::Tensor bias_f32 = float32_bias("amx_linear_silu_and_mul", bias, out_features);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features / 2}, x.options());
#ifdef LLMPLUG_AMX
  if (y.numel() > 0)
    amx_linear_silu_and_mul_impl(xc, packed, bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, y);
#endif
  return y;
}

// amx_linear's product of a qkv weight with its first rotary_columns outputs (q and k heads of head_dim, a multiple of
// 32) rotated rotate-half by cos and sin [M, head_dim] (bfloat16, contiguous) -> [M, out_features] bfloat16: the
// bits of rotary_embedding(amx_linear(x, packed, bias, out_features)[:, :rotary_columns], cos, sin, neox).
at::Tensor amx_linear_rotary(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t out_features, const at::Tensor& cos, const at::Tensor& sin,
                             int64_t rotary_columns, int64_t head_dim) {
  check_amx_linear("amx_linear_rotary", x, packed, out_features);
  TORCH_CHECK(head_dim > 0 && head_dim % (2 * kTileRows) == 0 && rotary_columns > 0 &&
                  rotary_columns % head_dim == 0 && rotary_columns <= out_features,
              "llmplug_cpu::amx_linear_rotary: head_dim must be a positive multiple of 32 and rotary_columns a "
              "multiple of it within out_features, got head_dim ", head_dim, ", rotary_columns ", rotary_columns,
              ", out_features ", out_features);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == x.size(0) * head_dim,
                "llmplug_cpu::amx_linear_rotary: cos and sin must be contiguous bfloat16 [", x.size(0), ", ",
                head_dim, "], got ", t->scalar_type(), " ", t->sizes());
  const at::Tensor bias_f32 = float32_bias("amx_linear_rotary", bias, out_features);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
#ifdef LLMPLUG_AMX
  if (y.numel() > 0)
    amx_linear_rotary_impl(xc, packed, bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr,
                           reinterpret_cast<const uint16_t*>(cos.data_ptr()),
                           reinterpret_cast<const uint16_t*>(sin.data_ptr()), rotary_columns, head_dim, y);
#endif
  return y;
}

// x [M, K] (bfloat16 or float32, K a multiple of 64) times the int8 weight packed into AMX tiles (pack_weight of its
// codes) with float32 per-output scales [N], plus bias [N] where given -> [M, N] in x's dtype: Int8LinearMethod's
// W8A8 product, bit for bit.
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                           const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(llmplug::amx_enabled(), "llmplug_cpu::amx_int8_linear: AMX is not available here");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.size(1) % kInt8Depth == 0,
              "llmplug_cpu::amx_int8_linear: x must be bfloat16 or float32 [M, K], K a multiple of 64, got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(0) % 2 == 0 && packed.size(1) * kInt8Depth == K && packed.size(2) == kTileRows &&
                  packed.size(3) == kInt8Depth,
              "llmplug_cpu::amx_int8_linear: packed must be contiguous int8 [N' / 16, K / 64, 16, 64] for K = ", K,
              ", got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kTileRows &&
                  out_features > (packed.size(0) - 2) * kTileRows,
              "llmplug_cpu::amx_int8_linear: out_features ", out_features, " does not fit the packed weight");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.numel() == out_features,
              "llmplug_cpu::amx_int8_linear: weight_scale must be contiguous float32 [", out_features, "]");
  const at::Tensor bias_f32 = float32_bias("amx_int8_linear", bias, out_features);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
#ifdef LLMPLUG_AMX
  if (y.numel() > 0) {
    const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
    if (x.scalar_type() == at::kBFloat16) {
      amx_int8_impl<c10::BFloat16>(xc, packed, weight_scale.data_ptr<float>(), b, y);
    } else {
      amx_int8_impl<float>(xc, packed, weight_scale.data_ptr<float>(), b, y);
    }
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmplug_cpu, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("amx_linear_silu_and_mul(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("amx_linear_rotary(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor cos, Tensor sin, "
        "int rotary_columns, int head_dim) -> Tensor");
  m.def("amx_int8_linear(Tensor x, Tensor packed, Tensor weight_scale, Tensor? bias, int out_features) -> Tensor");
  m.def("amx_enabled() -> bool", [] { return llmplug::amx_enabled(); });
}

TORCH_LIBRARY_IMPL(llmplug_cpu, CPU, m) {
  m.impl("amx_linear", amx_linear);
  m.impl("amx_linear_silu_and_mul", amx_linear_silu_and_mul);
  m.impl("amx_linear_rotary", amx_linear_rotary);
  m.impl("amx_int8_linear", amx_int8_linear);
}
