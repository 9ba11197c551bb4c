// The AMX tile configuration both tile kernels load (amx_decode.cpp, amx_prefill.cpp): palette 1, up to
// eight tiles of `rows` x `colsb` bytes each.
#pragma once
#include <cstdint>

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Not _tile_loadconfig: GCC 12's macro tells the compiler it reads only a pointer's worth of the struct,
// so the rest may not be stored yet when the instruction runs (#GP on a garbage config).
inline void load_tile_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }
