"""The int8 KV cache (per-token-head scales) and the kernels reading quantized caches in place:
rounding bounds, the slot write (torch and C++ alike), byte-exact block moves of data and
scales, the logit error against the model dtype's cache, and the in-place decode kernel against
a dequantized reference in both of its vector builds (AVX-512 and, forced, AVX2)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels, library_path
from pagedkv.kv.spec import FullAttentionSpec
from pagedkv.model.kv_cache import KVCache
from pagedkv.model.kv_int8 import (
    SCALE_FACTORS,
    dequantize_per_token,
    quantize_into_per_token,
    quantize_per_token,
    round_trip_per_token,
)
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.isa_child import run_with_isa
from pagedkv.testing.kv_quant_accuracy import compare_logits, teacher_forced_logits
from pagedkv.testing.quantized_decode_check import (
    INT8_FLOAT32_TOLERANCE,
    check_quantized_decode,
)
from tests.model.driver import TRITON_DEVICE

# Max |logit error| against the float32 cache on the tiny llama, teacher-forced (70 + 30 tokens,
# seed 0; logits spread over ~5): measured 0.0304 on both CPU paths (fp8 e4m3: 0.099); the
# bound is that plus 20%.
INT8_LOGIT_BOUND = 0.037


def test_each_scale_is_the_least_squared_error_candidate_and_zero_vectors_stay_zero():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    x[4, 1] = 0.0
    q, scales = quantize_per_token(x)
    assert q.dtype == torch.int8 and scales.shape == (50, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    base = x.abs().amax(-1) / 127
    nonzero = base > 0
    base[4, 1] = 1.0
    # every scale is one of the candidates, and no candidate rounds x back closer (float64;
    # the kernel counts errors in units of ~2^-21 of the step: equal to 1e-4)
    factors = torch.tensor(SCALE_FACTORS)
    assert bool((base.unsqueeze(-1) * factors).eq(scales.unsqueeze(-1)).any(-1)[nonzero].all())
    errors = torch.stack([(round_trip(x, base * f) - x.double()).pow(2).sum(-1) for f in factors])
    got = (dequantize_per_token(q, scales, torch.float64) - x.double()).pow(2).sum(-1)
    assert bool((got <= errors.min(0).values * (1 + 1e-4)).all())
    # the search pays: ~13% less squared error than max|x| / 127 alone, never more
    assert bool((got <= errors[SCALE_FACTORS.index(1.0)] * (1 + 1e-4)).all())
    assert float(got.sum() / errors[SCALE_FACTORS.index(1.0)].sum()) < 0.92
    assert float(scales[4, 1]) == 0.0 and not bool(round_trip_per_token(x)[4, 1].any())


def round_trip(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x as round(x / s) within +-127, times s, in float64 (the naive reference)."""
    q = torch.round(x / scales.unsqueeze(-1)).clamp(-127, 127)
    return q.double() * scales.double().unsqueeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_into_writes_exactly_the_given_slots_and_the_kernel_agrees(dtype):
    ensure_cpu_kernels("wait")
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(2, 6, 4, 32, dtype=torch.int8)
    scales = torch.zeros(2, 6, 4)
    values = (torch.randn(9, 2, 32, generator=gen) * 3).to(dtype)
    slots = torch.tensor([5, 6, 7, 8, 13, 2, 22, 23, 9])
    quantize_into_per_token(cache, scales, slots, values)
    q, s = quantize_per_token(values)
    flat, flat_scales = cache.view(2, 24, 32), scales.view(2, 24)
    assert torch.equal(flat[:, slots], q.transpose(0, 1))
    assert torch.equal(flat_scales[:, slots], s.transpose(0, 1))
    untouched = [i for i in range(24) if i not in slots.tolist()]
    assert not bool(flat[:, untouched].any()) and not bool(flat_scales[:, untouched].any())
    # The C++ write rounds the same way, bit for bit, and skips negative slots.
    cache2, scales2 = torch.zeros_like(cache), torch.zeros_like(scales)
    torch.ops.pagedkv_cpu.write_kv_int8_(values, cache2, scales2, slots)
    assert torch.equal(cache2, cache) and torch.equal(scales2, scales)
    torch.ops.pagedkv_cpu.write_kv_int8_(values[:1], cache2, scales2, torch.tensor([-1]))
    assert torch.equal(cache2, cache)


def hard_vectors(n: int, ties: int, constant: int, dtype: torch.dtype) -> torch.Tensor:
    """x [n, 2, 72] for the writes' bit-for-bit checks: Gaussian vectors of every magnitude
    (subnormal to 1e37), then `ties` of small integers (equal errors for several candidates,
    halves in x / s), `constant` constant ones, and x[ties + constant, 0] all zeros."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 2, 72, generator=gen)
    x *= torch.exp2(torch.randint(-140, 120, (n, 2, 1), generator=gen).float())
    x[:ties] = torch.randint(-127, 128, (ties, 2, 72), generator=gen).float()
    x[ties:ties + constant] = torch.rand(constant, 2, 1, generator=gen) * 7
    x[ties + constant, 0] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_picks_the_same_scale_as_torch_for_every_vector(dtype):
    """Many vectors of every magnitude (subnormal to 1e37), constant ones and small integers
    (equal errors for several candidates: ties), head size 72 (the vector path and a
    tail), written by the C++ kernel and by torch: the
    same int8 values and scales, bit for bit (the errors are compared as integers)."""
    ensure_cpu_kernels("wait")
    x = hard_vectors(600, 40, 20, dtype)
    slots = torch.arange(600)
    cache, scales = torch.zeros(2, 150, 4, 72, dtype=torch.int8), torch.zeros(2, 150, 4)
    quantize_into_per_token(cache, scales, slots, x)
    cache2, scales2 = torch.zeros_like(cache), torch.zeros_like(scales)
    torch.ops.pagedkv_cpu.write_kv_int8_(x, cache2, scales2, slots)
    assert torch.equal(scales2, scales) and torch.equal(cache2, cache)
    flat = scales.view(2, -1)
    assert float(flat[0, 599]) != 0.0 and float(flat[0, 60]) == 0.0


def test_int8_swap_copy_and_block_rows_move_values_and_scales_exactly():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="int8",
                             num_layers=2)
    cache = KVCache.from_spec(spec, num_blocks=5, device=torch.device("cpu"), num_host_blocks=3)
    assert cache.nbytes == 5 * spec.page_size_bytes == 5 * 4 * 2 * 2 * 2 * (8 + 4)
    gen = torch.Generator().manual_seed(2)
    cache.kv.copy_(torch.randint(-127, 128, cache.kv.shape, generator=gen, dtype=torch.int8))
    cache.scales_kv.copy_(torch.rand(cache.scales_kv.shape, generator=gen))
    kv, sc = cache.kv.clone(), cache.scales_kv.clone()
    cache.swap_out([(1, 2), (3, 1)])
    cache.kv.zero_()
    cache.scales_kv.zero_()
    cache.swap_in([(2, 4), (1, 2)])
    assert torch.equal(cache.kv[:, :, :, 4], kv[:, :, :, 1])
    assert torch.equal(cache.scales_kv[:, :, :, 2], sc[:, :, :, 3])
    cache.copy([(4, 1)])
    assert torch.equal(cache.scales_kv[:, :, :, 1], sc[:, :, :, 1])
    rows = cache.read_blocks([1, 2])
    assert rows.shape == (2, spec.page_size_bytes) and rows.dtype == torch.uint8
    cache.kv.zero_()
    cache.scales_kv.zero_()
    cache.write_blocks([3, 0], rows)
    assert torch.equal(cache.kv[:, :, :, 3], kv[:, :, :, 1])
    assert torch.equal(cache.scales_kv[:, :, :, 0], sc[:, :, :, 3])
    with pytest.raises(ValueError, match="rows must be uint8"):
        cache.write_blocks([1], rows[:, :-4])
    assert cache.dtype_tag() == "torch.int8:per-token-head-float32-scales"


def _prompt_and_continuation(seed: int, vocab: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return ([rng.randrange(4, vocab) for _ in range(70)],
            [rng.randrange(4, vocab) for _ in range(30)])


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
def test_int8_logits_stay_close_to_the_model_dtype_cache(tiny_llama, cpu_kernels):
    """Both CPU paths: the dequantized compact copy (off) and the fused kernel reading the
    blocks in place (auto: built by the session fixture)."""
    prompt, cont = _prompt_and_continuation(0, 200)
    ref_runner = ModelRunner(tiny_llama, block_size=4, num_blocks=32, device="cpu",
                             cpu_kernels="off")
    runner = ModelRunner(tiny_llama, block_size=4, num_blocks=32, device="cpu",
                         kv_cache_dtype="int8", cpu_kernels=cpu_kernels)
    runner._use_cpu_kernels()
    assert runner.kv_cache.kv.dtype == torch.int8
    assert all(layer.self_attn.kv_scales is not None for layer in runner.model.layers)
    ref = teacher_forced_logits(ref_runner, prompt, cont)
    got = compare_logits(ref, teacher_forced_logits(runner, prompt, cont))
    assert 0.0 < got.max_abs_error < INT8_LOGIT_BOUND, got
    assert got.greedy_agreement == 1.0, got


def test_in_place_decode_kernel_matches_the_dequantized_reference():
    errors = check_quantized_decode()
    assert set(errors) == {f"{c}/{q}/{d}"
                           for c in ("int8", "float8_e4m3fn", "float8_e5m2", "model dtype")
                           for q in ("float32", "bfloat16") for d in (64, 80, 128)}


@pytest.mark.slow
def test_the_avx2_build_of_the_kernel_matches_the_reference_too():
    """PAGEDKV_CPU_ISA=avx2 builds the library without AVX-512 (another build key, so another
    library: Zen 3's 8-lane code), and its in-place decode passes the same check; its int8
    write (the scalar error loop) picks the same scales as torch."""
    code = ("import json, torch; from pagedkv.kernels.cpu import library_path; "
            "from pagedkv.testing.quantized_decode_check import check_quantized_decode; "
            "from tests.model.test_kv_int8 import "
            "test_the_kernel_picks_the_same_scale_as_torch_for_every_vector as same_scales; "
            "same_scales(torch.float32); same_scales(torch.bfloat16); "
            "print(json.dumps([str(library_path()), check_quantized_decode()]))")
    path, errors = run_with_isa(code)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDKV_CPU_ISA", "avx2")
        assert path == str(library_path())  # the AVX2 build's key
    if os.environ.get("PAGEDKV_CPU_ISA") != "avx2":  # this process runs the native build
        assert path != str(library_path())
    assert len(errors) == 24 and all(e <= INT8_FLOAT32_TOLERANCE or "bfloat16" in k
                                     for k, e in errors.items())


def test_triton_backend_reads_the_int8_cache_in_place(tiny_llama):
    """The CUDA backend (its Triton kernels interpreted on CPU) over an int8 cache, unwrapped
    ("int8" in `reads_cache_dtypes`): the kernel stores values and scales and applies the scales itself;
    the same logit bound against the model dtype's cache. Short: the interpreter is slow."""
    rng = random.Random(1)
    prompt = [rng.randrange(4, 200) for _ in range(20)]
    cont = [rng.randrange(4, 200) for _ in range(4)]
    ref = teacher_forced_logits(ModelRunner(tiny_llama, block_size=4, num_blocks=16,
                                            device="cpu"), prompt, cont, chunk_size=8)
    runner = ModelRunner(tiny_llama, block_size=4, num_blocks=16, device=TRITON_DEVICE,
                         attention_backend="cuda", kv_cache_dtype="int8")
    from pagedkv.model.backends.triton_paged import TritonPagedBackend
    assert isinstance(runner.attn_backend, TritonPagedBackend)  # not wrapped: read in place
    got = compare_logits(ref, teacher_forced_logits(runner, prompt, cont, chunk_size=8))
    assert 0.0 < got.max_abs_error < INT8_LOGIT_BOUND, got
    assert bool(runner.kv_cache.scales_kv.any())  # the kernel stored the scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_store_writes_what_torch_writes_bit_for_bit(dtype):
    """The Triton int8 store (scale search, quantization and write in one launch; interpreted
    on CPU) over hard_vectors as strided views of one K/V tensor (the model's split), some
    tokens unmapped (slot -1): the torch write's int8 rows and scales, bit for bit; every other
    slot untouched. Small: the interpreter runs each program in Python."""
    pytest.importorskip("triton")
    from pagedkv.model.backends.triton_int8_store import store_kv_int8

    n = 28
    x = hard_vectors(n, 8, 4, dtype)
    kv = torch.stack([x, x.flip(0) * 0.5], dim=1).reshape(n, 4, 72)
    k, v = kv[:, :2], kv[:, 2:]
    slots = torch.randperm(2 * n, generator=torch.Generator().manual_seed(4))[:n]
    slots[[3, n - 1]] = -1
    mapped = slots >= 0
    want = [torch.full((2, n, 2, 72), 7, dtype=torch.int8) for _ in range(2)]
    want += [torch.full((2, n, 2), -1.0) for _ in range(2)]
    got = [t.clone().to(TRITON_DEVICE) for t in want]
    quantize_into_per_token(want[0], want[2], slots[mapped], k[mapped])
    quantize_into_per_token(want[1], want[3], slots[mapped], v[mapped])
    store_kv_int8(k.to(TRITON_DEVICE), v.to(TRITON_DEVICE), got[0], got[1], got[2], got[3],
                  slots.to(TRITON_DEVICE))
    got = [t.cpu() for t in got]
    for name, w, g in zip(("keys", "values", "key scales", "value scales"), want, got,
                          strict=True):
        assert torch.equal(g, w), name
    assert bool((got[2] == 0).any()) and bool((got[0] == 7).any())  # a zero vector; free slots
