"""The vectorized elementwise CPU kernels (norm_rope_act.cpp) against float64, on this CPU's
widest build and in an AVX2 build (a child process), tails and strided rows included."""

from __future__ import annotations

import pytest

from pagedkv.testing.elementwise_check import check_elementwise
from pagedkv.testing.isa_child import run_with_isa


def assert_within_bounds(got: dict) -> None:
    ratios = {k: v for k, v in got.items() if k != "isa" and not isinstance(v, bool)
              and "residual" not in k}
    assert len(ratios) == 15, sorted(got)
    for key, ratio in ratios.items():
        assert 0.0 <= ratio <= 1.0, (key, got)
    for key, value in got.items():
        if "residual" in key:
            assert value == 0.0, (key, got)  # the add rounds once, in the dtype: exact
        if key.endswith("untouched"):
            assert value is True, key  # rope_ rotates only the heads it is given


def test_elementwise_kernels_meet_the_reference_bound():
    assert_within_bounds(check_elementwise())


@pytest.mark.slow
def test_the_avx2_build_meets_the_same_bound():
    got = run_with_isa("import json; from pagedkv.testing.elementwise_check import "
                       "check_elementwise; print(json.dumps(check_elementwise()))")
    assert got["isa"] == "avx2"
    assert_within_bounds(got)
