// pagedkv's fused CPU kernels as torch.ops.pagedkv_cpu.* (built on first use by
// pagedkv/kernels/cpu.py, see there): each op's schema and its definition (ops.h).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagedkv_cpu, m) {
  using namespace pagedkv_cpu;
  m.def("pack_panels(Tensor w) -> Tensor", &pack_panels);
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor", &panel_linear);
  m.def("panel_isa() -> str", &panel_isa);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor",
        &add_rms_norm_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()", &rope_);
  m.def("write_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv_);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor first_pos, Tensor seq_lens, float scale, Tensor(a!) out, Tensor(b!)? lse) -> ()",
        &paged_decode_attention);
  m.def("paged_decode_attention_q(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scales, "
        "Tensor? v_scales, Tensor block_tables, Tensor first_pos, Tensor seq_lens, float scale, "
        "Tensor(a!) out, Tensor(b!)? lse) -> ()", &paged_decode_attention_q);
  m.def("write_kv_int8_(Tensor x, Tensor(a!) cache, Tensor(b!) scales, Tensor slot_mapping) -> ()",
        &write_kv_int8_);
  m.def("write_kv_fp8_(Tensor x, Tensor(a!) cache, Tensor slot_mapping) -> ()", &write_kv_fp8_);
  m.def("paged_prefill_supports(int head_dim, ScalarType dtype) -> bool", &paged_prefill_supports);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor starts, Tensor ends, Tensor seq_lens, int window, float scale, Tensor(a!) out, "
        "bool causal=True, Tensor(b!)? lse=None, Tensor? k_scales=None, "
        "Tensor? v_scales=None) -> ()",
        &paged_prefill_attention);
  m.def("amx_prefill_supported(int head_dim, ScalarType dtype) -> bool", &amx_prefill_supported);
  m.def("amx_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor ends, "
        "float scale, Tensor(a!) out) -> ()", &amx_prefill_attention);
  m.def("amx_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, "
        "float scale, Tensor(a!) out, Tensor(b!) lse) -> ()", &amx_prefix_attention);
  m.def("amx_prefix_attention_merge_(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_ids, float scale, Tensor(a!) out, Tensor(b!) lse) -> ()",
        &amx_prefix_attention_merge_);
}
