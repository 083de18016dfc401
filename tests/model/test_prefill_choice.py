"""The CPU prefill attention's kernel choice (pagedkv/model/prefill_choice.py): the fused tiled
kernel or torch's attention, by the step's chunks' lengths (fresh, or after a cached prefix),
forced or measured (cached on disk and reused); both routes of a mixed step agree with the torch
backend."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.kernels import choice
from pagedkv.model import prefill_choice
from pagedkv.model.attention import PrefillChunk
from pagedkv.model.backends.cpu_native import NativeAttentionMetadata
from tests.model.test_prefill_kernel import TOL, mixed_step_error, supported

CLASS = (torch.bfloat16, 8, 4, 64, 16)  # dtype, heads, KV heads, head size, block size


@pytest.fixture(autouse=True)
def _fresh_choice(fresh_kernel_choice, monkeypatch):
    """An empty in-process prefill table per test (beside fresh_kernel_choice's)."""
    monkeypatch.setattr(prefill_choice, "_torch_from", {})


def needs_the_tiled_kernel(dtype: torch.dtype) -> None:
    """Skip where the build has no tiled prefill kernel for head size 64 (the AVX2 build: the
    backend then never asks for a choice, see test_prefill_kernel.py)."""
    if not supported(64, dtype):
        pytest.skip("this build has no tiled prefill kernel for this dtype")


def chunks(*lengths: int, cached: int = 0) -> list[PrefillChunk]:
    out, start = [], 0
    for n in lengths:
        out.append(PrefillChunk(start, start + n, cached, cached + n,
                                torch.arange(-(-(cached + n) // 16))))
        start += n
    return out


def step_tensors(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [tokens, 8, 64], a cache [4 KV heads, 8 blocks, 16, 64]) of CLASS."""
    return torch.zeros(tokens, 8, 64, dtype=torch.bfloat16), \
        torch.zeros(4, 8, 16, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize(("forced", "start"), [("panel", None), ("isa", None), ("onednn", 0)])
def test_a_forced_choice_fixes_the_kernel(forced, start, monkeypatch):
    monkeypatch.setenv(choice.ENV, forced)
    assert prefill_choice.torch_prefill_from(*CLASS)[:2] == (start, start)
    q, cache = step_tensors(3)
    assert prefill_choice.native_prefill(q, cache, chunks(3)) is (start is None)
    assert prefill_choice.native_prefill(q, cache, chunks(3, cached=500)) is (start is None)
    assert prefill_choice.prefill_table() == {}  # nothing measured


def test_the_step_takes_torch_from_the_measured_length_of_its_chunks_kind():
    key = prefill_choice.attention_class(*CLASS)
    prefill_choice._torch_from[key] = prefill_choice.TorchFrom(64, 32)
    q, cache = step_tensors(80)
    assert prefill_choice.native_prefill(q, cache, chunks(10, 63))
    assert not prefill_choice.native_prefill(q, cache, chunks(10, 64))
    assert prefill_choice.native_prefill(q, cache, chunks(10, 31, cached=1000))
    assert not prefill_choice.native_prefill(q, cache, chunks(10, 32, cached=1000))
    mixed = chunks(40) + [PrefillChunk(40, 72, 16, 48, torch.arange(3))]  # 32 after 16
    assert not prefill_choice.native_prefill(q, cache, mixed)
    prefill_choice._torch_from[key] = prefill_choice.TorchFrom(None, None)
    assert prefill_choice.native_prefill(q, cache, chunks(2000))
    assert prefill_choice.native_prefill(q, cache, chunks(2000, cached=100))


def test_the_measured_length_is_cached_on_disk_and_reused(monkeypatch):
    needs_the_tiled_kernel(CLASS[0])
    calls = []
    measure = prefill_choice.measure_prefill

    def counted(*args):
        calls.append(args)
        return measure(*args)

    monkeypatch.setattr(prefill_choice, "measure_prefill", counted)
    start = prefill_choice.torch_prefill_from(*CLASS)
    assert calls == [CLASS]
    assert all(n is None or n in prefill_choice.LENGTHS for n in start[:2])
    key = prefill_choice.attention_class(*CLASS)
    on_disk = json.loads(choice.table_path().read_text())
    assert on_disk["prefill_attention"][key] == {"torch_from": start.fresh,
                                                 "torch_from_after_prefix": start.after_prefix}
    monkeypatch.setattr(prefill_choice, "_torch_from", {})  # a second start: the file
    assert prefill_choice.torch_prefill_from(*CLASS) == start
    assert calls == [CLASS]
    assert prefill_choice.prefill_table() == {key: start}


@pytest.mark.parametrize("cached", [0, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_timed_candidates_compute_the_same_attention(dtype, cached):
    """What the measurement times both ways is one attention (the fused kernel's cache laid
    out as the torch call's K/V, fresh or after a cached prefix): a wrong layout would time a
    different problem."""
    needs_the_tiled_kernel(dtype)
    calls = prefill_choice.prefill_candidates(dtype, 6, 2, 64, 16, 40,
                                              torch.Generator().manual_seed(2), cached)
    got_torch, got_native = calls["torch"](), calls["native"]()
    assert got_native.shape == got_torch.shape == (40, 6, 64)
    err = float((got_native.double() - got_torch.double()).abs().max())
    assert err <= TOL[dtype] * max(1.0, float(got_torch.abs().max()))


@pytest.mark.parametrize("forced", ["onednn", "panel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_agrees_with_the_torch_backend_on_either_route(forced, dtype, monkeypatch):
    """The native metadata's step (decodes, a cascade group, prefill chunks mid-block and from
    position 0) with its prefill routed to torch's attention ("onednn") or the tiled kernel
    ("panel"): the route taken is the one asked for, and every row agrees with the torch
    backend."""
    if forced == "panel":
        needs_the_tiled_kernel(dtype)
    monkeypatch.setenv(choice.ENV, forced)
    fused = []
    original = NativeAttentionMetadata._prefill

    def spy(self, *args):
        fused.append(True)
        return original(self, *args)

    monkeypatch.setattr(NativeAttentionMetadata, "_prefill", spy)
    assert mixed_step_error(dtype, 64, 2, None) <= TOL[dtype]
    assert bool(fused) is (forced == "panel")


def test_an_entry_without_the_after_prefix_length_is_measured_again(monkeypatch):
    """A table file written before chunks after a cached prefix were measured on their own."""
    key = prefill_choice.attention_class(*CLASS)
    choice._write_disk(choice.table_path(), "prefill_attention", key, {"torch_from": 64})
    monkeypatch.setattr(prefill_choice, "measure_prefill",
                        lambda *args: prefill_choice.TorchFrom(128, 16))
    assert prefill_choice.torch_prefill_from(*CLASS)[:2] == (128, 16)
    on_disk = json.loads(choice.table_path().read_text())["prefill_attention"][key]
    assert on_disk == {"torch_from": 128, "torch_from_after_prefix": 16}
