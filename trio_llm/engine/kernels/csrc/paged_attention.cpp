// trio_llm::paged_attention_decode: attention of single-token requests (decode) over the
// paged KV cache, read in place through each request's block table.
//
// Layout (trio_llm.engine.kv_cache.KVCache): keys and values are
// [(num_blocks + 1) * block_size, H_kv, D]; position p of a request lives at slot
// table[p / block_size] * block_size + p % block_size.
//
// Work: one item per (request, KV head, context split). The H / H_kv query heads that
// share a KV head are handled by the same item, so each key and value row is loaded
// once for all of them (grouped-query attention without expanding KV). A long context
// is split into several items (flash-decoding): each keeps its own running max, sum and
// un-normalised accumulator (online softmax), and a second pass combines the splits.
// Everything is computed in float32 whatever the storage dtype (float32 or bfloat16).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_math.h"
#include "common.h"

namespace trio_llm {
namespace {

using namespace attention_math;

// A context split is at least this many tokens (below, the reduction costs more).
constexpr int64_t kMinSplit = 128;
// Work items wanted per thread before a request's context is split.
constexpr int64_t kItemsPerThread = 8;

struct Geometry {
  int64_t groups;      // query heads per KV head
  int64_t head_dim;    // D
  int64_t row_stride;  // elements between two slots of the cache (H_kv * D)
  int64_t block_size;
  float softcap;       // 0: none
};

// Online softmax of `groups` query rows (q: [groups, D] float32, pre-scaled) over the
// keys/values of KV head `head` at positions [begin, end) of one request. Leaves the
// running max m[g], sum l[g] and un-normalised accumulator acc[g, D].
template <typename kv_t>
void attend_range(const Geometry& geo, const float* q, const kv_t* k_cache, const kv_t* v_cache,
                  int64_t head, const int64_t* table, int64_t begin, int64_t end, float* m,
                  float* l, float* acc, float* scores) {
  const int64_t groups = geo.groups, d = geo.head_dim, bs = geo.block_size;
  const bool vec = vector_width_fits(d);
  for (int64_t g = 0; g < groups; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  std::fill(acc, acc + groups * d, 0.0f);
  for (int64_t pos = begin; pos < end;) {
    const int64_t offset = pos % bs;
    const int64_t n = std::min({kTile, bs - offset, end - pos});
    const int64_t slot = table[pos / bs] * bs + offset;
    const kv_t* k = k_cache + slot * geo.row_stride + head * d;
    const kv_t* v = v_cache + slot * geo.row_stride + head * d;
    for (int64_t t = 0; t < n; ++t) {
      const kv_t* row = k + t * geo.row_stride;
      for (int64_t g = 0; g < groups; ++g) {
        scores[g * kTile + t] = vec ? dot(q + g * d, row, d) : dot_scalar(q + g * d, row, d);
      }
    }
    if (geo.softcap > 0.0f) {
      // transformers' eager order: scale (in q), then tanh(s / cap) * cap.
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores + g * kTile;
        for (int64_t t = 0; t < n; ++t) s[t] = std::tanh(s[t] / geo.softcap) * geo.softcap;
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* s = scores + g * kTile;
      const float m_new = std::max(m[g], max_of(s, n));
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first tile (m = -inf)
      const float sum = exp_sum(s, n, m_new);
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      if (alpha != 1.0f) {
        float* a = acc + g * d;
        for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
      }
    }
    if (vec) {
      accumulate(acc, scores, groups, v, geo.row_stride, n, d);
    } else {
      accumulate_scalar(acc, scores, groups, v, geo.row_stride, n, d);
    }
    pos += n;
  }
}

template <typename out_t>
inline void store_row(out_t* out, const float* acc, float inv, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<out_t>(acc[i] * inv);
}

template <typename q_t, typename kv_t>
void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const std::vector<int64_t>& first,
            const std::vector<int64_t>& last, int64_t block_size, float scale, float softcap,
            at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), d = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1);
  const Geometry geo{num_heads / num_kv_heads, d, num_kv_heads * d, block_size, softcap};
  const int64_t groups = geo.groups;

  // The queries as float32 [N, H, D], pre-multiplied by the softmax scale.
  std::vector<float> qf(num_seqs * num_heads * d);
  const q_t* q_ptr = query.data_ptr<q_t>();
  for (int64_t n = 0; n < num_seqs; ++n) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const q_t* src = q_ptr + n * query.stride(0) + h * query.stride(1);
      float* dst = qf.data() + (n * num_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * scale;
    }
  }

  // Splits per request: enough items for every thread, none shorter than kMinSplit.
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  std::vector<int64_t> splits(num_seqs), part_of(num_seqs + 1, 0);
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int64_t length = last[n] - first[n];
    int64_t want = (wanted + num_seqs * num_kv_heads - 1) / (num_seqs * num_kv_heads);
    splits[n] = std::max<int64_t>(1, std::min(want, length / kMinSplit));
    part_of[n + 1] = part_of[n] + splits[n];
  }
  const int64_t num_parts = part_of[num_seqs];
  std::vector<int64_t> part_seq(num_parts);
  for (int64_t n = 0; n < num_seqs; ++n) {
    for (int64_t s = part_of[n]; s < part_of[n + 1]; ++s) part_seq[s] = n;
  }
  const bool split = num_parts > num_seqs;
  // Partial results of split requests: [part, H_kv, groups] max and sum, [.., D] acc.
  std::vector<float> part_m, part_l, part_acc;
  if (split) {
    part_m.resize(num_parts * num_heads);
    part_l.resize(num_parts * num_heads);
    part_acc.resize(num_parts * num_heads * d);
  }

  const kv_t* k_ptr = key_cache.data_ptr<kv_t>();
  const kv_t* v_ptr = value_cache.data_ptr<kv_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  q_t* out_ptr = out.data_ptr<q_t>();
  const int64_t out_s0 = out.stride(0), out_s1 = out.stride(1);

  at::parallel_for(0, num_parts * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(groups * (2 + d + kTile));
    float* m = scratch.data();
    float* l = m + groups;
    float* acc = l + groups;
    float* scores = acc + groups * d;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = item / num_kv_heads, head = item % num_kv_heads;
      const int64_t n = part_seq[part], s = part - part_of[n];
      const int64_t length = last[n] - first[n];
      const int64_t chunk = (length + splits[n] - 1) / splits[n];
      const int64_t lo = first[n] + s * chunk, hi = std::min(last[n], lo + chunk);
      const float* q = qf.data() + (n * num_heads + head * groups) * d;
      attend_range(geo, q, k_ptr, v_ptr, head, tables + n * table_stride, lo, hi, m, l, acc,
                   scores);
      if (splits[n] == 1) {
        for (int64_t g = 0; g < groups; ++g) {
          q_t* dst = out_ptr + n * out_s0 + (head * groups + g) * out_s1;
          store_row(dst, acc + g * d, 1.0f / l[g], d);
        }
      } else {
        const int64_t row = part * num_heads + head * groups;
        std::copy(m, m + groups, part_m.begin() + row);
        std::copy(l, l + groups, part_l.begin() + row);
        std::copy(acc, acc + groups * d, part_acc.begin() + row * d);
      }
    }
  });
  if (!split) return;

  // Combine the splits of each (request, query head): rescale to the global max.
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> total(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / num_heads, h = item % num_heads;
      if (splits[n] == 1) continue;
      float m_all = -std::numeric_limits<float>::infinity();
      for (int64_t p = part_of[n]; p < part_of[n + 1]; ++p) {
        m_all = std::max(m_all, part_m[p * num_heads + h]);
      }
      float l_all = 0.0f;
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t p = part_of[n]; p < part_of[n + 1]; ++p) {
        const int64_t row = p * num_heads + h;
        const float w = std::exp(part_m[row] - m_all);
        l_all += part_l[row] * w;
        const float* a = part_acc.data() + row * d;
        for (int64_t i = 0; i < d; ++i) total[i] += w * a[i];
      }
      store_row(out_ptr + n * out_s0 + h * out_s1, total.data(), 1.0f / l_all, d);
    }
  });
}

}  // namespace

void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale,
                            int64_t sliding_window, double softcap, at::Tensor& out) {
  TRIO_LLM_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors only");
  TRIO_LLM_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [N, H, D], D contiguous");
  TRIO_LLM_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous(),
                 "key/value cache must be contiguous [slots, H_kv, D]");
  TRIO_LLM_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TRIO_LLM_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
                 "key and value caches differ in dtype");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), d = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1);
  TRIO_LLM_CHECK(key_cache.size(2) == d, "head size of the cache differs from the query's");
  TRIO_LLM_CHECK(num_heads % num_kv_heads == 0, num_heads, " query heads over ", num_kv_heads,
                 " KV heads");
  TRIO_LLM_CHECK(block_size >= 1 && key_cache.size(0) % block_size == 0, "bad block_size");
  TRIO_LLM_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                     block_tables.size(0) == num_seqs && block_tables.stride(1) == 1,
                 "block_tables must be int64 [N, max_blocks] with contiguous rows");
  TRIO_LLM_CHECK(context_lens.scalar_type() == at::kLong && context_lens.numel() == num_seqs &&
                     context_lens.is_contiguous(),
                 "context_lens must be int64 [N]");
  TRIO_LLM_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                     out.stride(2) == 1,
                 "out must be [N, H, D] of the query's dtype");

  // Each request's visible positions [first, last), and a check that every block read
  // is inside the pool (a wrong table must not read outside the cache).
  const int64_t num_blocks = key_cache.size(0) / block_size;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> first(num_seqs), last(num_seqs);
  for (int64_t n = 0; n < num_seqs; ++n) {
    TRIO_LLM_CHECK(lens[n] >= 1, "context length ", lens[n], " of request ", n);
    last[n] = lens[n];
    first[n] = sliding_window > 0 ? std::max<int64_t>(0, lens[n] - sliding_window) : 0;
    const int64_t last_col = (last[n] - 1) / block_size;
    TRIO_LLM_CHECK(last_col < block_tables.size(1), "block table of request ", n,
                   " is shorter than its context");
    for (int64_t col = first[n] / block_size; col <= last_col; ++col) {
      const int64_t block = tables[n * block_tables.stride(0) + col];
      TRIO_LLM_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the pool");
    }
  }
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool q_bf16 = query.scalar_type() == at::kBFloat16;
  const bool kv_bf16 = key_cache.scalar_type() == at::kBFloat16;
  TRIO_LLM_CHECK(q_bf16 || query.scalar_type() == at::kFloat, "query must be float32 or bfloat16");
  TRIO_LLM_CHECK(kv_bf16 || key_cache.scalar_type() == at::kFloat,
                 "KV cache must be float32 or bfloat16");
  if (q_bf16 && kv_bf16) {
    decode<c10::BFloat16, c10::BFloat16>(query, key_cache, value_cache, block_tables, first, last,
                                         block_size, s, cap, out);
  } else if (q_bf16) {
    decode<c10::BFloat16, float>(query, key_cache, value_cache, block_tables, first, last,
                                 block_size, s, cap, out);
  } else if (kv_bf16) {
    decode<float, c10::BFloat16>(query, key_cache, value_cache, block_tables, first, last,
                                 block_size, s, cap, out);
  } else {
    decode<float, float>(query, key_cache, value_cache, block_tables, first, last, block_size, s,
                         cap, out);
  }
}

}  // namespace trio_llm

TORCH_LIBRARY_FRAGMENT(trio_llm, m) {
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, "
      "int sliding_window, float softcap, Tensor(a!) out) -> ()",
      &trio_llm::paged_attention_decode);
}
