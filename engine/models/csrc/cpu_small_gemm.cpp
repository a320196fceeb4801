// float32 linear layers at few rows (decode steps of 1-24 sequences) on AVX2 + FMA CPUs:
// y[M, N] = x[M, K] W[N, K]^T (+ bias), W packed once into panels of 24 output columns,
// [ceil(N / 24), K, 24], each panel one contiguous stream of K * 96 bytes.
//
// At few rows a decode step's linears are bound by streaming the weights from memory. oneDNN's
// blocked fp32 GEMM reached 45-65% of that bound at 1-16 rows on an AVX2 machine (AMD EPYC Zen 3,
// 2 threads); this kernel streams each panel once per 4 rows with every load feeding 4-12 FMAs:
// 4 rows x 3 vectors of 8 columns in 12 accumulators, the panel row (3 loads) shared by the 4
// rows and each x element broadcast once. Threads split the panels.
//
// Sums run over k in order, one FMA per step, in float32: not bitwise the order of any BLAS (no
// GEMM promises one), within float32 rounding of it (the tests bound it).

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

constexpr int64_t kPanel = 24;  // output columns per panel: 3 AVX2 vectors

#ifdef PDSERVE_SMALL_GEMM

inline void store_row(float* out, __m256 a, __m256 b, __m256 c, const float* bias) {
  if (bias != nullptr) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(bias));
    b = _mm256_add_ps(b, _mm256_loadu_ps(bias + 8));
    c = _mm256_add_ps(c, _mm256_loadu_ps(bias + 16));
  }
  _mm256_storeu_ps(out, a);
  _mm256_storeu_ps(out + 8, b);
  _mm256_storeu_ps(out + 16, c);
}

// out[MT, 24] = x[MT, K] panel[K, 24] (+ bias), MT <= 4. The 12 accumulators are named
// variables, not an array: with an array GCC kept them in memory through the k loop in some
// builds (a store per FMA, 1.5x slower at 8-24 rows).
template <int MT>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                 float* out, int64_t ldo) {
  static_assert(MT >= 1 && MT <= 4, "1-4 rows per tile");
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, a1 = zero, a2 = zero, b0 = zero, b1 = zero, b2 = zero;
  __m256 c0 = zero, c1 = zero, c2 = zero, d0 = zero, d1 = zero, d2 = zero;
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * kPanel;
    const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8),
                 w2 = _mm256_loadu_ps(p + 16);
    const __m256 xa = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xa, w0, a0);
    a1 = _mm256_fmadd_ps(xa, w1, a1);
    a2 = _mm256_fmadd_ps(xa, w2, a2);
    if constexpr (MT > 1) {
      const __m256 xb = _mm256_broadcast_ss(x + ldx + k);
      b0 = _mm256_fmadd_ps(xb, w0, b0);
      b1 = _mm256_fmadd_ps(xb, w1, b1);
      b2 = _mm256_fmadd_ps(xb, w2, b2);
    }
    if constexpr (MT > 2) {
      const __m256 xc = _mm256_broadcast_ss(x + 2 * ldx + k);
      c0 = _mm256_fmadd_ps(xc, w0, c0);
      c1 = _mm256_fmadd_ps(xc, w1, c1);
      c2 = _mm256_fmadd_ps(xc, w2, c2);
    }
    if constexpr (MT > 3) {
      const __m256 xd = _mm256_broadcast_ss(x + 3 * ldx + k);
      d0 = _mm256_fmadd_ps(xd, w0, d0);
      d1 = _mm256_fmadd_ps(xd, w1, d1);
      d2 = _mm256_fmadd_ps(xd, w2, d2);
    }
  }
  store_row(out, a0, a1, a2, bias);
  if constexpr (MT > 1) store_row(out + ldo, b0, b1, b2, bias);
  if constexpr (MT > 2) store_row(out + 2 * ldo, c0, c1, c2, bias);
  if constexpr (MT > 3) store_row(out + 3 * ldo, d0, d1, d2, bias);
}

// Rows [0, M) of x against one full panel, 4 rows at a time (the panel stays in L1/L2).
void full_panel(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K,
                const float* bias, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4>(x + m * ldx, ldx, panel, K, bias, out + m * ldo, ldo);
  const float* xm = x + m * ldx;
  float* om = out + m * ldo;
  switch (M - m) {
    case 3: tile<3>(xm, ldx, panel, K, bias, om, ldo); break;
    case 2: tile<2>(xm, ldx, panel, K, bias, om, ldo); break;
    case 1: tile<1>(xm, ldx, panel, K, bias, om, ldo); break;
    default: break;
  }
}

// The last panel when N is not a multiple of 24: its `cols` columns, a row at a time through a
// 24-column buffer (bias added in the copy: it has only `cols` entries).
void last_panel(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K,
                const float* bias, float* out, int64_t ldo, int64_t cols) {
  alignas(32) float row[kPanel];
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

// W [N, K] -> panels [ceil(N / 24), K, 24]; the last panel's columns past N are zeros.
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
  m.def("pack", &pack, "a float32 weight [N, K] packed into panels of 24 output columns");
  m.def("linear", &linear, "x W^T (+ bias) from the packed weight, for few rows (CPU)");
}
