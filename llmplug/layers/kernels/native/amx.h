// What llmplug's AMX kernels (amx_linear.cpp, int4.cpp) share: whether this process uses AMX, and the tile
// configuration's layout (palette 1).
#pragma once

#include <cstdint>

namespace llmplug {

// Whether llmplug's kernels compute with AMX here (decided once per process, amx_linear.cpp): the build has
// AMX-BF16 and AMX-INT8, Linux lends the process the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM), as oneDNN asks),
// and neither LLMPLUG_CPU_AMX=0 nor a oneDNN ISA cap below AMX (ONEDNN_MAX_CPU_ISA, DNNL_MAX_CPU_ISA) says otherwise.
bool amx_enabled();

// ldtilecfg's 64 bytes: each tile's rows and bytes a row (0: unused).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of `config`. GCC 12's _tile_loadconfig tells the compiler the instruction reads the config's first 8
// bytes only, so it may drop the stores of the rest (seen in w4a8.cpp: a zeroed config, then SIGSEGV); this asm
// names all 64 as its input.
inline void load_tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }

// All 8 tiles as 16 rows of 64 bytes (amx_linear's and the prompt attention's tiles).
inline void configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  load_tile_config(config);
}

}  // namespace llmplug
