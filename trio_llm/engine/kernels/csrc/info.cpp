// trio_llm::isa(): the instruction sets this library was compiled for.
#include <torch/library.h>

#include <string>

#include "common.h"

namespace trio_llm {

std::string isa() {
  std::string out;
#if defined(__AVX512F__)
  out += "avx512f ";
#endif
#if defined(__AVX512BF16__)
  out += "avx512_bf16 ";
#endif
#if defined(__AVX512VNNI__)
  out += "avx512_vnni ";
#endif
#if defined(__AVXVNNI__)
  out += "avx_vnni ";
#endif
#if defined(__AVX2__)
  out += "avx2 ";
#endif
#if defined(__FMA__)
  out += "fma ";
#endif
  if (out.empty()) return "generic";
  out.pop_back();
  return out;
}

}  // namespace trio_llm

TORCH_LIBRARY_FRAGMENT(trio_llm, m) { m.def("isa", &trio_llm::isa); }
