// Paged decode attention for CPU: one query token per sequence, K/V read in place through the
// block table (no gather copy); each cache slot (all KV heads) is read once for all query heads,
// so GQA groups share the load. Softmax in fp32; cache and query may be float or bfloat16.
// Built with -ffast-math for the vector expf: inputs are finite (only written slots are read).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// HD > 0 fixes head_dim at compile time, so the inner loops unroll into independent vector FMAs
// (a runtime trip count leaves one serial accumulator chain per dot product).
template <typename T, int HD>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                 at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = HD > 0 ? HD : q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv = k_cache.size(2);
  const int64_t group = num_heads / num_kv;
  const int64_t width = block_table.size(1);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t o_seq_stride = out.stride(0), o_head_stride = out.stride(1);
  const int64_t row_stride = num_kv * head_dim;  // one slot of the cache
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // One work item per sequence: each cache slot holds all KV heads contiguously (NHD), so the
  // loops walk whole slots and every byte of K and V is read exactly once.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores;
    std::vector<float> inv_sum(num_heads);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      scores.resize(num_heads * len);
      for (int64_t hq = 0; hq < num_heads; ++hq)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[hq * head_dim + d] = to_float(qp[s * q_seq_stride + hq * q_head_stride + d]) * fscale;
      // Pass 1: scores of every query head against every key position.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[s * width + t / block_size]) * block_size
                             + t % block_size;
        const T* krow = kp + slot * row_stride;
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const float* qh = qf.data() + hq * head_dim;
          const T* kh = krow + (hq / group) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(kh[d]);
          scores[hq * len + t] = dot;
        }
      }
      // Softmax per head (stable: subtract the max); the simd loops use the vector expf.
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        float* sh = scores.data() + hq * len;
        float mx = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sh[t] = expf(sh[t] - mx);
          sum += sh[t];
        }
        inv_sum[hq] = 1.f / sum;
      }
      // Pass 2: probability-weighted sum of V rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[s * width + t / block_size]) * block_size
                             + t % block_size;
        const T* vrow = vp + slot * row_stride;
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const float p = scores[hq * len + t];
          const T* vh = vrow + (hq / group) * head_dim;
          float* ah = acc.data() + hq * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * to_float(vh[d]);
        }
      }
      for (int64_t hq = 0; hq < num_heads; ++hq)
        for (int64_t d = 0; d < head_dim; ++d)
          op[s * o_seq_stride + hq * o_head_stride + d] =
              static_cast<T>(acc[hq * head_dim + d] * inv_sum[hq]);
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                       at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return decode_impl<T, 64>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
    case 80: return decode_impl<T, 80>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
    case 128: return decode_impl<T, 128>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
    default: return decode_impl<T, 0>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  }
}

}  // namespace

// q: [num_seqs, num_heads, head_dim] (one decode query per sequence; rows may be strided)
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous
// block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (>= 1)
// out: [num_seqs, num_heads, head_dim], written in place
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [num_seqs, heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, caches and out must share a dtype");
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<at::BFloat16>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
