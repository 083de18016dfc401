"""GGUF Q8_0 / Q6_K / Q5_0 / Q3_K / IQ4 weights kept packed (pagedkv/model/quant/int8_*): blocks read as int8 codes
and per-block scales with no loss (against the `gguf` package's dequantization); the integer
kernel (kernels/csrc/quant_int8.cpp, this machine's build and the AVX2 one) against float64
references: exactly the activation-quantized product up to float32 summation, and the
dequantize-then-matmul product within the bound the activation quantization allows; a model's
packed linears, head and embedding table against the same file dequantized, and the bytes
the engine counts."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from pagedkv.kernels import choice
from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.quant.gguf_parts import narrowest_scales
from pagedkv.model.quant.int8_block_linear import (
    INT8_BLOCK_ROWS,
    Int8BlockEmbedding,
    Int8BlockLinear,
    expand_reference,
)
from pagedkv.model.quant.int8_blocks import (
    IQ4_VALUES,
    int8_codes_and_scales,
    packed_codes,
    q3_k_two_level,
    q6_k_two_level,
    two_level_block_scales,
    unpacked_codes,
)
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.isa_child import run_with_isa
from pagedkv.testing.kv_quant_accuracy import kl_divergence, teacher_forced_logits
from tests.model.gguf_files import write_gguf

Q8_0, Q6_K, Q5_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_0
N, K = 48, 544  # K: eight 64-code chunks and a 32-code tail


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert ensure_cpu_kernels("wait")


def q8_0_rows(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random weights quantized by the gguf package's Q8_0 [n, bytes per row]."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quants.quantize(w, Q8_0)


# Where each super-block type keeps its fp16 d.
D_BYTES = {Q6_K: 208, GGMLQuantizationType.Q3_K: 108, GGMLQuantizationType.IQ4_XS: 0,
           GGMLQuantizationType.IQ4_NL: 0}


def random_blocks(ggml_type: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `ggml_type` [n, bytes per row] (types the gguf package cannot
    quantize to): random codes and sub-scales, an fp16 d between 1e-3 and 1e-2."""
    rng = np.random.default_rng(seed)
    per_block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (n * k // per_block, size), dtype=np.uint8)
    at = D_BYTES[ggml_type]
    raw[:, at:at + 2] = rng.uniform(1e-3, 1e-2, (raw.shape[0], 1)).astype(np.float16) \
        .view(np.uint8)
    return raw.reshape(n, -1)


def q6_k_rows(n: int, k: int, seed: int = 0) -> np.ndarray:
    return random_blocks(Q6_K, n, k, seed)


def q5_0_rows(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random weights quantized by the gguf package's Q5_0 [n, bytes per row]."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quants.quantize(w, Q5_0)


Q3_K, IQ4_NL, IQ4_XS = (GGMLQuantizationType.Q3_K, GGMLQuantizationType.IQ4_NL,
                        GGMLQuantizationType.IQ4_XS)
ROWS = {Q8_0: q8_0_rows, Q6_K: q6_k_rows, Q5_0: q5_0_rows,
        **{t: functools.partial(random_blocks, t) for t in (Q3_K, IQ4_NL, IQ4_XS)}}
CODE_RANGE = {Q8_0: (-127, 127), Q6_K: (-32, 31), Q5_0: (-16, 15), Q3_K: (-4, 3),
              IQ4_NL: (-127, 113), IQ4_XS: (-127, 113)}


@pytest.mark.parametrize("ggml_type", list(ROWS), ids=lambda t: t.name)
def test_codes_and_scales_are_the_format_without_loss(ggml_type):
    raw = ROWS[ggml_type](N, 512)
    codes, scales, block = int8_codes_and_scales(raw, ggml_type)
    assert block == (16 if ggml_type in (Q6_K, Q3_K) else 32) and codes.dtype == np.int8
    ours = codes.astype(np.float64).reshape(N, -1, block) * scales[..., None]
    want = quants.dequantize(raw, ggml_type).astype(np.float64)
    np.testing.assert_allclose(ours.reshape(N, -1), want, rtol=1e-7, atol=0)
    low, high = CODE_RANGE[ggml_type]
    assert low <= codes.min() and codes.max() <= high
    assert codes.min() <= low // 2 and codes.max() >= high // 2  # the range is used
    assert np.unique(np.sign(scales)).size > 1 or ggml_type in (Q8_0, Q5_0, IQ4_NL)


@pytest.mark.parametrize("kind", [Q6_K, GGMLQuantizationType.Q3_K], ids=lambda t: t.name)
def test_two_levels_are_the_float32_scales(kind):
    """Q6_K's and Q3_K's scales kept as the file has them (int8 sub-scales per 16, fp16 d per
    256: K/16 + K/128 bytes a row) are the float32 scales' very values, with the same codes."""
    raw = ROWS[kind](N, 768, seed=5)
    codes, table = TWO_LEVEL[kind][0](raw)
    want_codes, want_scales, _ = int8_codes_and_scales(raw, kind)
    assert table.dtype == np.uint8 and table.shape == (N, 768 // 16 + 768 // 128)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(two_level_block_scales(table), want_scales)


@pytest.mark.parametrize("bits", [3, 4, 5, 6])
def test_packed_codes_round_trip(bits):
    """Every 3-, 5- or 6-bit code, and every IQ4 value as a 4-bit index, in every position of a
    chunk packs and unpacks to itself, in 0.375, 0.5, 0.625 or 0.75 bytes a code; other codes
    are refused."""
    half = 1 << (bits - 1)
    rng = np.random.default_rng(0)
    values = np.arange(-half, half) if bits != 4 else IQ4_VALUES.astype(np.int64)
    codes = values[rng.integers(0, len(values), (5, 256))].astype(np.int8)
    codes[0] = values[np.arange(256) % len(values)]
    packed = packed_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (5, 256 // 64 * 8 * bits)
    np.testing.assert_array_equal(unpacked_codes(packed, bits), codes)
    with pytest.raises(ValueError, match=rf"{bits}-bit codes .*(within|IQ4's values)"):
        packed_codes((codes.astype(np.int16) * 2).clip(-128, 127).astype(np.int8), bits)


# The two-level types: their reader and the bits the loader keeps their codes in.
TWO_LEVEL = {Q6_K: (q6_k_two_level, 6), GGMLQuantizationType.Q3_K: (q3_k_two_level, 3)}


def two_level_linears(n: int, k: int, seed: int, kind: GGMLQuantizationType = Q6_K
                      ) -> dict[str, Int8BlockLinear]:
    """The same random Q6_K (or Q3_K) rows as Int8BlockLinears: "six" (6-bit codes, or 3-bit
    ones, two-level scales: the model's), "two" (int8 codes, two levels), "wide" (int8 codes,
    float32 scales)."""
    raw = ROWS[kind](n, k, seed)
    read, bits = TWO_LEVEL[kind]
    codes, table = read(raw)
    _, scales, _ = int8_codes_and_scales(raw, kind)
    linears = {"six": Int8BlockLinear(torch.from_numpy(packed_codes(codes, bits)),
                                      torch.from_numpy(table)),
               "two": Int8BlockLinear(torch.from_numpy(codes), torch.from_numpy(table)),
               "wide": Int8BlockLinear(torch.from_numpy(codes), torch.from_numpy(scales))}
    assert linears["six"].in_features == k and linears["six"].block == 16
    return linears


@pytest.mark.parametrize("kind", [Q6_K, GGMLQuantizationType.Q3_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 40, 300])
def test_two_level_and_packed_products_equal_the_float32_tables(rows, kind, monkeypatch):
    """Every path on Q6_K's (Q3_K's) two levels, with int8 codes or 6-bit (3-bit) ones (the
    decode tiles at 1-3 rows reading the packed bits in place, the panel product from 4
    unpacking them as it lays the panel out, AMX tiles from 10, row blocks at 300; 40 outputs:
    2 tasks of 16 and a tail of 8), on one thread and two, in bfloat16 and float32, gives the
    float32 table's very outputs (the same codes and scales); so do the expansion and the
    embedding rows. (The rows' route forced: each layout is a shape class of its own, whose
    measured product rows may differ.)"""
    monkeypatch.setenv(choice.ENV, "isa")
    linears = two_level_linears(40, 768, seed=rows, kind=kind)
    wide = linears.pop("wide")
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(count)) \
                    .to(dtype)
                want = wide(x)
                want_expanded = torch.ops.pagedkv_cpu.int8_block_forward(
                    x, wide.codes, wide.scales, 16, None, 0)
                for name, m in linears.items():
                    assert torch.equal(m(x), want), (name, count, dtype)
                    assert torch.equal(torch.ops.pagedkv_cpu.int8_block_forward(
                        x, m.codes, m.scales, 16, None, 0), want_expanded), name
    finally:
        torch.set_num_threads(threads)
    ids = torch.tensor([[39, 0], [7, 39]])
    for m in linears.values():
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            assert torch.equal(m.dequantized(dtype), wide.dequantized(dtype))
            assert torch.equal(m.dequantized(dtype), expand_reference(m.codes, m.scales, dtype))
        table = Int8BlockEmbedding(m.codes, m.scales, torch.bfloat16)
        assert torch.equal(table(ids), wide.dequantized(torch.bfloat16)[ids])


PACKED_BITS = {Q5_0: 5, IQ4_NL: 4, IQ4_XS: 4}


def packed_pair(ggml_type: GGMLQuantizationType, n: int, k: int, seed: int
                ) -> tuple[Int8BlockLinear, Int8BlockLinear]:
    """(the Int8BlockLinear on packed codes, the one on int8 codes) of the same rows of
    `ggml_type` (Q5_0: 5 bits; IQ4_NL, IQ4_XS: 4-bit indices), the same scales (float16 where
    exact, as the loader keeps them)."""
    codes, scales, _ = int8_codes_and_scales(ROWS[ggml_type](n, k, seed), ggml_type)
    table = torch.from_numpy(np.ascontiguousarray(narrowest_scales(scales)))
    bits = PACKED_BITS[ggml_type]
    packed = Int8BlockLinear(torch.from_numpy(packed_codes(codes, bits)), table)
    assert packed.in_features == k and packed.block == 32
    assert packed.codes.shape[1] == k * bits // 8
    return packed, Int8BlockLinear(torch.from_numpy(codes), table)


@pytest.mark.parametrize("ggml_type,k", [(Q5_0, 576), (IQ4_NL, 576), (IQ4_XS, 768)],
                         ids=["Q5_0", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("rows", [1, 3, 4, 12, 300])
def test_packed_products_equal_the_int8_codes(ggml_type, k, rows, monkeypatch):
    """Q5_0's codes in 5 bits and IQ4's as 4-bit indices (K = 576: nine chunks of 64, as
    SmolLM2's rows; 768 for IQ4_XS's super-blocks; 40 outputs), on one thread and two, in
    bfloat16 and float32, give the int8 codes' very outputs on every path (decode tiles,
    panel, row blocks, the expansion, the embedding rows; the rows' route forced, as above)."""
    monkeypatch.setenv(choice.ENV, "isa")
    five, plain = packed_pair(ggml_type, 40, k, seed=rows)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(count)) \
                    .to(dtype)
                assert torch.equal(five(x), plain(x)), (count, dtype)
                expanded = [torch.ops.pagedkv_cpu.int8_block_forward(
                    x, m.codes, m.scales, 32, None, 0) for m in (five, plain)]
                assert torch.equal(*expanded)
    finally:
        torch.set_num_threads(threads)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(five.dequantized(dtype), plain.dequantized(dtype))
    ids = torch.tensor([[39, 0], [7, 39]])
    table = Int8BlockEmbedding(five.codes, five.scales, torch.bfloat16)
    assert torch.equal(table(ids), plain.dequantized(torch.bfloat16)[ids])


def quantized_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float64, scales float64) of x's rows per block, as the kernel rounds them
    (float32 scale = max |x| / 127, codes to nearest even of x * (1 / scale))."""
    xb = x.float().reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv).double(), d.double()


def random_linear(block: int, seed: int, n: int = N,
                  scale_dtype: torch.dtype = torch.float32) -> Int8BlockLinear:
    """Codes over the whole int8 range (-128 included), scales of mixed sign (stored in
    `scale_dtype`: float32, or float16 as Q8_0's); `n` outputs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, K), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, K // block, generator=g) - 0.3) * 1e-2
    linear = Int8BlockLinear(codes, scales.to(scale_dtype))
    assert linear.scales.dtype == scale_dtype
    return linear


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 5, INT8_BLOCK_ROWS, INT8_BLOCK_ROWS + 3, 64, 65, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_linear_equals_float64_references(block, rows, dtype, scale_dtype):
    linear = random_linear(block, seed=block + rows, scale_dtype=scale_dtype)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = linear(x).double()
    w = expand_reference(linear.codes, linear.scales, torch.float64)
    magnitude = x.double().abs() @ w.abs().T
    out_rounding = (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20) * (magnitude + 1e-6)
    if rows <= linear.product_rows_for(dtype):  # the integer kernel (AMX tiles from 10 rows)
        q, d = quantized_activations(x, block)
        exact = ((q * d).reshape(rows, K)) @ w.T
        assert ((got - exact).abs() <= out_rounding).all()
        # |x - q d| <= d / 2 per value: the bound against the unquantized product.
        slack = (d / 2).expand(-1, -1, block).reshape(rows, K) @ w.abs().T
    else:  # the expanded weight, rounded to the activations' dtype
        slack = (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23) * magnitude
    want = x.double() @ w.T
    err = (got - want).abs()
    assert (err <= slack + out_rounding).all(), float((err / (slack + out_rounding)).max())
    assert float(err.max()) > 0 or dtype == torch.float32  # the bound is not vacuous


def test_expand_kernel_equals_torch_ops_and_bias_and_leading_dims():
    for block, scale_dtype in ((16, torch.float32), (32, torch.float32), (32, torch.float16)):
        linear = random_linear(block, seed=7, scale_dtype=scale_dtype)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            got = torch.ops.pagedkv_cpu.int8_block_expand(linear.codes, linear.scales, block,
                                                          dtype)
            want = expand_reference(linear.codes, linear.scales, dtype)
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=0)
    bias = torch.randn(N)
    with_bias = Int8BlockLinear(linear.codes, linear.scales, bias)
    x = torch.randn(2, 3, K)
    got = with_bias(x)
    assert got.shape == (2, 3, N)
    torch.testing.assert_close(got, linear(x.reshape(6, K)).reshape(2, 3, N) + bias)



@pytest.mark.parametrize("n", [1, 45])
def test_column_counts_off_the_kernels_tile_are_exact(n):
    """The kernel computes 4 output columns together: counts that leave single columns (45: a
    task's 16 columns and a tail of 13; 1) give the same exact integer products."""
    linear = random_linear(32, seed=n, n=n)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(n))
    got = linear(x).double()
    w = expand_reference(linear.codes, linear.scales, torch.float64)
    q, d = quantized_activations(x, 32)
    exact = (q * d).reshape(5, K) @ w.T
    assert got.shape == (5, n)
    assert ((got - exact).abs() <= 2.0 ** -20 * (x.double().abs() @ w.abs().T + 1e-6)).all()

@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("k", [96, 800])
@pytest.mark.parametrize("rows", [3, 4, 6, 7, 9, 64])
def test_row_and_column_tiles_off_the_panel_are_exact(block, k, rows):
    """From 4 rows the AVX-512 VNNI kernel lays out 16 weight rows at a time, 256 codes along K
    at a time, and computes 4 activation rows together: K = 3 blocks of 32 (less than one
    stretch) and 800 (three stretches and a tail of 32, an odd count of 32-code blocks), 20
    outputs (a panel and 4 rows of the next), row counts off the tile of 4 and across the
    3 / 4 rows where the products change, on one thread and two, give the exact integer
    products; float16 scales as Q8_0's."""
    g = torch.Generator().manual_seed(rows * k + block)
    n = 20
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = ((torch.rand(n, k // block, generator=g) - 0.3) * 1e-2).half()
    assert_exact_on_one_and_two_threads(torch.randn(rows, k, generator=g), codes, scales, block)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 5])
def test_weights_past_the_prefetch_distance_are_exact(block, rows):
    """Weights longer than the decode product's far prefetch reaches (16 KiB of codes ahead, on
    AMD's cores; 2 KiB on others): 200 rows of 544 codes (106 KiB), float16 scales as Q8_0's,
    on one thread and on two (a thread's prefetch runs into the other's rows), give the exact
    integer products, to the last rows (where the prefetch stops at the weight's end)."""
    linear = random_linear(block, seed=rows, n=200, scale_dtype=torch.float16)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(block))
    assert_exact_on_one_and_two_threads(x, linear.codes, linear.scales, block)


def assert_exact_on_one_and_two_threads(x: torch.Tensor, codes: torch.Tensor,
                                        scales: torch.Tensor, block: int) -> None:
    """int8_block_linear(x) equals the exact integer products of x's quantized rows with the
    codes (float32 sums of exact dots: within 2^-20 of |x| |w|), on one thread and on two."""
    w = expand_reference(codes, scales, torch.float64)
    q, d = quantized_activations(x, block)
    exact = (q * d).reshape(x.shape) @ w.T
    bound = 2.0 ** -20 * (x.double().abs() @ w.abs().T + 1e-6)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got = torch.ops.pagedkv_cpu.int8_block_linear(x, codes, scales, block).double()
            assert got.shape == exact.shape
            assert ((got - exact).abs() <= bound).all()
    finally:
        torch.set_num_threads(threads)


def test_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match=r"codes \[4, 40\].*multiple of 32"):
        Int8BlockLinear(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 5))
    with pytest.raises(ValueError, match=r"codes \[4, 512\] \(8 bits\) with scales \[4, 32\].*uint8"):
        Int8BlockLinear(torch.zeros(4, 512, dtype=torch.int8), torch.zeros(4, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"codes \[4, 288\].*two levels"):
        Int8BlockLinear(torch.zeros(4, 288, dtype=torch.int8), torch.zeros(4, 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"codes \[4, 256\] \(5 bits\).*5 bits in blocks of 32"):
        Int8BlockLinear(torch.zeros(4, 160, dtype=torch.uint8), torch.ones(4, 16))


def test_embedding_dequantizes_only_the_rows_asked_for():
    linear = random_linear(32, seed=3)
    table = Int8BlockEmbedding(linear.codes, linear.scales, torch.bfloat16)
    ids = torch.tensor([[3, 0], [47, 3]])
    got = table(ids)
    assert got.shape == (2, 2, K) and got.dtype == torch.bfloat16
    want = expand_reference(linear.codes, linear.scales, torch.bfloat16)[ids]
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    head = table.tied_head()
    assert head.codes is table.codes and head.scales is table.scales


_AVX2_CHECK = """
import json, os, torch
from pagedkv.kernels.cpu import ensure_cpu_kernels
assert ensure_cpu_kernels("wait")
from tests.model.test_quant_int8_blocks import quantized_activations, random_linear
from pagedkv.model.quant.int8_block_linear import expand_reference
worst = 0.0
for block, scale_dtype in ((16, torch.float32), (32, torch.float32), (32, torch.float16)):
    linear = random_linear(block, seed=block, scale_dtype=scale_dtype)
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(1))
    got = torch.ops.pagedkv_cpu.int8_block_linear(x, linear.codes, linear.scales, block).double()
    q, d = quantized_activations(x, block)
    w = expand_reference(linear.codes, linear.scales, torch.float64)
    exact = (q * d).reshape(5, -1) @ w.T
    worst = max(worst, float(((got - exact).abs() / (x.double().abs() @ w.abs().T)).max()))
from tests.model.test_quant_int8_blocks import TWO_LEVEL, two_level_linears
os.environ["PAGEDKV_KERNEL_CHOICE"] = "isa"  # each layout's rows routed alike (until the end)
same = True
for kind in TWO_LEVEL:
    linears = two_level_linears(40, 768, seed=2, kind=kind)
    for rows in (5, 20):
        x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(2))
        same &= torch.equal(linears["six"](x), linears["wide"](x))
        same &= torch.equal(linears["two"](x), linears["wide"](x))
from tests.model.test_quant_int8_blocks import IQ4_NL, Q5_0, packed_pair
for ggml_type in (Q5_0, IQ4_NL):
    packed, plain = packed_pair(ggml_type, 40, 576, seed=3)
    for rows in (1, 20):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(3))
        same &= torch.equal(packed(x), plain(x))
del os.environ["PAGEDKV_KERNEL_CHOICE"]
print(json.dumps([torch.ops.pagedkv_cpu.int8_block_isa(), worst, same]))
"""


def test_the_avx2_build_computes_the_same_product():
    isa, worst, two_levels_same = run_with_isa(_AVX2_CHECK)
    assert isa == "avx2"
    assert worst <= 2.0 ** -20  # float32 summation of exact integer dots
    assert two_levels_same  # Q6_K's and Q3_K's two levels, 6-, 5- and 3-bit codes: the same


PROMPT = [5, 17, 99, 230, 41, 8, 77, 300, 12, 64, 3, 150, 9, 250, 33, 71, 200, 18, 44, 6]
CONTINUATION = [90, 14, 321, 7, 55, 260, 2, 101, 48, 11, 199, 36]


def runner(path, quantization: str) -> ModelRunner:
    return ModelRunner(str(path), block_size=4, num_blocks=16, device="cpu", dtype="bfloat16",
                       quantization=quantization)


def _packed_bytes(model: torch.nn.Module) -> int:
    """What the packed modules' weights take: a byte a code and a scale a block (float16 for
    Q8_0's, float32 for Q6_K's)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (Int8BlockLinear, Int8BlockEmbedding)) and id(m.codes) not in seen:
            seen.add(id(m.codes))
            total += m.codes.numel() + m.scales.element_size() * m.scales.numel()
    return total


@pytest.mark.parametrize("quant", [Q8_0, Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_llama_mqa"])
def test_q8_0_model_kept_packed_matches_dequantized(model_fixture, quant, request, tmp_path):
    """Every linear, the embedding table and the head (untied: its own; tied: the table's
    codes) packed, Q8_0 or Q5_0 (its 5-bit codes as int8); next-token distributions within
    the activation quantization's reach of the dequantized model; the model's bytes are the
    packed ones."""
    path = write_gguf(request.getfixturevalue(model_fixture), tmp_path / "m.gguf", quant=quant)
    packed, dense = runner(path, "auto"), runner(path, "none")
    model = packed.model
    assert isinstance(model.embed_tokens, Int8BlockEmbedding)
    assert isinstance(model.lm_head, Int8BlockLinear)
    assert sum(isinstance(m, Int8BlockLinear) for m in model.modules()) == 9  # 2 x 4 + head
    tied = model_fixture == "tiny_llama_mqa"
    assert (model.lm_head.codes is model.embed_tokens.codes) is tied
    packed_scales = {m.scales.dtype for m in model.modules()
                     if isinstance(m, (Int8BlockLinear, Int8BlockEmbedding))}
    assert packed_scales == {torch.float16}  # Q8_0's own fp16 scales, kept as they are
    dense_bytes = sum(p.numel() * p.element_size() for name, p in dense.model.named_parameters()
                      if "norm" not in name)
    assert packed.weights_bytes == dense.weights_bytes - dense_bytes + _packed_bytes(model)
    with torch.inference_mode():
        kl = kl_divergence([teacher_forced_logits(dense, PROMPT, CONTINUATION)],
                           [teacher_forced_logits(packed, PROMPT, CONTINUATION)])
    print(f"{quant.name} {model_fixture}: mean KL {kl.mean_kl:.2e}, "
          f"top-1 {kl.top1_agreement:.3f}")
    assert kl.mean_kl < 1e-3 and kl.top1_agreement >= 0.9, kl
