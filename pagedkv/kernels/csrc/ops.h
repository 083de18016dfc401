// The ops of torch.ops.pagedkv_cpu, one definition file per family; bindings.cpp registers each
// with its schema (argument meanings: the comment above each definition). Hidden: the library
// exports only its registration, and calls between its files do not go through the PLT.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#pragma GCC visibility push(hidden)
namespace pagedkv_cpu {

// norm_rope_act.cpp: RMSNorm (with the residual add), SiLU-and-mul, rotate-half RoPE in place.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                         double eps);
at::Tensor silu_and_mul(const at::Tensor& gu);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin);

// cache_write.cpp: a step's keys and values into their slots (model dtype, int8, fp8).
void write_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping);
void write_kv_int8_(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales,
                    const at::Tensor& slot_mapping);
void write_kv_fp8_(const at::Tensor& x, at::Tensor& cache, const at::Tensor& slot_mapping);

// decode_attention.cpp: paged decode attention (caches of q's dtype; int8 or fp8 caches).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& first_pos, const at::Tensor& seq_lens,
                            double scale, at::Tensor& out, const c10::optional<at::Tensor>& lse);
void paged_decode_attention_q(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache,
                              const c10::optional<at::Tensor>& k_scales,
                              const c10::optional<at::Tensor>& v_scales,
                              const at::Tensor& block_tables, const at::Tensor& first_pos,
                              const at::Tensor& seq_lens, double scale, at::Tensor& out,
                              const c10::optional<at::Tensor>& lse);

// prefill_attention.cpp: paged prefill attention, where this build supports the head size.
bool paged_prefill_supports(int64_t head_dim, at::ScalarType dtype);
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& starts, const at::Tensor& ends,
                             const at::Tensor& seq_lens, int64_t window, double scale,
                             at::Tensor& out, bool causal, const c10::optional<at::Tensor>& lse,
                             const c10::optional<at::Tensor>& k_scales,
                             const c10::optional<at::Tensor>& v_scales);

// prefill_attention_amx.cpp: causal attention of fresh prompts on AMX tiles (bfloat16).
bool amx_prefill_supported(int64_t head_dim, at::ScalarType dtype);
void amx_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& starts, const at::Tensor& ends, double scale,
                           at::Tensor& out);
void amx_prefix_attention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_ids, double scale,
                          at::Tensor& out, at::Tensor& lse);

// panel_linear.cpp: weights packed into panels once, y = x @ W^T (+ bias) from them.
at::Tensor pack_panels(const at::Tensor& w);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias);
std::string panel_isa();

// prefill_attention_amx.cpp: amx_prefix_attention merged in place into the other keys' part.
void amx_prefix_attention_merge_(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_ids,
                                 double scale, at::Tensor& out, at::Tensor& lse);

}  // namespace pagedkv_cpu
#pragma GCC visibility pop
