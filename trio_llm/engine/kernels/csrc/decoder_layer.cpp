// trio_llm::decoder_layer_decode: one Llama decoder layer of a decode-only step on the GGUF
// path, behind one call (issue 42, item 3): the same operators the Python loop of
// trio_llm/engine/native.py (NativeLlama._fused_call) runs, in the same order on the same
// tensors, without ~25 Python-level dispatches a layer.
//
//   x      = add_rms_norm_(hidden, delta, input_norm)        hidden += delta
//   qkv    = gguf_matmul(x, qkv_w); rotary_ on its q and k heads
//   cache[slots] = k, v (cast to the cache's dtype)
//   attn   = paged_attention_decode(q, cache, block_tables, context_lens)
//   x      = add_rms_norm_(hidden, gguf_matmul(attn, o_w), post_norm)
//   return   gguf_matmul(silu_and_mul(gguf_matmul(x, gate_up_w)), down_w)   (the next delta)
//
// Every product is a GGUF product (gguf_matmul's types, packed or not) without bias; the
// layer has no sliding window and no softcap; hidden is float32 [1, T, hidden_size] with
// every token a decode token. The Python caller checks those conditions.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "common.h"

namespace trio_llm {

at::Tensor add_rms_norm_(at::Tensor hidden, const std::optional<at::Tensor>& delta,
                         const at::Tensor& weight, double eps);
void rotary_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
             int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& w, int64_t type);
void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale,
                            int64_t sliding_window, double softcap, at::Tensor& out);

namespace {

// cache[slots[t]] = rows[t] (float32 rows of `width` values, `stride` apart), cast to the
// cache's dtype (bfloat16 rounds to nearest even, as Tensor.to does).
template <typename kv_t>
void write_rows(const float* rows, int64_t stride, int64_t width, const int64_t* slots,
                int64_t tokens, kv_t* cache) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* src = rows + t * stride;
    kv_t* dst = cache + slots[t] * width;
    for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<kv_t>(src[i]);
  }
}

void write_keys(const at::Tensor& qkv, int64_t first, int64_t width, const at::Tensor& slots,
                at::Tensor& cache) {
  TRIO_LLM_CHECK(cache.is_contiguous() && cache.size(1) * cache.size(2) == width,
                 "decoder_layer_decode: the cache must be contiguous [slots, H_kv, D]");
  TRIO_LLM_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(),
                 "decoder_layer_decode: slots must be contiguous int64");
  const int64_t tokens = qkv.size(0), count = cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TRIO_LLM_CHECK(slot[t] >= 0 && slot[t] < count, "decoder_layer_decode: slot ", slot[t],
                   " outside the cache");
  }
  const float* rows = qkv.data_ptr<float>() + first;
  if (cache.scalar_type() == at::kBFloat16) {
    write_rows(rows, qkv.size(1), width, slot, tokens, cache.data_ptr<c10::BFloat16>());
  } else {
    TRIO_LLM_CHECK(cache.scalar_type() == at::kFloat,
                   "decoder_layer_decode: the cache must be float32 or bfloat16");
    write_rows(rows, qkv.size(1), width, slot, tokens, cache.data_ptr<float>());
  }
}

}  // namespace

at::Tensor decoder_layer_decode(at::Tensor hidden, const std::optional<at::Tensor>& delta,
                                const at::Tensor& input_norm, const at::Tensor& post_norm,
                                double eps, const at::Tensor& qkv_w, int64_t qkv_type,
                                const at::Tensor& o_w, int64_t o_type, const at::Tensor& gate_up_w,
                                int64_t gate_up_type, const at::Tensor& down_w, int64_t down_type,
                                const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, at::Tensor key_cache,
                                at::Tensor value_cache, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                int64_t block_size, double scale) {
  TRIO_LLM_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 &&
                     hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
                 "decoder_layer_decode: hidden must be contiguous float32 [1, T, hidden_size]");
  const int64_t tokens = hidden.size(1), width = hidden.size(2);
  const int64_t heads = num_heads + 2 * num_kv_heads;
  TRIO_LLM_CHECK(slots.numel() == tokens && context_lens.numel() == tokens,
                 "decoder_layer_decode: one slot and one context length per token");
  at::Tensor x = add_rms_norm_(hidden, delta, input_norm, eps);
  at::Tensor qkv = gguf_matmul(x.view({tokens, width}), qkv_w, qkv_type);
  TRIO_LLM_CHECK(qkv.size(1) == heads * head_dim, "decoder_layer_decode: the qkv product has ",
                 qkv.size(1), " columns, not ", heads, " heads of ", head_dim);
  rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
  const at::Tensor split = qkv.view({tokens, heads, head_dim});
  write_keys(qkv, num_heads * head_dim, num_kv_heads * head_dim, slots, key_cache);
  write_keys(qkv, (num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim, slots,
             value_cache);
  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, qkv.options());
  paged_attention_decode(split.narrow(1, 0, num_heads), key_cache, value_cache, block_tables,
                         context_lens, block_size, scale, 0, 0.0, attn);
  const at::Tensor o = gguf_matmul(attn.view({tokens, num_heads * head_dim}), o_w, o_type);
  x = add_rms_norm_(hidden, o.view({1, tokens, width}), post_norm, eps);
  const at::Tensor gate_up = gguf_matmul(x.view({tokens, width}), gate_up_w, gate_up_type);
  return gguf_matmul(silu_and_mul(gate_up), down_w, down_type).view({1, tokens, width});
}

}  // namespace trio_llm

TORCH_LIBRARY_FRAGMENT(trio_llm, m) {
  m.def(
      "decoder_layer_decode(Tensor(a!) hidden, Tensor? delta, Tensor input_norm, "
      "Tensor post_norm, float eps, Tensor qkv_w, int qkv_type, Tensor o_w, int o_type, "
      "Tensor gate_up_w, int gate_up_type, Tensor down_w, int down_type, Tensor cos, "
      "Tensor sin, int num_heads, int num_kv_heads, int head_dim, Tensor(b!) key_cache, "
      "Tensor(c!) value_cache, Tensor slots, Tensor block_tables, Tensor context_lens, "
      "int block_size, float scale) -> Tensor",
      &trio_llm::decoder_layer_decode);
}
