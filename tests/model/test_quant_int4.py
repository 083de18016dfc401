"""The packed 4- and 5-bit linear (pagedkv/model/quant): GGUF Q4_0 / Q4_1 / Q4_K / Q5_1 / Q5_K
blocks read as codes, scales and offsets (checked against the `gguf` package's own dequantization), and Int4Linear's
output on each of its paths (the int4 product on int8 activations at decode sizes, torch's int4
op before the kernels load, the expanded weight above) against a float64
dequantize-then-matmul reference, within the rounding its activations allow; the kernels
(kernels/csrc/quant_int4.cpp: the expansion, the int4 product on int8 activations per group of
32, the int8 product on int16 ones) against float64 references, in this machine's build and
the AVX2 one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.quant import int4_linear
from pagedkv.model.quant.int4_blocks import INT4_TYPES, codes, codes_and_scales, pack_group_codes
from pagedkv.model.quant.int4_linear import GEMV_ROWS, Int4Linear, product_rows
from pagedkv.testing.isa_child import run_with_isa

TYPES = sorted(INT4_TYPES, key=lambda t: t.name)
N, K = 48, 512
# The output is rounded once to bfloat16 (2^-9 of it), and torch's int4 op (before the kernels
# load) rounds the scales and zeros to bfloat16 (2^-9 of each weight's terms): twice that covers
# float32 summation. The int4 product adds its int8 activations' rounding (half a step, max |x|
# / 127 per group of 32, per value). (An offset off by one step, or codes in the wrong order,
# is far outside.)
REL = 2.0 ** -8


def random_rows(ggml_type: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `ggml_type` [n, bytes per row], every fp16 scale and min finite and
    between 1e-3 and 1e-1 in size (signs mixed: real files have negative mins)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    halves = 2 if ggml_type == GGMLQuantizationType.Q4_0 else 4  # d (and m / dmin) lead
    fp16 = rng.uniform(1e-3, 1e-1, (raw.shape[0], halves // 2)).astype(np.float16)
    fp16 *= rng.choice(np.array([-1, 1], dtype=np.float16), fp16.shape)
    if ggml_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        fp16[:, 0] = np.abs(fp16[:, 0])
    raw[:, :halves] = fp16.view(np.uint8).reshape(raw.shape[0], halves)
    return raw.reshape(n, -1)


def reference_weight(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The format's own dequantization (the gguf package), float64."""
    return quants.dequantize(raw, ggml_type).astype(np.float64)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_codes_and_scales_are_the_format(ggml_type):
    raw = random_rows(ggml_type, N, K)
    packed, scale, offset = codes_and_scales(raw, ggml_type)
    q = codes(packed, K // 32).astype(np.float64).reshape(N, -1, 32)
    ours = (q * scale[..., None] + offset[..., None]).reshape(N, K)
    want = reference_weight(raw, ggml_type)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def blocks(request):
    return codes_and_scales(random_rows(request.param, N, K, seed=1), request.param), \
        reference_weight(random_rows(request.param, N, K, seed=1), request.param)


@pytest.fixture(scope="module")
def packed(blocks):
    parts, w = blocks
    return Int4Linear(*parts), w


@pytest.mark.parametrize("rows", [1, 3, GEMV_ROWS, GEMV_ROWS + 1, 40, 64, 65, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernels", ["fused", "torch"])
def test_int4_linear_equals_float64_reference(packed, rows, dtype, kernels, monkeypatch):
    if kernels == "fused":
        assert ensure_cpu_kernels("wait")
    else:
        monkeypatch.setattr(int4_linear, "cpu_kernels_loaded", lambda: False)
    linear, w = packed
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16().to(dtype)
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, N)
    xd = x.double().numpy()
    want = xd @ w.T
    bound = REL * (np.abs(xd) @ np.abs(w).T + np.abs(want)) + 1e-6
    if kernels == "fused" and rows <= linear.product_rows_for(dtype):
        step = np.abs(xd).reshape(rows, -1, 32).max(axis=2) / 127  # [rows, K/32]
        bound += (step / 2) @ np.abs(w).reshape(N, -1, 32).sum(axis=2).T
    err = np.abs(got.double().numpy() - want)
    assert (err <= bound).all(), f"worst {err.max()} over bound {bound[err.argmax() // N]}"


def test_bias_and_leading_dims(blocks, packed):
    bias = torch.randn(N)
    with_bias = Int4Linear(*blocks[0], bias=bias)
    x = torch.randn(2, GEMV_ROWS, K).bfloat16()
    for rows in (x[:, :1], x):  # both paths: 2 rows (the int4 kernel), more (expanded)
        got = with_bias(rows).float()
        want = packed[0](rows.reshape(-1, K)).float().reshape(*rows.shape[:2], N) + bias
        assert got.shape == (*rows.shape[:2], N)
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


def test_scales_kept_exactly(blocks, packed):
    """The file's scales and offsets, as float16 (Q4_0's offsets, -8 times its scales, implied:
    its scales alone, 2 bytes per 32 weights as in the file)."""
    (_, scale, offset), _ = blocks
    stored = packed[0].scales.float().numpy()
    q4_0 = bool(np.array_equal(offset, -8 * scale))
    assert (stored.shape == scale.shape) == q4_0  # the scales alone: Q4_0's, and only those
    if q4_0:
        assert packed[0].scales.dtype == torch.float16
        np.testing.assert_array_equal(stored, scale)
    else:
        np.testing.assert_array_equal(stored, np.concatenate((scale, offset), axis=1))


def test_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match=r"weight \[40, 64\] needs rows a multiple of 16"):
        Int4Linear(np.zeros((40, 32), np.uint8), np.ones((40, 2), np.float32),
                   np.zeros((40, 2), np.float32))


def test_expand_kernel_equals_torch_ops(packed):
    assert ensure_cpu_kernels("wait")
    linear, _ = packed
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        got = torch.ops.pagedkv_cpu.int4_expand(linear.codes, linear.scales, dtype)
        want = linear.dequantized_reference(dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    assert int4_linear.cpu_kernels_loaded()


def products_against_references(n: int, k: int, rows: int, seed: int) -> dict:
    """The fused int4 and int8 products (kernels/csrc/quant_int4.cpp) of random weights [n, k]
    on float32 activations [rows, k] with one outlier feature, against float64 references:
    per path, the largest error over its bound (a pass is <= 1): the activations' steps (max |x|
    / 127 per group of 32 for int4, max |x| / 32767 per row for int8; half of one at most per
    value) times the weights' magnitudes, plus float32 summation. The int4 product with float16
    and float32 scales. Also run by the AVX2 child."""
    gen = torch.Generator().manual_seed(seed)
    nib = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    x[:, 1] *= 30
    bias = torch.randn(n, generator=gen)
    blocks = nib.view(n, -1, 16)
    q4 = torch.cat((blocks & 15, blocks >> 4), dim=2).double()  # [N, K/32, 32]
    x64 = x.double()
    step = x64.abs().reshape(rows, -1, 32).amax(dim=2) / 127  # [rows, K/32]
    ratios = {}
    for dtype in (torch.float16, torch.float32):
        scales = (torch.rand(n, k // 16, generator=gen) * 0.2 - 0.1).to(dtype)  # [N, 2 * K/32]
        scale, offset = scales.double().view(n, 2, -1, 1).unbind(dim=1)
        w4 = (q4 * scale + offset).reshape(n, k)
        got4 = torch.ops.pagedkv_cpu.int4_gemv(x, nib, scales, bias).double()
        # Each activation off by half a step at most, times each weight (codes and offsets
        # meet the same quantized activations).
        bound4 = (step / 2) @ w4.abs().reshape(n, -1, 32).sum(dim=2).T \
            + 1e-5 * (x64.abs() @ w4.abs().T + 1)
        ratios[f"int4_{dtype}"] = float(((got4 - x64 @ w4.T - bias).abs() / bound4).max())
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s8 = (torch.rand(n, generator=gen) + 0.01).bfloat16()
    wd = w8.double() * s8.double()[:, None]
    got8 = torch.ops.pagedkv_cpu.int8_gemv(x, w8, s8, None).double()
    bound8 = x64.abs().amax(dim=1, keepdim=True) / 65534 * wd.abs().sum(dim=1) \
        + 1e-5 * (x64.abs() @ wd.abs().T + 1)
    ratios["int8"] = float(((got8 - x64 @ wd.T).abs() / bound8).max())
    return ratios


# (N, K, rows): N not a multiple of 4 (the last rows one at a time), K of 3, 17 and 18 groups
# (a partial last chunk of 4 / 2 groups), rows across the runs of 4; from 10 rows with N a
# multiple of 16, AMX tiles where they run (a partial tile of rows, an odd group count).
PRODUCT_CASES = [(20, 96, 1), (33, 544, 5), (16, 576, 12), (48, 544, 37)]


@pytest.mark.parametrize(("n", "k", "rows"), PRODUCT_CASES)
def test_products_equal_float64_references(n, k, rows):
    assert ensure_cpu_kernels("wait")
    ratios = products_against_references(n, k, rows, seed=n)
    assert max(ratios.values()) <= 1, ratios


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, steps) float64 [rows, K/32, 32], [rows, K/32, 1] of x's rows per group of 32, as
    the kernels round them (float32 step = max |x| / 127, codes to nearest even of
    x * (127 / max |x|))."""
    xg = x.float().reshape(x.shape[0], -1, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # (a tensor divided: `127 / amax` is torch's reciprocal times 127, an ulp off the kernels'
    # 127 / max |x| in a quarter of cases, and a value next to a tie then rounds the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xg * inv).double(), (amax / 127).double()


def exact_products_ratio(n: int, k: int, rows: int, style: str, scale_dtype: torch.dtype,
                         seed: int) -> float:
    """int4_gemv on random codes [n, k] with a bias, scales in `scale_dtype` (mixed signs) and
    offsets as Q4_0's (-8 times the scale) or Q4_1's (their own, mixed signs), or 5-bit codes
    with their own offsets as Q5_1's (style "q5_1": the fifth bits after the nibbles), on float32
    activations [rows, k], against the exact product of the activations as the kernels quantize
    them (codes and offsets alike: the offset meets the quantized values' sum, step times the
    codes' integer sum): the largest error over its bound (a pass is <= 1). The integer dots
    are exact, so what remains is float32's: each group's term is rounded at most 4 times (the
    two scales' product, the multiply-adds of the dot and of the offset, the sum's product with
    the step: below 2^-19 of its magnitudes) and added to a sum of up to 72 groups here,
    2^-17 of the terms' magnitudes covers both (a group's term off, or an offset missed, is
    ~2^-5 of them). Also run by the AVX2 child."""
    g = torch.Generator().manual_seed(seed)
    bits = 5 if style == "q5_1" else 4
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    nib = torch.from_numpy(pack_group_codes(q.numpy(), bits))
    scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 1e-2).to(scale_dtype)
    if style == "q4_0":
        offset = -8 * scale  # exact in float16 too
    else:
        offset = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).to(scale_dtype)
    scales = torch.cat((scale, offset), dim=1).contiguous()
    x = torch.randn(rows, k, generator=g)
    x[:, 3] *= 20  # an outlier feature: one group's step far above the others'
    bias = torch.randn(n, generator=g)
    cs = q.double().view(n, -1, 32) * scale.double()[..., None]  # [N, K/32, 32]
    off = offset.double()  # [N, K/32]
    xq, step = quantized_activations(x)
    sums = (xq.sum(-1, keepdim=True) * step)[..., 0]  # [rows, K/32]
    exact = torch.einsum("rgc,ngc->rn", xq * step, cs) + sums @ off.T + bias.double()
    magnitude = torch.einsum("rgc,ngc->rn", (xq * step).abs(), cs.abs()) \
        + (xq.abs() * step).sum(-1) @ off.abs().T
    bound = 2.0 ** -17 * magnitude + 1e-30
    got = torch.ops.pagedkv_cpu.int4_gemv(x, nib, scales, bias).double()
    assert got.shape == (rows, n)
    return float(((got - exact).abs() / bound).max())


@pytest.mark.parametrize(("k", "rows"), [(800, 300), (2304, 250)])
def test_rows_across_blocks_are_exact(k, rows):
    """The panel product meets each weight panel with a block of activation rows at a time (64
    to 256, fewer the longer K: 256 at K = 800, 112 at 2,304): rows across two blocks and into
    a third give the exact products of the activations as quantized."""
    assert ensure_cpu_kernels("wait")
    for style in ("q4_0", "q4_1", "q5_1"):
        ratio = exact_products_ratio(20, k, rows, style, torch.float16, seed=rows)
        assert ratio <= 1, (style, ratio)


@pytest.mark.parametrize("style", ["q4_0", "q4_1", "q5_1"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("k", [96, 800])
@pytest.mark.parametrize("rows", [3, 4, 5, 7, 9, 64])
def test_row_and_column_tiles_off_the_panel_are_exact(style, scale_dtype, k, rows):
    """From 4 rows the AVX-512 VNNI kernel lays out 16 weight rows at a time, 8 groups (256
    codes) along K at a time, and computes 4 activation rows together: K = 3 groups (less than
    one stretch, an odd count: a lone group in the last pair) and 800 (three stretches and a
    tail of one group), 20 outputs (a panel and 4 rows of the next), row counts off the tile of
    4 and across the 3 / 4 rows where the products change, float16 (Q4_0, Q4_1) and float32
    (Q4_K) scales, Q4_0's offsets and Q4_1's, 5-bit codes (their fifth bits added to the
    nibbles on each path), on one thread and two, give the exact products
    of the activations as quantized (the float32 sums' rounding aside)."""
    assert ensure_cpu_kernels("wait")
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            ratio = exact_products_ratio(20, k, rows, style, scale_dtype, seed=rows * k)
            assert ratio <= 1, (count, ratio)
    finally:
        torch.set_num_threads(threads)


def test_product_rows_cover_the_panel_product():
    """Where the integer product is AVX-512 VNNI's, the packed linear runs it at every row count
    (the panel product, a block of rows at a time), or up to 64 rows where AMX tiles run (the
    expanded weight on oneDNN's AMX matmul beyond); elsewhere up to GEMV_ROWS."""
    assert ensure_cpu_kernels("wait")
    if torch.ops.pagedkv_cpu.int_gemv_isa() != "avx512_vnni":
        assert product_rows() == GEMV_ROWS
    elif "amx_int8" in Path("/proc/cpuinfo").read_text():  # 64 where the tiles are permitted
        assert product_rows() in (64, 1 << 40)
    else:
        assert product_rows() == 1 << 40


def test_product_kernels_check_their_inputs():
    assert ensure_cpu_kernels("wait")
    nib, sc = torch.zeros(16, 16, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        torch.ops.pagedkv_cpu.int4_gemv(torch.zeros(1, 64), nib, sc, None)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.pagedkv_cpu.int4_gemv(torch.zeros(1, 32), nib, sc.bfloat16(), None)


_AVX2_CHECK = """
import json, numpy as np, torch
from pagedkv.kernels.cpu import ensure_cpu_kernels, panel_isa
assert ensure_cpu_kernels("wait")
from pagedkv.model.quant.int4_linear import Int4Linear
from test_quant_int4 import PRODUCT_CASES, exact_products_ratio, products_against_references
rng = np.random.default_rng(2)
lin = Int4Linear(rng.integers(0, 256, (32, 64), dtype=np.uint8),
                 rng.uniform(-0.1, 0.1, (32, 4)).astype(np.float32),
                 rng.uniform(-0.1, 0.1, (32, 4)).astype(np.float32))
got = torch.ops.pagedkv_cpu.int4_expand(lin.codes, lin.scales, torch.float32)
want = lin.dequantized_reference(torch.float32)
ratios = [products_against_references(*case, seed=case[0]) for case in PRODUCT_CASES]
ratios.append({f"exact_{style}_{dtype}_{rows}": exact_products_ratio(20, 800, rows, style, dtype, 7)
               for style in ("q4_0", "q4_1", "q5_1") for dtype in (torch.float16, torch.float32)
               for rows in (5, 64)})
from gguf import GGMLQuantizationType
from pagedkv.model.quant.int4_blocks import codes_and_scales, k_quant_two_level
from test_quant_int4 import random_rows
x, ops, two_err = torch.randn(5, 512), torch.ops.pagedkv_cpu, 0.0
for kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
    raw = random_rows(kind, 32, 512, seed=4)
    wide = Int4Linear(*codes_and_scales(raw, kind))
    two = Int4Linear.from_two_level(*k_quant_two_level(raw, kind))
    two_err = max([two_err] + [float((ops.int4_gemv(x[:r], two.codes, two.scales, None)
                          - ops.int4_gemv(x[:r], wide.codes, wide.scales, None)).abs().max())
                   for r in (1, 5)]
                  + [float((ops.int4_expand(two.codes, two.scales, torch.float32)
                            - ops.int4_expand(wide.codes, wide.scales, torch.float32)).abs().max())])
from test_quant_int4 import q4_0_scale_only_error
print(json.dumps([panel_isa(), torch.ops.pagedkv_cpu.int_gemv_isa(),
                  float((got - want).abs().max()), float(want.abs().max()), ratios, two_err,
                  q4_0_scale_only_error((1, 5, 20))]))
"""


def test_kernels_in_the_avx2_build():
    isa, gemv_isa, err, scale, ratios, two_level_err, scale_only_err = run_with_isa(
        _AVX2_CHECK, extra_path=(str(Path(__file__).parent),))
    assert "avx2" in isa.lower() and gemv_isa == "avx2", (isa, gemv_isa)
    assert err <= 1e-6 * scale, json.dumps([err, scale])
    assert all(max(r.values()) <= 1 for r in ratios), ratios
    assert two_level_err == 0  # Q4_K's two levels, materialized: the float32 table's products
    assert scale_only_err <= 2.0 ** -20  # Q4_0's scales alone: the full table's, summed alike


def q4_0_scale_only_error(rows: tuple[int, ...], k: int = 800) -> float:
    """The largest difference between int4_gemv / int4_expand on Q4_0's float16 scales alone
    (offsets implied) and on the table with the offsets (-8 x scale) stored, 40 outputs, over
    the products' magnitudes (|x| |W|; the expansion: |W|): the same terms, so float32
    summation order at most (a build may vectorize one layout's offset sum and not the
    other's)."""
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 256, (40, k // 2), dtype=torch.uint8, generator=g)
    scale = ((torch.rand(40, k // 32, generator=g) - 0.3) * 0.1).half()
    full = torch.cat((scale, -8 * scale), dim=1).contiguous()
    ops = torch.ops.pagedkv_cpu
    w = ops.int4_expand(codes, full, torch.float32)
    errs = [float(((ops.int4_gemv(x, codes, scale, None) - ops.int4_gemv(x, codes, full, None))
                   .abs() / (x.abs() @ w.abs().T)).max())
            for x in (torch.randn(r, k, generator=g) for r in rows)]
    errs.append(float(((ops.int4_expand(codes, scale, torch.float32) - w).abs()
                       / (w.abs().max())).max()))
    return max(errs)


def test_q4_0_scales_alone_compute_as_the_full_table():
    """Q4_0's float16 scales alone, its offsets implied (-8 x scale; 2 bytes per 32 weights, the
    file's): every path (the decode product reading them in place at 1-3 rows, the panel
    product from 4, AMX tiles where they run, the row blocks at 300, the expansion) gives the
    table with the offsets stored's products up to float32 summation order, on one thread and
    two (a scale or offset misread is off by whole terms: 1e-2 and more)."""
    assert ensure_cpu_kernels("wait")
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert q4_0_scale_only_error((1, 2, 3, 4, 12, 40, 300)) <= 2.0 ** -20
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 5, 40, 300])
@pytest.mark.parametrize("kernels", ["fused", "torch"])
def test_k_quant_two_level_scales_compute_as_the_float32_table(kind, rows, kernels,
                                                               monkeypatch):
    """Q4_K's and Q5_K's scales kept as the file has them (fp16 d and -dmin per 256, 6-bit
    sub-scales and mins per 32) give the very products of the float32 table they expand to, on
    every path (1 row, the rows past the panel's 4, the row blocks, the expanded weight, torch's
    op without the kernels), in a third of its bytes; the table's layout is checked as it is
    read back."""
    from pagedkv.model.quant.int4_blocks import k_quant_two_level, two_level_scales

    if kernels == "fused":
        assert ensure_cpu_kernels("wait")
    else:
        monkeypatch.setattr(int4_linear, "cpu_kernels_loaded", lambda: False)
    n, k = 48, 768  # 3 super-blocks a row
    raw = random_rows(kind, n, k, seed=rows)
    nibbles, scale, offset = codes_and_scales(raw, kind)
    two_nibbles, table = k_quant_two_level(raw, kind)
    np.testing.assert_array_equal(two_nibbles, nibbles)
    back = two_level_scales(table)
    np.testing.assert_array_equal(back[0], scale)
    np.testing.assert_array_equal(back[1], offset)
    wide = Int4Linear(nibbles, scale, offset)
    two = Int4Linear.from_two_level(nibbles, table)
    assert wide.scales.dtype == torch.float32 and two.scales.dtype == torch.uint8
    assert two.scales.numel() * 3 < wide.scales.numel() * 4
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    torch.testing.assert_close(two(x), wide(x), rtol=0, atol=0)
    if kernels == "fused":
        ops = torch.ops.pagedkv_cpu
        torch.testing.assert_close(ops.int4_linear(x, two.codes, two.scales, None, 0),
                                   ops.int4_linear(x, wide.codes, wide.scales, None, 0),
                                   rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="two-level uint8 scales"):
            ops.int4_gemv(x, two.codes, two.scales[:, 1:].contiguous(), None)
