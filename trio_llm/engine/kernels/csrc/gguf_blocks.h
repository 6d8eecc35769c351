// GGUF's weight blocks as gguf_matmul.cpp reads them: one 32-value block in a common form
// (`Block`) and, per format, its size and how its bytes unpack into that form (the traits
// FQ8_0, FQ4_0, FQ4_1, FQ4_K, FQ6_K; layouts in gguf_matmul.cpp's header comment).
#pragma once

#include <cstring>

#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace trio_llm {
namespace gguf_blocks {

// GGML type ids of the formats below.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// One 32-value weight block in a common form: 32 bytes (signed or unsigned values), the
// integer scales of its two 16-value halves (1 except Q6_K), a float scale and an offset.
#if defined(__AVX2__)
using Bytes = __m256i;
#else
struct Bytes {
  uint8_t b[32];
};
#endif

struct Block {
  Bytes q;
  int sc0, sc1;
  float s, m;
};

// ---- format traits: values per block, bytes per block, signedness, unpack ----------------

struct FQ8_0 {
  static constexpr int kValues = 32, kBytes = 34, kSub = 1;
  static constexpr bool kSigned = true, kHalfScales = false;
  static inline void unpack(const uint8_t* blk, int /*j*/, Block& out) {
    out.s = half_to_float(blk);
    out.m = 0.0f;
    out.sc0 = out.sc1 = 1;
#if defined(__AVX2__)
    out.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
#else
    std::memcpy(out.q.b, blk + 2, 32);
#endif
  }
};

template <bool kOffset>
inline void unpack_nibbles(const uint8_t* qs, Block& out) {
#if defined(__AVX2__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  __m256i v = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
  if (!kOffset) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
  out.q = v;
#else
  for (int j = 0; j < 16; ++j) {
    int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
    if (!kOffset) {
      lo -= 8;
      hi -= 8;
    }
    out.q.b[j] = static_cast<uint8_t>(lo);
    out.q.b[j + 16] = static_cast<uint8_t>(hi);
  }
#endif
}

struct FQ4_0 {
  static constexpr int kValues = 32, kBytes = 18, kSub = 1;
  static constexpr bool kSigned = true, kHalfScales = false;
  static inline void unpack(const uint8_t* blk, int /*j*/, Block& out) {
    out.s = half_to_float(blk);
    out.m = 0.0f;
    out.sc0 = out.sc1 = 1;
    unpack_nibbles<false>(blk + 2, out);
  }
};

struct FQ4_1 {
  static constexpr int kValues = 32, kBytes = 20, kSub = 1;
  static constexpr bool kSigned = false, kHalfScales = false;
  static inline void unpack(const uint8_t* blk, int /*j*/, Block& out) {
    out.s = half_to_float(blk);
    out.m = half_to_float(blk + 2);
    out.sc0 = out.sc1 = 1;
    unpack_nibbles<true>(blk + 4, out);
  }
};

struct FQ4_K {
  static constexpr int kValues = 256, kBytes = 144, kSub = 8;
  static constexpr bool kSigned = false, kHalfScales = false;
  static inline void unpack(const uint8_t* blk, int j, Block& out) {
    const float d = half_to_float(blk);
    const float dmin = half_to_float(blk + 2);
    const uint8_t* sc = blk + 4;
    int scale, min;
    if (j < 4) {
      scale = sc[j] & 63;
      min = sc[j + 4] & 63;
    } else {
      scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
      min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
    out.s = d * static_cast<float>(scale);
    out.m = -dmin * static_cast<float>(min);
    out.sc0 = out.sc1 = 1;
    const uint8_t* qs = blk + 16 + 32 * (j / 2);
    const int shift = 4 * (j % 2);
#if defined(__AVX2__)
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    v = _mm256_srli_epi16(v, shift);
    out.q = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
#else
    for (int l = 0; l < 32; ++l) out.q.b[l] = static_cast<uint8_t>((qs[l] >> shift) & 0x0F);
#endif
  }
};

struct FQ6_K {
  static constexpr int kValues = 256, kBytes = 210, kSub = 8;
  static constexpr bool kSigned = true, kHalfScales = true;
  static inline void unpack(const uint8_t* blk, int j, Block& out) {
    // Sub-block j = 4h + t holds values 128h + 32t + l (l = 0..31).
    const int h = j / 4, t = j % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (t & 1);
    const uint8_t* qh = blk + 128 + 32 * h;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    out.s = half_to_float(blk + 208);
    out.m = 0.0f;
    out.sc0 = scales[2 * j];
    out.sc1 = scales[2 * j + 1];
    const int lshift = 4 * (t >> 1), hshift = 2 * t;
#if defined(__AVX2__)
    __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    lo = _mm256_and_si256(_mm256_srli_epi16(lo, lshift), _mm256_set1_epi8(0x0F));
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    hi = _mm256_and_si256(_mm256_srli_epi16(hi, hshift), _mm256_set1_epi8(0x03));
    hi = _mm256_slli_epi16(hi, 4);
    out.q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
#else
    for (int l = 0; l < 32; ++l) {
      const int q = ((ql[l] >> lshift) & 0x0F) | (((qh[l] >> hshift) & 0x03) << 4);
      out.q.b[l] = static_cast<uint8_t>(static_cast<int8_t>(q - 32));
    }
#endif
  }
};

// Calls f(Format{}) with the format traits of GGML `type` (FQ4_0, FQ4_1, FQ8_0, FQ4_K,
// FQ6_K); false, without calling it, for any other type.
template <typename F>
inline bool with_format(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0:
      f(FQ4_0{});
      return true;
    case kQ4_1:
      f(FQ4_1{});
      return true;
    case kQ8_0:
      f(FQ8_0{});
      return true;
    case kQ4_K:
      f(FQ4_K{});
      return true;
    case kQ6_K:
      f(FQ6_K{});
      return true;
  }
  return false;
}

}  // namespace gguf_blocks
}  // namespace trio_llm
