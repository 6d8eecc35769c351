// Shared helpers of the engine's native CPU kernels (see trio_llm/engine/kernels).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace trio_llm {

// Loads as float: the kernels compute in float32 whatever the storage dtype.
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

#define TRIO_LLM_CHECK(cond, ...) TORCH_CHECK(cond, "trio_llm kernels: ", __VA_ARGS__)

}  // namespace trio_llm
