"""/kv_cache_info's `cpu_kernels`: the CPU kernels' choice read from the engine core (issue 38),
with the core in its own process and in-process. A server started with PAGEDKV_KERNEL_CHOICE
forced names that kernel for every linear of the model and every rows bucket, and the loaded
build's panel ISA; the prefill attention's entry appears once a prompt has been prefilled (the
choice is made at the first prefill); with `--cpu-kernels off` the key is null. The model has
head size 64, which the fused prefill kernel takes. In-process: a measured choice crosses the
core's utility call as it was measured, and a runner on another device answers null."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from pagedkv.engine.utility import run_utility
from pagedkv.kernels import choice
from pagedkv.kernels.cpu import ensure_cpu_kernels, panel_isa
from pagedkv.model import decode_choice, prefill_choice
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, serving
from tests.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.timeout(400)

PROMPT = list(range(3, 203))  # 200 token ids: longer than every prefill crossover length
# (forced kernel, where the core runs, --cpu-kernels)
CASES = [("onednn", "process", "auto"), ("panel", "inproc", "auto"), ("panel", "process", "off")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    ensure_cpu_kernels("wait")
    return build_tiny_hf_model(tmp_path_factory.mktemp("qwen2_hd64") / "m", "qwen2_hd64")


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def case(request, model_dir):
    forced, core, kernels = request.param
    flags = engine_flags(**ENGINE_KWARGS, cpu_kernels=kernels)
    with pytest.MonkeyPatch.context() as env:  # the server inherits the environment
        env.setenv(choice.ENV, forced)
        env.setenv("PAGEDKV_ENGINE_CORE", core)
        proc = ServerProcess(model_dir, *flags)
        with serving(proc):
            yield request.param, proc


def kernel_info(url: str) -> dict | None:
    resp = httpx.get(url + "/kv_cache_info", timeout=30)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["block_size"] == ENGINE_KWARGS["block_size"]  # the other facts stay
    return info["cpu_kernels"]


def expected_classes(model_dir: Path) -> tuple[str, str]:
    """(the o projection's linear shape class, the attention class) of the model."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    o_proj = f"float32 {config['hidden_size']}x{heads * head_dim}"
    attention = f"float32 {heads}/{kv_heads}x{head_dim} block {ENGINE_KWARGS['block_size']}"
    return o_proj, attention


def prefill(url: str) -> None:
    resp = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0})
    assert resp.status_code == 200, resp.text


def test_kv_cache_info_names_the_forced_kernel_and_the_prefill_choice(case, model_dir):
    (forced, _, kernels), proc = case
    before = kernel_info(proc.url)
    if kernels == "off":
        assert before is None
        prefill(proc.url)
        assert kernel_info(proc.url) is None
        return
    assert before["mode"] == forced
    assert before["isa"] == panel_isa()
    o_proj, attention = expected_classes(model_dir)
    assert o_proj in before["linears"]
    for shape, buckets in before["linears"].items():
        assert list(buckets) == [choice.bucket_label(b) for b in choice.ROW_BUCKETS], shape
        assert set(buckets.values()) == {forced}, shape
    assert before["prefill_attention"] == {}  # chosen at the first prefill

    prefill(proc.url)
    after = kernel_info(proc.url)
    assert after["linears"] == before["linears"]
    start = 0 if forced == "onednn" else None
    assert after["prefill_attention"] == {attention: {"torch_from": start,
                                                      "torch_from_after_prefix": start,
                                                      "amx_fresh": False,
                                                      "amx_prefix": False}}
    decode = f"{attention} kv float32"  # chosen at start-up, forced here
    assert after["decode_attention"] == {decode: {"forced": "torch" if forced == "onednn"
                                                  else "native"}}


def core_of(device: str, cpu_kernels: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(runner=SimpleNamespace(device=torch.device(device),
                                                  cpu_kernels=cpu_kernels))


def test_a_measured_choice_crosses_the_utility_call_as_measured(monkeypatch):
    ensure_cpu_kernels("wait")
    monkeypatch.setenv(choice.ENV, "measure")
    shape = choice.shape_class(torch.bfloat16, 128, 64, False)
    measured = ("panel",) * 3 + ("onednn",) * (len(choice.ROW_BUCKETS) - 3)
    monkeypatch.setattr(choice, "_tables", {shape: measured})  # as a start that measured it
    monkeypatch.setattr(choice, "_in_use", {})
    attention = (torch.bfloat16, 8, 4, 64, 16)
    key = prefill_choice.attention_class(*attention)
    monkeypatch.setattr(prefill_choice, "_torch_from", {key: prefill_choice.TorchFrom(64, 32)})
    monkeypatch.setattr(prefill_choice, "_in_use", {})
    monkeypatch.setattr(decode_choice, "_in_use", {})

    def unmeasurable(kernel: str):
        raise AssertionError("measured again")

    assert choice.choose_linear(shape, torch.bfloat16, 64, unmeasurable, choice.KERNELS,
                                "panel") == measured
    assert prefill_choice.torch_prefill_from(*attention)[:2] == (64, 32)
    info = run_utility(core_of("cpu"), "cpu_kernel_choice", ())
    labels = [choice.bucket_label(b) for b in choice.ROW_BUCKETS]
    assert info == {"mode": "measure", "isa": panel_isa(),
                    "linears": {shape: dict(zip(labels, measured, strict=True))},
                    "prefill_attention": {key: {"torch_from": 64,
                                                "torch_from_after_prefix": 32,
                                                "amx_fresh": False,
                                                "amx_prefix": False}},
                    "decode_attention": {}}
    json.dumps(info)  # JSON-able as it is


@pytest.mark.parametrize(("device", "cpu_kernels"), [("cpu", "off"), ("meta", "auto")])
def test_no_fused_cpu_kernel_answers_null(device, cpu_kernels):
    assert run_utility(core_of(device, cpu_kernels), "cpu_kernel_choice", ()) is None
