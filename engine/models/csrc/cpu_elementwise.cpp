// The decoder layer's element-wise chains as one native CPU kernel each (AVX-512 or AVX2):
// residual add + RMSNorm, RoPE on q and k in place, SiLU(gate) * up. The torch form runs 3-8
// small kernels per chain, each a pass over memory and a dispatch; at decode those were ~30% of a
// bf16 step.
//
// Every kernel rounds where the torch form (engine.models.elementwise, transformers' numerics)
// rounds, and computes each rounded value the way torch's CPU kernels do: products and sums in
// fp32 without contraction into FMA (built with -ffp-contract=off), bf16 by round-to-nearest-even,
// exp by the SLEEF routine torch's vectorized exp calls at the build's width (Sleef_expf16_u10 or
// Sleef_expf8_u10, exported by libtorch_cpu), the RMSNorm's sum of squares in the order of torch's
// sum kernel. So all three are bitwise equal to the torch form in float32 and bfloat16 (the tests
// check it).
//
// Without AVX-512 (F, BW, VL) or AVX2 the module builds but `available()` is false and the model
// keeps the torch form.

// Headers: only what the kernels use and the pybind11 tensor caster (<torch/extension.h>, the
// whole C++ frontend, took 35 s of a ~43 s build on 2 cores).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

// One vector register of fp32 lanes and the handful of operations the kernels need, for the
// widest instruction set the build targets: AVX-512 (16 lanes, masked tails) or AVX2 (8 lanes,
// tails through a small buffer). The kernels below are written once over this layer. Lane-wise
// IEEE products, sums and quotients do not depend on the width, and each build calls the SLEEF
// exp of its width, the one torch's own kernels call on such a machine.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDSERVE_ELEMENTWISE "avx512"
#include <immintrin.h>

extern "C" __m512 Sleef_expf16_u10(__m512);

namespace {

using vf = __m512;
constexpr int64_t kLanes = 16;

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// Loads and stores of a register's lanes, widened to fp32 / rounded back, `left` elements at most
// (the row's tail).
inline vf vload(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(tail_mask(left), p); }

inline vf vload(const at::BFloat16* p, int64_t left) {
  const __m256i raw = _mm256_maskz_loadu_epi16(tail_mask(left), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void vstore(float* p, vf x, int64_t left) { _mm512_mask_storeu_ps(p, tail_mask(left), x); }

// Round to nearest even, NaN kept quiet: c10::BFloat16's conversion, in integer operations.
inline __m512i bf16_bits(vf x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
}

// The 16 lanes as bf16 bits. With AVX512-BF16 one vcvtneps2bf16 rounds to nearest even, where
// the integer form takes eight operations (bf16 element-wise chains ran 1.6-2x the time of
// float32 ones for it). That instruction reads denormal inputs as zero and quiets a NaN keeping
// its sign and payload, where c10 gives a denormal's rounding and 0x7FC0: a vector holding
// either (one fpclass test finds them) takes the integer form, so every value keeps its bits.
inline __m256i bf16_pack(vf x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signalling NaN
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, kNanOrDenormal) == 0, 1))
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#endif
  return _mm512_cvtepi32_epi16(bf16_bits(x));
}

inline void vstore(at::BFloat16* p, vf x, int64_t left) {
  _mm256_mask_storeu_epi16(p, tail_mask(left), bf16_pack(x));
}

inline vf bf16_round(vf x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(x)), 16));
}
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vexp(vf x) { return Sleef_expf16_u10(x); }

}  // namespace

#elif defined(__AVX2__)
#define PDSERVE_ELEMENTWISE "avx2"
#include <immintrin.h>

extern "C" __m256 Sleef_expf8_u10(__m256);

namespace {

using vf = __m256;
constexpr int64_t kLanes = 8;

inline vf vload_full(const float* p) { return _mm256_loadu_ps(p); }

inline vf vload_full(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Round to nearest even, NaN kept quiet: c10::BFloat16's conversion.
inline __m256i bf16_bits(vf x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

inline void vstore_full(float* p, vf x) { _mm256_storeu_ps(p, x); }

inline void vstore_full(at::BFloat16* p, vf x) {
  // 8 x 32-bit holding 16-bit values -> 8 x 16-bit: packus works within 128-bit halves, the
  // permute brings both halves' results into the low 128 bits.
  const __m256i bits = bf16_bits(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// A row's tail (fewer than 8 elements left) goes through a zeroed buffer: AVX2 has no 16-bit
// masked loads and stores.
template <typename T>
inline vf vload(const T* p, int64_t left) {
  if (left >= kLanes) return vload_full(p);
  alignas(32) T tmp[kLanes] = {};
  std::memcpy(tmp, p, size_t(left) * sizeof(T));
  return vload_full(tmp);
}

template <typename T>
inline void vstore(T* p, vf x, int64_t left) {
  if (left >= kLanes) return vstore_full(p, x);
  alignas(32) T tmp[kLanes];
  vstore_full(tmp, x);
  std::memcpy(p, tmp, size_t(left) * sizeof(T));
}

inline vf bf16_round(vf x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vexp(vf x) { return Sleef_expf8_u10(x); }

}  // namespace
#endif

#ifdef PDSERVE_ELEMENTWISE
namespace {

// Element-wise work below this many elements runs on the calling thread: at decode sizes a
// parallel region costs more than it saves.
constexpr int64_t kParallelElements = 32768;

inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kParallelElements / cols); }

// The value a store to T would hold, back in fp32: where the torch form materialises a tensor.
template <typename T>
inline vf round_to(vf x);

template <>
inline vf round_to<float>(vf x) { return x; }

template <>
inline vf round_to<at::BFloat16>(vf x) { return bf16_round(x); }

// 8 lanes widened to fp32: the width torch's reductions run at (below).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The sum of x*x over a row, added in exactly the order of torch's CPU sum over a contiguous last
// dim (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum),
// so `x.pow(2).mean(-1)` of the torch form is reproduced bit for bit. Its kernel is registered
// without an AVX-512 variant, so it runs on 8-lane vectors even on AVX-512 machines: 8-lane
// vectors in four interleaved accumulators with a four-level cascade every 16 steps, the leftover
// vectors into the first, the four combined in order, then the scalar tail, then the lanes in
// order. (The tests check the bits against torch.)
template <typename T>
float torch_order_sum_of_squares(const T* x, int64_t n) {
  constexpr int kLanes = 8, kIlp = 4, kLevels = 4, kLevelPower = 4;  // max(4, CeilLog2(size) / 4)
  const int64_t vectors = n / kLanes, groups = vectors / kIlp;
  auto square = [&](int64_t v) {
    const __m256 a = load8(x + v * kLanes);
    return _mm256_mul_ps(a, a);
  };
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  const int64_t step = int64_t(1) << kLevelPower, mask = step - 1;
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(i * kIlp + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (j * kLevelPower))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(i * kIlp + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = groups * kIlp; v < vectors; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], square(v));
  for (int k = 1; k < kIlp; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t c = vectors * kLanes; c < n; ++c) {
    const float f = static_cast<float>(x[c]);
    total += f * f;
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc[0][0]);
  for (float lane : lanes) total += lane;
  return total;
}

// residual = h + delta (rounded to T); out = T(T(residual * rstd) * weight) with rstd =
// 1 / sqrt(mean(residual^2) + eps) in fp32: transformers' LlamaRMSNorm after the residual add.
template <typename T>
void add_rms_norm_row(const T* h, const T* delta, const T* weight, T* residual, T* out,
                      int64_t cols, float eps) {
  if (delta != nullptr) {
    for (int64_t c = 0; c < cols; c += kLanes)
      vstore(residual + c, vadd(vload(h + c, cols - c), vload(delta + c, cols - c)), cols - c);
  }
  const T* x_row = delta != nullptr ? residual : h;
  const float mean = torch_order_sum_of_squares(x_row, cols) / float(cols);
  const vf rstd = vset1(1.0f / std::sqrt(mean + eps));
  for (int64_t c = 0; c < cols; c += kLanes) {
    const vf normed = round_to<T>(vmul(vload(x_row + c, cols - c), rstd));
    vstore(out + c, vmul(normed, vload(weight + c, cols - c)), cols - c);
  }
}

// One token's heads in place: x1' = T(T(x1 * cos1) - T(x2 * sin1)), x2' = T(T(x2 * cos2) +
// T(x1 * sin2)): `x * cos + rotate_half(x) * sin` with its three roundings.
template <typename T>
void rope_token(T* x, int64_t heads, int64_t head_dim, const T* cos, const T* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* row = x + hd * head_dim;
    for (int64_t c = 0; c < half; c += kLanes) {
      const int64_t left = half - c;
      const vf x1 = vload(row + c, left), x2 = vload(row + half + c, left);
      const vf a1 = round_to<T>(vmul(x1, vload(cos + c, left)));
      const vf b1 = round_to<T>(vmul(x2, vload(sin + c, left)));
      const vf a2 = round_to<T>(vmul(x2, vload(cos + half + c, left)));
      const vf b2 = round_to<T>(vmul(x1, vload(sin + half + c, left)));
      vstore(row + c, vsub(a1, b1), left);
      vstore(row + half + c, vadd(a2, b2), left);
    }
  }
}

// out = T(T(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) as torch's vectorized kernel has it.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t cols) {
  const vf one = vset1(1.0f);
  for (int64_t c = 0; c < cols; c += kLanes) {
    const vf g = vload(gate + c, cols - c);
    const vf e = vexp(vsub(vset1(0.0f), g));
    const vf silu = round_to<T>(vdiv(g, vadd(one, e)));
    vstore(out + c, vmul(silu, vload(up + c, cols - c)), cols - c);
  }
}

template <typename T>
void add_rms_norm_typed(const at::Tensor& h, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, at::Tensor& residual, at::Tensor& out,
                        double eps) {
  const int64_t rows = h.size(0), cols = h.size(1);
  const T* hp = h.data_ptr<T>();
  const T* dp = delta.has_value() ? delta->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      add_rms_norm_row(hp + r * cols, dp ? dp + r * cols : nullptr, wp, rp + r * cols,
                       op + r * cols, cols, float(eps));
  });
}

template <typename T>
void rope_typed(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), stride = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) rope_token(xp + t * stride, heads, dim, cp + t * dim, sp + t * dim);
  });
}

template <typename T>
void silu_mul_typed(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), cols = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      silu_mul_row(gp + r * 2 * cols, gp + r * 2 * cols + cols, op + r * cols, cols);
  });
}

void check_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

}  // namespace

// (h + delta, rms_norm(h + delta) * weight) for h [rows, hidden]; delta None: (h, rms_norm(h) *
// weight).
std::vector<at::Tensor> add_rms_norm(at::Tensor h, c10::optional<at::Tensor> delta,
                                     at::Tensor weight, double eps) {
  check_dtype(h, "h");
  TORCH_CHECK(h.dim() == 2, "h must be [rows, hidden]");
  h = h.contiguous();
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(),
                "delta must match h");
    delta = delta->contiguous();
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) &&
                  weight.scalar_type() == h.scalar_type() && weight.is_contiguous(),
              "weight must be a contiguous [hidden] vector of h's dtype");
  // h is contiguous here: these are what torch::empty_like(h) gives it
  at::Tensor out = at::detail::empty_cpu(h.sizes(), h.options());
  at::Tensor residual = h;
  if (delta.has_value()) residual = at::detail::empty_cpu(h.sizes(), h.options());
  if (h.scalar_type() == at::kFloat)
    add_rms_norm_typed<float>(h, delta, weight, residual, out, eps);
  else
    add_rms_norm_typed<at::BFloat16>(h, delta, weight, residual, out, eps);
  return {residual, out};
}

// RoPE (rotate-half form) in place on x [tokens, heads, head_dim] (each token's heads contiguous,
// tokens strided: a view of the fused qkv projection) with cos, sin [tokens, head_dim].
at::Tensor rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [tokens, heads, head_dim] with each token's heads contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  cos = cos.reshape({x.size(0), x.size(2)}).contiguous();
  sin = sin.reshape({x.size(0), x.size(2)}).contiguous();
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must have x's dtype");
  if (x.scalar_type() == at::kFloat)
    rope_typed<float>(x, cos, sin);
  else
    rope_typed<at::BFloat16>(x, cos, sin);
  return x;
}

// The fused projection qkv [tokens, (heads + 2 kv_heads) * head_dim] split into q, k, v views
// ([tokens, heads or kv_heads, head_dim]), q and k rotated in place: the torch form's split and
// views were ~6 tensor ops a layer from Python (~20 us at decode), here one call.
std::vector<at::Tensor> rope_qkv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * head_dim,
              "qkv must be [tokens, (heads + 2 kv_heads) * head_dim] with contiguous rows");
  const int64_t tokens = qkv.size(0), row = qkv.stride(0);
  auto heads_view = [&](int64_t count, int64_t offset) {
    return qkv.as_strided({tokens, count, head_dim}, {row, head_dim, 1},
                          qkv.storage_offset() + offset);
  };
  rope_(heads_view(heads + kv_heads, 0), cos, sin);
  return {heads_view(heads, 0), heads_view(kv_heads, heads * head_dim),
          heads_view(kv_heads, (heads + kv_heads) * head_dim)};
}

// silu(gate) * up for gate_up [rows, 2 * I], gate first (the fused weight's layout).
at::Tensor silu_mul(at::Tensor gate_up) {
  check_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * I]");
  gate_up = gate_up.contiguous();
  at::Tensor out = at::detail::empty_cpu({gate_up.size(0), gate_up.size(1) / 2},
                                          gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_mul_typed<float>(gate_up, out);
  else
    silu_mul_typed<at::BFloat16>(gate_up, out);
  return out;
}

#endif  // PDSERVE_ELEMENTWISE

bool available() {
#ifdef PDSERVE_ELEMENTWISE
  return true;
#else
  return false;
#endif
}

// The instruction set the kernels were built for: "avx512", "avx2", or "" where none.
std::string isa() {
#ifdef PDSERVE_ELEMENTWISE
  return PDSERVE_ELEMENTWISE;
#else
  return "";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the vector kernels (AVX-512 or AVX2)");
  m.def("isa", &isa, "the instruction set the kernels were built for");
#ifdef PDSERVE_ELEMENTWISE
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (CPU)");
  m.def("rope_", &rope_, "RoPE in place (CPU)");
  m.def("rope_qkv", &rope_qkv, "q, k, v views of the fused projection, q and k rotated (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU)");
#endif
}
