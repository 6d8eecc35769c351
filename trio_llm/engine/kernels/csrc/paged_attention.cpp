// trio_llm::paged_attention_decode: attention of single-token requests (decode) over the
// paged KV cache, read in place through each request's block table.
//
// Layout (trio_llm.engine.attention.KVCache): keys and values are
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

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRIO_LLM_ATTN_AVX2 1
#endif

namespace trio_llm {
namespace {

// Tokens scored at once (a tile never crosses a KV block).
constexpr int64_t kTile = 32;
// A context split is at least this many tokens (below, the reduction costs more).
constexpr int64_t kMinSplit = 128;
// Work items wanted per thread before a request's context is split.
constexpr int64_t kItemsPerThread = 8;

#if defined(TRIO_LLM_ATTN_AVX2)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift.
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}

inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for x <= 0 (arguments of the softmax after the max is subtracted): x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 7 (relative error < 1e-7),
// times 2^n built in the exponent bits. Below -87 the result flushes to 0.
inline __m256 exp8(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  __m256 below = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_x);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(below, result);
}

template <typename kv_t>
inline float dot(const float* __restrict__ q, const kv_t* __restrict__ k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a1);
  }
  for (; i < d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
  return hsum(_mm256_add_ps(a0, a1));
}

// s[0..n) = exp(s - m), returns their sum.
inline float exp_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
    m = hmax(mv);
  }
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// acc[g][0..d) += sum_t p[g * kTile + t] * v[t][0..d), for the n rows v + t * stride.
template <typename kv_t>
inline void accumulate(float* __restrict__ acc, const float* __restrict__ p, int64_t groups,
                       const kv_t* __restrict__ v, int64_t stride, int64_t n, int64_t d) {
  for (int64_t g = 0; g < groups; ++g) {
    float* a = acc + g * d;
    const float* pg = p + g * kTile;
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
      __m256 a0 = _mm256_loadu_ps(a + i), a1 = _mm256_loadu_ps(a + i + 8);
      __m256 a2 = _mm256_loadu_ps(a + i + 16), a3 = _mm256_loadu_ps(a + i + 24);
      for (int64_t t = 0; t < n; ++t) {
        const kv_t* row = v + t * stride + i;
        __m256 w = _mm256_set1_ps(pg[t]);
        a0 = _mm256_fmadd_ps(w, load8(row), a0);
        a1 = _mm256_fmadd_ps(w, load8(row + 8), a1);
        a2 = _mm256_fmadd_ps(w, load8(row + 16), a2);
        a3 = _mm256_fmadd_ps(w, load8(row + 24), a3);
      }
      _mm256_storeu_ps(a + i, a0);
      _mm256_storeu_ps(a + i + 8, a1);
      _mm256_storeu_ps(a + i + 16, a2);
      _mm256_storeu_ps(a + i + 24, a3);
    }
    for (; i < d; i += 8) {
      __m256 a0 = _mm256_loadu_ps(a + i);
      for (int64_t t = 0; t < n; ++t) {
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]), load8(v + t * stride + i), a0);
      }
      _mm256_storeu_ps(a + i, a0);
    }
  }
}

inline bool vector_width_fits(int64_t d) { return d % 8 == 0; }

#else  // scalar fallback: plain loops the compiler may vectorise

template <typename kv_t>
inline float dot(const float* __restrict__ q, const kv_t* __restrict__ k, int64_t d) {
  float sum = 0.0f;
  for (int64_t i = 0; i < d; ++i) sum += q[i] * to_float(k[i]);
  return sum;
}

inline float exp_sum(float* s, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

template <typename kv_t>
inline void accumulate(float* __restrict__ acc, const float* __restrict__ p, int64_t groups,
                       const kv_t* __restrict__ v, int64_t stride, int64_t n, int64_t d) {
  for (int64_t g = 0; g < groups; ++g) {
    float* a = acc + g * d;
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[g * kTile + t];
      const kv_t* row = v + t * stride;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += w * to_float(row[i]);
    }
  }
}

inline bool vector_width_fits(int64_t) { return true; }

#endif

// Scalar versions of the vector helpers for head sizes that are not a multiple of 8.
template <typename kv_t>
inline float dot_scalar(const float* q, const kv_t* k, int64_t d) {
  float sum = 0.0f;
  for (int64_t i = 0; i < d; ++i) sum += q[i] * to_float(k[i]);
  return sum;
}

template <typename kv_t>
inline void accumulate_scalar(float* acc, const float* p, int64_t groups, const kv_t* v,
                              int64_t stride, int64_t n, int64_t d) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[g * kTile + t];
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] += w * to_float(v[t * stride + i]);
    }
  }
}

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

}  // namespace
}  // namespace trio_llm

TORCH_LIBRARY_FRAGMENT(trio_llm, m) {
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, "
      "int sliding_window, float softcap, Tensor(a!) out) -> ()",
      &trio_llm::paged_attention_decode);
}
