// Paged decode attention for CPU: one query token per sequence, K/V read in place through the
// block table (no gather copy), GQA query heads packed per KV head so each K/V row is loaded once
// for the whole group. Softmax in fp32; cache and query may be float or bfloat16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                 at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
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

  at::parallel_for(0, num_seqs * num_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv, h = item % num_kv;
      const int64_t len = lens[s];
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] =
              to_float(qp[s * q_seq_stride + (h * group + g) * q_head_stride + d]) * fscale;
      // Pass 1: scores for every key position, all heads of the group at once.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[s * width + t / block_size]) * block_size
                             + t % block_size;
        const T* krow = kp + slot * row_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(krow[d]);
          scores[g * len + t] = dot;
        }
      }
      // Softmax per head (stable: subtract the max).
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        inv_sum[g] = 1.f / sum;
      }
      // Pass 2: probability-weighted sum of V rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[s * width + t / block_size]) * block_size
                             + t % block_size;
        const T* vrow = vp + slot * row_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_float(vrow[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          op[s * o_seq_stride + (h * group + g) * o_head_stride + d] =
              static_cast<T>(acc[g * head_dim + d] * inv_sum[g]);
    }
  });
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
    decode_impl<float>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_impl<at::BFloat16>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
