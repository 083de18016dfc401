"""The CPU linears' kernel choice (pagedkv/kernels/choice.py): a forced choice routes every row
count to the named kernel, a measured table routes each rows bucket to its own, the table is
cached on disk and reused, and every route is within panel_linear_check's rounding bound of
float64 F.linear."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.kernels import choice
from pagedkv.model.layers import Linear, onednn_takes
from pagedkv.testing.panel_linear_check import worst_ratio

# Each bucket's first and last row count (the last bucket: past its measured 512 rows too).
BUCKET_ROWS = sorted({r for first, last in choice.ROW_BUCKETS for r in (first, last)} | {600})


pytestmark = pytest.mark.usefixtures("fresh_kernel_choice")


def make_layer(dtype: torch.dtype, in_features: int = 72, out_features: int = 40,
               bias: bool = True) -> Linear:
    torch.manual_seed(0)
    return Linear(in_features, out_features, bias=bias).to(dtype)


def mark_onednn(layer: Linear) -> None:
    """Re-pack the layer's oneDNN copy from 2 W (bias kept): a call routed there returns
    2 x W^T + b, so the route shows in the values."""
    layer._packed = torch.ops.mkldnn._reorder_linear_weight(2 * layer.weight.detach(), 64)


def routed_to(layer: Linear, rows: int) -> str:
    """Which copy a call of `rows` rows ran ("panel" or "onednn", after `mark_onednn`)."""
    x = torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
    got = layer(x).double()
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    once = x.double() @ w.T + b
    twice = x.double() @ (2 * w).T + b
    return "panel" if (got - once).abs().max() < (got - twice).abs().max() else "onednn"


def test_choice_mode_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv(choice.ENV, "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        choice.choice_mode()
    monkeypatch.setenv(choice.ENV, "onednn")
    assert choice.choice_mode() == "onednn"


def test_rows_route_covers_every_row_count_by_its_bucket():
    per_bucket = tuple(f"k{i}" for i in range(len(choice.ROW_BUCKETS)))
    route = choice.rows_route(per_bucket)
    assert len(route) == choice.ROUTE_LAST + 1
    for i, (first, last) in enumerate(choice.ROW_BUCKETS):
        for rows in (first, min(last, choice.ROUTE_LAST)):
            assert route[rows] == f"k{i}"
    assert route[0] == "k0"
    assert choice.describe_kernels(("panel",) * 2 + ("onednn",) * (len(choice.ROW_BUCKETS) - 2)) == \
        "panel at 1-4 rows, onednn at 5+ rows"


def test_pick_keeps_the_first_kernel_unless_another_is_clearly_faster():
    assert choice.pick({"panel": 1.0, "onednn": 0.97}) == "panel"
    assert choice.pick({"panel": 1.0, "onednn": 0.5}) == "onednn"
    assert choice.pick({"panel": 0.5, "onednn": 1.0}) == "panel"


@pytest.mark.parametrize("forced", ["panel", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forced_choice_routes_every_row_count_to_the_named_kernel(forced, dtype, monkeypatch):
    monkeypatch.setenv(choice.ENV, forced)
    layer = make_layer(dtype)
    if forced == "onednn" and not onednn_takes(layer.weight):
        pytest.skip("oneDNN has no native bfloat16 on this CPU")
    assert layer.pack(panels=True)
    assert (layer._panels is not None) is (forced == "panel")
    assert (layer._packed is not None) is (forced == "onednn")
    assert choice.choice_table() == {}  # nothing measured
    assert choice.describe_choice() == f"linears: {forced} ({choice.ENV})"
    if forced == "onednn":
        mark_onednn(layer)
    assert {routed_to(layer, rows) for rows in BUCKET_ROWS} == {forced}


def test_float16_has_only_the_panels_even_when_onednn_is_forced(monkeypatch):
    monkeypatch.setenv(choice.ENV, "onednn")
    layer = make_layer(torch.float16)
    assert layer.pack(panels=True) and layer._panels is not None and layer._packed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_table_routes_each_rows_bucket_to_its_kernel(dtype):
    layer = make_layer(dtype)
    if not onednn_takes(layer.weight):
        pytest.skip("oneDNN has no native bfloat16 on this CPU")
    per_bucket = (("panel", "onednn", "panel", "onednn", "onednn", "panel", "onednn")
                  + ("onednn",) * (len(choice.ROW_BUCKETS) - 7))
    choice._tables[choice.shape_class(dtype, 40, 72, True)] = per_bucket
    assert layer.pack(panels=True) and layer._panels is not None and layer._packed is not None
    mark_onednn(layer)
    for (first, last), kernel in zip(choice.ROW_BUCKETS, per_bucket, strict=True):
        assert routed_to(layer, first) == kernel, (first, kernel)
        assert routed_to(layer, last) == kernel, (last, kernel)
    assert routed_to(layer, 600) == per_bucket[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matmul_bucket_routes_to_the_transposed_weight(dtype):
    """A table whose last bucket is oneDNN's matmul: from 513 rows on the call runs on the
    [in, out] copy (made 2 W here, so the route shows in the values), below on the others."""
    layer = make_layer(dtype)
    if not onednn_takes(layer.weight):
        pytest.skip("oneDNN has no native bfloat16 on this CPU")
    per_bucket = ("panel",) * (len(choice.ROW_BUCKETS) - 2) + ("onednn", "matmul")
    choice._tables[choice.shape_class(dtype, 40, 72, True)] = per_bucket
    assert layer.pack(panels=True) and layer._matmul is not None
    assert layer._matmul.shape == (72, 40)
    layer._matmul = 2 * layer.weight.detach().t().contiguous()
    assert [routed_to(layer, rows) == "onednn" for rows in (1, 300, 512, 513, 900)] == \
        [False, False, False, True, True]


def test_a_table_of_one_kernel_keeps_one_prepared_copy():
    layer = make_layer(torch.float32)
    choice._tables[choice.shape_class(torch.float32, 40, 72, True)] = \
        ("panel",) * len(choice.ROW_BUCKETS)
    assert layer.pack(panels=True)
    assert layer._panels is not None and layer._packed is None and layer._panel_rows is None


def test_onednn_or_torch_held_below_the_cpu_get_a_table_of_their_own(monkeypatch):
    """ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY (`make test-isa`: an AMD CPU's paths on an
    Intel one) change what a measurement finds: each setting has a table file of its own, so
    neither run reads (or overwrites) the other's; unset, the table is the usual one."""
    for name in choice.ISA_CAPS_ENV:
        monkeypatch.delenv(name, raising=False)
    usual = choice.table_path()
    paths = {usual}
    for name, value in (("ONEDNN_MAX_CPU_ISA", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2")):
        monkeypatch.setenv(name, value)
        paths.add(choice.table_path())
    assert len(paths) == 3
    for name in choice.ISA_CAPS_ENV:
        monkeypatch.delenv(name)
    assert choice.table_path() == usual


def test_the_measured_table_is_cached_on_disk_and_reused(monkeypatch, tmp_path):
    calls = []
    measure = choice.measure_linear

    def counted(*args, **kwargs):
        calls.append(args[:2])
        return measure(*args, **kwargs)

    monkeypatch.setattr(choice, "measure_linear", counted)
    layer = make_layer(torch.float32, 96, 48, bias=False)
    assert layer.pack(panels=True)
    assert calls == [(torch.float32, 96)]
    shape = "float32 48x96"
    measured = choice.choice_table()[shape]
    assert list(measured) == [choice.bucket_label(b) for b in choice.ROW_BUCKETS]
    assert set(measured.values()) <= set(choice.KERNELS)
    path = choice.table_path()
    assert path.parent.parent == tmp_path
    on_disk = json.loads(path.read_text())
    assert on_disk["linears"][shape] == list(measured.values())
    assert on_disk["machine"]["torch"] == torch.__version__

    layer.pack(panels=True)  # the same process: the in-process table
    monkeypatch.setattr(choice, "_tables", {})  # a second start: the file
    layer.pack(panels=True)
    assert calls == [(torch.float32, 96)]
    assert choice.choice_table()[shape] == measured
    assert shape.split()[0] in choice.describe_choice()

    path.write_text("{not json")  # a broken file: measured again, and rewritten
    monkeypatch.setattr(choice, "_tables", {})
    layer.pack(panels=True)
    assert len(calls) == 2
    assert shape in json.loads(path.read_text())["linears"]


def test_measuring_restores_the_thread_count():
    threads = torch.get_num_threads()
    make_layer(torch.bfloat16).pack(panels=True)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table", ["panel", "onednn", "matmul", "mixed", "measure"])
def test_every_route_is_within_the_rounding_bound_of_float64(dtype, table):
    """Every rows bucket of every dtype, each route: within panel_linear_check's bound (float32
    accumulation plus one rounding to the dtype) of float64 F.linear of the same inputs."""
    layer = make_layer(dtype, 71, 100)
    shape = choice.shape_class(dtype, 100, 71, True)
    if table == "mixed":
        choice._tables[shape] = ("panel", "onednn") * 3 + ("onednn",) * (len(choice.ROW_BUCKETS)
                                                                         - 6)
    elif table != "measure":
        choice._tables[shape] = (table,) * len(choice.ROW_BUCKETS)
    assert layer.pack(panels=True)
    gen = torch.Generator().manual_seed(1)
    for rows in BUCKET_ROWS:
        x = torch.randn(rows, 71, generator=gen).to(dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (rows, 100)
        assert worst_ratio(got, x, layer.weight, layer.bias) <= 1.0, (rows, table)


def test_a_bfloat16_model_on_a_mixed_table_agrees_with_the_reference_path(tiny_llama,
                                                                          monkeypatch):
    """The tiny llama in bfloat16, teacher-forced, every linear on a table that sends decode
    rows to the panels and prefill chunks to oneDNN (where it takes bfloat16), against the
    pure-torch path: the same greedy tokens and logits within bfloat16 rounding."""
    from pagedkv.model.runner import ModelRunner
    from pagedkv.testing.kv_quant_accuracy import compare_logits, teacher_forced_logits

    per_bucket = ("panel",) * 3 + ("onednn",) * (len(choice.ROW_BUCKETS) - 3)

    class MixedTable(dict):  # every shape class: per_bucket
        def get(self, shape, default=None):
            return per_bucket

        def __getitem__(self, shape):
            return per_bucket

    monkeypatch.setattr(choice, "_tables", MixedTable())
    # decodes on the fused kernel: the tiny head size's measured choice may be torch's, which
    # would make the two paths one
    monkeypatch.setattr("pagedkv.model.backends.cpu_native.decode_route", lambda *a: "native")
    prompt, cont = list(range(5, 45)), list(range(60, 72))
    runners = [ModelRunner(tiny_llama, block_size=4, num_blocks=16, device="cpu",
                           dtype="bfloat16", cpu_kernels=mode) for mode in ("wait", "off")]
    got, want = (teacher_forced_logits(r, prompt, cont, chunk_size=16) for r in runners)
    linears = [m for m in runners[0].model.modules() if isinstance(m, Linear)]
    if onednn_takes(linears[0].weight):
        assert all(m._panel_rows is not None and m._panel_rows[8] and not m._panel_rows[9]
                   for m in linears)
    cmp = compare_logits(want, got)
    assert cmp.greedy_agreement == 1.0, cmp
    assert 0.0 < cmp.max_abs_error <= 2 ** -6 * cmp.logit_range, cmp


def test_the_start_up_facts_name_the_linears_choice(tiny_llama, monkeypatch):
    """The banner's "CPU kernels" line (runner_facts) says how the linears and the decode
    attention were chosen: the forced mode, or the measured split per dtype and class."""
    from pagedkv.engine.runner_facts import runner_facts
    from pagedkv.model.runner import ModelRunner

    runner = ModelRunner(tiny_llama, block_size=4, num_blocks=8, device="cpu", cpu_kernels="wait")
    facts = runner_facts(runner)["cpu_kernels"]
    assert facts.startswith("fused C++ kernels") and "float32" in facts
    assert choice.describe_choice() in facts and " rows" in facts
    assert "; decode attention: " in facts and " kv float32: " in facts
    monkeypatch.setenv(choice.ENV, "panel")
    forced = runner_facts(runner)["cpu_kernels"]
    assert f"linears: panel ({choice.ENV}); " in forced
    assert forced.endswith(f"decode attention: native ({choice.ENV}=panel)")
    off = ModelRunner(tiny_llama, block_size=4, num_blocks=8, device="cpu", cpu_kernels="off")
    assert runner_facts(off)["cpu_kernels"] == "off: the pure-torch path"
