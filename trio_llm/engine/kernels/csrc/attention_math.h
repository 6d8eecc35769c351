// The vector math of trio_llm::paged_attention_decode (paged_attention.cpp): dot products,
// the softmax's exp and max over a tile of scores, and the weighted sum of value rows, with
// AVX2 + FMA where the compiler targets it and plain loops otherwise. Every function
// computes in float32 whatever the storage dtype (float32 or bfloat16).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRIO_LLM_ATTN_AVX2 1
#endif

namespace trio_llm {
namespace attention_math {

// Tokens scored at once (a tile never crosses a KV block).
constexpr int64_t kTile = 32;

// Scalar versions of the vector helpers, for head sizes that are not a multiple of 8 (and
// the whole of the fallback where AVX2 is not targeted).
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

#else  // scalar fallback: the plain loops, which the compiler may vectorise

template <typename kv_t>
inline float dot(const float* q, const kv_t* k, int64_t d) { return dot_scalar(q, k, d); }

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
inline void accumulate(float* acc, const float* p, int64_t groups, const kv_t* v,
                       int64_t stride, int64_t n, int64_t d) {
  accumulate_scalar(acc, p, groups, v, stride, n, d);
}

inline bool vector_width_fits(int64_t) { return true; }

#endif

}  // namespace attention_math
}  // namespace trio_llm
