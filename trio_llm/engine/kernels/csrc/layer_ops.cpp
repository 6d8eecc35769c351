// The small pieces of a decoder layer, each one pass over its rows instead of a chain of
// torch operators (issue 32's "fused decode-layer pieces"):
//
//   add_rms_norm_(hidden, delta?, weight, eps) -> normed
//       hidden += delta (in place, when given), then normed = hidden * rsqrt(mean(hidden^2)
//       + eps) * weight: the residual add and the RMSNorm that follows it.
//   rotary_(qkv, cos, sin, num_heads, head_dim)
//       the rotary embedding ("rotate half" layout) of the first num_heads heads of each
//       row of qkv, in place; cos and sin are [T, head_dim] with both halves equal.
//   silu_and_mul(gate_up) -> silu(gate_up[:, :I]) * gate_up[:, I:], I = width / 2.
//
// Rows are the flattened leading dimensions; the last one must be contiguous. float32 and
// bfloat16 storage; the arithmetic is float32. Results equal the torch operators' up to
// float32 rounding (the sum of squares is accumulated in another order), so the engine
// uses them where bit-identity with transformers is not promised (quantized weights).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace trio_llm {
namespace {

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

void check_rows(const at::Tensor& t, const char* name) {
  TRIO_LLM_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TRIO_LLM_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                 " must be float32 or bfloat16, got ", t.scalar_type());
  TRIO_LLM_CHECK(t.dim() >= 1 && t.is_contiguous(), name, " must be contiguous");
}

template <typename T>
void add_rms_norm_impl(T* hidden, const T* delta, const T* weight, T* out, int64_t rows,
                       int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* h = hidden + r * width;
      float sum = 0.f;
      if (delta != nullptr) {
        const T* d = delta + r * width;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < width; ++i) {
          float v = to_float(h[i]) + to_float(d[i]);
          h[i] = from_float<T>(v);
          float stored = to_float(h[i]);
          sum += stored * stored;
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < width; ++i) {
          float v = to_float(h[i]);
          sum += v * v;
        }
      }
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      T* o = out + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        o[i] = from_float<T>(to_float(h[i]) * scale * to_float(weight[i]));
      }
    }
  });
}

}  // namespace

at::Tensor add_rms_norm_(at::Tensor hidden, const std::optional<at::Tensor>& delta,
                         const at::Tensor& weight, double eps) {
  check_rows(hidden, "hidden");
  const int64_t width = hidden.size(-1);
  TRIO_LLM_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous() &&
                     weight.scalar_type() == hidden.scalar_type(),
                 "weight must be [", width, "] of hidden's dtype");
  if (delta.has_value()) {
    check_rows(*delta, "delta");
    TRIO_LLM_CHECK(delta->sizes() == hidden.sizes() &&
                       delta->scalar_type() == hidden.scalar_type(),
                   "delta must have hidden's shape and dtype");
  }
  at::Tensor out = at::empty_like(hidden);
  const int64_t rows = width == 0 ? 0 : hidden.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, hidden.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_impl<scalar_t>(hidden.data_ptr<scalar_t>(),
                                delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                                width, static_cast<float>(eps));
  });
  return out;
}

namespace {

template <typename T>
void rotary_impl(T* qkv, const T* cos, const T* sin, int64_t tokens, int64_t row_width,
                 int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens * num_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_heads;
      const int64_t h = item % num_heads;
      T* x = qkv + t * row_width + h * head_dim;
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(x[i]);
        const float x2 = to_float(x[i + half]);
        x[i] = from_float<T>(x1 * to_float(c[i]) - x2 * to_float(s[i]));
        x[i + half] = from_float<T>(x2 * to_float(c[i + half]) + x1 * to_float(s[i + half]));
      }
    }
  });
}

}  // namespace

void rotary_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
             int64_t head_dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TRIO_LLM_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  const int64_t row_width = qkv.size(-1);
  TRIO_LLM_CHECK(num_heads >= 0 && num_heads * head_dim <= row_width, num_heads,
                 " heads of ", head_dim, " do not fit rows of ", row_width);
  const int64_t tokens = qkv.numel() / row_width;
  TRIO_LLM_CHECK(cos.numel() == tokens * head_dim && sin.numel() == tokens * head_dim,
                 "cos and sin must be [", tokens, ", ", head_dim, "]");
  TRIO_LLM_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
                 "cos and sin must have qkv's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                          sin.data_ptr<scalar_t>(), tokens, row_width, num_heads, head_dim);
  });
}

namespace {

#if defined(__AVX512F__)
// exp(x) for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor
// polynomial of degree 7 (relative error < 1e-7), times 2^n built in the exponent bits;
// below -87 the result flushes to 0 (attention_math.h's exp8, 16 wide).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 floor_x = _mm512_set1_ps(-87.0f);
  const __mmask16 below = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor_x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) {
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  }
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~below), poly, _mm512_castsi512_ps(bits));
}

// o[i] = silu(g[i]) * u[i] for i < n (a multiple of 16): sigmoid(x) from e = exp(-|x|),
// 1 / (1 + e) for x >= 0 and e / (1 + e) below, so the exponential never overflows.
inline void silu_and_mul_row(const float* g, const float* u, float* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
    const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid), _mm512_loadu_ps(u + i)));
  }
}
#endif

template <typename T>
void silu_and_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inner;
      const T* u = g + inner;
      T* o = out + r * inner;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (inner % 16 == 0) {
          silu_and_mul_row(g, u, o, inner);
          continue;
        }
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) {
        const float x = to_float(g[i]);
        o[i] = from_float<T>(x / (1.f + std::exp(-x)) * to_float(u[i]));
      }
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1);
  TRIO_LLM_CHECK(width % 2 == 0, "gate_up's last dimension must be even, got ", width);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width / 2;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const int64_t rows = width == 0 ? 0 : gate_up.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                                width / 2);
  });
  return out;
}

}  // namespace trio_llm

TORCH_LIBRARY_FRAGMENT(trio_llm, m) {
  m.def("add_rms_norm_(Tensor(a!) hidden, Tensor? delta, Tensor weight, float eps) -> Tensor",
        &trio_llm::add_rms_norm_);
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()",
        &trio_llm::rotary_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &trio_llm::silu_and_mul);
}
