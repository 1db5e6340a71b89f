// Prompt rows of paged_attention with AMX-BF16 (prompt_attention.cpp): a tile of up to kPromptTileRows consecutive
// prompt tokens of one request against one KV head's keys, for its G query heads.
#pragma once

#include <cstdint>
#include <vector>

namespace llmplug {

// Prompt rows a task takes: 16 at a time against key and value tiles made once for them all (32: 0.81-0.87x the
// time of 16 on the default model's prompts of 45-2,048 tokens; 64: 0.92x the time of 32 on the 32 benchmark
// prompts of 41-48 tokens, one task each instead of two, 0.88x on 512 tokens, the same on 2,048).
constexpr int64_t kPromptTileRows = 64;

// The cache's layout and head dims a prompt tile reads (elements, bf16).
struct PromptShape {
  int64_t group, dim, block_size, k_block_stride, k_row_stride, v_block_stride, v_row_stride;
};

// Per-thread buffers of prompt_tile, grown to the largest tile a thread meets.
struct PromptScratch {
  std::vector<uint32_t> keys;    // the keys as B tiles: [16-key blocks][dim / 32][16 dim pairs][16 keys]
  std::vector<uint16_t> values;  // the values as B tiles: [32-key chunks][dim / 16][16 key pairs][16 dims x 2]
  std::vector<float> scores;     // [16 rows][keys, rounded up to 16]
  std::vector<uint16_t> probs;   // [16 rows][keys, rounded up to 32], bf16
  std::vector<float> exps;       // one row's exponentials
};

// Whether prompt_tile serves a layer: this build and process use AMX, bf16, dim == dim_v in {64, 128}, blocks of a
// multiple of 16 tokens, and plain causal attention (no sliding window or chunk).
bool prompt_tile_supported(int64_t dim, int64_t dim_v, int64_t block_size, int64_t window, int64_t chunk);

// rows (<= kPromptTileRows) consecutive prompt tokens from position pos0 on, each over keys 0 .. its position
// (table: the request's blocks): out row i, head g = softmax(scale q_ig . k) v, with q . k and p . v summed by
// TDPBF16PS and the probabilities rounded to bf16 (as an eager bf16 attention rounds them). q [rows] x G heads
// (strides in elements), out likewise. A row's bits depend only on its query and keys: each score is one TDPBF16PS
// chain over the dims, the softmax the row's own, and p . v one chain over 32-key chunks from key 0, the chunks
// past the row's own adding exact zeros (denormal sums flushed to zero at the end, as a longer chain flushes them).
void prompt_tile(const uint16_t* q, int64_t q_token_stride, int64_t q_head_stride, const uint16_t* keys,
                 const uint16_t* values, const int64_t* table, const PromptShape& shape, int64_t pos0, int64_t rows,
                 float scale, PromptScratch& scratch, uint16_t* out, int64_t out_token_stride);

}  // namespace llmplug
