// The causal prefill kernel's two products on Intel's AMX tiles (prefill_attention.cpp, bf16
// model, where the build has AMX-TILE and AMX-BF16: Sapphire Rapids and later Xeons).
//
// On an AMX Xeon the kernel's vdpbf16ps products ran at ~0.6-0.7x the speed of SDPA's flash
// kernel, whose products oneDNN puts on the tiles; here the products take a handful of tile
// instructions per 16 rows x 32 keys and the online softmax stays on AVX-512. Both operands are
// already in the layouts the tiles read: a tile row of B is 16 32-bit words, each a bf16 pair
// along the reduced dimension, which is how the kernel packs its keys ([D/2][32 keys][2]) and
// values ([16 key pairs][D][2]) for vdpbf16ps. Queries (A of the scores) are copied into
// [rows][D] per work item, the probabilities (A of the values) are written as [rows][32].
//
// The tiles' permission and configuration: engine/csrc/amx_tiles.h.
#pragma once

#include "amx_tiles.h"

#if defined(PDSERVE_AMX)
#define PREFILL_AMX 1

namespace amx {

constexpr int kTileKeys = 32;  // keys per chunk: two C tiles of scores, one A tile of probabilities

// s[16][32] (fp32, row stride 32) = q[16][D] (bf16, row stride D) . the chunk's 32 keys, packed
// [D/2][32][2]: tiles 0, 1 accumulate keys 0-15 and 16-31 over D/32 slices of the head dims.
template <int D>
inline void scores(const void* q, const void* kp, float* s) {
  const char* qb = static_cast<const char*>(q);
  const char* kb = static_cast<const char*>(kp);
  _tile_zero(0);
  _tile_zero(1);
  for (int slice = 0; slice < D / 32; ++slice) {
    _tile_loadd(2, qb + slice * 64, D * 2);
    _tile_loadd(3, kb + slice * 16 * kTileKeys * 4, kTileKeys * 4);
    _tile_loadd(4, kb + slice * 16 * kTileKeys * 4 + 64, kTileKeys * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, s, kTileKeys * 4);
  _tile_stored(1, s + 16, kTileKeys * 4);
}

// o[16][D] (fp32, row stride D) = p[16][32] (bf16, row stride 32) . the chunk's values, packed
// [16][D][2]: 64 head dims at a time into tiles 4-7, the value tiles alternating 0 and 1.
template <int D>
inline void values(const void* p, const void* vp, float* o) {
  const char* vb = static_cast<const char*>(vp);
  _tile_loadd(2, p, kTileKeys * 2);
  for (int h = 0; h < D / 64; ++h) {
    const char* cols = vb + h * 64 * 4;
    _tile_loadd(0, cols, D * 4);
    _tile_loadd(1, cols + 64, D * 4);
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbf16ps(4, 2, 0);
    _tile_dpbf16ps(5, 2, 1);
    _tile_loadd(0, cols + 128, D * 4);
    _tile_loadd(1, cols + 192, D * 4);
    _tile_zero(6);
    _tile_zero(7);
    _tile_dpbf16ps(6, 2, 0);
    _tile_dpbf16ps(7, 2, 1);
    float* dst = o + h * 64;
    _tile_stored(4, dst, D * 4);
    _tile_stored(5, dst + 16, D * 4);
    _tile_stored(6, dst + 32, D * 4);
    _tile_stored(7, dst + 48, D * 4);
  }
}

}  // namespace amx

#endif  // AMX-TILE, AMX-BF16, AVX512-BF16
