"""The fused CPU decode attention kernel (decode_attention.cpp) against float64, on this CPU's
widest build and in an AVX2 build (a child process): partial blocks and row groups, windows,
a shared tile and scattered blocks."""

from __future__ import annotations

import pytest

from pagedkv.testing.decode_kernel_check import check_decode_kernel
from pagedkv.testing.isa_child import run_with_isa


def assert_within_bounds(got: dict) -> None:
    ratios = {k: v for k, v in got.items() if k != "isa"}
    assert len(ratios) == 12, sorted(got)
    for key, ratio in ratios.items():
        assert 0.0 < ratio <= 1.0, (key, got)


def test_decode_kernel_meets_the_reference_bound():
    assert_within_bounds(check_decode_kernel())


@pytest.mark.slow
def test_the_avx2_build_meets_the_same_bound():
    got = run_with_isa("import json; from pagedkv.testing.decode_kernel_check import "
                       "check_decode_kernel; print(json.dumps(check_decode_kernel()))")
    assert got["isa"] == "avx2"
    assert_within_bounds(got)
