// GGUF-native weight products: y[M, N] = x[M, K] @ W[N, K].T where W is a GGUF tensor's raw
// blocks (uint8 [N, row_bytes], row-major, N rows of K / block_size blocks), without a
// de-quantized copy of W.
//
// The activations are quantized per 32-value block to int8 with one float32 scale
// (dx = amax / 127, q = round-half-even(x / dx)), then each weight block's integer dot
// product with the activation block is taken in int32 and scaled once per block:
//
//   signed formats (Q8_0, Q4_0, Q6_K):  w = s * sc[half] * q          (q signed)
//   offset formats (Q4_1, Q4_K):        w = s * q + m                 (q unsigned)
//   y += dx * s * sum(sc[half] * q_w * q_x)  (+ m * dx * sum(q_x) for offset formats)
//
// AVX2: _mm256_maddubs_epi16 (u8 x s8 pairs) then _mm256_madd_epi16 (to int32); a signed
// weight uses the sign trick (|w| x sign(x, w)). With AVX-VNNI / AVX512-VNNI+VL the two
// steps are one dpbusd. A scalar fallback computes the same integers. Block layouts are
// those of the gguf package's quants.py (ggml's):
//   Q4_0  (32 values, 18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8)
//   Q4_1  (32 values, 20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
//   Q8_0  (32 values, 34 bytes): fp16 d, 32 int8; w = d * q
//   Q4_K  (256 values, 144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales / mins for
//         8 sub-blocks of 32, 128 bytes of nibbles; w = d * sc_j * q - dmin * m_j
//   Q6_K  (256 values, 210 bytes): 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8
//         scales (one per 16 values), fp16 d; w = d * sc_i * (q - 32)
// In element order a 32-value (sub-)block's nibbles are: values 0..15 the low nibbles of
// its 16 bytes, 16..31 the high ones (Q4_0 / Q4_1); Q4_K's sub-block 2g is the low nibbles
// of bytes 32g..32g+31 and 2g+1 their high nibbles.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "common.h"
#include "gguf_blocks.h"
#include "gguf_packed.h"
#include "gguf_tiles.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace trio_llm {
namespace {

using namespace gguf_blocks;

// Quantized activations: q int8 [M, K], d float [M, K / 32] (the block scale), ds float
// [M, K / 32] (d * sum of the block's q, for offset formats).
struct Acts {
  const int8_t* q;
  const float* d;
  const float* ds;
  int64_t K;
  int64_t nb;
};

template <typename T>
void quantize_rows(const T* __restrict__ x, int64_t M, int64_t K, int8_t* __restrict__ q,
                   float* __restrict__ d, float* __restrict__ ds) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xb = x + (i / nb) * K + (i % nb) * 32;
      int8_t* qb = q + (i / nb) * K + (i % nb) * 32;
      float v[32];
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) {
        v[j] = to_float(xb[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float scale = amax / 127.0f;
      const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int r = static_cast<int>(std::nearbyint(v[j] * inv));
        qb[j] = static_cast<int8_t>(r);
        sum += r;
      }
      d[i] = scale;
      ds[i] = scale * static_cast<float>(sum);
    }
  });
}

// ---- the integer dot product of one block with one activation block -----------------------

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// int32 x 8: lanes 0..3 sum values 0..15 (times sc0), lanes 4..7 values 16..31 (times sc1).
template <bool kSigned, bool kHalfScales>
inline __m256i idot(__m256i w, __m256i x, const Block& b) {
  __m256i u = w, s = x;
  if (kSigned) {
    u = _mm256_sign_epi8(w, w);
    s = _mm256_sign_epi8(x, w);
  }
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#if defined(__AVXVNNI__)
  __m256i r = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  __m256i r = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
  if (kHalfScales) {
    r = _mm256_mullo_epi32(r, _mm256_set_m128i(_mm_set1_epi32(b.sc1), _mm_set1_epi32(b.sc0)));
  }
  return r;
#else
  const __m256i p = _mm256_maddubs_epi16(u, s);  // no saturation: |u| <= 128, |s| <= 127
  const __m256i scales =
      kHalfScales ? _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b.sc1)),
                                     _mm_set1_epi16(static_cast<int16_t>(b.sc0)))
                  : _mm256_set1_epi16(1);
  return _mm256_madd_epi16(p, scales);
#endif
}
#endif

#if defined(__AVX2__)
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a, Acc b) { return hsum(_mm256_add_ps(a, b)); }
#else
using Acc = float;
inline Acc acc_zero() { return 0.0f; }
inline float acc_sum(Acc a, Acc b) { return a + b; }
#endif

// Sub-block `idx` of a weight row (32 values) times activation rows m0 .. m0 + R - 1,
// added to acc[r] (the block's scaled integer dot) and off[r] (the offset term).
template <class F, int R>
inline void block_dot(const uint8_t* __restrict__ wrow, const Acts& a, int64_t m0, int64_t idx,
                      Acc* acc, float* off) {
  Block b;
  F::unpack(wrow + (idx / F::kSub) * F::kBytes, static_cast<int>(idx % F::kSub), b);
  for (int r = 0; r < R; ++r) {
    const int64_t row = m0 + r;
    const float dx = a.d[row * a.nb + idx];
    const int8_t* xq = a.q + row * a.K + idx * 32;
#if defined(__AVX2__)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    const __m256i dot = idot<F::kSigned, F::kHalfScales>(b.q, x, b);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(b.s * dx), acc[r]);
#else
    int s0 = 0, s1 = 0;
    for (int l = 0; l < 16; ++l) {
      const int w0 = F::kSigned ? static_cast<int8_t>(b.q.b[l]) : b.q.b[l];
      const int w1 = F::kSigned ? static_cast<int8_t>(b.q.b[l + 16]) : b.q.b[l + 16];
      s0 += w0 * xq[l];
      s1 += w1 * xq[l + 16];
    }
    acc[r] += b.s * dx * static_cast<float>(s0 * b.sc0 + s1 * b.sc1);
#endif
    if (!F::kSigned) off[r] += b.m * a.ds[row * a.nb + idx];
  }
}

// y[m0 + r, n] for r < R: one weight row against R activation rows. Even and odd
// sub-blocks go to separate accumulators (two independent FMA chains for batch 1).
template <class F, int R>
inline void row_dot(const uint8_t* __restrict__ wrow, const Acts& a, int64_t m0, float* out) {
  const int64_t total = a.nb;  // 32-value sub-blocks per row
  Acc acc0[R], acc1[R];
  float off0[R], off1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = acc1[r] = acc_zero();
    off0[r] = off1[r] = 0.0f;
  }
  int64_t idx = 0;
  for (; idx + 1 < total; idx += 2) {
    block_dot<F, R>(wrow, a, m0, idx, acc0, off0);
    block_dot<F, R>(wrow, a, m0, idx + 1, acc1, off1);
  }
  if (idx < total) block_dot<F, R>(wrow, a, m0, idx, acc0, off0);
  for (int r = 0; r < R; ++r) out[r] = acc_sum(acc0[r], acc1[r]) + off0[r] + off1[r];
}

// From this many activation rows on, the product runs on AMX tiles where the CPU and the
// kernel allow (gguf_tiles.cpp): the int8 row kernel below costs M times its M = 1 time.
constexpr int64_t kTileMinRows = 4;
// The same for repacked blocks, whose VNNI kernel (gguf_packed.cpp) stays ahead of the tiles
// up to about 16 rows (SmolLM2's layers, Intel Xeon with AMX: 227 against 342 us at 8 rows).
constexpr int64_t kPackedTileMinRows = 16;
// Without tiles, from this many rows on repacked blocks multiply in bfloat16 (AVX512_BF16 dot
// products) rather than with int8 activations: closer to the float32 model at prefill (the
// teacher-forced agreement, AMD EPYC with AVX512_BF16: top-1 97.9 % -> 99.4 %), at the int8
// kernel's speed from 32 rows on (SmolLM2's layers: 0.9-1.2x its time), slower below.
constexpr int64_t kPackedBf16MinRows = 32;

constexpr int64_t kRowsPerTask = 4;   // output channels per parallel work item, at least
constexpr int64_t kMTile = 64;        // activation rows per work item (prefill)

template <class F>
void matmul(const uint8_t* w, int64_t row_bytes, const Acts& a, int64_t M, int64_t N,
            float* y) {
  const int64_t m_tiles = (M + kMTile - 1) / kMTile;
  const int64_t n_tiles = (N + kRowsPerTask - 1) / kRowsPerTask;
  // Grain: enough output channels per task to amortise the task start, for decode.
  const int64_t grain = std::max<int64_t>(1, 64 / std::min<int64_t>(M, 16));
  at::parallel_for(0, m_tiles * n_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mt = t / n_tiles, nt = t % n_tiles;
      const int64_t m_begin = mt * kMTile, m_end = std::min(M, m_begin + kMTile);
      const int64_t n_begin = nt * kRowsPerTask, n_end = std::min(N, n_begin + kRowsPerTask);
      for (int64_t m = m_begin; m < m_end;) {
        const int64_t left = m_end - m;
        for (int64_t n = n_begin; n < n_end; ++n) {
          const uint8_t* wrow = w + n * row_bytes;
          float out[4];
          if (left >= 4) {
            row_dot<F, 4>(wrow, a, m, out);
          } else if (left == 3) {
            row_dot<F, 3>(wrow, a, m, out);
          } else if (left == 2) {
            row_dot<F, 2>(wrow, a, m, out);
          } else {
            row_dot<F, 1>(wrow, a, m, out);
          }
          for (int64_t r = 0; r < std::min<int64_t>(left, 4); ++r) y[(m + r) * N + n] = out[r];
        }
        m += std::min<int64_t>(left, 4);
      }
    }
  });
}

int64_t values_per_block(int64_t type) {
  switch (type) {
    case kQ4_0:
    case kQ4_1:
    case kQ8_0:
      return 32;
    case kQ4_K:
    case kQ6_K:
      return 256;
  }
  TRIO_LLM_CHECK(false, "gguf_matmul: unsupported GGML type ", type,
                 " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
  return 0;
}

int64_t bytes_per_block(int64_t type) {
  int64_t bytes = 0;
  if (!with_format(type, [&](auto format) { bytes = decltype(format)::kBytes; })) {
    values_per_block(type);  // raises
  }
  return bytes;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x) {
  TRIO_LLM_CHECK(x.dim() == 2, "gguf_quantize_rows: x must be [M, K]");
  TRIO_LLM_CHECK(x.device().is_cpu(), "gguf_quantize_rows: x must be on the CPU");
  TRIO_LLM_CHECK(x.size(1) % 32 == 0, "gguf_quantize_rows: K must be a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  at::Tensor ds = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  if (xc.scalar_type() == at::kFloat) {
    quantize_rows(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  ds.data_ptr<float>());
  } else if (xc.scalar_type() == at::kBFloat16) {
    quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, q.data_ptr<int8_t>(),
                  d.data_ptr<float>(), ds.data_ptr<float>());
  } else {
    TRIO_LLM_CHECK(false, "gguf_quantize_rows: x must be float32 or bfloat16");
  }
  return {q, d, ds};
}

}  // namespace

// Quantize each row of x (float32 or bfloat16 [M, K], K % 32 == 0) per 32-value block.
// Returns (q int8 [M, K], d float32 [M, K / 32], d * sum(q) float32 [M, K / 32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_rows(const at::Tensor& x) {
  return quantize(x);
}

// As `product` for w repacked by gguf_repack (type kPacked + its GGML type).
static at::Tensor packed_product(const at::Tensor& x, const at::Tensor& w, int64_t type,
                                 bool tiles) {
  TRIO_LLM_CHECK(gguf_packed_type(type - kPacked) == type, "gguf_matmul: packed type ", type,
                 " is not one this library packs");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  TRIO_LLM_CHECK(K % 32 == 0, "gguf_matmul: K=", K, " is not a multiple of 32");
  const int64_t group = type - kPacked == kQ8_0 ? 576 : 320;
  TRIO_LLM_CHECK(w.size(1) == K / 32 * group, "gguf_matmul: packed rows of ", w.size(1),
                 " bytes; K=", K, " needs ", K / 32 * group);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  float* yp = y.data_ptr<float>();
  if (tiles && M >= kPackedTileMinRows && gguf_packed_tiles(x, w, type, yp)) return y;
  if (tiles && M >= kPackedBf16MinRows && gguf_packed_dpbf16(x, w, type, yp)) return y;
  auto [q, d, ds] = quantize(x);
  gguf_packed_vnni(q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>(), M, K, w,
                   type, yp);
  return y;
}

// y float32 [M, N] = x [M, K] @ dequantize(w).T, w uint8 [N, K / values * bytes] of GGML
// type `type`; x float32 or bfloat16. With `tiles` and M >= kTileMinRows on AMX tiles where
// available (weights and x rounded to bfloat16), else x quantized to int8 per 32-value block.
static at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t type, bool tiles) {
  TRIO_LLM_CHECK(x.dim() == 2 && w.dim() == 2, "gguf_matmul: x [M, K] and w [N, row_bytes]");
  TRIO_LLM_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gguf_matmul: CPU tensors only");
  TRIO_LLM_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(),
                 "gguf_matmul: w must be a contiguous uint8 tensor of GGUF blocks");
  TRIO_LLM_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                 "gguf_matmul: x must be float32 or bfloat16");
  if (type >= kPacked) return packed_product(x, w, type, tiles);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t values = values_per_block(type);
  TRIO_LLM_CHECK(K % values == 0, "gguf_matmul: K=", K, " is not a multiple of ", values);
  const int64_t row_bytes = K / values * bytes_per_block(type);
  TRIO_LLM_CHECK(w.size(1) == row_bytes, "gguf_matmul: w rows have ", w.size(1),
                 " bytes; K=", K, " of type ", type, " needs ", row_bytes);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (tiles && M >= kTileMinRows && gguf_matmul_tiles(x, wp, row_bytes, type, N, yp)) return y;
  auto [q, d, ds] = quantize(x);
  const Acts a{q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>(), K, K / 32};
  with_format(type, [&](auto format) {
    matmul<decltype(format)>(wp, row_bytes, a, M, N, yp);
  });
  return y;
}

// The product as the engine takes it: on tiles from kTileMinRows rows where available.
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  return product(x, w, type, true);
}

// The int8 row kernel alone, whatever M (the tiles' fallback; for tests and benchmarks).
at::Tensor gguf_matmul_int8(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  return product(x, w, type, false);
}

}  // namespace trio_llm

TORCH_LIBRARY_FRAGMENT(trio_llm, m) {
  m.def("gguf_quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)",
        &trio_llm::gguf_quantize_rows);
  m.def("gguf_matmul(Tensor x, Tensor w, int type) -> Tensor", &trio_llm::gguf_matmul);
  m.def("gguf_matmul_int8(Tensor x, Tensor w, int type) -> Tensor", &trio_llm::gguf_matmul_int8);
  m.def("gguf_tiles_available() -> bool", &trio_llm::gguf_tiles_available);
  m.def("gguf_packed_type(int type) -> int", &trio_llm::gguf_packed_type);
  m.def("gguf_repack(Tensor w, int type, int K) -> Tensor", &trio_llm::gguf_repack);
}
