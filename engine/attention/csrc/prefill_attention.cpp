// Causal prefill attention for CPU: one sequence's queries (a whole prompt, or a chunk after a
// cached prefix) against its contiguous keys and values, bottom-right causal, with an optional
// sliding window. Flash-attention style: per work item (one KV head's query group x a tile of
// query positions) the scores of 32 keys at a time, a running max / sum per query row (online
// softmax, in the log2 domain so the exponential is exp2) and the V accumulation, all in fp32,
// with no score matrix over the whole sequence.
//
// SDPA's CPU flash kernel reaches ~48 GFLOP/s on SmolLM2's 256-token bf16 prompts here (Zen 4,
// 2 threads), against ~350 for the linear layers: attention was a quarter of a prefill. This
// kernel multiplies with the CPU's bf16 dot-product instruction (vdpbf16ps: two bf16 products
// summed into an fp32 lane) in the bf16 model, and with fp32 FMAs in the fp32 model, both on
// AVX-512. Keys and values are first repacked, once per call, into the pair-interleaved layout
// vdpbf16ps reads (K: for each pair of head dims, 32 keys; V: for each pair of keys, every head
// dim), so the inner loops are broadcast + vector dot products with every accumulator in a
// register. Probabilities are rounded to bf16 before the V product in the bf16 model, as SDPA's
// bf16 flash kernel does. On AVX2 (+FMA) machines without AVX-512 the fp32 model runs the same
// tiles on 8-lane registers (scores through a small buffer: 16 registers do not hold a tile's);
// bf16 there stays with SDPA (no bf16 arithmetic). Where the build has AMX (Intel Xeon since
// Sapphire Rapids) the bf16 model's two products run on the AMX tiles instead (prefill_amx.h),
// 16 rows x 32 keys per tile product, from the same packed keys and values; the softmax is the
// same code.
//
// Masked lanes use a large finite negative rather than -inf (the build uses -ffast-math), and
// their probabilities are zeroed by mask, so a row whose keys so far were all masked adds nothing.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "prefill_amx.h"
#include "vec_math.h"

#if defined(__AVX512F__)
#define PREFILL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PREFILL_AVX2 1
#endif

namespace {

#if defined(PREFILL_AVX512) || defined(PREFILL_AVX2)

using bf16 = c10::BFloat16;
constexpr int kQ = 16;     // query positions per work item
constexpr int kKeys = 32;  // keys per online-softmax step: two zmm of scores per row
constexpr int kRows = 8;   // query rows whose scores are computed together (16 accumulators)
constexpr float kNeg = -1e30f;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t lq, len, heads, kv, group;
  int64_t q_row, k_row, v_row, o_row;  // strides between positions, in elements
  float scale_log2;
  int64_t window;  // 0: none
  int64_t chunks;  // ceil(len / kKeys)
  T* kp;           // packed keys   [kv][chunks][chunk elements]
  T* vp;           // packed values [kv][chunks][chunk elements]
};

// Packed chunk layouts (kKeys keys x D dims; keys past the sequence are zeros):
//   bf16 K: [D/2][kKeys][2]: 32-bit word (p, j) = dims 2p, 2p+1 of key j
//   bf16 V: [kKeys/2][D][2]: 32-bit word (jp, d) = dim d of keys 2jp, 2jp+1
//   fp32 K: [D][kKeys];  fp32 V: [kKeys][D]
template <typename T, int D>
void pack_chunk(const Problem<T>& a, int64_t g, int64_t c) {
  const int64_t first = c * kKeys, n = std::min<int64_t>(kKeys, a.len - first);
  T* kp = a.kp + (g * a.chunks + c) * kKeys * D;
  T* vp = a.vp + (g * a.chunks + c) * kKeys * D;
  std::memset(static_cast<void*>(kp), 0, sizeof(T) * kKeys * D);
  std::memset(static_cast<void*>(vp), 0, sizeof(T) * kKeys * D);
  for (int64_t j = 0; j < n; ++j) {
    const T* key = a.k + (first + j) * a.k_row + g * D;
    const T* val = a.v + (first + j) * a.v_row + g * D;
    if constexpr (sizeof(T) == 2) {
      for (int p = 0; p < D / 2; ++p) {
        kp[(p * kKeys + j) * 2] = key[2 * p];
        kp[(p * kKeys + j) * 2 + 1] = key[2 * p + 1];
      }
      for (int d = 0; d < D; ++d) vp[((j / 2) * D + d) * 2 + (j % 2)] = val[d];
    } else {
      for (int d = 0; d < D; ++d) kp[d * kKeys + j] = key[d];
      std::memcpy(vp + j * D, val, sizeof(T) * D);
    }
  }
}

// Rows of one work item: scores, then the running softmax; o holds the unnormalised outputs.
struct RowState {
  float* o;      // [rows][D]
  float* m;      // [rows] running max (log2 domain)
  float* l;      // [rows] running sum
  float* alpha;  // [rows] this chunk's rescale of o
  float* p;      // [rows][kKeys] probabilities (fp32 model)
  bf16* pb;      // [rows][kKeys] probabilities (bf16 model)
};

#if defined(PREFILL_AVX512)

// The scores of kRows rows for one chunk, in registers.
struct Scores {
  __m512 s[2 * kRows];
};
template <int D>
constexpr int kValueRows = D <= 64 ? 4 : 2;  // rows per V pass: kValueRows * D / 16 accumulators

// s[2r], s[2r + 1] = q_r . (keys 0-15, 16-31 of the chunk), for kRows rows.
#if defined(__AVX512BF16__)
template <int D>
inline void chunk_scores(const bf16* const* q, const bf16* kp, Scores& sc) {
  __m512* s = sc.s;
  for (int i = 0; i < 2 * kRows; ++i) s[i] = _mm512_setzero_ps();
  const uint32_t* words = reinterpret_cast<const uint32_t*>(kp);
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(words + p * kKeys);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(words + p * kKeys + 16);
    for (int r = 0; r < kRows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q[r] + 2 * p, sizeof(pair));
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      s[2 * r] = _mm512_dpbf16_ps(s[2 * r], qb, k0);
      s[2 * r + 1] = _mm512_dpbf16_ps(s[2 * r + 1], qb, k1);
    }
  }
}

#endif  // __AVX512BF16__

template <int D>
inline void chunk_scores(const float* const* q, const float* kp, Scores& sc) {
  __m512* s = sc.s;
  for (int i = 0; i < 2 * kRows; ++i) s[i] = _mm512_setzero_ps();
  for (int p = 0; p < D; ++p) {
    const __m512 k0 = _mm512_loadu_ps(kp + p * kKeys);
    const __m512 k1 = _mm512_loadu_ps(kp + p * kKeys + 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r][p]);
      s[2 * r] = _mm512_fmadd_ps(qb, k0, s[2 * r]);
      s[2 * r + 1] = _mm512_fmadd_ps(qb, k1, s[2 * r + 1]);
    }
  }
}

// Lane r (0..7) of the result = op over the 16 lanes of v[r]: a transposing tree (the decode
// kernel's reduce16, for 8 rows) instead of 8 horizontal reductions, each a chain of dependent
// shuffles.
template <class Op>
inline __m512 reduce_rows8(const __m512* v, Op op) {
  __m512 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // 128-bit chunks: v2i (c0 c2, c1 c3), v2i+1 (c0 c2, c1 c3)
    a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 2; ++j)  // chunk k of b[j] now holds 4 partials of v[4j + k]
    b[j] = op(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
              _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
  const __m512 c = op(_mm512_shuffle_ps(b[0], b[1], 0x44), _mm512_shuffle_ps(b[0], b[1], 0xEE));
  const __m512 d = op(c, _mm512_shuffle_ps(c, c, 0xB1));
  // Chunk k of d: lanes 0, 1 = v[k]; lanes 2, 3 = v[4 + k].
  const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, d);
}

// The chunk's scores of kRows rows with the keys a row does not see (past `limit[r]` or before
// `start[r]`) masked to kNeg, and those keys in vis. Most chunks are seen whole by every row:
// only the diagonal and a window's edge need masks.
inline void visible_scores(const Scores& sc, int64_t first, const int64_t* limit,
                           const int64_t* start, __m512* x, __mmask16* vis) {
  bool whole = true;
  for (int r = 0; r < kRows; ++r)
    whole = whole && first + kKeys - 1 <= limit[r] && first >= start[r];
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < 2 * kRows; ++i) {
    x[i] = sc.s[i];
    vis[i] = 0xFFFF;
    if (whole) continue;
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(
                                                   static_cast<int>(first + 16 * (i % 2))));
    vis[i] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(limit[i / 2]))) &
             _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(start[i / 2])));
    x[i] = _mm512_mask_mov_ps(_mm512_set1_ps(kNeg), vis[i], x[i]);
  }
}

// Folds one chunk's scores into the running max / sum of kRows rows starting at `row` and writes
// their probabilities. The rows' maxima, rescale factors and sums are taken 8 rows at a time
// across registers: the kernel ran 1.25-1.29x (fp32) and 1.15-1.25x (bf16) the speed of one row
// at a time, 128-512 queries (Zen 4; benchmarks.prefill_attention_forms --against 4a6ab53). The
// scale is applied inside the exponent's FMA (scale > 0 keeps the max where it is).
inline void softmax_step(const Scores& sc, int64_t row, int64_t first, const int64_t* limit,
                         const int64_t* start, float scale, RowState& st) {
  static_assert(kRows == 8, "reduce_rows8 takes 8 rows");
  __m512 x[2 * kRows], part[kRows];
  __mmask16 vis[2 * kRows];
  visible_scores(sc, first, limit, start, x, vis);
  for (int r = 0; r < kRows; ++r) part[r] = _mm512_max_ps(x[2 * r], x[2 * r + 1]);
  const __m512 mx = reduce_rows8(part, [](__m512 u, __m512 w) { return _mm512_max_ps(u, w); });
  const __mmask16 eight = 0xFF;
  const __m512 sl2 = _mm512_set1_ps(scale), m_old = _mm512_maskz_loadu_ps(eight, st.m + row);
  const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx, sl2));
  const __m512 alpha = exp2_ps(_mm512_sub_ps(m_old, m_new));
  _mm512_mask_storeu_ps(st.m + row, eight, m_new);
  _mm512_mask_storeu_ps(st.alpha + row, eight, alpha);
  alignas(64) float top[16];
  _mm512_store_ps(top, m_new);
  for (int r = 0; r < kRows; ++r) {
    const __m512 shift = _mm512_set1_ps(-top[r]);
    const __m512 e0 = _mm512_maskz_mov_ps(vis[2 * r],
                                          exp2_ps(_mm512_fmadd_ps(x[2 * r], sl2, shift)));
    const __m512 e1 = _mm512_maskz_mov_ps(vis[2 * r + 1],
                                          exp2_ps(_mm512_fmadd_ps(x[2 * r + 1], sl2, shift)));
    part[r] = _mm512_add_ps(e0, e1);
#if defined(__AVX512BF16__)
    if (st.pb != nullptr) {
      _mm512_storeu_si512(st.pb + (row + r) * kKeys, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      continue;
    }
#endif
    _mm512_storeu_ps(st.p + (row + r) * kKeys, e0);
    _mm512_storeu_ps(st.p + (row + r) * kKeys + 16, e1);
  }
  const __m512 sums = reduce_rows8(part, [](__m512 u, __m512 w) { return _mm512_add_ps(u, w); });
  const __m512 l_old = _mm512_maskz_loadu_ps(eight, st.l + row);
  _mm512_mask_storeu_ps(st.l + row, eight, _mm512_fmadd_ps(l_old, alpha, sums));
}

// The unnormalised outputs of RB rows into registers, rescaled by this chunk's alpha; and back.
template <int D, int RB>
inline void load_rescaled(const RowState& st, int64_t row, __m512 (&o)[RB][D / 16]) {
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < D / 16; ++c)
      o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(st.o + (row + r) * D + 16 * c),
                              _mm512_set1_ps(st.alpha[row + r]));
}

template <int D, int RB>
inline void store_rows(RowState& st, int64_t row, const __m512 (&o)[RB][D / 16]) {
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(st.o + (row + r) * D + 16 * c, o[r][c]);
}

// o[r] = o[r] * alpha[r] + p[r] . V_chunk for RB rows starting at `row`.
#if defined(__AVX512BF16__)
template <int D, int RB>
inline void chunk_values(const bf16* vp, int64_t row, RowState& st) {
  constexpr int C = D / 16;
  __m512 o[RB][C];
  load_rescaled<D, RB>(st, row, o);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(vp);
  for (int jp = 0; jp < kKeys / 2; ++jp) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(words + jp * D + 16 * c);
    for (int r = 0; r < RB; ++r) {
      uint32_t pair;
      std::memcpy(&pair, st.pb + (row + r) * kKeys + 2 * jp, sizeof(pair));
      const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pw, v[c]);
    }
  }
  store_rows<D, RB>(st, row, o);
}

#endif  // __AVX512BF16__

template <int D, int RB>
inline void chunk_values(const float* vp, int64_t row, RowState& st) {
  constexpr int C = D / 16;
  __m512 o[RB][C];
  load_rescaled<D, RB>(st, row, o);
  for (int j = 0; j < kKeys; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vp + j * D + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 pj = _mm512_set1_ps(st.p[(row + r) * kKeys + j]);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(pj, v[c], o[r][c]);
    }
  }
  store_rows<D, RB>(st, row, o);
}

#else  // PREFILL_AVX2: fp32 only, on 8 lanes

// The scores of kRows rows for one chunk, in memory: a tile's 8 x 32 scores would take all 16
// registers. They stay in L1 between the two passes.
struct Scores {
  alignas(32) float s[kRows * kKeys];  // [row][key]
};
template <int D>
constexpr int kValueRows = 2;  // rows per V pass, over 32 columns at a time: 8 accumulators

// s[r][j] = q_r . key j for kRows rows: 4 rows x 16 keys at a time (8 accumulators).
template <int D>
inline void chunk_scores(const float* const* q, const float* kp, Scores& sc) {
  for (int r0 = 0; r0 < kRows; r0 += 4) {
    for (int h = 0; h < kKeys; h += 16) {
      __m256 acc[4][2];
      for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
      for (int p = 0; p < D; ++p) {
        const __m256 k0 = _mm256_loadu_ps(kp + p * kKeys + h);
        const __m256 k1 = _mm256_loadu_ps(kp + p * kKeys + h + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 qb = _mm256_broadcast_ss(q[r0 + r] + p);
          acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_store_ps(sc.s + (r0 + r) * kKeys + h, acc[r][0]);
        _mm256_store_ps(sc.s + (r0 + r) * kKeys + h + 8, acc[r][1]);
      }
    }
  }
}

// Lane r of the result = op over the 8 lanes of v[r]: reduce_rows8 of the AVX-512 build on
// 8-lane registers (in-half shuffles, then the two halves crossed once).
template <class Op>
inline __m256 reduce_rows8(const __m256* v, Op op) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // each half: v2i (0+2, 1+3), v2i+1 (0+2, 1+3)
    a[i] = op(_mm256_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
              _mm256_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 2; ++j)  // each half of b[j]: v4j .. v4j+3, over that half
    b[j] = op(_mm256_shuffle_ps(a[2 * j], a[2 * j + 1], 0x88),
              _mm256_shuffle_ps(a[2 * j], a[2 * j + 1], 0xDD));
  return op(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// The chunk's scores of kRows rows with the keys a row does not see (past `limit[r]` or before
// `start[r]`) set to kNeg in place, and false in vis; nothing to do for a chunk every row sees
// whole (all but the diagonal and a window's edge), which returns true.
inline bool visible_scores(Scores& sc, int64_t first, const int64_t* limit, const int64_t* start,
                           __m256* vis) {
  bool whole = true;
  for (int r = 0; r < kRows; ++r)
    whole = whole && first + kKeys - 1 <= limit[r] && first >= start[r];
  if (whole) return true;
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < 4 * kRows; ++i) {
    const int r = i / 4;
    const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(
                                                   static_cast<int>(first + 8 * (i % 4))));
    const __m256i out = _mm256_or_si256(
        _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(limit[r]))),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(start[r])), key));
    vis[i] = _mm256_castsi256_ps(_mm256_xor_si256(out, _mm256_set1_epi32(-1)));
    _mm256_store_ps(sc.s + 8 * i, _mm256_blendv_ps(_mm256_set1_ps(kNeg),
                                                   _mm256_load_ps(sc.s + 8 * i), vis[i]));
  }
  return false;
}

// softmax_step of the AVX-512 build on 8-lane registers: four quarters of each row's 32 scores,
// the 8 rows' maxima, rescale factors and sums across registers.
inline void softmax_step(Scores& sc, int64_t row, int64_t first, const int64_t* limit,
                         const int64_t* start, float scale, RowState& st) {
  static_assert(kRows == 8, "reduce_rows8 takes 8 rows");
  __m256 vis[4 * kRows], part[kRows];
  const bool whole = visible_scores(sc, first, limit, start, vis);
  for (int r = 0; r < kRows; ++r) {
    const float* x = sc.s + r * kKeys;
    part[r] = _mm256_max_ps(_mm256_max_ps(_mm256_load_ps(x), _mm256_load_ps(x + 8)),
                            _mm256_max_ps(_mm256_load_ps(x + 16), _mm256_load_ps(x + 24)));
  }
  const __m256 mx = reduce_rows8(part, [](__m256 u, __m256 w) { return _mm256_max_ps(u, w); });
  const __m256 sl2 = _mm256_set1_ps(scale), m_old = _mm256_loadu_ps(st.m + row);
  const __m256 m_new = _mm256_max_ps(m_old, _mm256_mul_ps(mx, sl2));
  const __m256 alpha = exp2_ps8(_mm256_sub_ps(m_old, m_new));
  _mm256_storeu_ps(st.m + row, m_new);
  _mm256_storeu_ps(st.alpha + row, alpha);
  alignas(32) float top[8];
  _mm256_store_ps(top, m_new);
  for (int r = 0; r < kRows; ++r) {
    const __m256 shift = _mm256_set1_ps(-top[r]);
    part[r] = _mm256_setzero_ps();
    for (int h = 0; h < 4; ++h) {
      __m256 e = exp2_ps8(_mm256_fmadd_ps(_mm256_load_ps(sc.s + r * kKeys + 8 * h), sl2, shift));
      if (!whole) e = _mm256_and_ps(e, vis[4 * r + h]);  // exact zeros for unseen keys
      _mm256_storeu_ps(st.p + (row + r) * kKeys + 8 * h, e);
      part[r] = _mm256_add_ps(part[r], e);
    }
  }
  _mm256_storeu_ps(st.l + row, _mm256_fmadd_ps(_mm256_loadu_ps(st.l + row), alpha, reduce8(part)));
}

// o[r] = o[r] * alpha[r] + p[r] . V_chunk for RB rows starting at `row`, 32 columns at a time.
template <int D, int RB>
inline void chunk_values(const float* vp, int64_t row, RowState& st) {
  for (int c0 = 0; c0 < D; c0 += 32) {
    __m256 o[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < 4; ++c)
        o[r][c] = _mm256_mul_ps(_mm256_loadu_ps(st.o + (row + r) * D + c0 + 8 * c),
                                _mm256_set1_ps(st.alpha[row + r]));
    for (int j = 0; j < kKeys; ++j) {
      __m256 v[4];
      for (int c = 0; c < 4; ++c) v[c] = _mm256_loadu_ps(vp + j * D + c0 + 8 * c);
      for (int r = 0; r < RB; ++r) {
        const __m256 pj = _mm256_broadcast_ss(st.p + (row + r) * kKeys + j);
        for (int c = 0; c < 4; ++c) o[r][c] = _mm256_fmadd_ps(pj, v[c], o[r][c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(st.o + (row + r) * D + c0 + 8 * c, o[r][c]);
  }
}

#endif  // PREFILL_AVX512 / PREFILL_AVX2

// Per-thread buffers for one work item of up to kQ * group rows (rounded up to kRowAlign).
struct Buffers {
  std::vector<float> o, m, l, alpha, p;
  std::vector<bf16> pb;
  std::vector<const void*> q;
  std::vector<int64_t> limit, start;
  std::vector<bf16> qa;       // AMX: the item's query rows, [rows][D]
  std::vector<float> s, pv;   // AMX: one row tile's scores [16][32] and values [16][D]
  Buffers(int64_t rows, int64_t d)
      : o(rows * d), m(rows), l(rows), alpha(rows), p(rows * kKeys), pb(rows * kKeys), q(rows),
        limit(rows), start(rows) {
#if defined(PREFILL_AMX)
    qa.resize(rows * d);
    s.resize(amx::kTileRows * kKeys);
    pv.resize(amx::kTileRows * d);
#endif
  }
};

// Rows are padded to a multiple of the softmax's 8 (kRows), and of a tile's 16 rows with AMX.
#if defined(PREFILL_AMX)
constexpr int64_t kRowAlign = amx::kTileRows;
#else
constexpr int64_t kRowAlign = kRows;
#endif

// Work item (g, t): KV head g's query heads at query positions t*kQ .. t*kQ + kQ - 1.
struct Item {
  int64_t q0, nq, rows, padded;
  int64_t first_chunk, last_chunk;  // the key chunks any of its rows sees
};

// Sets up the item's rows in b: row r = query position r / group, head r % group; rows past
// `rows` (to `padded`) repeat the last row and are never written out.
template <typename T, int D>
Item start_item(const Problem<T>& a, int64_t g, int64_t t, int64_t align, Buffers& b) {
  Item it;
  const int64_t offset = a.len - a.lq;
  it.q0 = t * kQ;
  it.nq = std::min<int64_t>(kQ, a.lq - it.q0);
  it.rows = it.nq * a.group;
  it.padded = (it.rows + align - 1) / align * align;
  for (int64_t r = 0; r < it.padded; ++r) {
    const int64_t i = std::min(r, it.rows - 1);
    const int64_t pos = offset + it.q0 + i / a.group;
    b.q[r] = a.q + (it.q0 + i / a.group) * a.q_row + (g * a.group + i % a.group) * D;
    b.limit[r] = pos;
    b.start[r] = a.window > 0 ? pos - a.window + 1 : 0;
    b.m[r] = kNeg;
    b.l[r] = 0.f;
  }
  std::fill(b.o.begin(), b.o.begin() + it.padded * D, 0.f);
  const int64_t first_key =
      a.window > 0 ? std::max<int64_t>(0, offset + it.q0 - a.window + 1) : 0;
  it.first_chunk = first_key / kKeys;
  it.last_chunk = (offset + it.q0 + it.nq - 1) / kKeys;
  return it;
}

// Normalises the item's rows by their sums and writes them to the output.
template <typename T, int D>
void finish_item(const Problem<T>& a, int64_t g, const Item& it, const Buffers& b) {
  for (int64_t r = 0; r < it.rows; ++r) {
    const float inv = 1.f / b.l[r];
    T* dst = a.out + (it.q0 + r / a.group) * a.o_row + (g * a.group + r % a.group) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(b.o[r * D + d] * inv);
  }
}

template <typename T, int D>
void run_item(const Problem<T>& a, int64_t g, int64_t t, Buffers& b) {
  constexpr int RB = kValueRows<D>;
  const Item it = start_item<T, D>(a, g, t, kRows, b);
  RowState st{b.o.data(), b.m.data(), b.l.data(), b.alpha.data(), b.p.data(),
              sizeof(T) == 2 ? b.pb.data() : nullptr};
  const T* const* q = reinterpret_cast<const T* const*>(b.q.data());
  Scores s;
  for (int64_t c = it.first_chunk; c <= it.last_chunk; ++c) {
    const int64_t base = (g * a.chunks + c) * kKeys * D;
    for (int64_t row = 0; row < it.padded; row += kRows) {
      chunk_scores<D>(q + row, a.kp + base, s);
      softmax_step(s, row, c * kKeys, b.limit.data() + row, b.start.data() + row, a.scale_log2,
                   st);
    }
    for (int64_t row = 0; row < it.padded; row += RB) chunk_values<D, RB>(a.vp + base, row, st);
  }
  finish_item<T, D>(a, g, it, b);
}

#if defined(PREFILL_AMX)

// One chunk's scores for one tile of 16 rows on the tiles, then their online softmax 8 rows at
// a time (probabilities into b.pb, each row's rescale into b.alpha).
template <int D>
void amx_chunk_scores(const Problem<bf16>& a, const bf16* kp, int64_t c, int64_t row,
                      Buffers& b, RowState& st) {
  amx::scores<D>(b.qa.data() + row * D, kp, b.s.data());
  Scores sc;
  for (int half = 0; half < 2; ++half) {
    const float* s = b.s.data() + half * kRows * kKeys;
    for (int i = 0; i < 2 * kRows; ++i) sc.s[i] = _mm512_loadu_ps(s + i * 16);
    const int64_t r = row + half * kRows;
    softmax_step(sc, r, c * kKeys, b.limit.data() + r, b.start.data() + r, a.scale_log2, st);
  }
}

// o = o * alpha + p . V for one tile of 16 rows, the product on the tiles.
template <int D>
void amx_chunk_values(const bf16* vp, int64_t row, Buffers& b) {
  amx::values<D>(b.pb.data() + row * kKeys, vp, b.pv.data());
  for (int r = 0; r < amx::kTileRows; ++r) {
    const __m512 alpha = _mm512_set1_ps(b.alpha[row + r]);
    float* o = b.o.data() + (row + r) * D;
    const float* pv = b.pv.data() + r * D;
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), alpha,
                                              _mm512_loadu_ps(pv + d)));
  }
}

// run_item for the bf16 model with the products on the AMX tiles (the calling thread holds the
// tile configuration).
template <int D>
void run_item_amx(const Problem<bf16>& a, int64_t g, int64_t t, Buffers& b) {
  const Item it = start_item<bf16, D>(a, g, t, amx::kTileRows, b);
  for (int64_t r = 0; r < it.padded; ++r)
    std::memcpy(b.qa.data() + r * D, b.q[r], sizeof(bf16) * D);
  RowState st{b.o.data(), b.m.data(), b.l.data(), b.alpha.data(), b.p.data(), b.pb.data()};
  for (int64_t c = it.first_chunk; c <= it.last_chunk; ++c) {
    const int64_t base = (g * a.chunks + c) * kKeys * D;
    // Every row tile's probabilities are written before the first is loaded into a tile: a tile
    // load right after the vector stores of its data waited on them (~30% of the kernel's time).
    for (int64_t row = 0; row < it.padded; row += amx::kTileRows)
      amx_chunk_scores<D>(a, a.kp + base, c, row, b, st);
    for (int64_t row = 0; row < it.padded; row += amx::kTileRows)
      amx_chunk_values<D>(a.vp + base, row, b);
  }
  finish_item<bf16, D>(a, g, it, b);
}

#endif  // PREFILL_AMX

// Whether this call's products go to the AMX tiles: the bf16 model in an AMX build whose process
// was granted the tiles.
template <typename T>
bool use_amx() {
#if defined(PREFILL_AMX)
  return sizeof(T) == 2 && amx::amx_permitted();
#else
  return false;
#endif
}

// One thread's share of the work items, taken from `next` until none is left.
template <typename T, int D>
void run_items(const Problem<T>& a, int64_t tiles, std::atomic<int64_t>& next) {
  const int64_t items = tiles * a.kv;
  Buffers b((kQ * a.group + kRowAlign - 1) / kRowAlign * kRowAlign, D);
#if defined(PREFILL_AMX)
  if constexpr (sizeof(T) == 2) {
    if (use_amx<T>()) {
      amx::TileConfig config;
      for (int64_t item = next++; item < items; item = next++)
        run_item_amx<D>(a, item % a.kv, tiles - 1 - item / a.kv, b);
      return;
    }
  }
#endif
  for (int64_t item = next++; item < items; item = next++)
    run_item<T, D>(a, item % a.kv, tiles - 1 - item / a.kv, b);
}

template <typename T, int D>
void run(const Problem<T>& a) {
  at::parallel_for(0, a.kv * a.chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) pack_chunk<T, D>(a, i / a.chunks, i % a.chunks);
  });
  const int64_t tiles = (a.lq + kQ - 1) / kQ;
  std::atomic<int64_t> next{0};
  // Later tiles see more keys: handed out first, so the last items to finish are short ones.
  at::parallel_for(0, at::get_num_threads(), 1,
                   [&](int64_t, int64_t) { run_items<T, D>(a, tiles, next); });
}

template <typename T>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
            at::Tensor& out, int64_t window) {
  Problem<T> a;
  a.q = q.data_ptr<T>();
  a.k = k.data_ptr<T>();
  a.v = v.data_ptr<T>();
  a.out = out.data_ptr<T>();
  a.lq = q.size(0);
  a.len = k.size(0);
  a.heads = q.size(1);
  a.kv = k.size(1);
  a.group = a.heads / a.kv;
  a.q_row = q.stride(0);
  a.k_row = k.stride(0);
  a.v_row = v.stride(0);
  a.o_row = out.stride(0);
  a.scale_log2 = static_cast<float>(scale) * kLog2e;
  a.window = window;
  a.chunks = (a.len + kKeys - 1) / kKeys;
  const int64_t d = q.size(2);
  at::Tensor packed = at::detail::empty_cpu({2, a.kv * a.chunks * kKeys * d}, q.options());
  a.kp = packed.data_ptr<T>();
  a.vp = a.kp + a.kv * a.chunks * kKeys * d;
  if (d == 64) {
    run<T, 64>(a);
  } else {
    run<T, 128>(a);
  }
}

#endif  // PREFILL_AVX512 || PREFILL_AVX2

// Whether bfloat16 prompts run their products on the AMX tiles: an AMX build in a process the
// kernel granted them.
bool uses_amx() {
#if defined(PREFILL_AMX)
  return amx::amx_permitted();
#else
  return false;
#endif
}

bool supports_dtype(const std::string& dtype) {
#if defined(__AVX512BF16__)
  if (dtype == "bfloat16") return true;
#endif
#if defined(PREFILL_AVX512) || defined(PREFILL_AVX2)
  if (dtype == "float32") return true;
#endif
  return false;
}

}  // namespace

// q: [lq, heads, head_dim], the last lq positions of the sequence; k, v: [len, kv_heads,
// head_dim] (len >= lq); out like q, written in place. Rows may be strided (head_dim and the
// heads of one position contiguous). Query i (at position len - lq + i) attends keys up to its
// own position, and with window > 0 only the last `window` of them. head_dim 64 or 128; float32
// on AVX-512 or AVX2 + FMA, bfloat16 with AVX512-BF16 (`supports` says which this build has).
void causal_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              double scale, at::Tensor out, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "q and out must be [lq, heads, head_dim], k and v [len, kv_heads, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) >= q.size(0), "k and v must match, len >= lq");
  TORCH_CHECK(q.size(2) == k.size(2) && (q.size(2) == 64 || q.size(2) == 128),
              "head_dim must be 64 or 128");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "heads must be a multiple of kv heads");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "each position's heads must be contiguous");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, k, v and out must share a dtype");
  TORCH_CHECK(supports_dtype(q.scalar_type() == at::kFloat ? "float32"
                             : q.scalar_type() == at::kBFloat16 ? "bfloat16" : "other"),
              "this build of causal_prefill_attention does not support ", q.scalar_type());
  if (q.size(0) == 0) return;
#if defined(PREFILL_AVX512) || defined(PREFILL_AVX2)
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16) return launch<bf16>(q, k, v, scale, out, window);
#endif
  launch<float>(q, k, v, scale, out, window);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_prefill_attention", &causal_prefill_attention, "causal prefill attention (CPU)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("scale"),
        pybind11::arg("out"), pybind11::arg("window") = 0);
  m.def("supports", &supports_dtype, "whether this build runs the dtype", pybind11::arg("dtype"));
  m.def("uses_amx", &uses_amx, "whether bfloat16 products run on the AMX tiles");
}
