// GGUF blocks repacked for AVX-512 VNNI and AMX (gguf_packed.cpp), for gguf_matmul.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace trio_llm {

// A packed tensor's type id is kPacked + its GGML type.
constexpr int64_t kPacked = 256;

// Quantized activations as gguf_matmul.cpp makes them: q int8 [M, K], d and d * sum(q)
// float [M, K / 32].
struct PackedActs {
  const int8_t* q;
  const float* d;
  const float* ds;
};

// kPacked + type where this library repacks `type` (Q4_0, Q4_1, Q8_0 with AVX-512 VNNI),
// else -1.
int64_t gguf_packed_type(int64_t type);

// w uint8 [N, row_bytes] (the file's rows of K / 32 blocks of `type`) repacked: uint8
// [N / 16, K / 32 * G] (gguf_packed.cpp's layout). Raises for an unpacked type, N % 16 != 0
// or rows of the wrong size.
at::Tensor gguf_repack(const at::Tensor& w, int64_t type, int64_t K);

// y float [M, N] = x [M, K] @ W.T on AMX tiles (x rounded to bfloat16); false (y untouched)
// where the CPU or the kernel gives no tiles.
bool gguf_packed_tiles(const at::Tensor& x, const at::Tensor& w, int64_t packed_type, float* y);

// y float [M, N] = x [M, K] @ W.T with AVX-512 BF16 dot products (x rounded to bfloat16,
// each task's weights de-quantized to bfloat16 once for every row), for CPUs with
// AVX512_BF16 but no AMX tiles; false (y untouched) where the library has no AVX512_BF16.
bool gguf_packed_dpbf16(const at::Tensor& x, const at::Tensor& w, int64_t packed_type, float* y);

// y float [M, N] = the quantized activations @ W.T with VNNI dot products.
void gguf_packed_vnni(const int8_t* q, const float* d, const float* ds, int64_t M, int64_t K,
                      const at::Tensor& w, int64_t packed_type, float* y);

}  // namespace trio_llm
