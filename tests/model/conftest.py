"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest

from pagedkv.kernels import choice
from pagedkv.kernels.cpu import ensure_cpu_kernels


@pytest.fixture
def fresh_kernel_choice(tmp_path, monkeypatch):
    """The fused kernels loaded, an empty kernel cache folder (no table measured by another
    test), the measured choice on (PAGEDKV_KERNEL_CHOICE unset) and empty in-process tables of
    the linears' choice (mutates the environment and kernels.choice for the test)."""
    assert ensure_cpu_kernels("wait")
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(choice.ENV, raising=False)
    monkeypatch.setattr(choice, "_tables", {})
    monkeypatch.setattr(choice, "_in_use", {})
