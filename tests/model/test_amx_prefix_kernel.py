"""The AMX shared-prefix attention kernel (`amx_prefix_attention`: cascade attention's prefix
part, every query over a prefix of whole cache blocks) against float64: output and log-sum-exp.
Skips where the CPU or build has no AMX (printing the CPU flag and what the build says)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from tests.model.test_amx_prefill_kernel import cpu_has_amx


@pytest.fixture(scope="module")
def amx() -> None:
    assert ensure_cpu_kernels("wait")
    built = bool(torch.ops.pagedkv_cpu.amx_prefill_supported(64, torch.bfloat16))
    print(f"CPU flag amx_bf16: {cpu_has_amx()}; AMX prefix kernel in this build: {built}")
    if not built:
        pytest.skip("no AMX prefix kernel on this CPU / build")


def exact_prefix(q, k_cache, v_cache, block_ids, scale):
    """float64 (out [n, heads, D], lse [n, heads]) of q over the blocks `block_ids`."""
    kvh, _, _, d = k_cache.shape
    g = q.shape[1] // kvh
    k = k_cache[:, block_ids].reshape(kvh, -1, d).double().repeat_interleave(g, 0)
    v = v_cache[:, block_ids].reshape(kvh, -1, d).double().repeat_interleave(g, 0)
    s = torch.einsum("nhd,hkd->nhk", q.double(), k) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("nhk,hkd->nhd", torch.softmax(s, -1), v), lse


def torch_bf16_prefix(q, k_cache, v_cache, block_ids, scale):
    """The same in torch's bfloat16 matmuls (the error budget's yardstick)."""
    kvh, _, _, d = k_cache.shape
    g = q.shape[1] // kvh
    k = k_cache[:, block_ids].reshape(kvh, -1, d).repeat_interleave(g, 0)
    v = v_cache[:, block_ids].reshape(kvh, -1, d).repeat_interleave(g, 0)
    p = torch.softmax(torch.einsum("nhd,hkd->nhk", q, k).float() * scale, -1)
    return torch.einsum("nhk,hkd->nhd", p.bfloat16(), v)


@pytest.mark.parametrize("n,heads,kv_heads,d,block,nb",
                         [(32, 8, 4, 64, 32, 5), (3, 4, 1, 128, 16, 3), (9, 2, 2, 64, 16, 1)])
def test_prefix_kernel_matches_float64(amx, n, heads, kv_heads, d, block, nb):
    """Scattered block ids, query rows strided (a view), partial 16-row tiles, key counts not a
    multiple of 64; error within twice torch's bfloat16 one plus a rounding; lse within 1e-3;
    rows outside the view untouched."""
    torch.manual_seed(0)
    caches = [(torch.randn(kv_heads, 12, block, d) * 2).bfloat16() for _ in range(2)]
    block_ids = torch.randperm(12)[:nb]
    qs = (torch.randn(n, heads + 1, d) * 2).bfloat16()
    q = qs[:, :heads]
    out = torch.full((n + 2, heads, d), 7.0, dtype=torch.bfloat16)
    lse = torch.empty(n, heads)
    scale = d ** -0.5
    torch.ops.pagedkv_cpu.amx_prefix_attention(q, *caches, block_ids, scale, out[:n], lse)
    exact, exact_lse = exact_prefix(q, *caches, block_ids, scale)
    ours = (out[:n].double() - exact).abs().max().item()
    theirs = (torch_bf16_prefix(q, *caches, block_ids, scale).double() - exact).abs().max().item()
    print(f"max error: AMX {ours:.4g}, torch bf16 {theirs:.4g}")
    assert ours <= 2 * theirs + 2 ** -8 * exact.abs().max().item()
    assert torch.allclose(lse.double(), exact_lse, atol=1e-3, rtol=1e-4)
    assert bool((out[n:] == 7.0).all())


def test_prefix_kernel_rejects_bad_input(amx):
    """A block id outside the cache and a block size not a multiple of 16 are errors."""
    q = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(2, 2)
    cache = torch.zeros(1, 4, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pagedkv_cpu.amx_prefix_attention(q, cache, cache, torch.tensor([4]), 0.1,
                                                   out, lse)
    odd = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.pagedkv_cpu.amx_prefix_attention(q, odd, odd, torch.tensor([0]), 0.1, out, lse)


def test_decodes_sharing_a_prefix_run_it_and_agree_with_the_fused_kernel(amx, tmp_path,
                                                                           monkeypatch):
    """A random bfloat16 Llama (head size 64, block 16), four prompts sharing 96 cached tokens:
    their prefill chunks (one step) and their decodes run the prefix part on the AMX kernel
    (every layer; merged in the kernel), and the greedy tokens are
    those of the fused kernel's cascade (the AMX kernel turned off)."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.model.backends import cpu_native
    from pagedkv.testing.random_model import build_random_model_dir

    monkeypatch.delenv("PAGEDKV_KERNEL_CHOICE", raising=False)
    model = build_random_model_dir(tmp_path / "m", dtype="bfloat16", seed=0, hidden_size=128,
                                   intermediate_size=256, num_heads=2, num_kv_heads=1)
    calls = []
    for name in ("amx_prefix_attention", "amx_prefix_attention_merge_"):  # either form
        op = getattr(torch.ops.pagedkv_cpu, name)
        monkeypatch.setattr(torch.ops.pagedkv_cpu, name,
                            lambda *a, op=op: (calls.append(a[0].shape[0]), op(*a)))
    prefix = list(range(5, 101))
    prompts = [{"prompt_token_ids": prefix + [200 + i, 300 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = []
    for amx_on in (True, False):
        if not amx_on:
            monkeypatch.setattr(cpu_native, "amx_prefix_ok", lambda *a: False)
        llm = LLM(model=str(model), dtype="bfloat16", seed=0, block_size=16, cpu_threads=1,
                  kv_cache_memory_bytes=1 << 24, cpu_kernels="wait", enable_prefix_caching=True,
                  device="cpu")
        llm.generate(prompts[:1], params, use_tqdm=False)  # the prefix cached
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
        llm.shutdown()
        if amx_on:
            assert calls.count(4) >= 2 * 5  # the four decodes' prefix, every layer and step
            assert calls.count(8) == 2  # their prefill chunks' (2 tokens each), every layer
            calls.clear()
    assert not calls
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("n,heads,kv_heads,d,block,nb", [(32, 8, 4, 64, 32, 5), (3, 4, 1, 128, 16, 3)])
def test_prefix_merge_matches_unfused(amx, n, heads, kv_heads, d, block, nb):
    """amx_prefix_attention_merge_ (the prefix part merged in place into the other keys' part)
    against float64 over both key sets together and against the unfused kernel plus
    cascade.merge_states: strided views of out and lse, a row with no other keys (lse -inf),
    rows outside the views untouched."""
    from pagedkv.model.cascade import merge_states

    torch.manual_seed(1)
    caches = [(torch.randn(kv_heads, 12, block, d) * 2).bfloat16() for _ in range(2)]
    block_ids = torch.randperm(12)[:nb]
    q = (torch.randn(n, heads, d) * 2).bfloat16()
    scale = d ** -0.5
    # The other keys' part: float64 attention over 20 random keys per row (row 0: none).
    ko, vo = (torch.randn(n, kv_heads, 20, d) * 2).bfloat16(), torch.randn(n, kv_heads, 20, d)
    g = heads // kv_heads
    s_o = torch.einsum("nhd,nhkd->nhk", q.double(), ko.double().repeat_interleave(g, 1)) * scale
    lse_o = torch.logsumexp(s_o, -1)
    o_o = torch.einsum("nhk,nhkd->nhd", torch.softmax(s_o, -1),
                       vo.bfloat16().double().repeat_interleave(g, 1))
    lse_o[0], o_o[0] = float("-inf"), 0.0
    out = torch.full((n + 1, heads + 1, d), 7.0, dtype=torch.bfloat16)
    lse = torch.full((n + 1, heads + 1), 7.0)
    out[:n, :heads], lse[:n, :heads] = o_o.bfloat16(), lse_o.float()
    torch.ops.pagedkv_cpu.amx_prefix_attention_merge_(q, *caches, block_ids, scale,
                                                      out[:n, :heads], lse[:n, :heads])
    o_p, lse_p = exact_prefix(q, *caches, block_ids, scale)
    top = torch.maximum(lse_p, lse_o)
    w_p, w_o = (lse_p - top).exp(), (lse_o - top).exp()
    exact = (o_p * w_p[..., None] + o_o * w_o[..., None]) / (w_p + w_o)[..., None]
    exact_lse = top + (w_p + w_o).log()
    ours = (out[:n, :heads].double() - exact).abs().max().item()
    unfused_o, unfused_lse = torch.empty_like(q), torch.empty(n, heads)
    torch.ops.pagedkv_cpu.amx_prefix_attention(q, *caches, block_ids, scale, unfused_o,
                                               unfused_lse)
    unfused = merge_states(o_o.bfloat16(), lse_o.float(), unfused_o, unfused_lse)
    theirs = (unfused.double() - exact).abs().max().item()
    print(f"max error: fused {ours:.4g}, unfused {theirs:.4g}")
    assert ours <= theirs + 2 ** -8 * exact.abs().max().item()
    assert (out[:n, :heads].float() - unfused.float()).abs().max().item() <= \
        2 ** -6 * exact.abs().max().item()
    assert torch.allclose(lse[:n, :heads].double(), exact_lse, atol=1e-3, rtol=1e-4)
    assert bool((out[n:] == 7.0).all()) and bool((out[:, heads:] == 7.0).all())
    assert bool((lse[n:] == 7.0).all()) and bool((lse[:, heads:] == 7.0).all())


def test_prefill_cascade_matches_float64(amx):
    """cpu_native.PrefillCascade: three prefill chunks (5, 17 and 9 tokens, the second after
    some tokens of its own already cached) sharing a cached prefix of two blocks, each token
    causal over the prefix and its own keys: against float64 attention; rows outside the
    chunks untouched."""
    from pagedkv.model.attention import PrefillChunk
    from pagedkv.model.backends.cpu_native import PrefillCascade
    from pagedkv.model.cascade import find_shared_prefixes

    torch.manual_seed(2)
    heads, kvh, d, bs, blocks = 8, 4, 64, 16, 16
    k_cache, v_cache = ((torch.randn(kvh, blocks, bs, d) * 2).bfloat16() for _ in range(2))
    prefix = torch.tensor([7, 3])
    own = {0: [5], 1: [9, 12], 2: [1]}
    cached = {0: 0, 1: 4, 2: 0}  # own tokens already in the cache before the chunk
    sizes = {0: 5, 1: 17, 2: 9}
    chunks, start = [], 1  # row 0 of the batch: another request's token
    for c in range(3):
        table = torch.cat([prefix, torch.tensor(own[c])])
        pos0 = 2 * bs + cached[c]
        chunks.append(PrefillChunk(start, start + sizes[c], pos0, pos0 + sizes[c], table))
        start += sizes[c]
    tables = torch.stack([torch.cat([c.block_table, torch.zeros(4 - len(c.block_table),
                                                                dtype=torch.long)])
                          for c in chunks])
    (group,) = find_shared_prefixes(tables, [c.start_pos + 1 for c in chunks], bs,
                                     min_tokens=bs)
    assert group.num_blocks == 2
    q = (torch.randn(start + 1, heads, d) * 2).bfloat16()
    out = torch.full((start + 1, heads, d), 7.0, dtype=torch.bfloat16)
    scale = d ** -0.5
    PrefillCascade.of(chunks, group, bs).attend(q, k_cache, v_cache, scale, out)
    g = heads // kvh
    worst = 0.0
    for c in chunks:
        keys = torch.cat([k_cache[:, b] for b in c.block_table.tolist()], 1).double()
        vals = torch.cat([v_cache[:, b] for b in c.block_table.tolist()], 1).double()
        for i in range(c.token_end - c.token_start):
            n = c.start_pos + i + 1
            s = torch.einsum("hd,hkd->hk", q[c.token_start + i].double(),
                             keys[:, :n].repeat_interleave(g, 0)) * scale
            exact = torch.einsum("hk,hkd->hd", torch.softmax(s, -1),
                                 vals[:, :n].repeat_interleave(g, 0))
            err = (out[c.token_start + i].double() - exact).abs().max().item()
            worst = max(worst, err / max(1.0, exact.abs().max().item()))
    print(f"max relative error {worst:.4g}")
    assert worst <= 2 ** -6
    assert bool((out[0] == 7.0).all()) and bool((out[start] == 7.0).all())
