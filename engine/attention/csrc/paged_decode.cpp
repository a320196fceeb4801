// Paged decode attention for CPU: one query per row (a decode token, or one query of a short
// prefill chunk), K/V read in place through the block table (no gather copy). Single pass with a
// block-wise online softmax: per tile of up to 16 tokens, the scores of every query head of a KV
// group, a running max / sum rescale, and the V accumulation, all in fp32; the group's query heads
// share every K/V load. Decode attention is bound by the bytes of K/V it reads, so the design goal
// is to stream each byte once at memory speed: no score buffer over the whole context, no second
// pass over the cache, and enough vector work per byte to keep up (AVX-512, or AVX2 with FMA,
// where the compiler targets it).
//
// Work items are (sequence, KV split, KV heads): an item normally covers every KV head of its
// sequence, reading each cache block as one contiguous stream; with few sequences long contexts
// are split (flash-decoding style, merged afterwards) and short ones go down to one KV head per
// item, so every core has work. Items are handed out dynamically, so uneven lengths balance.
// The next tile's rows are prefetched into L2 while the current one is computed.
//
// Scores live in the log2 domain (scale * log2(e) folded in) so the exponential is exp2. Masked
// lanes use a large finite negative rather than -inf: the build uses -ffast-math, under which the
// compiler may assume infinities never occur.
// Headers: only what the kernel uses (tensors, parallel_for, an empty CPU tensor) and the
// pybind11 tensor caster. <torch/extension.h> pulls in the whole C++ frontend: it alone took
// 35 s of this file's ~57 s build on 2 cores; these take ~11 s.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int kTile = 16;                 // tokens per online-softmax step: one zmm of scores
constexpr float kNeg = -1e30f;            // "minus infinity" that survives -ffast-math
constexpr float kLog2e = 1.4426950408889634f;

inline float to_float(float x) { return x; }
// bf16 is the top half of an fp32: a shift, not a call through c10's conversion.
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
struct Args {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int32_t* table;
  const int32_t* lens;
  int64_t num_seqs, num_heads, num_kv, head_dim, group, block_size, width;
  int64_t q_seq, q_head, o_seq, o_head;  // strides, in elements
  int64_t row;                           // elements per cache slot: num_kv * head_dim
  float scale_log2;                      // softmax scale * log2(e)
  int64_t window;                        // sliding window (0: none): a row of length n reads
                                         // its last min(n, window) tokens only
  int64_t splits;                        // KV splits per sequence; > 1 merges through scratch
  int64_t kv_per_item;                   // KV heads one work item covers: 1 or num_kv
  float* scratch;                        // [num_seqs, splits, num_heads, head_dim + 2]
};

// Running state of one KV head's query group, in the worker's buffer (no allocation per item):
// acc [G * D] unnormalised output, m [G] running max per head, l [G * 16] running sums kept per
// lane (reduced once at the end instead of per tile), q [G * D] the group's queries. Each part
// starts on a 64-byte boundary.
struct State {
  float* acc;
  float* m;
  float* l;
  float* q;
};

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

inline int64_t state_floats(int64_t group, int64_t head_dim) {
  return 2 * round16(group * head_dim) + round16(group) + 16 * group;
}

inline State state_at(float* base, int64_t group, int64_t head_dim) {
  float* m = base + round16(group * head_dim);
  float* l = m + round16(group);
  return State{base, m, l, l + 16 * group};
}

// The next tile's rows are requested while this one is computed: blocks are scattered, so the
// hardware prefetcher cannot run ahead across the block-table jump, and without this the loads
// stall the arithmetic instead of overlapping it. Into L2 (prefetcht1), not L1: measured on a
// 2-core Zen 4, prefetcht0 gained nothing (the few L1 miss buffers fill up) while prefetcht1 one
// tile ahead took 64 x 1024-token decode from 10-15 to 19-23 GB/s; two tiles ahead was no better.
inline void prefetch_line(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);
#endif
}

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_line(p + off);
}

// ---------------------------------------------------------------------------------------------
// Portable path: any head_dim and group, plain loops the compiler vectorises (omp simd). Used
// where neither AVX-512 nor AVX2 with FMA is there, and for shapes without a specialised kernel.
// HD > 0 fixes head_dim at compile time (64 and 128), so the loops unroll into independent vector
// FMAs; HD == 0 reads it at run time.
template <typename T, int HD>
struct PortableHeads {
  int64_t group, runtime_dim;

  int64_t dim() const { return HD > 0 ? HD : runtime_dim; }

  // A cache row as fp32: fp32 rows are used in place, bf16 rows widened into `tmp`.
  const float* widen(const T* src, float* tmp) const {
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      const int64_t D = dim();
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) tmp[d] = to_float(src[d]);
      return tmp;
    }
  }

  void begin(const State& st, const T* q, int64_t q_head) const {
    const int64_t D = dim();
    for (int64_t h = 0; h < group; ++h) {
      st.m[h] = kNeg;
      st.l[16 * h] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        st.q[h * D + d] = to_float(q[h * q_head + d]);
        st.acc[h * D + d] = 0.f;
      }
    }
  }

  // Scores of the tile's n tokens for every head of the group, into s[h * 16 + t].
  void dots(const State& st, const T* k, int64_t stride, int n, float sl2, float* s,
            float* row) const {
    const int64_t D = dim();
    for (int t = 0; t < n; ++t) {
      const float* kr = widen(k + t * stride, row);
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = st.q + h * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * kr[d];
        s[h * kTile + t] = dot * sl2;
      }
    }
  }

  // `tmp` holds one widened cache row ([head_dim]) and the tile's scores ([group * 16]).
  void tile(const State& st, const T* k, const T* v, int64_t stride, int n, float sl2,
            float* tmp, const T* kn, const T* vn, int nn) const {
    const int64_t D = dim();
    for (int t = 0; t < nn; ++t) {
      prefetch_row(kn + t * stride, D * int64_t(sizeof(T)));
      prefetch_row(vn + t * stride, D * int64_t(sizeof(T)));
    }
    float* row = tmp;
    float* s = tmp + D;
    dots(st, k, stride, n, sl2, s, row);
    for (int64_t h = 0; h < group; ++h) {
      float* sh = s + h * kTile;
      float mx = st.m[h];
      for (int t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
      const float alpha = std::exp2(st.m[h] - mx);
      st.m[h] = mx;
      float sum = 0.f;
      for (int t = 0; t < n; ++t) {
        sh[t] = std::exp2(sh[t] - mx);
        sum += sh[t];
      }
      st.l[16 * h] = st.l[16 * h] * alpha + sum;
      float* ah = st.acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ah[d] *= alpha;
    }
    for (int t = 0; t < n; ++t) {
      const float* vr = widen(v + t * stride, row);
      for (int64_t h = 0; h < group; ++h) {
        const float p = s[h * kTile + t];
        float* ah = st.acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] += p * vr[d];
      }
    }
  }

  float sum(const State& st, int64_t h) const { return st.l[16 * h]; }
  void finish(const State&) const {}
  int64_t tmp_floats() const { return dim() + group * kTile; }
};

// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)

// r[t] = sum of the 16 lanes of v[t]: a transposing tree (30 shuffles, 15 adds for 16 dot
// products) instead of 16 separate horizontal reductions (~8 dependent ops each).
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: [v2i lo+hi | v2i+1 lo+hi]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lane k now holds 4 partials of v[4j + k]
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], 0x44),
                                  _mm512_shuffle_ps(b[0], b[1], 0xEE));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_ps(b[2], b[3], 0x44),
                                  _mm512_shuffle_ps(b[2], b[3], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c0, c1, 0x88), _mm512_shuffle_ps(c0, c1, 0xDD));
  // Element 4k + i of r is the sum of v[4i + k]: put token t back in lane t.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // widen: bf16 bits into the top half of each fp32 lane
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// HD (64 or 128) and G (query heads per KV head, 1..8) fixed at compile time: the dot products
// and the V accumulation unroll into independent vector FMAs with the group's accumulators in
// registers.
template <typename T, int HD, int G>
struct Avx512Heads {
  static constexpr int C = HD / 16;
#if defined(__AVX512BF16__)
  // bf16 model: q.k with vdpbf16ps straight from the cache, no widening. Products of two bf16
  // are exact in fp32, so this differs from widening then FMA only in summation order (pairs
  // first) and in denormal inputs being flushed; q is the model's bf16 value, unscaled.
  static constexpr bool kDot16 = std::is_same_v<T, bf16>;
#else
  static constexpr bool kDot16 = false;
#endif

  void begin(const State& st, const T* q, int64_t q_head) const {
    for (int h = 0; h < G; ++h) {
      if constexpr (kDot16) {
        std::memcpy(reinterpret_cast<uint16_t*>(st.q) + h * HD, q + h * q_head, HD * 2);
      } else {
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(st.q + h * HD + 16 * c,
                                                     load16(q + h * q_head + 16 * c));
      }
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(st.acc + h * HD + 16 * c, _mm512_setzero_ps());
      _mm512_storeu_ps(st.l + 16 * h, _mm512_setzero_ps());
    }
    _mm512_storeu_ps(st.m, _mm512_set1_ps(kNeg));
  }

  static constexpr int64_t kRowBytes = HD * int64_t(sizeof(T));

  // One 16-lane partial dot product per (head, token) of the tile, K row loaded once per token;
  // the next tile's K rows are requested one per token, spread between the arithmetic.
  static void dots(const State& st, const T* k, int64_t stride, int n, __m512 (*part)[kTile],
                   const T* kn, int nn) {
    for (int t = 0; t < n; ++t) {
      const T* kr = k + t * stride;
      if (t < nn) prefetch_row(kn + t * stride, kRowBytes);
      if constexpr (kDot16) {
#if defined(__AVX512BF16__)
        __m512bh kc[HD / 32];
        for (int c = 0; c < HD / 32; ++c)
          kc[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kr + 32 * c));
        const uint16_t* qb = reinterpret_cast<const uint16_t*>(st.q);
        for (int h = 0; h < G; ++h) {
          __m512 s = _mm512_setzero_ps();
          for (int c = 0; c < HD / 32; ++c)
            s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qb + h * HD + 32 * c), kc[c]);
          part[h][t] = s;
        }
#endif
      } else {
        __m512 kc[C];
        for (int c = 0; c < C; ++c) kc[c] = load16(kr + 16 * c);
        for (int h = 0; h < G; ++h) {
          const float* qh = st.q + h * HD;
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qh), kc[0]);
          for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kc[c], s);
          part[h][t] = s;
        }
      }
    }
    for (int t = n; t < kTile; ++t)  // rows past the sequence are never read
      for (int h = 0; h < G; ++h) part[h][t] = _mm512_setzero_ps();
  }

  // Scores -> probabilities against the running max (rescaling the running sums); each head's
  // factor for the accumulator goes to alpha.
  static void softmax(const State& st, __m512 (*part)[kTile], int n, float sl2,
                      float (*p)[kTile], float* alpha) {
    const __mmask16 valid = n >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    alignas(64) float shift[16] = {0.f};
    for (int h = 0; h < G; ++h) {
      __m512 sc = _mm512_mul_ps(reduce16(part[h]), _mm512_set1_ps(sl2));
      sc = _mm512_mask_mov_ps(_mm512_set1_ps(kNeg), valid, sc);
      const float old_max = st.m[h];
      const float new_max = std::max(old_max, _mm512_reduce_max_ps(sc));
      st.m[h] = new_max;
      shift[h] = old_max - new_max;
      const __m512 e = exp2_ps(_mm512_sub_ps(sc, _mm512_set1_ps(new_max)));
      _mm512_store_ps(p[h], _mm512_maskz_mov_ps(valid, e));  // exact zeros past the sequence
    }
    _mm512_store_ps(alpha, exp2_ps(_mm512_load_ps(shift)));  // all heads' factors at once
    for (int h = 0; h < G; ++h)
      _mm512_storeu_ps(st.l + 16 * h, _mm512_fmadd_ps(_mm512_loadu_ps(st.l + 16 * h),
                                                      _mm512_set1_ps(alpha[h]),
                                                      _mm512_load_ps(p[h])));
  }

  // kn, vn: the next tile's rows for this KV head (nn of them; 0 at the end of the item).
  void tile(const State& st, const T* k, const T* v, int64_t stride, int n, float sl2,
            float*, const T* kn, const T* vn, int nn) const {
    __m512 part[G][kTile];
    alignas(64) float p[G][kTile];
    alignas(64) float alpha[16];
    dots(st, k, stride, n, part, kn, nn);
    for (int t = n; t < nn; ++t) prefetch_row(kn + t * stride, kRowBytes);
    softmax(st, part, n, sl2, p, alpha);
    // acc = acc * alpha + sum_t p[t] * v[t], one 16-wide column strip at a time so the G
    // accumulators stay in registers and each V strip is widened once for all heads.
    for (int t = 0; t < nn; ++t) prefetch_row(vn + t * stride, kRowBytes);
    if constexpr (std::is_same_v<T, bf16>) {
      accumulate_pairs(st, v, stride, n, p, alpha);
      return;
    }
    for (int c = 0; c < C; ++c) {
      __m512 a[G];
      for (int h = 0; h < G; ++h)
        a[h] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + h * HD + 16 * c), _mm512_set1_ps(alpha[h]));
      for (int t = 0; t < n; ++t) {
        const __m512 vv = load16(v + t * stride + 16 * c);
        for (int h = 0; h < G; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]), vv, a[h]);
      }
      for (int h = 0; h < G; ++h) _mm512_storeu_ps(st.acc + h * HD + 16 * c, a[h]);
    }
  }

  // bf16 V: one 64-byte load holds 32 values, which two single instructions widen into the
  // even-indexed 16 (each lane's low half, shifted up) and the odd-indexed 16 (its high half,
  // masked): half the loads and widening instructions of 16 values at a time. The kernel with
  // its K/V in L2 ran 1.05-1.07x faster for it (from memory: within noise). The accumulator
  // keeps each 32-value chunk as [16 even | 16 odd] until `finish` restores the order. Every
  // output value gets the same products and sums in the same order: the same bits.
  static void accumulate_pairs(const State& st, const T* v, int64_t stride, int n,
                               float (*p)[kTile], const float* alpha) {
    const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
    for (int c = 0; c < HD / 32; ++c) {
      __m512 even[G], odd[G];
      for (int h = 0; h < G; ++h) {
        const __m512 scale = _mm512_set1_ps(alpha[h]);
        even[h] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + h * HD + 32 * c), scale);
        odd[h] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + h * HD + 32 * c + 16), scale);
      }
      for (int t = 0; t < n; ++t) {
        const __m512i raw =
            _mm512_loadu_si512(reinterpret_cast<const void*>(v + t * stride + 32 * c));
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
        for (int h = 0; h < G; ++h) {
          const __m512 ph = _mm512_set1_ps(p[h][t]);
          even[h] = _mm512_fmadd_ps(ph, ve, even[h]);
          odd[h] = _mm512_fmadd_ps(ph, vo, odd[h]);
        }
      }
      for (int h = 0; h < G; ++h) {
        _mm512_storeu_ps(st.acc + h * HD + 32 * c, even[h]);
        _mm512_storeu_ps(st.acc + h * HD + 32 * c + 16, odd[h]);
      }
    }
  }

  // The accumulator back in dimension order (bf16 kept it as [even | odd] per 32 values).
  void finish(const State& st) const {
    if constexpr (std::is_same_v<T, bf16>) {
      const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                          24, 8);
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < HD / 32; ++c) {
          float* chunk = st.acc + h * HD + 32 * c;
          const __m512 even = _mm512_loadu_ps(chunk), odd = _mm512_loadu_ps(chunk + 16);
          _mm512_storeu_ps(chunk, _mm512_permutex2var_ps(even, lo, odd));
          _mm512_storeu_ps(chunk + 16, _mm512_permutex2var_ps(even, hi, odd));
        }
    }
  }

  float sum(const State& st, int64_t h) const {
    return _mm512_reduce_add_ps(_mm512_loadu_ps(st.l + 16 * h));
  }
  int64_t tmp_floats() const { return 0; }
};

#endif  // __AVX512F__

// ---------------------------------------------------------------------------------------------
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {  // widen: bf16 bits into the top half of each fp32 lane
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Avx512Heads on 8-lane registers: a tile's 16 tokens are two halves of 8 lanes (scores, running
// sums), HD / 8 column strips per row. HD (64 or 128) and G (1..8) fixed at compile time.
template <typename T, int HD, int G>
struct Avx2Heads {
  static constexpr int C = HD / 8;
  static constexpr int64_t kRowBytes = HD * int64_t(sizeof(T));

  void begin(const State& st, const T* q, int64_t q_head) const {
    for (int h = 0; h < G; ++h) {
      for (int c = 0; c < C; ++c) {
        _mm256_storeu_ps(st.q + h * HD + 8 * c, load8(q + h * q_head + 8 * c));
        _mm256_storeu_ps(st.acc + h * HD + 8 * c, _mm256_setzero_ps());
      }
      _mm256_storeu_ps(st.l + 16 * h, _mm256_setzero_ps());
      _mm256_storeu_ps(st.l + 16 * h + 8, _mm256_setzero_ps());
      st.m[h] = kNeg;
    }
  }

  // One 8-lane partial dot product per (head, token), each K strip loaded once for all heads.
  static void dots(const State& st, const T* k, int64_t stride, int n, __m256 (*part)[kTile],
                   const T* kn, int nn) {
    for (int t = 0; t < n; ++t) {
      const T* kr = k + t * stride;
      if (t < nn) prefetch_row(kn + t * stride, kRowBytes);
      __m256 s[G];
      const __m256 k0 = load8(kr);
      for (int h = 0; h < G; ++h) s[h] = _mm256_mul_ps(_mm256_loadu_ps(st.q + h * HD), k0);
      for (int c = 1; c < C; ++c) {
        const __m256 kc = load8(kr + 8 * c);
        for (int h = 0; h < G; ++h)
          s[h] = _mm256_fmadd_ps(_mm256_loadu_ps(st.q + h * HD + 8 * c), kc, s[h]);
      }
      for (int h = 0; h < G; ++h) part[h][t] = s[h];
    }
    for (int t = n; t < kTile; ++t)  // rows past the sequence are never read
      for (int h = 0; h < G; ++h) part[h][t] = _mm256_setzero_ps();
  }

  // Scores -> probabilities against the running max (rescaling the running sums); each head's
  // factor for the accumulator goes to alpha.
  static void softmax(const State& st, __m256 (*part)[kTile], int n, float sl2,
                      float (*p)[kTile], float* alpha) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), count = _mm256_set1_ps(float(n));
    const __m256 valid[2] = {_mm256_cmp_ps(lane, count, _CMP_LT_OQ),
                             _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.f)), count,
                                           _CMP_LT_OQ)};
    alignas(32) float shift[8] = {0.f};
    for (int h = 0; h < G; ++h) {
      __m256 sc[2];
      for (int half = 0; half < 2; ++half)
        sc[half] = _mm256_blendv_ps(_mm256_set1_ps(kNeg),
                                    _mm256_mul_ps(reduce8(part[h] + 8 * half), _mm256_set1_ps(sl2)),
                                    valid[half]);
      const float old_max = st.m[h];
      const float new_max = std::max(old_max, hmax8(_mm256_max_ps(sc[0], sc[1])));
      st.m[h] = new_max;
      shift[h] = old_max - new_max;
      for (int half = 0; half < 2; ++half) {  // exact zeros past the sequence
        const __m256 e = exp2_ps8(_mm256_sub_ps(sc[half], _mm256_set1_ps(new_max)));
        _mm256_store_ps(p[h] + 8 * half, _mm256_and_ps(e, valid[half]));
      }
    }
    _mm256_store_ps(alpha, exp2_ps8(_mm256_load_ps(shift)));  // all heads' factors at once
    for (int h = 0; h < G; ++h)
      for (int half = 0; half < 2; ++half) {
        float* l = st.l + 16 * h + 8 * half;
        _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), _mm256_set1_ps(alpha[h]),
                                            _mm256_load_ps(p[h] + 8 * half)));
      }
  }

  // kn, vn: the next tile's rows for this KV head (nn of them; 0 at the end of the item).
  void tile(const State& st, const T* k, const T* v, int64_t stride, int n, float sl2,
            float*, const T* kn, const T* vn, int nn) const {
    __m256 part[G][kTile];
    alignas(32) float p[G][kTile];
    alignas(32) float alpha[8];
    dots(st, k, stride, n, part, kn, nn);
    for (int t = n; t < nn; ++t) prefetch_row(kn + t * stride, kRowBytes);
    softmax(st, part, n, sl2, p, alpha);
    // acc = acc * alpha + sum_t p[t] * v[t], one 8-wide column strip at a time so the G
    // accumulators stay in registers and each V strip is widened once for all heads.
    for (int t = 0; t < nn; ++t) prefetch_row(vn + t * stride, kRowBytes);
    for (int c = 0; c < C; ++c) {
      __m256 a[G];
      for (int h = 0; h < G; ++h)
        a[h] = _mm256_mul_ps(_mm256_loadu_ps(st.acc + h * HD + 8 * c), _mm256_set1_ps(alpha[h]));
      for (int t = 0; t < n; ++t) {
        const __m256 vv = load8(v + t * stride + 8 * c);
        for (int h = 0; h < G; ++h) a[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h][t]), vv, a[h]);
      }
      for (int h = 0; h < G; ++h) _mm256_storeu_ps(st.acc + h * HD + 8 * c, a[h]);
    }
  }

  void finish(const State&) const {}
  float sum(const State& st, int64_t h) const {
    return hsum8(_mm256_add_ps(_mm256_loadu_ps(st.l + 16 * h), _mm256_loadu_ps(st.l + 16 * h + 8)));
  }
  int64_t tmp_floats() const { return 0; }
};

#endif  // __AVX2__ && __FMA__ && !__AVX512F__

// ---------------------------------------------------------------------------------------------
// The driver: work items, tiles, the split merge. `Heads` is the per-group kernel.

template <typename T, class Heads>
void finish_item(const Args<T>& a, const Heads& heads, const State& st, int64_t s, int64_t sp,
                 int64_t kvh) {
  heads.finish(st);  // the accumulator in dimension order
  const int64_t D = a.head_dim;
  for (int64_t j = 0; j < a.group; ++j) {
    const int64_t h = kvh * a.group + j;
    const float l = heads.sum(st, j);
    const float* acc = st.acc + j * D;
    if (a.splits > 1) {  // the merge rescales by exp2(m - global max); keep the raw sums
      float* dst = a.scratch + ((s * a.splits + sp) * a.num_heads + h) * (D + 2);
      dst[0] = st.m[j];
      dst[1] = l;
      std::memcpy(dst + 2, acc, D * sizeof(float));
      continue;
    }
    T* o = a.out + s * a.o_seq + h * a.o_head;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
  }
}

// The tiles of one item in order: tokens [t0, t0 + n) of block b; a tile never crosses a block.
struct TileCursor {
  int64_t b, t0, b1, len, bs;
  bool valid() const { return b < b1; }
  int n() const { return int(std::min<int64_t>(kTile, std::min(bs, len - b * bs) - t0)); }
  TileCursor next() const {
    TileCursor c = *this;
    c.t0 += kTile;
    if (c.t0 >= std::min(bs, len - b * bs)) {
      ++c.b;
      c.t0 = 0;
    }
    return c;
  }
};

template <typename T, class Heads>
void run_item(const Args<T>& a, const Heads& heads, int64_t item, float* buf) {
  const int64_t chunks = a.num_kv / a.kv_per_item;
  const int64_t s = item / (a.splits * chunks), sp = item / chunks % a.splits;
  const int64_t kv0 = item % chunks * a.kv_per_item, kv1 = kv0 + a.kv_per_item;
  const int64_t len = std::max<int32_t>(a.lens[s], 0), bs = a.block_size;
  // A sliding window starts the row at token `first`: its blocks before that are never read
  // (the first tile starts inside its block), and the splits divide the blocks from there on.
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t fb = first / bs, nb = (len + bs - 1) / bs;
  const int64_t per = (nb - fb + a.splits - 1) / a.splits;
  const int64_t b0 = std::min(nb, fb + sp * per), b1 = std::min(nb, b0 + per);
  const int64_t per_kv = state_floats(a.group, a.head_dim);
  float* tmp = buf + a.kv_per_item * per_kv;
  for (int64_t kvh = kv0; kvh < kv1; ++kvh)
    heads.begin(state_at(buf + (kvh - kv0) * per_kv, a.group, a.head_dim),
                a.q + s * a.q_seq + kvh * a.group * a.q_head, a.q_head);
  const int32_t* table = a.table + s * a.width;
  auto offset = [&](const TileCursor& c) {  // of the tile's first row, at KV head kv0
    return (int64_t(table[c.b]) * bs + c.t0) * a.row + kv0 * a.head_dim;
  };
  // Heads of one slot are adjacent, so an item over all KV heads reads each block as one
  // contiguous stream (measured faster than one item per KV head).
  for (TileCursor cur{b0, b0 == fb ? first % bs : 0, b1, len, bs}; cur.valid();) {
    const TileCursor nxt = cur.next();
    const int n = cur.n(), nn = nxt.valid() ? nxt.n() : 0;
    const int64_t here = offset(cur), next = nxt.valid() ? offset(nxt) : here;
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const int64_t h = (kvh - kv0) * a.head_dim;
      heads.tile(state_at(buf + (kvh - kv0) * per_kv, a.group, a.head_dim), a.k + here + h,
                 a.v + here + h, a.row, n, a.scale_log2, tmp, a.k + next + h, a.v + next + h, nn);
    }
    cur = nxt;
  }
  for (int64_t kvh = kv0; kvh < kv1; ++kvh)
    finish_item(a, heads, state_at(buf + (kvh - kv0) * per_kv, a.group, a.head_dim), s, sp, kvh);
}

// Split results -> out: o = sum_i acc_i 2^(m_i - M) / sum_i l_i 2^(m_i - M).
template <typename T>
void merge_splits(const Args<T>& a) {
  const int64_t D = a.head_dim;
  at::parallel_for(0, a.num_seqs * a.num_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / a.num_heads, h = i % a.num_heads;
      auto part = [&](int64_t sp) {
        return a.scratch + ((s * a.splits + sp) * a.num_heads + h) * (D + 2);
      };
      float mx = kNeg;
      for (int64_t sp = 0; sp < a.splits; ++sp)
        if (part(sp)[1] > 0.f) mx = std::max(mx, part(sp)[0]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int64_t sp = 0; sp < a.splits; ++sp) {
        const float* src = part(sp);
        if (!(src[1] > 0.f)) continue;  // an empty split (short sequence): nothing to add
        const float w = std::exp2(src[0] - mx);
        l += w * src[1];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += w * src[2 + d];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* o = a.out + s * a.o_seq + h * a.o_head;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

template <typename T, class Heads>
void run(const Args<T>& a, const Heads& heads) {
  const int64_t items = a.num_seqs * a.splits * (a.num_kv / a.kv_per_item);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  const int64_t floats = a.kv_per_item * state_floats(a.group, a.head_dim) + heads.tmp_floats();
  std::atomic<int64_t> next{0};
  // One range element per worker; items are claimed from a shared counter so a worker that
  // drew short sequences takes more of them.
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buf(floats + 16);  // once per worker and call, not per item
    const uintptr_t addr = reinterpret_cast<uintptr_t>(buf.data());
    float* base = reinterpret_cast<float*>((addr + 63) & ~uintptr_t(63));  // 64-byte aligned
    for (int64_t i = next++; i < items; i = next++) run_item(a, heads, i, base);
  });
  if (a.splits > 1) merge_splits(a);
}

// The vector kernel this build has (the widest the compiler targets), if any.
#if defined(__AVX512F__)
template <typename T, int HD, int G>
using VectorHeads = Avx512Heads<T, HD, G>;
#define PD_VECTOR_HEADS 1
#elif defined(__AVX2__) && defined(__FMA__)
template <typename T, int HD, int G>
using VectorHeads = Avx2Heads<T, HD, G>;
#define PD_VECTOR_HEADS 1
#endif

template <typename T>
void dispatch(const Args<T>& a) {
#ifdef PD_VECTOR_HEADS
  const bool specialised = a.group >= 1 && a.group <= 8 && (a.head_dim == 64 || a.head_dim == 128);
  switch (specialised ? a.head_dim * 16 + a.group : 0) {
#define PD_CASE(HD, G) \
  case HD * 16 + G:    \
    return run(a, VectorHeads<T, HD, G>{});
    PD_CASE(64, 1) PD_CASE(64, 2) PD_CASE(64, 3) PD_CASE(64, 4)
    PD_CASE(64, 5) PD_CASE(64, 6) PD_CASE(64, 7) PD_CASE(64, 8)
    PD_CASE(128, 1) PD_CASE(128, 2) PD_CASE(128, 3) PD_CASE(128, 4)
    PD_CASE(128, 5) PD_CASE(128, 6) PD_CASE(128, 7) PD_CASE(128, 8)
#undef PD_CASE
    default:
      break;
  }
#endif
  if (a.head_dim == 64) return run(a, PortableHeads<T, 64>{a.group, 64});
  if (a.head_dim == 128) return run(a, PortableHeads<T, 128>{a.group, 128});
  run(a, PortableHeads<T, 0>{a.group, a.head_dim});
}

// Enough work items for every thread (4 per thread evens out the tail). An item covers all KV
// heads of a sequence (contiguous reads); with few sequences, long contexts are split along the
// KV instead (measured: 1-4 sequences of 4096 tokens ran 10-30% faster split this way than
// with one item per KV head), and only when that still leaves a thread idle (short contexts)
// do items go down to one KV head.
template <typename T>
void choose_items(Args<T>& a, int64_t max_len) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t want = 4 * threads;
  const int64_t min_split = 128;  // tokens: below this the merge costs more than it balances
  auto splits_for = [&](int64_t items) {
    if (items >= want) return int64_t(1);
    return std::max<int64_t>(1, std::min((want + items - 1) / items, max_len / min_split));
  };
  a.kv_per_item = a.num_kv;
  a.splits = splits_for(a.num_seqs);
  if (a.num_seqs * a.splits < threads && a.num_kv > 1) {
    a.kv_per_item = 1;
    a.splits = splits_for(a.num_seqs * a.num_kv);
  }
}

template <typename T>
void launch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
            at::Tensor& out, int64_t window) {
  Args<T> a;
  a.q = q.data_ptr<T>();
  a.k = k_cache.data_ptr<T>();
  a.v = v_cache.data_ptr<T>();
  a.out = out.data_ptr<T>();
  a.table = block_table.data_ptr<int32_t>();
  a.lens = seq_lens.data_ptr<int32_t>();
  a.num_seqs = q.size(0);
  a.num_heads = q.size(1);
  a.head_dim = q.size(2);
  a.block_size = k_cache.size(1);
  a.num_kv = k_cache.size(2);
  a.group = a.num_heads / a.num_kv;
  a.width = block_table.size(1);
  a.q_seq = q.stride(0);
  a.q_head = q.stride(1);
  a.o_seq = out.stride(0);
  a.o_head = out.stride(1);
  a.row = a.num_kv * a.head_dim;
  a.scale_log2 = static_cast<float>(scale) * kLog2e;
  int64_t max_len = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) max_len = std::max<int64_t>(max_len, a.lens[s]);
  TORCH_CHECK(max_len <= a.width * a.block_size, "a sequence is longer than its block table");
  a.window = window;
  choose_items(a, window > 0 ? std::min(max_len, window) : max_len);
  at::Tensor scratch;
  if (a.splits > 1) {
    scratch = at::detail::empty_cpu({a.num_seqs * a.splits * a.num_heads * (a.head_dim + 2)},
                                    q.options().dtype(at::kFloat));
    a.scratch = scratch.data_ptr<float>();
  } else {
    a.scratch = nullptr;
  }
  dispatch(a);
}

}  // namespace

// q: [num_seqs, num_heads, head_dim] (one query per row; rows may be strided). A row is a decode
// query, or one query of a prefill chunk: torch_paged.py gives each of a chunk's queries the
// sequence's block-table row and the length up to its own position (bottom-right causal).
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous
// block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (>= 1)
// out: [num_seqs, num_heads, head_dim], written in place
// window: sliding-window attention (0: none): a row of length n attends its last
// min(n, window) tokens (keys p - window + 1 .. p for the query at position p = n - 1)
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, at::Tensor out,
                            int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [num_seqs, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost dim");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && out.sizes() == q.sizes(), "shape mismatch");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(block_table.size(0) >= q.size(0) && seq_lens.size(0) >= q.size(0),
              "one block-table row and length per sequence");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "q, caches and out must share a dtype");
  if (q.size(0) == 0) return;
  if (q.scalar_type() == at::kFloat) {
    launch<float>(q, k_cache, v_cache, block_table, seq_lens, scale, out, window);
  } else if (q.scalar_type() == at::kBFloat16) {
    launch<bf16>(q, k_cache, v_cache, block_table, seq_lens, scale, out, window);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

// Stores this step's K and V ([tokens, kv_heads, head_dim], each token's heads contiguous, tokens
// strided: views of the fused projection) at their cache slots (block * block_size + offset;
// negative: skipped, as the Triton writer does). One row copy per token and cache, where the
// torch form (two index_copy_ calls on strided views) took ~35 us a call at 64 tokens: ~2 ms of
// a 30-layer bf16 decode step.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [tokens, kv_heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k and v must have the cache's kv_heads and head_dim");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "each token's K/V heads must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be a contiguous int64 [tokens]");
  const int64_t tokens = k.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = k.size(1) * k.size(2) * int64_t(k.element_size());
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " is past the cache's ", slots, " slots");
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, 2048, [&](int64_t a, int64_t b) {  // a prompt's worth per thread
    for (int64_t t = a; t < b; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(kc + slot[t] * row, kp + t * k_step, size_t(row));
      std::memcpy(vc + slot[t] * row, vp + t * v_step, size_t(row));
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_table"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("out"), pybind11::arg("window") = 0);
  m.def("write_kv", &write_kv, "store a step's K/V at their cache slots (CPU)",
        pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("slot_mapping"));
}
