"""The packed linears' product rows (pagedkv/model/quant/product_route.py): chosen by the kernel
choice's measurement per shape class and rows bucket, the product up to the first bucket the
expansion takes; the instruction-set rule where the choice is forced; cached on disk; listed
with the linears' choices; the decode stack's call and the forward's agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.kernels import choice
from pagedkv.model.quant import int4_linear, int8_block_linear
from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.int8_block_linear import Int8BlockLinear
from pagedkv.model.quant.product_route import EVERY_ROW, rows_from_buckets

N, K = 48, 256
BUCKETS = len(choice.ROW_BUCKETS)
# The expansion from the 65-256 bucket on: the product up to 64 rows.
EXPAND_FROM_65 = ("product",) * 5 + ("expand",) * 3


pytestmark = pytest.mark.usefixtures("fresh_kernel_choice")


def q4_0_linear(seed: int = 0) -> Int4Linear:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, (N, K // 32)).astype(np.float16).astype(np.float32)
    return Int4Linear(codes, scale, -8 * scale)


def q8_0_linear(seed: int = 0) -> Int8BlockLinear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    return Int8BlockLinear(codes, (torch.rand(N, K // 32, generator=g) * 1e-2).half())


def fake_measure(table: tuple[str, ...], seen: list):
    """A stand-in for choice.measure_linear returning `table`, recording the candidates' names
    and each one's result on X70 (70 rows: past the table's product rows)."""
    def measure(dtype, in_features, kernels):
        seen.append(sorted(kernels))
        seen.extend((name, f(X70.to(dtype))) for name, f in kernels.items())
        return table
    return measure


X70 = torch.randn(70, K, generator=torch.Generator().manual_seed(7))


def test_rows_from_buckets():
    assert rows_from_buckets(("product",) * BUCKETS) == EVERY_ROW
    assert rows_from_buckets(EXPAND_FROM_65) == 64
    assert rows_from_buckets(("expand",) * BUCKETS) == 0
    assert rows_from_buckets(("product", "expand") + ("product",) * (BUCKETS - 2)) == 1


@pytest.mark.parametrize("make", [q4_0_linear, q8_0_linear], ids=["int4", "int8"])
def test_a_measured_table_routes_rows_past_its_bucket_to_the_expansion(make, monkeypatch):
    seen: list = []
    monkeypatch.setattr(choice, "measure_linear", fake_measure(EXPAND_FROM_65, seen))
    linear = make()
    x = torch.randn(100, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert linear.product_rows_for(torch.bfloat16) == 64
    assert seen[0] == ["expand", "product"]
    # The candidates were the op itself with the product on every row and on none.
    results = dict(seen[1:])
    assert torch.equal(results["product"], linear._call(X70.bfloat16(), EVERY_ROW))
    assert torch.equal(results["expand"], linear._call(X70.bfloat16(), 0))
    # A call of 100 rows runs the expansion, of 64 the product: the op's own results.
    assert torch.equal(linear(x), linear._call(x, 0))
    assert torch.equal(linear(x[:64]), linear._call(x[:64], EVERY_ROW))
    assert not torch.equal(linear._call(x, 0), linear._call(x, EVERY_ROW))
    # Listed with the linears' choices, under the packed format's own shape class.
    (shape, buckets), = choice.linears_in_use().items()
    assert shape.startswith(linear.route.kind + " bfloat16 ")
    assert list(buckets.values()) == list(EXPAND_FROM_65)
    # The decode stack's call runs the same op with the same rows.
    call = linear.decode_call(100)
    assert call.ints[-1] == 64


def test_a_forced_choice_keeps_the_instruction_set_rule(monkeypatch):
    monkeypatch.setenv(choice.ENV, "panel")
    monkeypatch.setattr(choice, "measure_linear", lambda *a: pytest.fail("measured"))
    linear = q4_0_linear()
    assert linear.product_rows_for(torch.bfloat16) == int4_linear.product_rows()
    assert q8_0_linear().product_rows_for(torch.float32) == int8_block_linear.product_rows()
    assert linear.decode_call(4).ints == (int4_linear.product_rows(),)


def test_the_choice_is_measured_once_per_shape_class_and_cached_on_disk(monkeypatch):
    seen: list = []
    monkeypatch.setattr(choice, "measure_linear", fake_measure(EXPAND_FROM_65, seen))
    first, second = q4_0_linear(0), q4_0_linear(1)
    assert first.product_rows_for(torch.bfloat16) == second.product_rows_for(torch.bfloat16) == 64
    assert len([s for s in seen if isinstance(s, list)]) == 1  # one measurement for both
    # Another process (an empty in-process table) reads the file and measures nothing.
    monkeypatch.setattr(choice, "_tables", {})
    monkeypatch.setattr(choice, "measure_linear", lambda *a: pytest.fail("measured"))
    assert q4_0_linear(2).product_rows_for(torch.bfloat16) == 64
    # A float32 call is a shape class of its own, measured again.
    monkeypatch.setattr(choice, "measure_linear", fake_measure(("product",) * BUCKETS, []))
    assert first.product_rows_for(torch.float32) == EVERY_ROW
    assert first.product_rows_for(torch.bfloat16) == 64


def test_packing_again_chooses_again(monkeypatch):
    monkeypatch.setattr(choice, "measure_linear", fake_measure(EXPAND_FROM_65, []))
    linear = q4_0_linear()
    assert linear.product_rows_for(torch.bfloat16) == 64
    assert linear.route.last() == 64
    linear.pack(panels=True)
    assert linear.route.last() == int4_linear.product_rows()  # nothing chosen yet
    monkeypatch.setattr(choice, "_tables", {})
    choice.table_path().unlink()
    monkeypatch.setattr(choice, "measure_linear", fake_measure(("product",) * BUCKETS, []))
    assert linear.product_rows_for(torch.bfloat16) == EVERY_ROW


def test_a_real_measurement_picks_a_bucket_boundary():
    """On this CPU, measured: the product rows are a bucket's last row or every row, and the
    product runs at one row (a decode's)."""
    linear = q4_0_linear()
    rows = linear.product_rows_for(torch.bfloat16)
    assert rows == EVERY_ROW or rows in {last for _, last in choice.ROW_BUCKETS}
    assert rows >= 1
    (shape, buckets), = choice.linears_in_use().items()
    assert set(buckets.values()) <= {"product", "expand"}
