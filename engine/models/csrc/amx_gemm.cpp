// bfloat16 linear layers at few rows (decode steps) on Intel's AMX tiles:
// y[M, N] = x[M, K] W[N, K]^T (+ bias), float32 sums rounded once to bfloat16.
//
// A decode step's linears are bound by streaming the weights from memory: at 1-32 rows the
// tiles multiply far faster than memory delivers the weights (one 16 x 32 x 16 tile product per
// KiB of weights). On an Emerald Rapids Xeon (2 threads) the vdpbf16ps panel kernel
// (cpu_small_gemm.cpp) read the default model's weights at ~14 GB/s at one row and was compute
// bound above four, and oneDNN's AMX GEMM was no faster at 1-32 rows; reads run at ~25 GB/s
// there. This kernel streams each weight once per call at any row count up to kMaxRows, every
// tile product waiting only on the weights.
//
// W is packed once into blocks of kBlockCols output columns, each one contiguous stream over K:
// [ceil(N / 32)][ceil(K / 32)][2 column tiles][16 k pairs][16 columns][2] (the B-tile layout:
// each 32-bit word one column's weights at k and k + 1; zeros past N and K). x is copied into a
// zero-padded [rows rounded to 32][K rounded to 32] buffer, whose 16-row slices are the A tiles.
// Each thread takes a run of column blocks; per block and 32 rows, four C tiles (2 row tiles x
// 2 column tiles) accumulate over K, are stored to a small float32 buffer, get the bias added and
// are rounded to bfloat16 (nearest even).

// Headers: only what the kernel uses and the pybind11 tensor caster (see cpu_elementwise.cpp).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "amx_tiles.h"

namespace {

constexpr int64_t kBlockCols = 32;  // output columns per block: two C tiles
constexpr int64_t kStepK = 32;      // k per tile product
constexpr int64_t kRowBlock = 32;   // rows per pass over a block: two A tiles
constexpr int64_t kMaxRows = 256;   // the most rows a call may have (eight passes per block)
constexpr int64_t kStepBytes = 2 * amx::kTileRows * 64;  // one k step of a block: two B tiles

// The weights are prefetched this far ahead of the tile loads: 1.09-1.16x at 32-64 rows, the
// same at 1-16 (the default model's shapes, 2 threads, weights not in cache).
constexpr int64_t kPrefetchBytes = 8 * kStepBytes;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

#if defined(PDSERVE_AMX)

using bf16 = c10::BFloat16;

// One block's pass over K for up to 32 rows (two row tiles when `two`): A tiles 0, 1; B tiles
// 2, 3; C tiles 4, 5 (rows 0-15) and 6, 7 (rows 16-31), stored to c [32][32] float32.
// Tiles are not renamed: a load into a tile waits for the products that read it. So the loads
// of step s + 1 are issued each right after the last product of step s that reads its tile, and
// run beside the products still to come, rather than all at the top of the step, behind every
// product of the step before. The products and their order are unchanged (the same sums). On an
// Emerald Rapids Xeon (2 threads): the default model's 30 layers' linears 1.05-1.13x faster at
// 24-96 rows, 1.01-1.03x at 1-16 (25 interleaved repeats); whole decode steps, the two builds
// taking turns step by step in one engine, faster in 42 of 60 pairs at 64 running (median
// 1.013x) and 46 of 60 at 32 (1.024x).
template <bool two>
void block_pass(const bf16* xa, int64_t lda, const char* panel, int64_t steps, float* c) {
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  _tile_loadd(0, xa, lda * 2);
  _tile_loadd(2, panel, 64);
  _tile_loadd(3, panel + kStepBytes / 2, 64);
  if constexpr (two) _tile_loadd(1, xa + 16 * lda, lda * 2);
  for (int64_t s = 0; s < steps; ++s) {
    const bool more = s + 1 < steps;
    const char* b = panel + (s + 1) * kStepBytes;  // step s + 1's tiles
    const bf16* a = xa + (s + 1) * kStepK;
    for (int line = 0; line < kStepBytes; line += 64)
      _mm_prefetch(panel + s * kStepBytes + kPrefetchBytes + line, _MM_HINT_T0);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (two) {
      if (more) _tile_loadd(0, a, lda * 2);
      _tile_dpbf16ps(6, 1, 2);
      if (more) _tile_loadd(2, b, 64);
      _tile_dpbf16ps(7, 1, 3);
      if (more) {
        _tile_loadd(3, b + kStepBytes / 2, 64);
        _tile_loadd(1, a + 16 * lda, lda * 2);
      }
    } else if (more) {
      _tile_loadd(0, a, lda * 2);
      _tile_loadd(2, b, 64);
      _tile_loadd(3, b + kStepBytes / 2, 64);
    }
  }
  _tile_stored(4, c, kBlockCols * 4);
  _tile_stored(5, c + 16, kBlockCols * 4);
  if constexpr (two) {
    _tile_stored(6, c + 16 * kBlockCols, kBlockCols * 4);
    _tile_stored(7, c + 16 * kBlockCols + 16, kBlockCols * 4);
  }
}

// rows x cols of c (+ bias) rounded to bf16 into out (row stride ldo).
void write_rows(const float* c, int64_t rows, int64_t cols, const bf16* bias, bf16* out,
                int64_t ldo) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lo, bias)), 16));
    b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(hi, bias + 16)), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + r * kBlockCols), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + r * kBlockCols + 16), b1);
    _mm256_mask_storeu_epi16(out + r * ldo, lo, (__m256i)_mm512_cvtneps_pbh(v0));
    _mm256_mask_storeu_epi16(out + r * ldo + 16, hi, (__m256i)_mm512_cvtneps_pbh(v1));
  }
}

struct Call {
  const bf16* xa;  // [round_up(M, 32)][lda], zero-padded
  int64_t lda, M, N, steps;
  const char* packed;
  const bf16* bias;
  bf16* out;
};

// Column blocks [begin, end) for every row of the call, on this thread.
void run_blocks(const Call& a, int64_t begin, int64_t end) {
  amx::TileConfig config;
  alignas(64) float c[kRowBlock * kBlockCols];
  for (int64_t nb = begin; nb < end; ++nb) {
    const char* panel = a.packed + nb * a.steps * kStepBytes;
    const int64_t col0 = nb * kBlockCols, cols = std::min(kBlockCols, a.N - col0);
    for (int64_t r0 = 0; r0 < a.M; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, a.M - r0);
      if (rows > 16) {
        block_pass<true>(a.xa + r0 * a.lda, a.lda, panel, a.steps, c);
      } else {
        block_pass<false>(a.xa + r0 * a.lda, a.lda, panel, a.steps, c);
      }
      write_rows(c, rows, cols, a.bias ? a.bias + col0 : nullptr, a.out + r0 * a.N + col0, a.N);
    }
  }
}

#endif  // PDSERVE_AMX

bool available() {
#if defined(PDSERVE_AMX)
  return amx::amx_permitted();
#else
  return false;
#endif
}

void check_available() {
  TORCH_CHECK(available(), "this build or process has no AMX bfloat16 tiles");
}

}  // namespace

// W [N, K] bfloat16 into the kernel's blocks: [ceil(N / 32) * ceil(K / 32) * 1024] int16 words.
at::Tensor pack(const at::Tensor& w) {
  check_available();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight must be [N, K] bf16");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t blocks = round_up(N, kBlockCols) / kBlockCols, steps = round_up(K, kStepK) / kStepK;
  at::Tensor packed = at::detail::empty_cpu({blocks * steps * kStepBytes / 2}, at::kShort,
                                            std::nullopt, std::nullopt, std::nullopt,
                                            std::nullopt);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
  std::memset(dst, 0, packed.numel() * sizeof(uint16_t));
  // Word (nb, s, t, p, col) = W[nb * 32 + t * 16 + col][s * 32 + 2 p, + 1]: each k pair of a row
  // is one 32-bit word, its first k in the low half (an odd K's last pair holds one k). A
  // block's rows are copied kPackSteps steps at a time, so the 16 KiB they fill stay in L1:
  // one element at a time, with a division per index, this ran at a quarter of a copy's speed.
  constexpr int64_t kPackSteps = 8;
  const int64_t pairs = (K + 1) / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t s0 = 0; s0 < steps; s0 += kPackSteps) {
        const int64_t q1 = std::min(pairs, (s0 + kPackSteps) * (kStepK / 2));
        for (int64_t r = 0; r < kBlockCols && nb * kBlockCols + r < N; ++r) {
          const uint16_t* row = src + (nb * kBlockCols + r) * K;
          uint32_t* out = dst + (nb * steps * 2 + r / 16) * 256 + r % 16;
          for (int64_t q = s0 * (kStepK / 2); q < q1; ++q) {
            uint32_t word = row[2 * q];
            if (2 * q + 1 < K) word |= static_cast<uint32_t>(row[2 * q + 1]) << 16;
            out[(q >> 4) * 512 + (q & 15) * 16] = word;
          }
        }
      }
  });
  return packed;
}

// y = x W^T (+ bias) for x [M, K] bfloat16 (M <= kMaxRows, rows contiguous), W packed by `pack`.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K,
                  const std::optional<at::Tensor>& bias) {
  check_available();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 &&
                  x.stride(1) == 1, "x must be [M, K] bf16 with contiguous rows");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most ", kMaxRows, " rows per call");
  const int64_t M = x.size(0), steps = round_up(K, kStepK) / kStepK;
  const int64_t blocks = round_up(N, kBlockCols) / kBlockCols;
  TORCH_CHECK(packed.numel() == blocks * steps * kStepBytes / 2, "packed weight does not match");
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == at::kBFloat16 &&
                        bias->is_contiguous()), "bias must be [N] contiguous bf16");
  at::Tensor out = at::detail::empty_cpu({M, N}, x.options());
  if (M == 0) return out;
#if defined(PDSERVE_AMX)
  const int64_t lda = steps * kStepK;
  at::Tensor xa = at::detail::empty_cpu({round_up(M, kRowBlock), lda}, x.options());
  bf16* xa_rows = xa.data_ptr<bf16>();
  std::memset(static_cast<void*>(xa_rows), 0, xa.numel() * sizeof(bf16));
  for (int64_t r = 0; r < M; ++r)
    std::memcpy(static_cast<void*>(xa_rows + r * lda), x.data_ptr<bf16>() + r * x.stride(0),
                K * sizeof(bf16));
  const Call call{xa_rows, lda, M, N, steps,
                  reinterpret_cast<const char*>(packed.data_ptr()),
                  bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>()};
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) { run_blocks(call, begin, end); });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build and process run AMX bf16 tiles");
  m.def("max_rows", []() { return kMaxRows; }, "the most rows a call may have");
  m.def("pack", &pack, "pack W [N, K] bf16 for linear", pybind11::arg("w"));
  m.def("linear", &linear, "y = x W^T (+ bias) on AMX tiles", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("K"),
        pybind11::arg("bias") = std::nullopt);
}
