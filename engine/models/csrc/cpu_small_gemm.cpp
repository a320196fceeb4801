// float32 linear layers at few rows (decode steps of 1-24 sequences) on AVX2 + FMA CPUs, with
// an AVX-512 form where the build has it:
// y[M, N] = x[M, K] W[N, K]^T (+ bias), W packed once into panels of 3 vectors of output columns
// (24 with AVX2, 48 with AVX-512), [ceil(N / kPanel), K, kPanel], each panel one contiguous
// stream of K * kPanel floats.
//
// At few rows a decode step's linears are bound by streaming the weights from memory. oneDNN's
// blocked fp32 GEMM reached 45-65% of that bound at 1-16 rows on an AVX2 machine (AMD EPYC Zen 3,
// 2 threads); this kernel streams each panel once per tile of rows with every load feeding
// 4-24 FMAs: a tile is up to kMaxRows rows (4 with AVX2's 16 registers, 8 with AVX-512's 32) x 3
// vectors in named accumulators, the panel row (3 loads) shared by the tile's rows and each x
// element broadcast once. Threads split the panels.
//
// Sums run over k in order, one FMA per step, in float32: every output element is the same
// chain of FMAs in either form (so both forms give the same bits), not bitwise the order of any
// BLAS (no GEMM promises one), within float32 rounding of it (the tests bound it).
//
// bfloat16, where the CPU has AVX512-BF16: W packed as pairs, [ceil(N / 48), ceil(K / 2), 48, 2]
// (each 32-bit lane of a panel vector holds one column's weights at k and k + 1), and one
// vdpbf16ps per panel vector and row adds both products into the column's float32 sum, as
// oneDNN's AVX512-BF16 GEMM does; the bias is added in float32 and the sum rounded once to
// bfloat16 (nearest even, as c10::BFloat16 rounds).

// Headers: only what the kernel uses and the pybind11 tensor caster (see cpu_elementwise.cpp).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_SMALL_GEMM 1
#include <immintrin.h>
#endif
#if defined(PDSERVE_SMALL_GEMM) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_SMALL_GEMM_BF16 1
#endif

namespace {

#if defined(PDSERVE_SMALL_GEMM) && defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kMaxRows = 8;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#elif defined(PDSERVE_SMALL_GEMM)
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kMaxRows = 4;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#else
constexpr int64_t kLanes = 8;
constexpr int kMaxRows = 4;
#endif

constexpr int64_t kPanel = 3 * kLanes;  // output columns per panel: 3 vectors
// Bytes of panel one k step reads (one pair of k for bfloat16): 192 with AVX-512, 96 with AVX2.
constexpr int64_t kStepBytes = kPanel * int64_t(sizeof(float));
// How far ahead of its loads a tile prefetches its panel, in k steps (6 KB with AVX-512). With
// the hardware prefetcher alone, one stream per thread, a decode step's linears took about the
// sum of their streaming and arithmetic time rather than the larger of the two (float32, the
// default model's 30 layers and lm_head, 2 threads, an Emerald Rapids Xeon, bits unchanged:
// 1.36-1.54x faster at 4-8 rows, 1.15-1.42x at 16-64, 1.04-1.07x at 1, 1.00x at 512; 16-64 steps
// ahead alike; the later tiles of a panel fetching the next panel instead was no better).
constexpr int64_t kAheadSteps = 32;

#ifdef PDSERVE_SMALL_GEMM

// Prefetches into L1 the panel step kAheadSteps after the one at `step` (past the panel's end,
// the thread's next panel or nothing: a prefetch does not fault).
inline void prefetch_ahead(const void* step) {
  const char* ahead = static_cast<const char*>(step) + kAheadSteps * kStepBytes;
  for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

inline void store_row(float* out, Vec a, Vec b, Vec c, const float* bias) {
  if (bias != nullptr) {
    a = vadd(a, vload(bias));
    b = vadd(b, vload(bias + kLanes));
    c = vadd(c, vload(bias + 2 * kLanes));
  }
  vstore(out, a);
  vstore(out + kLanes, b);
  vstore(out + 2 * kLanes, c);
}

// Row r of a tile: its x element broadcast once, three FMAs against the panel row.
#define PDSERVE_TILE_ROW(r)                              \
  if constexpr (MT > r) {                                \
    const Vec xr = vbroadcast(x + (r) * ldx + k);        \
    acc##r##_0 = vfma(xr, w0, acc##r##_0);               \
    acc##r##_1 = vfma(xr, w1, acc##r##_1);               \
    acc##r##_2 = vfma(xr, w2, acc##r##_2);               \
  }
#define PDSERVE_TILE_ACC(r) Vec acc##r##_0 = vzero(), acc##r##_1 = vzero(), acc##r##_2 = vzero();
#define PDSERVE_TILE_STORE(r) \
  if constexpr (MT > r) store_row(out + (r) * ldo, acc##r##_0, acc##r##_1, acc##r##_2, bias);

// out[MT, kPanel] = x[MT, K] panel[K, kPanel] (+ bias), MT <= kMaxRows. The accumulators are
// named variables, not an array: with an array GCC kept them in memory through the k loop in
// some builds (a store per FMA, 1.5x slower at 8-24 rows).
template <int MT>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                 float* out, int64_t ldo) {
  static_assert(MT >= 1 && MT <= kMaxRows, "1-kMaxRows rows per tile");
  PDSERVE_TILE_ACC(0) PDSERVE_TILE_ACC(1) PDSERVE_TILE_ACC(2) PDSERVE_TILE_ACC(3)
  PDSERVE_TILE_ACC(4) PDSERVE_TILE_ACC(5) PDSERVE_TILE_ACC(6) PDSERVE_TILE_ACC(7)
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * kPanel;
    const Vec w0 = vload(p), w1 = vload(p + kLanes), w2 = vload(p + 2 * kLanes);
    prefetch_ahead(p);
    PDSERVE_TILE_ROW(0) PDSERVE_TILE_ROW(1) PDSERVE_TILE_ROW(2) PDSERVE_TILE_ROW(3)
    PDSERVE_TILE_ROW(4) PDSERVE_TILE_ROW(5) PDSERVE_TILE_ROW(6) PDSERVE_TILE_ROW(7)
  }
  PDSERVE_TILE_STORE(0) PDSERVE_TILE_STORE(1) PDSERVE_TILE_STORE(2) PDSERVE_TILE_STORE(3)
  PDSERVE_TILE_STORE(4) PDSERVE_TILE_STORE(5) PDSERVE_TILE_STORE(6) PDSERVE_TILE_STORE(7)
}

#ifdef PDSERVE_SMALL_GEMM_BF16

inline int32_t load_pair(const at::BFloat16* p) {  // x[k], x[k + 1] as one 32-bit lane
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

inline __m512 load_bf16(const at::BFloat16* p) {  // 16 bfloat16 widened to float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Round to nearest even, NaN kept quiet: c10::BFloat16's conversion.
inline void store_bf16(at::BFloat16* p, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(out));
}

inline void store_row(at::BFloat16* out, __m512 a, __m512 b, __m512 c,
                      const at::BFloat16* bias) {
  if (bias != nullptr) {
    a = _mm512_add_ps(a, load_bf16(bias));
    b = _mm512_add_ps(b, load_bf16(bias + 16));
    c = _mm512_add_ps(c, load_bf16(bias + 32));
  }
  store_bf16(out, a);
  store_bf16(out + 16, b);
  store_bf16(out + 32, c);
}

#define PDSERVE_BF16_ROW(r)                                                         \
  if constexpr (MT > r) {                                                           \
    const __m512bh xr = (__m512bh)_mm512_set1_epi32(load_pair(x + (r) * ldx + 2 * k)); \
    acc##r##_0 = _mm512_dpbf16_ps(acc##r##_0, xr, w0);                              \
    acc##r##_1 = _mm512_dpbf16_ps(acc##r##_1, xr, w1);                              \
    acc##r##_2 = _mm512_dpbf16_ps(acc##r##_2, xr, w2);                              \
  }

// out[MT, 48] = x[MT, 2 * pairs] panel (+ bias) in bfloat16, as tile<MT> in float32: one
// vdpbf16ps per pair of k where the float32 form takes one FMA per k.
template <int MT>
inline void tile_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel,
                      int64_t pairs, const at::BFloat16* bias, at::BFloat16* out, int64_t ldo) {
  static_assert(MT >= 1 && MT <= kMaxRows, "1-kMaxRows rows per tile");
  PDSERVE_TILE_ACC(0) PDSERVE_TILE_ACC(1) PDSERVE_TILE_ACC(2) PDSERVE_TILE_ACC(3)
  PDSERVE_TILE_ACC(4) PDSERVE_TILE_ACC(5) PDSERVE_TILE_ACC(6) PDSERVE_TILE_ACC(7)
  for (int64_t k = 0; k < pairs; ++k) {
    const at::BFloat16* p = panel + k * 2 * kPanel;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p),
                   w1 = (__m512bh)_mm512_loadu_si512(p + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(p + 64);
    prefetch_ahead(p);
    PDSERVE_BF16_ROW(0) PDSERVE_BF16_ROW(1) PDSERVE_BF16_ROW(2) PDSERVE_BF16_ROW(3)
    PDSERVE_BF16_ROW(4) PDSERVE_BF16_ROW(5) PDSERVE_BF16_ROW(6) PDSERVE_BF16_ROW(7)
  }
  PDSERVE_TILE_STORE(0) PDSERVE_TILE_STORE(1) PDSERVE_TILE_STORE(2) PDSERVE_TILE_STORE(3)
  PDSERVE_TILE_STORE(4) PDSERVE_TILE_STORE(5) PDSERVE_TILE_STORE(6) PDSERVE_TILE_STORE(7)
}

struct Bf16Tiles {
  using T = at::BFloat16;
  template <int MT>
  static void run(const T* x, int64_t ldx, const T* panel, int64_t steps, const T* bias, T* out,
                  int64_t ldo) {
    tile_bf16<MT>(x, ldx, panel, steps, bias, out, ldo);
  }
};

#endif  // PDSERVE_SMALL_GEMM_BF16

struct F32Tiles {
  using T = float;
  template <int MT>
  static void run(const T* x, int64_t ldx, const T* panel, int64_t steps, const T* bias, T* out,
                  int64_t ldo) {
    tile<MT>(x, ldx, panel, steps, bias, out, ldo);
  }
};

// The remaining 1 .. kMaxRows - 1 rows of a panel, as one tile of that many. `steps`: the
// panel's rows (k for float32, pairs of k for bfloat16).
template <class Tiles, int MT = kMaxRows - 1>
inline void tail_tile(int rows, const typename Tiles::T* x, int64_t ldx,
                      const typename Tiles::T* panel, int64_t steps,
                      const typename Tiles::T* bias, typename Tiles::T* out, int64_t ldo) {
  if constexpr (MT >= 1) {
    if (rows == MT) return Tiles::template run<MT>(x, ldx, panel, steps, bias, out, ldo);
    tail_tile<Tiles, MT - 1>(rows, x, ldx, panel, steps, bias, out, ldo);
  }
}

// Rows [0, M) of x against one full panel, kMaxRows rows at a time (the panel stays in L1/L2).
template <class Tiles>
void full_panel(const typename Tiles::T* x, int64_t ldx, int64_t M,
                const typename Tiles::T* panel, int64_t steps, const typename Tiles::T* bias,
                typename Tiles::T* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows)
    Tiles::template run<kMaxRows>(x + m * ldx, ldx, panel, steps, bias, out + m * ldo, ldo);
  tail_tile<Tiles>(static_cast<int>(M - m), x + m * ldx, ldx, panel, steps, bias,
                   out + m * ldo, ldo);
}

// The last panel when N is not a multiple of kPanel: its `cols` columns, a row at a time through
// a kPanel-column buffer, with the bias padded to the panel (it has only `cols` entries).
template <class Tiles>
void last_panel(const typename Tiles::T* x, int64_t ldx, int64_t M,
                const typename Tiles::T* panel, int64_t steps, const typename Tiles::T* bias,
                typename Tiles::T* out, int64_t ldo, int64_t cols) {
  using T = typename Tiles::T;
  alignas(64) T row[kPanel];
  alignas(64) T padded_bias[kPanel];
  for (int64_t j = 0; j < kPanel; ++j) padded_bias[j] = bias && j < cols ? bias[j] : T(0);
  for (int64_t m = 0; m < M; ++m) {
    Tiles::template run<1>(x + m * ldx, ldx, panel, steps, bias ? padded_bias : nullptr, row,
                           kPanel);
    std::copy(row, row + cols, out + m * ldo);
  }
}

// y[M, N] over every panel, the threads splitting the panels. `panel_size`: elements per panel.
template <class Tiles>
void all_panels(const typename Tiles::T* x, int64_t ldx, int64_t M,
                const typename Tiles::T* packed, int64_t panel_size, int64_t steps, int64_t N,
                const typename Tiles::T* bias, typename Tiles::T* out) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kPanel, cols = std::min(kPanel, N - n);
      const auto* panel = packed + b * panel_size;
      const auto* bn = bias ? bias + n : nullptr;
      if (cols == kPanel)
        full_panel<Tiles>(x, ldx, M, panel, steps, bn, out + n, N);
      else
        last_panel<Tiles>(x, ldx, M, panel, steps, bn, out + n, N, cols);
    }
  });
}

#endif  // PDSERVE_SMALL_GEMM

bool bf16_available() {
#ifdef PDSERVE_SMALL_GEMM_BF16
  return true;
#else
  return false;
#endif
}

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == at::kFloat ||
                   (w.scalar_type() == at::kBFloat16 && bf16_available())),
              "weight must be a float32 (or, with AVX512-BF16, bfloat16) [out_features, "
              "in_features] CPU tensor");
}

// Packs W [N, K] into `packed` [panels, steps, kPanel * group]: element (b, s, j * group + g) is
// W[b * kPanel + j, s * group + g], zero past N or K (group 1 for float32, 2 for bfloat16).
// Each weight row is read in runs of kPackSteps steps while the panel's slice they land in
// (kPackSteps * kPanel * group elements, at most 12 KiB) stays in L1: reading the rows' elements one
// step at a time, across rows, ran at a quarter of a copy's speed and was most of an engine's
// build on 2 cores.
template <typename T, int64_t kGroup>
void pack_panels(const at::Tensor& w, at::Tensor& packed) {
  constexpr int64_t kPackSteps = 64, kStride = kPanel * kGroup;
  const int64_t N = w.size(0), K = w.size(1), panels = packed.size(0), steps = packed.size(1);
  const int64_t full_steps = K / kGroup;  // steps with no k past K
  const T* src = w.data_ptr<T>();
  T* dst = packed.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t s0 = 0; s0 < steps; s0 += kPackSteps)
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t n = b * kPanel + j, s1 = std::min(steps, s0 + kPackSteps);
          const int64_t copied = n < N ? std::min(s1, full_steps) : s0;  // the rest are zeros
          T* out = dst + b * steps * kStride + j * kGroup;
          const T* row = src + std::min(n, N - 1) * K;  // read only where n < N
          for (int64_t s = s0; s < copied; ++s)
            for (int64_t g = 0; g < kGroup; ++g) out[s * kStride + g] = row[s * kGroup + g];
          for (int64_t s = std::max(s0, copied); s < s1; ++s)
            for (int64_t g = 0; g < kGroup; ++g) {
              const int64_t k = s * kGroup + g;
              out[s * kStride + g] = n < N && k < K ? row[k] : T(0);
            }
        }
  });
}

}  // namespace

bool available() {
#ifdef PDSERVE_SMALL_GEMM
  return true;
#else
  return false;
#endif
}

// W [N, K] -> float32 panels [ceil(N / kPanel), K, kPanel], or bfloat16 ones
// [ceil(N / kPanel), ceil(K / 2), kPanel * 2]; columns past N (and a k past K) are zeros.
at::Tensor pack(at::Tensor w) {
  check_weight(w);
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  if (w.scalar_type() == at::kBFloat16) {
    at::Tensor packed = at::detail::empty_cpu({panels, (K + 1) / 2, kPanel * 2}, w.options());
    pack_panels<at::BFloat16, 2>(w, packed);
    return packed;
  }
  at::Tensor packed = at::detail::empty_cpu({panels, K, kPanel}, w.options());
  pack_panels<float, 1>(w, packed);
  return packed;
}

namespace {

// x's rows as the kernel reads them: unit column stride, and for bfloat16 an even row length
// (the pair loads would read past an odd one), a zero column appended to an odd one.
at::Tensor kernel_rows(const at::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  if (!bf16 || rows.size(1) % 2 == 0) return rows;
  const int64_t M = rows.size(0), K = rows.size(1), width = K + K % 2;
  at::Tensor even = at::detail::empty_cpu({M, width}, x.options());
  for (int64_t m = 0; m < M; ++m) {
    const at::BFloat16* src = rows.data_ptr<at::BFloat16>() + m * rows.stride(0);
    at::BFloat16* dst = even.data_ptr<at::BFloat16>() + m * width;
    std::copy(src, src + K, dst);
    if (width > K) dst[K] = at::BFloat16(0);
  }
  return even;
}

}  // namespace

// y = x W^T (+ bias) for x [M, K] of the weight's dtype (rows may be strided), `packed` from
// pack(W) of a W [out_features, in_features] (a bfloat16 packing holds K rounded up to even, so
// in_features is passed, not read from it).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  int64_t in_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "this build has no AVX2 + FMA small-row GEMM");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == packed.scalar_type() &&
                  (x.scalar_type() == at::kFloat || bf16),
              "x must be a [rows, in_features] CPU tensor of the weight's dtype (float32 or "
              "bfloat16)");
  const int64_t K = x.size(1), N = out_features, group = bf16 ? 2 : 1;
  TORCH_CHECK(K == in_features, "x has ", K, " columns, the weight's in_features is ", in_features);
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kPanel * group &&
                  packed.size(1) == (K + group - 1) / group &&
                  packed.size(0) * kPanel >= out_features && packed.is_contiguous(),
              "packed must come from pack() of a weight with x's in_features");
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == x.scalar_type() &&
                    bias->numel() == N && bias->is_contiguous(),
                "bias must be a contiguous [out_features] CPU tensor of x's dtype");
  const at::Tensor rows = kernel_rows(x);
  const int64_t M = rows.size(0), ldx = rows.stride(0);
  at::Tensor out = at::detail::empty_cpu({M, N}, x.options());
  const int64_t panel_size = packed.size(1) * packed.size(2);
#ifdef PDSERVE_SMALL_GEMM_BF16
  if (bf16) {
    using T = at::BFloat16;
    all_panels<Bf16Tiles>(rows.data_ptr<T>(), ldx, M, packed.data_ptr<T>(), panel_size,
                          packed.size(1), N, bias ? bias->data_ptr<T>() : nullptr,
                          out.data_ptr<T>());
    return out;
  }
#endif
#ifdef PDSERVE_SMALL_GEMM
  all_panels<F32Tiles>(rows.data_ptr<float>(), ldx, M, packed.data_ptr<float>(), panel_size, K,
                       N, bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>());
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX2 + FMA kernel");
  m.def("bf16_available", &bf16_available, "whether it has the AVX512-BF16 bfloat16 kernel");
  m.def("panel_width", []() { return kPanel; }, "output columns per packed panel (24 or 48)");
  m.def("max_tile_rows", []() { return kMaxRows; },
        "rows per tile (4 with AVX2, 8 with AVX-512)");
  m.def("pack", &pack, "a weight [N, K] packed into panels of output columns");
  m.def("linear", &linear, "x W^T (+ bias) from the packed weight, for few rows (CPU)");
}
