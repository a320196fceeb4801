// Each row's argmax as torch's `argmax(dim=-1)` answers it (the first index of the maximum; a row
// holding NaN answers its first NaN, which torch counts as the maximum), for float32 and bfloat16
// rows with AVX-512: one pass for the row's maximum (and whether it holds a NaN), a second for
// the first lane equal to it, the row still in cache. bfloat16 rows are read as they are: their
// widening to float32 is exact and keeps the order, so the sampler need not widen a step's whole
// logits ([64, 49152] took 0.5-2.6 ms of a bf16 decode step) to pick its greedy tokens.
// Without AVX-512 (F, BW) the module builds but `available()` is false and engine.row_argmax
// keeps its torch form.

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PDSERVE_ROW_ARGMAX 1
#include <immintrin.h>

namespace {

inline __mmask16 lanes_left(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// 16 values as float32 (lanes past `left` hold -inf: never above a row's maximum, never NaN).
inline __m512 load16(const float* p, int64_t left) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes_left(left), p);
}

inline __m512 load16(const at::BFloat16* p, int64_t left) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes_left(left), p);
  const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), lanes_left(left), x);
}

template <typename T>
int64_t first_nan(const T* row, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c)
    if (std::isnan(static_cast<float>(row[c]))) return c;
  return -1;
}

// The row's maximum over four independent accumulators; `nan` set where any value is NaN.
template <typename T>
float row_max(const T* row, int64_t cols, bool& nan) {
  __m512 m[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                 _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
  __mmask16 unordered = 0;
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64)
    for (int i = 0; i < 4; ++i) {
      const __m512 x = load16(row + c + 16 * i, 16);
      unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      m[i] = _mm512_max_ps(m[i], x);
    }
  for (; c < cols; c += 16) {
    const __m512 x = load16(row + c, cols - c);
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    m[0] = _mm512_max_ps(m[0], x);
  }
  nan = unordered != 0;
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
}

template <typename T>
int64_t argmax_row(const T* row, int64_t cols) {
  bool nan = false;
  const float best = row_max(row, cols, nan);
  if (nan) return first_nan(row, cols);
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 hit =
        _mm512_cmp_ps_mask(load16(row + c, cols - c), target, _CMP_EQ_OQ) & lanes_left(cols - c);
    if (hit) return c + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the maximum is one of the row's values
}

template <typename T>
void argmax_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1), stride = x.stride(0);
  const T* base = x.data_ptr<T>();
  int64_t* index = out.data_ptr<int64_t>();
  // One row of the default model's vocabulary is ~25 us: rows are split between threads where
  // the work is more than a parallel region's start.
  const int64_t grain = std::max<int64_t>(1, 32768 / cols);
  at::parallel_for(0, rows, grain, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) index[r] = argmax_row(base + r * stride, cols);
  });
}

}  // namespace

// x: [rows, cols] float32 or bfloat16, cols >= 1, the last dim unit-stride -> int64 [rows].
at::Tensor row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && x.stride(1) == 1,
              "x must be [rows, cols >= 1] with unit-stride rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  at::Tensor out = at::detail::empty_cpu({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat)
    argmax_rows<float>(x, out);
  else
    argmax_rows<at::BFloat16>(x, out);
  return out;
}

#endif  // AVX-512

bool available() {
#ifdef PDSERVE_ROW_ARGMAX
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX-512 kernel");
#ifdef PDSERVE_ROW_ARGMAX
  m.def("row_argmax", &row_argmax, "each row's argmax, torch's answer (CPU)");
#endif
}
