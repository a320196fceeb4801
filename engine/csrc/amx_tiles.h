// What every AMX kernel here needs (engine/attention/csrc/prefill_amx.h,
// engine/models/csrc/amx_gemm.cpp): the process's permission to use the tiles and one tile
// configuration. engine.native_build puts this folder on every native build's include path and
// hashes its headers into each build's name.
//
// Linux hands the tiles' 8 KiB of register state only to a process that asked for it
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)): `amx_permitted` asks once; where it is
// refused the kernels keep their AVX-512 paths. The configuration belongs to the thread, and
// oneDNN loads its own between our calls, so each thread loads ours (TileConfig) for the span of
// one kernel call and releases it after.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDSERVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

constexpr int kTileRows = 16;   // rows of every tile
constexpr int kTileBytes = 64;  // bytes per tile row: 32 bf16, or 16 fp32 / bf16 pairs

// Whether this process may use the tiles (asked once, on first call).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Palette 1, tiles 0-7 each 16 rows of 64 bytes; loaded for one kernel call on one thread.
struct TileConfig {
  TileConfig() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette
    for (int t = 0; t < 8; ++t) {
      config[16 + 2 * t] = kTileBytes;  // bytes per row (little-endian uint16)
      config[48 + t] = kTileRows;
    }
    _tile_loadconfig(config);
  }
  ~TileConfig() { _tile_release(); }
  TileConfig(const TileConfig&) = delete;
  TileConfig& operator=(const TileConfig&) = delete;
};

}  // namespace amx

#endif  // AMX-TILE, AMX-BF16, AVX512-BF16
