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

// Headers: only what the kernel uses and the pybind11 tensor caster (see cpu_elementwise.cpp).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_SMALL_GEMM 1
#include <immintrin.h>
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

#ifdef PDSERVE_SMALL_GEMM

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
    PDSERVE_TILE_ROW(0) PDSERVE_TILE_ROW(1) PDSERVE_TILE_ROW(2) PDSERVE_TILE_ROW(3)
    PDSERVE_TILE_ROW(4) PDSERVE_TILE_ROW(5) PDSERVE_TILE_ROW(6) PDSERVE_TILE_ROW(7)
  }
  PDSERVE_TILE_STORE(0) PDSERVE_TILE_STORE(1) PDSERVE_TILE_STORE(2) PDSERVE_TILE_STORE(3)
  PDSERVE_TILE_STORE(4) PDSERVE_TILE_STORE(5) PDSERVE_TILE_STORE(6) PDSERVE_TILE_STORE(7)
}

// The remaining 1 .. kMaxRows - 1 rows of a panel, as one tile of that many.
template <int MT = kMaxRows - 1>
inline void tail_tile(int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                      const float* bias, float* out, int64_t ldo) {
  if constexpr (MT >= 1) {
    if (rows == MT) return tile<MT>(x, ldx, panel, K, bias, out, ldo);
    tail_tile<MT - 1>(rows, x, ldx, panel, K, bias, out, ldo);
  }
}

// Rows [0, M) of x against one full panel, kMaxRows rows at a time (the panel stays in L1/L2).
void full_panel(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K,
                const float* bias, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows)
    tile<kMaxRows>(x + m * ldx, ldx, panel, K, bias, out + m * ldo, ldo);
  tail_tile(static_cast<int>(M - m), x + m * ldx, ldx, panel, K, bias, out + m * ldo, ldo);
}

// The last panel when N is not a multiple of kPanel: its `cols` columns, a row at a time through
// a kPanel-column buffer (bias added in the copy: it has only `cols` entries).
void last_panel(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K,
                const float* bias, float* out, int64_t ldo, int64_t cols) {
  alignas(64) float row[kPanel];
  for (int64_t m = 0; m < M; ++m) {
    tile<1>(x + m * ldx, ldx, panel, K, nullptr, row, kPanel);
    for (int64_t j = 0; j < cols; ++j) out[m * ldo + j] = row[j] + (bias ? bias[j] : 0.f);
  }
}

#endif  // PDSERVE_SMALL_GEMM

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "weight must be a float32 [out_features, in_features] CPU tensor");
}

}  // namespace

bool available() {
#ifdef PDSERVE_SMALL_GEMM
  return true;
#else
  return false;
#endif
}

// W [N, K] -> panels [ceil(N / kPanel), K, kPanel]; the last panel's columns past N are
// zeros.
at::Tensor pack(at::Tensor w) {
  check_weight(w);
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::detail::empty_cpu({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t n = b * kPanel + j;
          dst[(b * K + k) * kPanel + j] = n < N ? src[n * K + k] : 0.f;
        }
  });
  return packed;
}

// y = x W^T (+ bias) for x [M, K] float32 (rows may be strided), `packed` from pack(W).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "this build has no AVX2 + FMA small-row GEMM");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a float32 [rows, in_features] CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
                  packed.size(0) * kPanel >= out_features && packed.is_contiguous(),
              "packed must come from pack() of a weight with x's in_features");
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), N = out_features;
  at::Tensor out = at::detail::empty_cpu({M, N}, x.options());
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "bias must be a contiguous float32 [out_features] tensor");
    bp = bias->data_ptr<float>();
  }
#ifdef PDSERVE_SMALL_GEMM
  const float* xp = rows.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = rows.stride(0), panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kPanel, cols = std::min(kPanel, N - n);
      const float* panel = pp + b * K * kPanel;
      const float* bn = bp ? bp + n : nullptr;
      if (cols == kPanel)
        full_panel(xp, ldx, M, panel, K, bn, op + n, N);
      else
        last_panel(xp, ldx, M, panel, K, bn, op + n, N, cols);
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX2 + FMA kernel");
  m.def("panel_width", []() { return kPanel; }, "output columns per packed panel (24 or 48)");
  m.def("max_tile_rows", []() { return kMaxRows; },
        "rows per tile (4 with AVX2, 8 with AVX-512)");
  m.def("pack", &pack, "a float32 weight [N, K] packed into panels of output columns");
  m.def("linear", &linear, "x W^T (+ bias) from the packed weight, for few rows (CPU)");
}
