"""The fused paged prefill attention kernel (csrc/prefill_attention.cpp `paged_prefill_attention`)
against a pure-torch float64 reference (over model-dtype caches, and int8 / fp8 caches read in
place against their dequantized values), and the native backend's use of it for prefill chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.backends.cpu_native import CpuNativeBackend
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.backends.torch_paged import TorchPagedBackend
from pagedkv.model.kv_int8 import dequantize_per_token
from pagedkv.testing.isa_child import run_with_isa

# float32: summation order only; bfloat16: q, k, v and the probabilities in bfloat16.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    """The kernels loaded; prefill chunks through the tiled kernel at every length (the
    measured choice of a step's kernel has its own tests: test_prefill_choice.py)."""
    assert ensure_cpu_kernels("wait")
    monkeypatch.setenv("PAGEDKV_KERNEL_CHOICE", "isa")


def supported(head_dim: int, dtype: torch.dtype) -> bool:
    return bool(torch.ops.pagedkv_cpu.paged_prefill_supports(head_dim, dtype))


def quantized(cache: torch.Tensor, fmt: str):
    """(the cache stored as `fmt`: "model" (as it is), "int8", "e4m3" or "e5m2"; its int8
    scales or None; the values it holds, float32). int8: random values over the full range, each
    row's scale random (1/64 .. 1/32 of its values' spread), not a search's."""
    if fmt == "model":
        return cache, None, cache.float()
    if fmt == "int8":
        values = torch.randint(-127, 128, cache.shape, dtype=torch.int8)
        scales = (1 + torch.rand(cache.shape[:-1])) * cache.float().std() / 64
        return values, scales, dequantize_per_token(values, scales, torch.float32)
    stored = cache.float().to({"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt])
    return stored, None, stored.float()


def reference(q, k_cache, v_cache, tables, starts, ends, lens, window, scale, causal=True):
    """(out, lse) of each chunk's rows: float64 attention over its gathered blocks, token at
    position p seeing keys max(0, p - window + 1) .. p, or (not causal) every key (query heads
    h over KV head h // g)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    kvh, _, bs, d = k_cache.shape
    g = q.shape[1] // kvh
    for c in range(len(starts)):
        n, length = ends[c] - starts[c], lens[c]
        blocks = tables[c][: -(-length // bs)]
        k = k_cache[:, blocks].reshape(kvh, -1, d)[:, :length].double().repeat_interleave(g, 0)
        v = v_cache[:, blocks].reshape(kvh, -1, d)[:, :length].double().repeat_interleave(g, 0)
        qc = q[starts[c]:ends[c]].double().transpose(0, 1)  # [H, n, D]
        pos = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None, :]
        seen = key <= pos if causal else torch.ones(n, length, dtype=torch.bool)
        if window:
            seen &= key > pos - window
        scores = (qc @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        out[starts[c]:ends[c]] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
        lse[starts[c]:ends[c]] = torch.logsumexp(scores, -1).transpose(0, 1)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 4), (2, 5)])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("fmt", ["model", "int8", "e4m3", "e5m2"])
def test_prefill_kernel_matches_the_reference(dtype, head_dim, kv_heads, group, window, fmt):
    """Chunks starting at 0, mid-block after a cached prefix, a single token, one longer than a
    tile and a key step (odd lengths: pairs of keys with a lone last key), tables out of order;
    caches of q's dtype, or int8 (per-token scales) / fp8 read in place against the values they
    hold."""
    if not supported(head_dim, dtype):
        pytest.skip("this build has no tiled prefill kernel for this dtype")
    torch.manual_seed(5)
    bs, num_blocks = 16, 48
    k_cache, k_scales, k_values = quantized(
        torch.randn(kv_heads, num_blocks, bs, head_dim, dtype=dtype) * 2, fmt)
    v_cache, v_scales, v_values = quantized(
        torch.randn(kv_heads, num_blocks, bs, head_dim, dtype=dtype), fmt)
    # (new tokens, total length): from position 0; after 21 cached; 1 token after 40; 75 after 28.
    shapes = [(19, 19), (30, 51), (1, 41), (75, 103)]
    perm = torch.randperm(num_blocks - 1) + 1
    tables, used = [], 0
    for _, length in shapes:
        n = -(-length // bs)
        tables.append(perm[used:used + n].tolist() + [0] * (8 - n))
        used += n
    starts, ends, t = [], [], 3  # three rows before the first chunk (decodes' places)
    for n, _ in shapes:
        starts.append(t)
        ends.append(t + n)
        t += n
    lens = [length for _, length in shapes]
    q = torch.randn(t, kv_heads * group, head_dim, dtype=dtype)
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    torch.ops.pagedkv_cpu.paged_prefill_attention(
        q, k_cache, v_cache, torch.tensor(tables), torch.tensor(starts), torch.tensor(ends),
        torch.tensor(lens), window, scale, out, True, None, k_scales, v_scales)
    want, _ = reference(q, k_values, v_values, tables, starts, ends, lens, window, scale)
    err = float((out[3:].double() - want[3:]).abs().max())
    assert err <= TOL[dtype] * max(1.0, float(want.abs().max()))
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))  # rows of no chunk untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fmt", ["model", "int8", "e4m3"])
def test_not_causal_rows_see_every_key_and_return_the_log_sum_exp(dtype, head_dim, fmt):
    """causal=False (decodes over a shared prefix): every row of a chunk sees all its keys,
    chunks of 1, 6 and 40 rows (more rows than keys too), and lse is each row's log-sum-exp
    (of the scores over the values a quantized cache holds: its scales in)."""
    if not supported(head_dim, dtype):
        pytest.skip("this build has no tiled prefill kernel for this dtype")
    torch.manual_seed(6)
    kvh, g, bs = 2, 4, 16
    k_cache, k_scales, k_values = quantized(
        torch.randn(kvh, 12, bs, head_dim, dtype=dtype) * 2, fmt)
    v_cache, v_scales, v_values = quantized(torch.randn(kvh, 12, bs, head_dim, dtype=dtype), fmt)
    tables = [[3, 7, 1, 9], [3, 7, 1, 9], [2, 0, 0, 0]]
    starts, ends, lens = [0, 2, 8], [1, 8, 48], [64, 50, 16]
    q = torch.randn(48, kvh * g, head_dim, dtype=dtype)
    out, lse = torch.empty_like(q), torch.full((48, kvh * g), 5.0)
    torch.ops.pagedkv_cpu.paged_prefill_attention(
        q, k_cache, v_cache, torch.tensor(tables), torch.tensor(starts), torch.tensor(ends),
        torch.tensor(lens), 0, 0.125, out, False, lse, k_scales, v_scales)
    want, want_lse = reference(q, k_values, v_values, tables, starts, ends, lens, 0, 0.125,
                               causal=False)
    rows = torch.tensor([0] + list(range(2, 48)))
    assert float((out[rows].double() - want[rows]).abs().max()) <= TOL[dtype] * float(
        want.abs().max())
    assert float((lse[rows].double() - want_lse[rows]).abs().max()) <= TOL[dtype] * float(
        want_lse.abs().max())
    assert torch.equal(lse[1], torch.full((kvh * g,), 5.0))  # row 1 is in no chunk


def test_prefill_kernel_refuses_bad_tables_and_shapes():
    if not supported(64, torch.float32):
        pytest.skip("this build has no tiled prefill kernel")
    kc = torch.zeros(1, 4, 16, 64)
    q, out = torch.zeros(5, 2, 64), torch.zeros(5, 2, 64)
    op = torch.ops.pagedkv_cpu.paged_prefill_attention
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        op(q, kc, kc, torch.tensor([[9, 1]]), torch.tensor([0]), torch.tensor([5]),
           torch.tensor([20]), 0, 0.125, out)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(q, kc, kc, torch.tensor([[1]]), torch.tensor([0]), torch.tensor([5]),
           torch.tensor([40]), 0, 0.125, out)
    with pytest.raises(RuntimeError, match="a window needs causal rows"):
        op(q, kc, kc, torch.tensor([[1]]), torch.tensor([0]), torch.tensor([5]),
           torch.tensor([5]), 4, 0.125, out, False)
    with pytest.raises(RuntimeError, match="int8 caches need k_scales"):
        op(q, kc.to(torch.int8), kc.to(torch.int8), torch.tensor([[1]]), torch.tensor([0]),
           torch.tensor([5]), torch.tensor([5]), 0, 0.125, out)
    with pytest.raises(RuntimeError, match="int8 caches need k_scales"):
        op(q, kc, kc, torch.tensor([[1]]), torch.tensor([0]), torch.tensor([5]),
           torch.tensor([5]), 0, 0.125, out, True, None, kc[..., 0], kc[..., 0])
    with pytest.raises(RuntimeError, match="v_scales must be contiguous float32"):
        op(q, kc.to(torch.int8), kc.to(torch.int8), torch.tensor([[1]]), torch.tensor([0]),
           torch.tensor([5]), torch.tensor([5]), 0, 0.125, out, True, None,
           kc[..., 0].contiguous(), kc[:, :2, :, 0].contiguous())
    with pytest.raises(RuntimeError, match="of one dtype"):
        op(q, kc.to(torch.float16), kc.to(torch.float16), torch.tensor([[1]]),
           torch.tensor([0]), torch.tensor([5]), torch.tensor([5]), 0, 0.125, out)
    with pytest.raises(RuntimeError, match="not supported"):
        op(torch.zeros(5, 2, 48), torch.zeros(1, 4, 16, 48), torch.zeros(1, 4, 16, 48),
           torch.tensor([[1]]), torch.tensor([0]), torch.tensor([5]), torch.tensor([5]), 0,
           0.125, torch.zeros(5, 2, 48))


def mixed_step_error(dtype: torch.dtype, head_dim: int, group: int, window: int | None) -> float:
    """max |native - torch reference| / max(1, |reference|) of one mixed step's attention:
    three decodes sharing four blocks (a cascade group of rows 0, 2, 3: two runs) and a lone
    one, then three prefill chunks (two after those shared blocks, mid-block: the torch path's
    cascade; one from position 0 spanning three blocks), through each backend's metadata; the
    caches written must be equal."""
    bs, kvh = 16, 2
    shared = [1, 2, 3, 4]
    tables = [shared + [5, 6], [9, 10], shared + [7], shared + [8],
              shared + [11, 12], shared + [13], [14, 15, 16]]
    new = [1, 1, 1, 1, 17, 7, 40]
    lens = [90, 20, 75, 65, 83, 76, 40]
    slots = [tables[i][p // bs] * bs + p % bs
             for i in range(len(new)) for p in range(lens[i] - new[i], lens[i])]
    step = StepSequences(new, lens, tables, slots, num_decodes=4, block_size=bs)
    torch.manual_seed(4)
    t, heads = sum(new), kvh * group
    q = torch.randn(t, heads, head_dim, dtype=dtype)
    k, v = torch.randn(t, kvh, head_dim, dtype=dtype), torch.randn(t, kvh, head_dim, dtype=dtype)
    k_cache = torch.randn(kvh, 20, bs, head_dim, dtype=dtype)
    v_cache = torch.randn(kvh, 20, bs, head_dim, dtype=dtype)
    ref_caches = (k_cache.clone(), v_cache.clone())
    scale = head_dim ** -0.5
    want = TorchPagedBackend(torch.device("cpu")).build_metadata(step).attend(
        q, k, v, *ref_caches, scale, window)
    native = CpuNativeBackend(torch.device("cpu"))
    native.set_fused(True)
    meta = native.build_metadata(step)
    assert [g.rows for g in meta.shared_prefixes()] == [[0, 2, 3]]
    got = meta.attend(q, k, v, k_cache, v_cache, scale, window)
    assert torch.equal(k_cache, ref_caches[0]) and torch.equal(v_cache, ref_caches[1])
    return float((got.double() - want.double()).abs().max()) / max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 5])
@pytest.mark.parametrize("window", [None, 24])
def test_native_backend_prefill_matches_the_torch_path(dtype, group, window):
    """The native metadata sends the step's prefill chunks (shared prefix, mid-block starts,
    sliding window) through the tiled kernel where the build has one, and agrees with the
    torch backend (gathers, SDPA, cascade) on every row."""
    assert mixed_step_error(dtype, 64, group, window) <= TOL[dtype]


@pytest.mark.slow
def test_an_avx2_build_has_no_tiled_prefill_and_keeps_the_torch_path():
    """PAGEDKV_CPU_ISA=avx2 (Zen 3's build, a child process: one library per process) reports
    no tiled prefill kernel, and the native backend's prefill chunks still match; so do an int8
    and an fp8 cache's, as rows of the decode kernel (that test asserts)."""
    code = ("import json, torch; from pagedkv.kernels.cpu import ensure_cpu_kernels; "
            "ensure_cpu_kernels('wait'); import test_prefill_kernel as t; "
            "import test_kv_quant_in_place as q; "
            "f = q.test_every_token_of_a_step_reads_the_quantized_cache_in_place; "
            "f(torch.int8, 6, False, torch.bfloat16); "
            "f(torch.float8_e4m3fn, None, False, torch.float32); "
            "print(json.dumps([t.supported(64, torch.float32), t.supported(128, torch.bfloat16), "
            "t.mixed_step_error(torch.float32, 64, 2, None), "
            "t.mixed_step_error(torch.bfloat16, 64, 2, 24)]))")
    sup32, sup16, err32, err16 = run_with_isa(code, extra_path=(str(Path(__file__).parent),))
    assert not sup32 and not sup16
    assert err32 <= TOL[torch.float32] and err16 <= TOL[torch.bfloat16]


# Prompts of 3 .. 40 tokens: past the window of 8, over two blocks of 16, chunks mid-block.
PROMPTS = [[1, 17, 93], [1] + list(range(40, 79)), [1] + list(range(300, 320)),
           [1] + list(range(100, 113))]


@pytest.mark.parametrize("chunk_size", [None, 13])
def test_greedy_tokens_through_the_tiled_kernel_equal_transformers(tmp_path, chunk_size):
    """A tiny Qwen2 of head size 64 (GQA 5; one full layer, one sliding over 8) with the CPU
    kernels on: greedy tokens equal transformers', whole prompts and chunks of 13 (chunks
    starting mid-block after a cached prefix)."""
    from pagedkv.model import ModelRunner
    from tests.model.driver import greedy_generate
    from tests.model.test_correctness import hf_greedy
    from tests.tiny_models import build_tiny_hf_model, load_hf_model

    model = build_tiny_hf_model(tmp_path / "m", "qwen2_hd64")
    runner = ModelRunner(model, block_size=16, num_blocks=64, cpu_kernels="wait", device="cpu")
    assert runner.attn_backend.fused
    ours = greedy_generate(runner, PROMPTS, 8, chunk_size=chunk_size)
    assert ours == hf_greedy(load_hf_model(model), PROMPTS, 8)
