"""The CPU decode attention's kernel choice (pagedkv/model/decode_choice.py): the fused kernel
or torch's over gathered blocks; every candidate computes the reference's attention (the fused
kernel also where it cuts a lone decode's context into parts over the threads), a forced choice
is fixed, a measured table is cached on disk and reused, and a step routed each way agrees with
the torch backend."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.kernels import choice
from pagedkv.model import decode_choice
from pagedkv.model.backends.cpu_native import CpuNativeBackend, NativeAttentionMetadata
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.backends.torch_paged import TorchPagedBackend
from pagedkv.model.decode_choice import DecodeClass, DecodeTable

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CLASS = DecodeClass(torch.bfloat16, 6, 3, 64, 16, torch.bfloat16)
NATIVE = (("native",) * len(decode_choice.CONTEXTS),) * len(decode_choice.BATCHES)


@pytest.fixture(autouse=True)
def _fresh_choice(fresh_kernel_choice, monkeypatch):
    """An empty in-process decode table per test (beside fresh_kernel_choice's)."""
    monkeypatch.setattr(decode_choice, "_tables", {})
    monkeypatch.setattr(decode_choice, "_in_use", {})
    monkeypatch.setattr(decode_choice, "POOL_TOKENS", 256)  # small caches: quick tests


def reference(q, k_cache, v_cache, k_scales, v_scales, tables, lens, scale) -> torch.Tensor:
    """Each decode's attention over its gathered (dequantized) keys, float64."""
    out = []
    kvh, _, bs, d = k_cache.shape
    g = q.shape[1] // kvh
    for s in range(q.shape[0]):
        n = int(lens[s])
        blocks = tables[s, : -(-n // bs)]
        k, v = (c[:, blocks].reshape(kvh, -1, d)[:, :n].double() for c in (k_cache, v_cache))
        if k_scales is not None:
            k = k * k_scales[:, blocks].reshape(kvh, -1)[:, :n, None]
            v = v * v_scales[:, blocks].reshape(kvh, -1)[:, :n, None]
        qs = q[s].double().view(kvh, g, d)
        w = torch.softmax(qs @ k.transpose(1, 2) * scale, -1)
        out.append((w @ v).reshape(-1, d))
    return torch.stack(out)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize(("batch", "context"), [(1, 16), (1, 150), (3, 70)])
def test_every_timed_candidate_computes_the_reference_attention(dtype, kv_dtype, batch, context):
    cls = DecodeClass(dtype, 6, 3, 64, 16, kv_dtype)
    calls = decode_choice.decode_candidates(cls, batch, context, torch.Generator().manual_seed(1))
    x = decode_choice._inputs(cls, batch, context, torch.Generator().manual_seed(1))
    want = reference(x.q, x.k_cache, x.v_cache, x.k_scales, x.v_scales, x.tables, x.lens,
                     x.scale)
    assert set(calls) == {"native"} | ({"torch"} if kv_dtype == dtype else set())
    for name, call in calls.items():
        got = call()
        assert got.shape == (batch, 6, 64), name
        err = float((got.double() - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert err <= TOL[dtype], (name, err)


@pytest.mark.parametrize(("dtype", "kv_dtype", "head_dim"), [
    (torch.float32, torch.float32, 64), (torch.bfloat16, torch.bfloat16, 128),
    (torch.bfloat16, torch.int8, 64), (torch.bfloat16, torch.float8_e4m3fn, 64),
    (torch.float32, torch.float32, 96)])  # 96: the kernel for any head size
@pytest.mark.parametrize(("batch", "context"), [(1, 100), (1, 200), (1, 2000), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_fused_kernel_cut_over_the_threads_computes_the_reference(dtype, kv_dtype, head_dim,
                                                                      batch, context, threads):
    """A call of fewer sequences x KV heads than twice the threads cuts each context into
    parts of whole blocks (at least 64 keys each) merged by their log-sum-exp: 3 KV heads
    on 2, 3 and 8 threads at 100 keys (never cut) to 2,000; three decodes, one with a window
    (first position 300) and one of 40 keys (a part of it empty); the log-sum-exp it returns
    included."""
    cls = DecodeClass(dtype, 6, 3, head_dim, 16, kv_dtype)
    x = decode_choice._inputs(cls, batch, context, torch.Generator().manual_seed(4))
    first = torch.tensor([0, 300, 0][:batch])
    lens = torch.tensor([context, context - 17, 40][:batch])
    want, want_lse = [], []
    for s in range(batch):  # the window: keys first[s] .. lens[s] - 1
        sub = reference_with_lse(x, s, int(first[s]), int(lens[s]))
        want.append(sub[0])
        want_lse.append(sub[1])
    out = torch.empty_like(x.q)
    lse = torch.empty(batch, 6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.pagedkv_cpu.paged_decode_attention_q(
            x.q, x.k_cache, x.v_cache, x.k_scales, x.v_scales, x.tables, first, lens, x.scale,
            out, lse)
    finally:
        torch.set_num_threads(before)
    want_out = torch.stack(want)
    err = float((out.double() - want_out).abs().max()) / max(1.0, float(want_out.abs().max()))
    assert err <= TOL[dtype], err
    assert torch.allclose(lse.double(), torch.stack(want_lse), atol=1e-3, rtol=1e-4)


def reference_with_lse(x, s: int, first: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode s of `decode_choice._inputs` over keys first .. length - 1 (float64): its
    attention [heads, D] and log-sum-exp of the scaled scores [heads]."""
    kvh, _, bs, d = x.k_cache.shape
    g = x.q.shape[1] // kvh
    blocks = x.tables[s, : -(-length // bs)]
    k, v = (c[:, blocks].reshape(kvh, -1, d)[:, first:length].double() for c in (x.k_cache, x.v_cache))
    if x.k_scales is not None:
        k = k * x.k_scales[:, blocks].reshape(kvh, -1)[:, first:length, None]
        v = v * x.v_scales[:, blocks].reshape(kvh, -1)[:, first:length, None]
    scores = x.q[s].double().view(kvh, g, d) @ k.transpose(1, 2) * x.scale
    return (torch.softmax(scores, -1) @ v).reshape(-1, d), torch.logsumexp(scores, -1).reshape(-1)


@pytest.mark.parametrize(("forced", "kernel"), [("panel", "native"), ("isa", "native"),
                                                ("onednn", "torch")])
def test_a_forced_choice_fixes_the_kernel_and_measures_nothing(forced, kernel, monkeypatch):
    monkeypatch.setenv(choice.ENV, forced)
    for batch, longest in ((1, 8000), (1, 10), (40, 3000)):
        assert decode_choice.decode_route(CLASS, batch, longest) == kernel
    int8 = CLASS._replace(kv_dtype=torch.int8)
    assert decode_choice.decode_route(int8, 1, 8000) == "native"  # no torch path
    assert not choice.table_path().exists()
    assert decode_choice.decode_in_use()[CLASS.key()] == {"forced": kernel}
    assert forced in decode_choice.describe_decode()


def test_the_measured_table_is_cached_on_disk_and_reused(monkeypatch):
    calls = []
    measure = decode_choice.measure_decode
    monkeypatch.setattr(decode_choice, "BATCHES", ((1, 1, 1), (2, 2, 2)))  # a quick table
    monkeypatch.setattr(decode_choice, "CONTEXTS", ((1, 64, 64), (65, 65, 160)))

    def counted(cls):
        calls.append(cls)
        return measure(cls)

    monkeypatch.setattr(decode_choice, "measure_decode", counted)
    table = decode_choice.decode_table(CLASS)
    assert calls == [CLASS]
    assert all(k in decode_choice.KERNELS for row in table.kernels for k in row)
    on_disk = json.loads(choice.table_path().read_text())["decode_attention"][CLASS.key()]
    assert on_disk == table.as_json()
    monkeypatch.setattr(decode_choice, "_tables", {})  # a second start: the file
    again = decode_choice.decode_table(CLASS)
    assert calls == [CLASS]
    assert again.kernels == table.kernels
    info = decode_choice.decode_in_use()[CLASS.key()]
    assert info == {"kernels": {"1": {"1-64": table.kernels[0][0], "65+": table.kernels[0][1]},
                                "2+": {"1-64": table.kernels[1][0], "65+": table.kernels[1][1]}}}


def test_the_route_reads_the_bucket_of_the_batch_and_longest_context():
    kernels = [list(row) for row in NATIVE]
    kernels[2][2] = "torch"
    decode_choice._tables[CLASS.key()] = DecodeTable(tuple(map(tuple, kernels)))
    route = decode_choice.decode_route
    assert route(CLASS, 40, 5000) == "torch"
    assert route(CLASS, 40, 1000) == "native"
    assert route(CLASS, 1, 5000) == "native"
    assert route(CLASS, 2, 5000) == "native"
    assert decode_choice.describe_decode().endswith("native; torch at batch 9+, context 4097+")


def one_decode_step_error(dtype: torch.dtype, route: str, monkeypatch,
                          window: int | None = None) -> tuple[float, list[str]]:
    """(max |native - torch backend| / max(1, |torch|), routes taken) of a step of one decode
    of 300 keys over scattered blocks, the native metadata's decode forced to `route`."""
    bs, kvh, heads, d = 16, 3, 6, 64
    table = [int(b) for b in torch.randperm(40, generator=torch.Generator().manual_seed(3))[:19]]
    step = StepSequences([1], [300], [table], [table[299 // bs] * bs + 299 % bs], num_decodes=1,
                         block_size=bs)
    torch.manual_seed(5)
    q = torch.randn(1, heads, d, dtype=dtype)
    k, v = torch.randn(1, kvh, d, dtype=dtype), torch.randn(1, kvh, d, dtype=dtype)
    k_cache, v_cache = (torch.randn(kvh, 40, bs, d, dtype=dtype) for _ in range(2))
    want = TorchPagedBackend(torch.device("cpu")).build_metadata(step).attend(
        q, k, v, k_cache.clone(), v_cache.clone(), d ** -0.5, window)
    taken = []
    monkeypatch.setattr("pagedkv.model.backends.cpu_native.decode_route",
                        lambda *args: taken.append(route) or route)
    native = CpuNativeBackend(torch.device("cpu"))
    native.set_fused(True)
    meta = native.build_metadata(step)
    assert isinstance(meta, NativeAttentionMetadata)
    got = meta.attend(q, k, v, k_cache, v_cache, d ** -0.5, window)
    return float((got.double() - want.double()).abs().max()) / max(1.0, float(want.abs().max())), \
        taken


@pytest.mark.parametrize("route", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
def test_a_decode_step_agrees_with_the_torch_backend_on_every_route(dtype, route, window,
                                                                    monkeypatch):
    err, taken = one_decode_step_error(dtype, route, monkeypatch, window)
    assert taken == [route]
    assert err <= TOL[dtype]


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_lone_decode_over_a_quantized_cache_agrees_with_the_dequantized_reference(
        cache_dtype):
    """The quantized cache's in-place metadata (quantized_native.py): a step of one decode of
    60 keys in scattered blocks, against softmax attention over the dequantized cache."""
    from pagedkv.model.backends.quantized import QuantizedKVBackend
    from tests.model.test_kv_quant_in_place import (
        BLOCK,
        HEAD_DIM,
        HEADS,
        KV_HEADS,
        NUM_BLOCKS,
        _fill,
        _reference,
    )

    gen = torch.Generator().manual_seed(2)
    table = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=gen)[:15]]
    seqs = [(1, 60, table)]
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    k_scales = v_scales = None
    if cache_dtype == torch.int8:
        k_scales, v_scales = torch.zeros(shape[:-1]), torch.zeros(shape[:-1])
    cached = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(59)])
    for cache, scales in ((k_cache, k_scales), (v_cache, v_scales)):
        _fill(cache, scales, cached, torch.randn(59, KV_HEADS, HEAD_DIM, generator=gen))
    step = StepSequences([1], [60], [table], [table[59 // BLOCK] * BLOCK + 59 % BLOCK],
                         num_decodes=1, block_size=BLOCK)
    backend = QuantizedKVBackend(CpuNativeBackend(torch.device("cpu")), reads_in_place=True)
    backend.set_fused(True)
    meta = backend.build_metadata(step)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen).bfloat16()
    k, v = (torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
    out = meta.attend(q, k, v, k_cache, v_cache, HEAD_DIM ** -0.5, None, k_scales=k_scales,
                      v_scales=v_scales)
    ref = _reference(q, k_cache, v_cache, k_scales, v_scales, None, seqs)
    assert float((out.float() - ref).abs().max() / ref.abs().max()) < 1e-2
