// GGUF blocks repacked for AVX-512: 16 output channels interleaved, so that one 64-byte
// load holds 4 bytes of each of 16 rows (a 32-bit lane per row), the layout of VNNI's
// dpbusd (u8 x s8, 4 products summed per lane) and, de-quantized, of an AMX tile's B
// operand (bfloat16 pairs per lane).
//
// Q4_0, Q4_1 and Q8_0 (32-value blocks) are repacked, at load time, per group g of 16
// rows and block b, into G bytes at offset (g * blocks + b) * G:
//   Q4_0 / Q4_1 (G = 320): 4 chunks of 64 bytes, chunk c lane r byte i = byte 4c + i of
//     row r's 16 nibble bytes (its low nibble is value 4c + i, its high nibble value
//     16 + 4c + i); then d[16] and m[16] as fp16;
//   Q8_0 (G = 576): 8 chunks, chunk c lane r byte i = value 4c + i of row r plus 128;
//     then d[16] and m[16].
// Every value is unsigned u (0..15 or 0..255) with w = d * u + m: Q4_1's own d and m,
// Q4_0's m = -8 d, Q8_0's m = -128 d (exact in fp16: powers of two).
//
// Products (gguf_matmul with the packed type id, kPacked + type):
//   - vnni: the activations quantized to int8 per 32 values (gguf_matmul.cpp's
//     quantize_rows: q, dx, dx * sum(q)); y[m, n] = sum_b d dx (u . q) + m dx sum(q);
//     up to 4 activation rows share each unpacked block;
//   - tiles (AMX, from kTileMinRows rows): each group's blocks de-quantized to bfloat16 B
//     tiles once, multiplied with every 16 activation rows (x rounded to bfloat16).
// Work: one task per group, handed out dynamically (an atomic counter).
#include "gguf_packed.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"
#include "work_split.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TRIO_LLM_PACKED 1
#include <immintrin.h>
#endif

namespace trio_llm {

#if defined(TRIO_LLM_PACKED)
namespace {

using namespace gguf_blocks;

constexpr int64_t kGroup = 16;
// Blocks prefetched ahead by the VNNI kernel (gguf_packed_vnni).
constexpr int64_t kAhead = 16;
// Consecutive groups per task of the VNNI kernel: one thread streams them in order.
constexpr int64_t kGroupsPerTask = 4;

int64_t group_bytes(int64_t type) { return type == kQ8_0 ? 576 : 320; }
int64_t chunks_of(int64_t type) { return type == kQ8_0 ? 8 : 4; }

uint16_t float_to_half(float value) { return c10::Half(value).x; }

// Repack rows [16g, 16g + 16) of w (the file's layout) into out.
void repack_group(const uint8_t* w, int64_t row_bytes, int64_t type, int64_t nb, int64_t g,
                  uint8_t* out) {
  const int64_t G = group_bytes(type), chunks = chunks_of(type);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* dst = out + (g * nb + b) * G;
    uint16_t* d = reinterpret_cast<uint16_t*>(dst + chunks * 64);
    uint16_t* m = d + kGroup;
    for (int64_t r = 0; r < kGroup; ++r) {
      const uint8_t* blk = w + (g * kGroup + r) * row_bytes;
      float scale = 0.0f, offset = 0.0f;
      const uint8_t* values = nullptr;
      if (type == kQ4_1) {
        blk += b * FQ4_1::kBytes;
        scale = half_to_float(blk);
        std::memcpy(&m[r], blk + 2, 2);
        values = blk + 4;
      } else if (type == kQ4_0) {
        blk += b * FQ4_0::kBytes;
        scale = half_to_float(blk);
        offset = -8.0f * scale;
        m[r] = float_to_half(offset);
        values = blk + 2;
      } else {
        blk += b * FQ8_0::kBytes;
        scale = half_to_float(blk);
        offset = -128.0f * scale;
        m[r] = float_to_half(offset);
        values = blk + 2;
      }
      std::memcpy(&d[r], blk, 2);
      for (int64_t c = 0; c < chunks; ++c) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t v = values[4 * c + i];
          dst[c * 64 + r * 4 + i] = type == kQ8_0 ? static_cast<uint8_t>(v ^ 0x80) : v;
        }
      }
    }
  }
}

// y[m0 + r, 16g .. 16g + 16) for r < R (R <= 4) with VNNI, over all nb blocks.
template <bool kQ8, int R>
inline void vnni_group(const uint8_t* w, int64_t nb, int64_t g, const PackedActs& a, int64_t K,
                       int64_t m0, int64_t N, float* y) {
  constexpr int kChunks = kQ8 ? 8 : 4;
  constexpr int64_t G = kQ8 ? 576 : 320;
  (void)kChunks;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* base = w + g * nb * G;
  for (int64_t b = 0; b < nb; ++b, base += G) {
    // The blocks stream from memory: ask for the ones kAhead blocks on now (the groups
    // are contiguous, so past this group's end that is the next group's start; a
    // prefetch never faults, even past the weights' end).
    for (int64_t line = 0; line < G; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(base + kAhead * G + line), _MM_HINT_T0);
    }
    __m512i v[8];
    if constexpr (kQ8) {
      for (int c = 0; c < 8; ++c) v[c] = _mm512_loadu_si512(base + 64 * c);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_loadu_si512(base + 64 * c);
        v[c] = _mm512_and_si512(raw, low);
        v[4 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + kChunks * 64)));
    const __m512 mn = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + kChunks * 64 + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.q + row * K + b * 32;
      int32_t x4[8];
      std::memcpy(x4, xq, 32);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      if constexpr (kQ8) {
        for (int c = 0; c < 8; c += 2) {
          s0 = _mm512_dpbusd_epi32(s0, v[c], _mm512_set1_epi32(x4[c]));
          s1 = _mm512_dpbusd_epi32(s1, v[c + 1], _mm512_set1_epi32(x4[c + 1]));
        }
      } else {
        for (int c = 0; c < 4; ++c) {
          s0 = _mm512_dpbusd_epi32(s0, v[c], _mm512_set1_epi32(x4[c]));
          s1 = _mm512_dpbusd_epi32(s1, v[4 + c], _mm512_set1_epi32(x4[4 + c]));
        }
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      const int64_t at = row * nb + b;
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a.d[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.ds[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + g * kGroup, acc[r]);
}

template <bool kQ8>
void vnni_task(const uint8_t* w, int64_t nb, int64_t g, const PackedActs& a, int64_t K,
               int64_t M, int64_t N, float* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) vnni_group<kQ8, 4>(w, nb, g, a, K, m, N, y);
  switch (M - m) {
    case 3:
      vnni_group<kQ8, 3>(w, nb, g, a, K, m, N, y);
      break;
    case 2:
      vnni_group<kQ8, 2>(w, nb, g, a, K, m, N, y);
      break;
    case 1:
      vnni_group<kQ8, 1>(w, nb, g, a, K, m, N, y);
      break;
  }
}

#if defined(__AVX512BF16__)
// Group g's block b de-quantized into one B tile: 16 rows (k pairs) of 16 lanes (n), each
// lane the bfloat16 pair (k = 2p, 2p + 1) of row n.
template <bool kQ8>
inline void dequantize_tile(const uint8_t* blk, uint16_t* tile) {
  constexpr int kChunks = kQ8 ? 8 : 4;
  const __m512 d = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kChunks * 64)));
  const __m512 mn = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kChunks * 64 + 32)));
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // words [w0 lanes 0..15 | w1 lanes 0..15] -> lane r = (w0_r, w1_r)
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                       6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  auto emit = [&](__m512i values, int k0) {  // values: 4 u8 per lane, k = k0 .. k0 + 3
    const __m512i u[4] = {_mm512_and_si512(values, byte),
                          _mm512_and_si512(_mm512_srli_epi32(values, 8), byte),
                          _mm512_and_si512(_mm512_srli_epi32(values, 16), byte),
                          _mm512_srli_epi32(values, 24)};
    __m512 f[4];
    for (int i = 0; i < 4; ++i) f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u[i]), d, mn);
    for (int h = 0; h < 2; ++h) {
      const __m512bh packed = _mm512_cvtne2ps_pbh(f[2 * h + 1], f[2 * h]);
      const __m512i pairs =
          _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(packed));
      _mm512_storeu_si512(tile + (k0 / 2 + h) * 32, pairs);
    }
  };
  if constexpr (kQ8) {
    for (int c = 0; c < 8; ++c) emit(_mm512_loadu_si512(blk + 64 * c), 4 * c);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(blk + 64 * c);
      emit(_mm512_and_si512(raw, low), 4 * c);
      emit(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), 16 + 4 * c);
    }
  }
}

// Groups g0 .. g0 + ng (ng = 1 or 2) de-quantized into bbuf, block b of group j at
// (j nb + b) 512: the B tile layout of dequantize_tile.
template <bool kQ8>
void dequantize_groups(const uint8_t* w, int64_t nb, int64_t g0, int64_t ng, uint16_t* bbuf) {
  constexpr int64_t G = kQ8 ? 576 : 320;
  for (int64_t j = 0; j < ng; ++j) {
    const uint8_t* base = w + (g0 + j) * nb * G;
    for (int64_t b = 0; b < nb; ++b) dequantize_tile<kQ8>(base + b * G, bbuf + (j * nb + b) * 512);
  }
}

// y[m0 + r, 16 g0 .. 16 (g0 + kN)) for r < R with AVX-512 BF16 dot products: x pairs
// (bfloat16 [M, K] read as uint32) broadcast against the de-quantized B rows in bbuf.
template <int R, int kN>
inline void dpbf16_rows(const uint32_t* xp, int64_t nb, const uint16_t* bbuf, int64_t m0,
                        int64_t K, int64_t N, int64_t g0, float* y) {
  __m512 acc[R][kN];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kN; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int kp = 0; kp < 16; ++kp) {
      __m512bh bv[kN];
      for (int j = 0; j < kN; ++j) {
        bv[j] = (__m512bh)_mm512_loadu_si512(bbuf + (j * nb + b) * 512 + kp * 32);
      }
      for (int r = 0; r < R; ++r) {
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(xp[(m0 + r) * (K / 2) + b * 16 + kp]);
        for (int j = 0; j < kN; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xa, bv[j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kN; ++j) _mm512_storeu_ps(y + (m0 + r) * N + (g0 + j) * kGroup, acc[r][j]);
}

// Every row of y[:, 16 g0 .. 16 (g0 + kN)) from bbuf: 6 rows at a time, then the rest.
template <int kN>
void dpbf16_task(const uint32_t* xp, int64_t nb, const uint16_t* bbuf, int64_t M, int64_t K,
                 int64_t N, int64_t g0, float* y) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) dpbf16_rows<6, kN>(xp, nb, bbuf, m, K, N, g0, y);
  for (; m < M; ++m) dpbf16_rows<1, kN>(xp, nb, bbuf, m, K, N, g0, y);
}
#endif

#if defined(TRIO_LLM_TILES)
// y[:Mp, 16 g0 .. 16 (g0 + ng)) on tiles (ng = 1 or 2 groups); xb bfloat16 A tiles
// [Mp / 16, K / 32, 16, 32] (Mp a multiple of 16), y [Mp, N]. Per 32 activation rows and block: 2 A tiles (x), ng B tiles
// (the groups' de-quantized blocks, made once per task), 2 ng accumulators.
template <bool kQ8>
void tiles_task(const uint8_t* w, int64_t nb, int64_t g0, int64_t ng, const uint16_t* xb,
                int64_t Mp, int64_t K, int64_t N, float* y, std::vector<uint16_t>& bbuf) {
  dequantize_groups<kQ8>(w, nb, g0, ng, bbuf.data());
  const uint16_t* b1 = bbuf.data() + nb * 512;
  const int64_t ystride = N * 4;
  for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
    const bool two_m = m0 + 16 < Mp, two_n = ng == 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < nb; ++b) {
      _tile_loadd(4, bbuf.data() + b * 512, 64);
      _tile_loadd(6, xb + ((m0 / 16) * nb + b) * 512, 64);
      _tile_dpbf16ps(0, 6, 4);
      if (two_n) {
        _tile_loadd(5, b1 + b * 512, 64);
        _tile_dpbf16ps(1, 6, 5);
      }
      if (two_m) {
        _tile_loadd(7, xb + ((m0 / 16 + 1) * nb + b) * 512, 64);
        _tile_dpbf16ps(2, 7, 4);
        if (two_n) _tile_dpbf16ps(3, 7, 5);
      }
    }
    float* out = y + m0 * N + g0 * kGroup;
    _tile_stored(0, out, ystride);
    if (two_n) _tile_stored(1, out + kGroup, ystride);
    if (two_m) {
      _tile_stored(2, out + 16 * N, ystride);
      if (two_n) _tile_stored(3, out + 16 * N + kGroup, ystride);
    }
  }
}
#endif

}  // namespace

int64_t gguf_packed_type(int64_t type) {
  return (type == kQ4_0 || type == kQ4_1 || type == kQ8_0) ? kPacked + type : -1;
}

at::Tensor gguf_repack(const at::Tensor& w, int64_t type, int64_t K) {
  TRIO_LLM_CHECK(gguf_packed_type(type) >= 0, "gguf_repack: type ", type, " is not repacked");
  TRIO_LLM_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                 "gguf_repack: w must be a contiguous uint8 [N, row_bytes] tensor");
  TRIO_LLM_CHECK(K % 32 == 0, "gguf_repack: K must be a multiple of 32");
  const int64_t N = w.size(0), nb = K / 32;
  const int64_t row_bytes = nb * (type == kQ4_1 ? 20 : type == kQ4_0 ? 18 : 34);
  TRIO_LLM_CHECK(w.size(1) == row_bytes, "gguf_repack: rows of ", w.size(1), " bytes, K=", K,
                 " needs ", row_bytes);
  TRIO_LLM_CHECK(N % kGroup == 0, "gguf_repack: N=", N, " is not a multiple of 16");
  at::Tensor out = at::empty({N / kGroup, nb * group_bytes(type)}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kGroup, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) repack_group(src, row_bytes, type, nb, g, dst);
  });
  return out;
}

bool gguf_packed_tiles(const at::Tensor& x, const at::Tensor& w, int64_t packed_type,
                       float* y) {
#if defined(TRIO_LLM_TILES)
  if (!gguf_tiles_available()) return false;
  const bool q8 = packed_type - kPacked == kQ8_0;
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  const int64_t N = w.size(0) * kGroup;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t Mp = (M + 15) / 16 * 16;
  at::Tensor padded = at::zeros({Mp, K}, x.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, M).copy_(x);
  // As A tiles, each 16 rows x 32 values contiguous (a tile load of 64-byte rows).
  const at::Tensor xb = padded.view({Mp / 16, 16, nb, 32}).permute({0, 2, 1, 3}).contiguous();
  const uint16_t* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr<c10::BFloat16>());
  // The tiles store 16 rows at once: rows past M go to a scratch copy of y's shape.
  at::Tensor scratch;
  float* out = y;
  if (Mp != M) {
    scratch = at::empty({Mp, N}, x.options().dtype(at::kFloat));
    out = scratch.data_ptr<float>();
  }
  thread_local std::vector<uint16_t> bbuf;
  const int64_t groups = N / kGroup;
  dynamic_tasks(
      (groups + 1) / 2,
      [&](int64_t t) {
        const int64_t ng = std::min<int64_t>(2, groups - 2 * t);
        if (q8) {
          tiles_task<true>(wp, nb, 2 * t, ng, xbp, Mp, K, N, out, bbuf);
        } else {
          tiles_task<false>(wp, nb, 2 * t, ng, xbp, Mp, K, N, out, bbuf);
        }
      },
      [&] {
        bbuf.resize(2 * nb * 512);
        gguf_configure_tiles();
      },
      [] { _tile_release(); });
  if (Mp != M) std::memcpy(y, out, sizeof(float) * M * N);
  return true;
#else
  return false;
#endif
}

bool gguf_packed_dpbf16(const at::Tensor& x, const at::Tensor& w, int64_t packed_type,
                        float* y) {
#if defined(__AVX512BF16__)
  const bool q8 = packed_type - kPacked == kQ8_0;
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  const int64_t N = w.size(0) * kGroup, groups = N / kGroup;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr<c10::BFloat16>());
  thread_local std::vector<uint16_t> bbuf;
  dynamic_tasks(
      (groups + 1) / 2,
      [&](int64_t t) {
        const int64_t ng = std::min<int64_t>(2, groups - 2 * t);
        if (q8) {
          dequantize_groups<true>(wp, nb, 2 * t, ng, bbuf.data());
        } else {
          dequantize_groups<false>(wp, nb, 2 * t, ng, bbuf.data());
        }
        if (ng == 2) {
          dpbf16_task<2>(xp, nb, bbuf.data(), M, K, N, 2 * t, y);
        } else {
          dpbf16_task<1>(xp, nb, bbuf.data(), M, K, N, 2 * t, y);
        }
      },
      [&] { bbuf.resize(2 * nb * 512); }, [] {});
  return true;
#else
  (void)x, (void)w, (void)packed_type, (void)y;
  return false;
#endif
}

void gguf_packed_vnni(const int8_t* q, const float* d, const float* ds, int64_t M, int64_t K,
                      const at::Tensor& w, int64_t packed_type, float* y) {
  const bool q8 = packed_type - kPacked == kQ8_0;
  const int64_t nb = K / 32, N = w.size(0) * kGroup;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const PackedActs a{q, d, ds};
  const int64_t groups = N / kGroup;
  dynamic_tasks(
      (groups + kGroupsPerTask - 1) / kGroupsPerTask,
      [&](int64_t t) {
        const int64_t end = std::min(groups, (t + 1) * kGroupsPerTask);
        for (int64_t g = t * kGroupsPerTask; g < end; ++g) {
          if (q8) {
            vnni_task<true>(wp, nb, g, a, K, M, N, y);
          } else {
            vnni_task<false>(wp, nb, g, a, K, M, N, y);
          }
        }
      },
      [] {}, [] {});
}

#else

int64_t gguf_packed_type(int64_t) { return -1; }

at::Tensor gguf_repack(const at::Tensor&, int64_t type, int64_t) {
  TRIO_LLM_CHECK(false, "gguf_repack: this CPU has no AVX-512 VNNI (type ", type, ")");
  return at::Tensor();
}

bool gguf_packed_tiles(const at::Tensor&, const at::Tensor&, int64_t, float*) { return false; }

bool gguf_packed_dpbf16(const at::Tensor&, const at::Tensor&, int64_t, float*) { return false; }

void gguf_packed_vnni(const int8_t*, const float*, const float*, int64_t, int64_t,
                      const at::Tensor&, int64_t packed_type, float*) {
  TRIO_LLM_CHECK(false, "gguf_matmul: packed type ", packed_type, " needs AVX-512 VNNI");
}

#endif

}  // namespace trio_llm
