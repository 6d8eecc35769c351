// Batched GGUF products on AMX-BF16 tiles (gguf_tiles.cpp), for gguf_matmul.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TRIO_LLM_TILES 1
#endif

namespace trio_llm {

// Whether this library has the tile path and the kernel lets this process use the tile
// state (asked once: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
bool gguf_tiles_available();

#if defined(TRIO_LLM_TILES)
// Load this thread's tile configuration: all 8 tiles 16 rows of 64 bytes.
void gguf_configure_tiles();
#endif

// y[M, N] (float32, row-major) = x[M, K] @ dequantize(w).T on AMX-BF16 tiles: each task
// de-quantizes 32 weight rows to bfloat16 once and multiplies them with every activation
// row (x rounded to bfloat16). False (y untouched) where the path does not apply: no tile
// path, N % 32 != 0, or K % 32 != 0.
bool gguf_matmul_tiles(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t type,
                       int64_t N, float* y);

}  // namespace trio_llm
