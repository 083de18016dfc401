"""The AMX prefill attention kernel (kernels/csrc/prefill_attention_amx.cpp) against float64,
and the backend's routing of fresh prompts to it. Skips where the CPU or build has no AMX
(printing the CPU flag and what the build says); the AVX2 build must say it has none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.attention import AttentionMetadata, PrefillChunk
from pagedkv.model.backends.cpu_native import NativeAttentionMetadata
from pagedkv.model.prefill_choice import amx_prefill_ok, fresh_prompt
from pagedkv.testing.isa_child import run_with_isa


def cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def amx() -> None:
    assert ensure_cpu_kernels("wait")
    built = bool(torch.ops.pagedkv_cpu.amx_prefill_supported(64, torch.bfloat16))
    print(f"CPU flag amx_bf16: {cpu_has_amx()}; AMX prefill kernel in this build: {built}")
    if not built:
        pytest.skip("no AMX prefill kernel on this CPU / build")


def exact_attention(q, k, v, lens) -> torch.Tensor:
    """float64 causal attention of each fresh prompt of `lens` (rows in order)."""
    out, start = [], 0
    for n in lens:
        part = (t[start:start + n].double().transpose(0, 1)[None] for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(*part, is_causal=True,
                                                  enable_gqa=True)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (4, 1, 128), (2, 2, 64)])
def test_amx_kernel_is_as_close_to_float64_as_torchs_bfloat16(amx, heads, kv_heads, d):
    """Chunks of 1 to 130 tokens (partial 16-row tiles, 32- and 64-key tails), strided views
    of one qkv tensor; the error against float64 within twice that of torch's own bfloat16
    attention plus one bfloat16 rounding; rows outside the chunks untouched."""
    torch.manual_seed(0)
    lens = [1, 15, 16, 17, 64, 100, 130]
    t = sum(lens)
    qkv = (torch.randn(t, heads + 2 * kv_heads, d) * 2).bfloat16()
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    bounds = torch.tensor([0, *lens]).cumsum(0)
    out = torch.full((t + 3, heads, d), 7.0, dtype=torch.bfloat16)
    torch.ops.pagedkv_cpu.amx_prefill_attention(q, k, v, bounds[:-1], bounds[1:], d ** -0.5, out)
    exact = exact_attention(q, k, v, lens)
    got_err = float((out[:t].double() - exact).abs().max())
    ref = torch.cat([F.scaled_dot_product_attention(
        *(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
        enable_gqa=True)[0].transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)])
    ref_err = float((ref.double() - exact).abs().max())
    assert got_err <= 2 * ref_err + 2 ** -8 * float(exact.abs().max()), (got_err, ref_err)
    assert bool((out[t:] == 7.0).all())


def test_amx_kernel_refuses_a_chunk_outside_the_rows(amx):
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the rows"):
        torch.ops.pagedkv_cpu.amx_prefill_attention(q, q, q, torch.tensor([0]),
                                                    torch.tensor([11]), 0.1, q.clone())


def step_fields(chunks: list[PrefillChunk], bs: int) -> dict:
    slots = [int(c.block_table[p // bs]) * bs + p % bs for c in chunks
             for p in range(c.start_pos, c.seq_len)]
    return dict(slot_mapping=torch.tensor(slots), num_decodes=0,
                decode_seq_lens=torch.zeros(0, dtype=torch.long),
                decode_block_tables=torch.zeros(0, 1, dtype=torch.long), prefills=chunks,
                block_size=bs, decode_seq_lens_list=[])


def test_backend_runs_fresh_prompts_on_amx_and_matches_the_torch_path(amx, monkeypatch):
    """A step of three fresh prompts and one chunk after a cached prefix: the fresh ones take
    the AMX kernel (default choice mode), the other one the fused kernel or torch's, and the
    step returns what the torch path does; a forced choice mode keeps AMX out."""
    monkeypatch.delenv("PAGEDKV_KERNEL_CHOICE", raising=False)
    bs, kvh, heads, d = 16, 2, 4, 64
    chunks = [PrefillChunk(0, 40, 0, 40, torch.tensor([1, 2, 3])),
              PrefillChunk(40, 57, 0, 17, torch.tensor([4, 5])),
              PrefillChunk(57, 77, 30, 50, torch.tensor([13, 14, 15, 0])),
              PrefillChunk(77, 177, 0, 100, torch.tensor([6, 7, 8, 9, 10, 11, 12]))]
    torch.manual_seed(1)
    qkv = torch.randn(177, heads + 2 * kvh, d).bfloat16()
    q, k, v = qkv.split([heads, kvh, kvh], dim=1)
    caches = tuple(torch.randn(kvh, 16, bs, d).bfloat16() for _ in range(2))
    ref_caches = tuple(c.clone() for c in caches)
    assert amx_prefill_ok(q, k, v, caches[0])
    assert [fresh_prompt(c, None) for c in chunks] == [True, True, False, True]
    assert not fresh_prompt(chunks[0], 30)  # a window hiding keys
    calls = []
    amx_op = torch.ops.pagedkv_cpu.amx_prefill_attention
    monkeypatch.setattr(torch.ops.pagedkv_cpu, "amx_prefill_attention",
                        lambda *a: (calls.append(a[3].tolist()), amx_op(*a)))
    want = AttentionMetadata(**step_fields(chunks, bs)).attend(q, k, v, *ref_caches, 0.125, None)
    got = NativeAttentionMetadata(**step_fields(chunks, bs)).attend(q, k, v, *caches, 0.125, None)
    assert calls == [[0, 40, 77]]  # the fresh prompts' first rows, one call
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    scale = max(1.0, float(want.float().abs().max()))
    assert float((got.float() - want.float()).abs().max()) <= 1e-2 * scale
    monkeypatch.setenv("PAGEDKV_KERNEL_CHOICE", "isa")
    assert not amx_prefill_ok(q, k, v, caches[0])


@pytest.mark.slow
def test_the_avx2_build_has_no_amx_kernel():
    got = run_with_isa("import json, torch; from pagedkv.kernels.cpu import ensure_cpu_kernels, "
                       "panel_isa; ensure_cpu_kernels('wait'); print(json.dumps([panel_isa(), "
                       "torch.ops.pagedkv_cpu.amx_prefill_supported(64, torch.bfloat16)]))")
    assert got == ["avx2", False]


def test_a_bfloat16_model_with_fresh_prompts_on_amx_agrees_with_the_reference_path(
        amx, tmp_path, monkeypatch):
    """A random bfloat16 Llama with head size 64, teacher-forced: its first prompt chunk runs on
    the AMX kernel (the later ones after a cached prefix do not), against the pure-torch
    runner: the same greedy tokens and logits within bfloat16 rounding."""
    from pagedkv.model.runner import ModelRunner
    from pagedkv.testing.kv_quant_accuracy import compare_logits, teacher_forced_logits
    from pagedkv.testing.random_model import build_random_model_dir

    monkeypatch.delenv("PAGEDKV_KERNEL_CHOICE", raising=False)
    model = build_random_model_dir(tmp_path / "m", dtype="bfloat16", seed=0, hidden_size=128,
                                   intermediate_size=256, num_heads=2, num_kv_heads=1)
    calls = []
    amx_op = torch.ops.pagedkv_cpu.amx_prefill_attention
    monkeypatch.setattr(torch.ops.pagedkv_cpu, "amx_prefill_attention",
                        lambda *a: (calls.append(a[4].tolist()), amx_op(*a)))
    prompt, cont = list(range(5, 75)), list(range(80, 90))
    runners = [ModelRunner(str(model), block_size=16, num_blocks=16, device="cpu",
                           dtype="bfloat16", cpu_kernels=mode) for mode in ("wait", "off")]
    got, want = (teacher_forced_logits(r, prompt, cont, chunk_size=48) for r in runners)
    assert calls and all(ends == [48] for ends in calls)  # the fresh chunk, every layer
    from pagedkv.engine.runner_facts import runner_facts
    banner = runner_facts(runners[0])["cpu_kernels"]
    assert "; fresh prompts' attention: amx_prefill_attention (AMX tiles)" in banner
    monkeypatch.setenv("PAGEDKV_KERNEL_CHOICE", "panel")
    assert "amx" not in runner_facts(runners[0])["cpu_kernels"]
    cmp = compare_logits(want, got)
    assert cmp.greedy_agreement == 1.0, cmp
    assert cmp.max_abs_error <= 0.05 * cmp.logit_range, cmp
