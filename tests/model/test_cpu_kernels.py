"""The fused CPU kernels (pagedkv/kernels/csrc/) against the pure-torch reference they
replace, op by op and through a whole attention call; and the build's fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from pagedkv.kernels.cpu import PANELS_BEAT_ONEDNN_BF16, _cpu_flags, ensure_cpu_kernels, panel_isa
from pagedkv.model.attention import AttentionMetadata, PrefillChunk, decode_attention
from pagedkv.model.backends.cpu_native import NativeAttentionMetadata
from pagedkv.model.layers import RotaryEmbedding
from pagedkv.model.ops import LayerOps, apply_rope_reference, rms_norm_reference
from pagedkv.testing.isa_child import run_with_isa
from pagedkv.testing.panel_linear_check import check_panel_linear, worst_ratio

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: summation order only; bf16/fp16: the kernels round where the reference rounds.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    """The kernels loaded; linears by the instruction-set rule (the measured choice, which
    depends on this CPU's timings, has its own tests: test_kernel_choice.py)."""
    assert ensure_cpu_kernels("wait")
    monkeypatch.setenv("PAGEDKV_KERNEL_CHOICE", "isa")


def fused_ops() -> LayerOps:
    ops = LayerOps()
    ops.cpu_fused = True
    return ops


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    a, b = a.detach(), b.detach()  # (a parameter's values, not a graph)
    scale = max(1.0, float(b.float().abs().max()))
    assert float((a.float() - b.float()).abs().max()) <= TOL[dtype] * scale


def expected_panel_isa() -> str:
    """The panel path a native build must pick on this CPU (from its feature flags)."""
    flags = set(_cpu_flags().split())
    if os.environ.get("PAGEDKV_CPU_ISA") == "avx2" or "avx512f" not in flags:
        return "avx2"
    return "avx512_bf16" if "avx512_bf16" in flags else "avx512"


def test_panel_linear_is_within_the_rounding_bound_of_float64():
    """Every dtype, tile remainder, column and K padding (panel_linear_check's bound: float32
    accumulation plus one rounding to the dtype, against float64 F.linear of the same
    inputs); the build runs the CPU's widest path, and the packing holds W exactly."""
    got = check_panel_linear()
    assert got["isa"] == expected_panel_isa()
    assert got["packed_exactly"]
    for dtype in ("float32", "bfloat16", "float16"):
        assert 0.0 < got[dtype] <= 1.0, (dtype, got)


def test_onednn_bfloat16_meets_the_same_bound_and_the_rule_picks_panels_over_it():
    """The bound is the one the replaced path meets too (oneDNN's pre-packed bfloat16 linear);
    Linear.pack takes the panels for bfloat16 exactly where the build has the vdpbf16ps path."""
    from pagedkv.model.layers import Linear, onednn_bf16_available

    torch.manual_seed(3)
    layer = Linear(71, 100, bias=True).to(torch.bfloat16)
    x = torch.randn(13, 71, dtype=torch.bfloat16)
    assert layer.pack(panels=True)
    assert "avx512_bf16" in PANELS_BEAT_ONEDNN_BF16
    assert (layer._panels is not None) is (panel_isa() == "avx512_bf16"
                                           or not onednn_bf16_available(layer.weight))
    assert worst_ratio(layer(x), x, layer.weight, layer.bias) <= 1.0
    if onednn_bf16_available(layer.weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 64)
        onednn = torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
        assert 0.0 < worst_ratio(onednn, x, layer.weight, layer.bias) <= 1.0


@pytest.mark.slow
def test_the_avx2_build_of_panel_linear_is_within_the_bound_too():
    """PAGEDKV_CPU_ISA=avx2 (Zen 3's 8-wide code, another library: a child process) passes the
    same check; so both paths are tested on an AVX-512 machine."""
    got = run_with_isa("import json; from pagedkv.testing.panel_linear_check import "
                       "check_panel_linear; print(json.dumps(check_panel_linear()))")
    assert got["isa"] == "avx2" and got["packed_exactly"]
    for dtype in ("float32", "bfloat16", "float16"):
        assert 0.0 < got[dtype] <= 1.0, (dtype, got)


def test_linear_uses_panels_once_packed_and_rejects_misfits():
    from pagedkv.model.layers import Linear

    torch.manual_seed(0)
    layer = Linear(40, 24, bias=True)
    x = torch.randn(9, 40)
    want = F.linear(x, layer.weight, layer.bias)
    assert layer.pack(panels=True) and layer._panels is not None
    close(layer(x), want, torch.float32)
    close(layer(x.view(3, 3, 40)), want.view(3, 3, 24), torch.float32)  # not 2-D: F.linear
    with pytest.raises(RuntimeError, match="does not fit panels"):
        torch.ops.pagedkv_cpu.panel_linear(torch.randn(2, 41), layer._panels, 24, None)
    with pytest.raises(RuntimeError, match="weights"):
        torch.ops.pagedkv_cpu.panel_linear(x.double(), layer._panels, 24, None)
    odd = Linear(41, 24, bias=False).to(torch.bfloat16)  # paired layout: K 41 padded to 42
    assert odd.pack(panels=True)
    with pytest.raises(RuntimeError, match="42"):
        odd(torch.randn(2, 42, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_silu_and_rope_match_the_reference(dtype):
    torch.manual_seed(0)
    ops = fused_ops()
    x, w = torch.randn(37, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    close(ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), dtype)
    residual = torch.randn(37, 96, dtype=dtype)
    want_residual = residual + x
    got = ops.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, want_residual)  # the add rounds once, in the dtype: exact
    close(got, rms_norm_reference(want_residual, w, 1e-5), dtype)
    gate_up = torch.randn(5, 2 * 40, dtype=dtype)
    gate, up = gate_up.chunk(2, -1)
    close(ops.silu_and_mul(gate_up), F.silu(gate) * up, dtype)
    rotary = RotaryEmbedding(32, 10000.0, None, 512)
    qkv = torch.randn(11, 4 + 2 + 2, 32, dtype=dtype)
    positions = torch.randint(0, 500, (11,))
    rope = rotary.inputs(positions, dtype)
    want = apply_rope_reference(qkv[:, :6], *rope.rows())
    untouched = qkv[:, 6:].clone()
    got = ops.rope(qkv[:, :6], rope)
    assert got.data_ptr() == qkv.data_ptr()  # in place on the qkv projection's output
    close(got, want, dtype)
    assert torch.equal(qkv[:, 6:], untouched)  # v is not rotated


def _random_cache(dtype, kvh=2, num_blocks=40, bs=4, d=16):
    torch.manual_seed(1)
    return (torch.randn(kvh, num_blocks, bs, d, dtype=dtype),
            torch.randn(kvh, num_blocks, bs, d, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5, 1000])
def test_decode_attention_matches_the_reference(dtype, window):
    k_cache, v_cache = _random_cache(dtype)
    lens = [1, 4, 5, 17, 23, 9]
    tables = torch.stack([torch.randperm(39)[:6] + 1 for _ in lens])
    q = torch.randn(len(lens), 6, 16, dtype=dtype)  # 6 query heads over 2 KV heads (GQA)
    check_decode(q, k_cache, v_cache, lens, tables, 0.25, window)


def check_decode(q, k_cache, v_cache, lens, tables, scale, window):
    """The native decode of q (one row per sequence of `lens` on `tables`) is close to the
    reference's."""
    fields = dict(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
                  decode_seq_lens=torch.tensor(lens), decode_block_tables=tables, prefills=[],
                  block_size=k_cache.shape[2], decode_seq_lens_list=lens)
    want = decode_attention(q, k_cache, v_cache, AttentionMetadata(**fields), scale, window)
    got = torch.empty_like(q)
    NativeAttentionMetadata(**fields)._decode(q, k_cache, v_cache, scale, window, got)
    close(got, want, q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,heads", [(2, 2), (1, 4), (2, 10)])
def test_fixed_size_decode_kernel_matches_for_every_query_group(dtype, head_dim, kv_heads, heads):
    """Head sizes 64 and 128 (the compile-time path) score key rows for pairs of query heads
    (vdpbf16ps for a bfloat16 cache on AVX512-BF16) and weigh a lone head's values in two
    partial sums: one head per KV head (MHA), four, and five (two pairs and a lone head)."""
    torch.manual_seed(3)
    bs, num_blocks = 16, 40
    k_cache = torch.randn(kv_heads, num_blocks, bs, head_dim, dtype=dtype) * 3
    v_cache = torch.randn(kv_heads, num_blocks, bs, head_dim, dtype=dtype)
    lens = [1, 17, 50, 100, 33]
    tables = torch.stack([torch.randperm(num_blocks - 1)[:7] + 1 for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    check_decode(q, k_cache, v_cache, lens, tables, head_dim ** -0.5, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_with_shared_prefixes_matches_the_reference(dtype):
    """A step of decodes (three sharing 64 leading tokens: cascade) and two prefill chunks: the
    native metadata writes the same cache and returns the same attention as the torch one."""
    bs, d, kvh, heads = 16, 16, 2, 4
    shared = [1, 2, 3, 4]
    tables = [shared + [5, 6], shared + [7, 8], shared + [9, 10], [11, 12, 13]]
    lens = [70, 75, 90, 40]  # decodes: seq_len includes the new token
    chunk_tables = [torch.tensor([14, 15, 16]), torch.tensor([17, 18])]
    chunks = [PrefillChunk(4, 9, 6, 11, chunk_tables[0]), PrefillChunk(9, 16, 0, 7, chunk_tables[1])]
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]
    slots += [int(chunk_tables[0][p // bs]) * bs + p % bs for p in range(6, 11)]
    slots += [int(chunk_tables[1][p // bs]) * bs + p % bs for p in range(7)]
    width = max(len(t) for t in tables)
    fields = dict(slot_mapping=torch.tensor(slots), num_decodes=4,
                  decode_seq_lens=torch.tensor(lens),
                  decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                  prefills=chunks, block_size=bs, decode_seq_lens_list=lens)
    torch.manual_seed(2)
    q = torch.randn(16, heads, d, dtype=dtype)
    k, v = torch.randn(16, kvh, d, dtype=dtype), torch.randn(16, kvh, d, dtype=dtype)
    caches = _random_cache(dtype, kvh=kvh, num_blocks=20, bs=bs, d=d)
    ref_caches = tuple(c.clone() for c in caches)
    want = AttentionMetadata(**fields).attend(q, k, v, *ref_caches, 0.25, None)
    native = NativeAttentionMetadata(**fields)
    assert [g.rows for g in native.shared_prefixes()] == [[0, 1, 2]]
    got = native.attend(q, k, v, *caches, 0.25, None)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    close(got, want, dtype)


def test_decode_kernel_refuses_a_block_id_outside_the_cache():
    k_cache, v_cache = _random_cache(torch.float32)
    q = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.pagedkv_cpu.paged_decode_attention(
            q, k_cache, v_cache, torch.tensor([[99]]), torch.tensor([0]), torch.tensor([3]),
            0.25, torch.empty_like(q), None)


def test_unknown_mode_is_a_value_error():
    with pytest.raises(ValueError, match="'fast'"):
        ensure_cpu_kernels("fast")


def test_a_failed_build_falls_back_to_the_torch_path(tmp_path, tiny_llama):
    """With no working compiler (and an empty cache), "auto" logs and keeps the pure-torch path,
    whose tokens are still right; "wait" raises. Run in a fresh process (the library is loaded
    in this one)."""
    code = f"""
import torch
from pagedkv import LLM, SamplingParams
from pagedkv.kernels import cpu
llm = LLM(model={str(tiny_llama)!r}, cpu_kernels="auto", device="cpu")
cpu._state["thread"].join()
assert not cpu.cpu_kernels_loaded() and cpu._state["error"] is not None
out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=3, temperature=0))
assert llm.llm_engine.runner.model.ops.cpu_fused is False
print("TOKENS", out[0].outputs[0].token_ids)
try:
    cpu.ensure_cpu_kernels("wait")
except RuntimeError as e:
    print("WAIT-FAILED", "could not be built" in str(e))
"""
    env = dict(os.environ, PAGEDKV_KERNEL_CACHE_DIR=str(tmp_path), CXX="false")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "WAIT-FAILED True" in proc.stdout
    assert "fused CPU kernels unavailable" in proc.stderr
    from tests.engine.conftest import hf_greedy

    tokens = eval(proc.stdout.split("TOKENS", 1)[1].splitlines()[0])
    assert tokens == hf_greedy(tiny_llama, [5, 6, 7], 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_linear_is_prepared_for_the_cpu_and_matches_the_16bit_product(dtype):
    """A 16-bit Linear on CPU is prepared (oneDNN-packed where the CPU has bfloat16 dot
    products, else a float32 copy of the weight) and gives the 16-bit product's values."""
    from pagedkv.model.layers import Linear, onednn_bf16_available

    torch.manual_seed(3)
    layer = Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(7, 64, dtype=dtype)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert layer.pack()
    packed = layer._packed is not None
    assert packed == (dtype == torch.bfloat16 and onednn_bf16_available(layer.weight))
    assert (layer._widened is not None) != packed
    got = layer(x)
    assert got.dtype == dtype
    close(got, want.to(dtype), dtype)
    f32 = Linear(64, 48, bias=True)  # float32: oneDNN-packed where oneDNN is built in
    assert f32.pack() == torch.backends.mkldnn.is_available()
    close(f32(x.float()), F.linear(x.float(), f32.weight, f32.bias), torch.float32)
    close(f32(x.float()[:, None, :]).squeeze(1), F.linear(x.float(), f32.weight, f32.bias),
          torch.float32)  # 3-D input: the plain product


def test_a_bfloat16_model_through_the_panels_agrees_with_the_reference_path(tiny_llama):
    """The tiny llama in bfloat16, teacher-forced: the fused kernels (every linear on this
    build's panels: vdpbf16ps on AVX512-BF16) against the pure-torch path (oneDNN's or a
    float32 copy's linears), the same greedy tokens and logits within bfloat16 rounding."""
    from pagedkv.model.runner import ModelRunner
    from pagedkv.testing.kv_quant_accuracy import compare_logits, teacher_forced_logits

    prompt, cont = list(range(5, 45)), list(range(60, 72))
    runners = [ModelRunner(tiny_llama, block_size=4, num_blocks=16, device="cpu",
                           dtype="bfloat16", cpu_kernels=mode) for mode in ("wait", "off")]
    got, want = (teacher_forced_logits(r, prompt, cont, chunk_size=16) for r in runners)
    linears = [m for m in runners[0].model.modules() if getattr(m, "_panels", None) is not None]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
    assert all(m._panels.dim() == (4 if panel_isa() == "avx512_bf16" else 3) for m in linears)
    cmp = compare_logits(want, got)
    assert cmp.greedy_agreement == 1.0, cmp
    assert 0.0 < cmp.max_abs_error <= 2 ** -6 * cmp.logit_range, cmp
