// Batched GGUF products on AMX-BF16 tiles: y[M, N] = x[M, K] @ dequantize(W).T for M rows
// at once (decode batches, prefill chunks), where the int8 row kernel of gguf_matmul.cpp
// costs M times its batch-1 time.
//
// The work is split into tasks of 32 weight rows (output channels), handed out dynamically
// (an atomic counter: a thread that a neighbour slows takes fewer). A task de-quantizes its
// 32 rows once into a bfloat16 buffer (row-major [32, K], the tile's A operand: 16 rows of
// 32 values per tile) and multiplies them with every activation row: the activations are
// rounded to bfloat16 once per product and laid out as the B operand (VNNI pairs:
// xv[m / 16][k / 2][m % 16][k % 2]). Each 32 x 32 output block takes 4 accumulator tiles
// (C[n][m], float32), 2 weight tiles and 2 activation tiles per 32 values of K; the
// accumulators are stored transposed into y.
//
// The weights are rounded to bfloat16 (8 significant bits) before the product, the
// activations too; the sums are float32. The tile state is asked of the kernel once
// (arch_prctl); where it refuses, or the CPU has no AMX-BF16, gguf_matmul uses its int8
// row kernel.
#include "gguf_tiles.h"

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "common.h"
#include "gguf_blocks.h"
#include "work_split.h"

#if defined(TRIO_LLM_TILES)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace trio_llm {

#if defined(TRIO_LLM_TILES)
namespace {

using namespace gguf_blocks;

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};


// 4-bit formats: a block's 16 possible values (s * q + m, q = 0..15; Q4_0's q - 8 read as
// q with m = -8 s) rounded to bfloat16 once, then looked up per value (vpermw).
template <class F>
constexpr bool kFourBit = std::is_same<F, FQ4_0>::value || std::is_same<F, FQ4_1>::value ||
                          std::is_same<F, FQ4_K>::value;

template <class F>
inline __m512i dequantize_block(const Block& b) {
  if constexpr (kFourBit<F>) {
    const __m256i q = F::kSigned ? _mm256_add_epi8(b.q, _mm256_set1_epi8(8)) : b.q;
    const float m = F::kSigned ? -8.0f * b.s : b.m;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m256bh table =
        _mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, _mm512_set1_ps(b.s), _mm512_set1_ps(m)));
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q),
                                    _mm512_castsi256_si512(reinterpret_cast<const __m256i&>(table)));
  } else {
    const __m128i lo = _mm256_castsi256_si128(b.q);
    const __m128i hi = _mm256_extracti128_si256(b.q, 1);
    const __m512i ilo = F::kSigned ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
    const __m512i ihi = F::kSigned ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
    const __m512 m = _mm512_set1_ps(b.m);
    const __m512 vlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo), _mm512_set1_ps(b.s * b.sc0), m);
    const __m512 vhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi), _mm512_set1_ps(b.s * b.sc1), m);
    const __m512bh packed = _mm512_cvtne2ps_pbh(vhi, vlo);  // [vlo..., vhi...]
    return reinterpret_cast<const __m512i&>(packed);
  }
}

// Rows [n0, n0 + 32) of W de-quantized to bfloat16 bits, row-major [32, K].
template <class F>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0,
                     uint16_t* out) {
  const int64_t subs = K / 32;
  for (int64_t r = 0; r < 32; ++r) {
    const uint8_t* wrow = w + (n0 + r) * row_bytes;
    uint16_t* orow = out + r * K;
    for (int64_t idx = 0; idx < subs; ++idx) {
      Block b;
      F::unpack(wrow + (idx / F::kSub) * F::kBytes, static_cast<int>(idx % F::kSub), b);
      _mm512_storeu_si512(orow + idx * 32, dequantize_block<F>(b));
    }
  }
}

// x [M, K] as the B operand: xv[t][p][i][j] = bf16(x[16t + i][2p + j]), zero for rows past
// M; Mp = M rounded up to 16. (A dword is one (2p, 2p + 1) pair of a row.)
void pack_activations(const at::Tensor& x, int64_t M, int64_t Mp, int64_t K, uint16_t* xv) {
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(xb.data_ptr<c10::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(xv);
  const int64_t pairs = K / 2;
  at::parallel_for(0, Mp / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint32_t* tile = dst + t * 16 * pairs;
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t m = t * 16 + i;
        if (m < M) {
          for (int64_t p = 0; p < pairs; ++p) tile[p * 16 + i] = src[m * pairs + p];
        } else {
          for (int64_t p = 0; p < pairs; ++p) tile[p * 16 + i] = 0;
        }
      }
    }
  });
}

// One task: output channels [n0, n0 + 32) for every row of x.
void multiply_block(const uint16_t* wbuf, const uint16_t* xv, int64_t M, int64_t Mp, int64_t K,
                    int64_t N, int64_t n0, float* y) {
  alignas(64) float c[4][16][16];
  const int64_t wstride = K * 2;  // bytes between weight rows
  for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
    const bool two = m0 + 16 < Mp;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* b0 = xv + (m0 / 16) * 16 * K;
    const uint16_t* b1 = b0 + 16 * K;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      _tile_loadd(4, wbuf + k0, wstride);
      _tile_loadd(5, wbuf + 16 * K + k0, wstride);
      _tile_loadd(6, b0 + k0 * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, b1 + k0 * 16, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (two) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    // c[2h + a][n][m]: channels n0 + 16a + n, rows m0 + 16h + m.
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      for (int64_t m = 0; m < 16 && m0 + 16 * h + m < M; ++m) {
        float* yrow = y + (m0 + 16 * h + m) * N + n0;
        for (int a = 0; a < 2; ++a) {
          for (int n = 0; n < 16; ++n) yrow[16 * a + n] = c[2 * h + a][n][m];
        }
      }
    }
  }
}

template <class F>
void matmul_tiles(const uint8_t* w, int64_t row_bytes, const uint16_t* xv, int64_t M,
                  int64_t Mp, int64_t K, int64_t N, float* y) {
  thread_local std::vector<uint16_t> wbuf;
  dynamic_tasks(
      N / 32,
      [&](int64_t t) {
        dequantize_rows<F>(w, row_bytes, K, t * 32, wbuf.data());
        multiply_block(wbuf.data(), xv, M, Mp, K, N, t * 32, y);
      },
      [&] {
        wbuf.resize(32 * K);
        gguf_configure_tiles();
      },
      [] { _tile_release(); });
}

bool request_tiles() {
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

// All 8 tiles: 16 rows of 64 bytes (32 bfloat16, or 16 float32 / bfloat16 pairs). The
// configuration is a static object: GCC's _tile_loadconfig tells the compiler it reads only
// the first 8 bytes, so the stores of a local one can be dropped (ldtilecfg then faults).
void gguf_configure_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

bool gguf_tiles_available() {
  static const bool granted = request_tiles();
  return granted;
}

bool gguf_matmul_tiles(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t type,
                       int64_t N, float* y) {
  const int64_t M = x.size(0), K = x.size(1);
  if (N % 32 != 0 || K % 32 != 0 || !gguf_tiles_available()) return false;
  const int64_t Mp = (M + 15) / 16 * 16;
  std::vector<uint16_t> xv(Mp * K);
  pack_activations(x, M, Mp, K, xv.data());
  return with_format(type, [&](auto format) {
    matmul_tiles<decltype(format)>(w, row_bytes, xv.data(), M, Mp, K, N, y);
  });
}

#else

bool gguf_tiles_available() { return false; }

bool gguf_matmul_tiles(const at::Tensor&, const uint8_t*, int64_t, int64_t, int64_t, float*) {
  return false;
}

#endif

}  // namespace trio_llm
