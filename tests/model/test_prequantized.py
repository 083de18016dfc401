"""GPTQ and AWQ checkpoints (pagedkv.model.quant.prequantized): their 4-bit linears kept packed
as Int4Linear, equal to the weights their codes stand for (the reference the test writer
computes from the values before packing), the rest dequantized exactly; the model's next-token
distributions against the float checkpoint of those weights; and the formats and options
pagedkv does not read refused with one error naming them."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedkv import LLM, SamplingParams
from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.prequantized import PermutedInt4Linear
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.prequantized_model import write_prequantized, write_reference
from tests.model.test_quant_models import CONTINUATION, PROMPT, assert_next_tokens_close

# (method, group size, bits, checkpoint format): GPTQ v1 and v2, AWQ, and group sizes of one
# Int4Linear group (32), several (64), the whole row (-1) and the common 128 (past the tiny
# model's 64 input features but for down_proj's 128).
PACKED = [("gptq", 128, "gptq"), ("gptq", 32, "gptq_v2"), ("gptq", -1, "gptq"),
          ("awq", 64, None), ("awq", 32, None)]


def _table_bytes(model) -> set[float]:
    """Bytes of scales a weight over the model's Int4Linears."""
    return {m.scales.numel() * m.scales.element_size() / (m.out_features * m.in_features)
            for m in model.modules() if isinstance(m, Int4Linear)}


def _write(tiny_llama, tmp_path_factory, method, group_size, fmt=None, **kw):
    out = tmp_path_factory.mktemp(method) / "m"
    reference = write_prequantized(tiny_llama, out, method, group_size=group_size,
                                   checkpoint_format=fmt or "gptq", **kw)
    return out, reference


def runner(path, dtype: str, quantization: str = "auto") -> ModelRunner:
    return ModelRunner(str(path), block_size=4, num_blocks=16, device="cpu", dtype=dtype,
                       quantization=quantization)


def _fused_reference(model, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference weights of the model's (fused) linears, by module name."""
    out = {}
    for name, sources in model.checkpoint_mapping().items():
        if all(s in reference for s in sources):
            out[name.removesuffix(".weight")] = torch.cat([reference[s] for s in sources])
    return out


@pytest.mark.parametrize(("method", "group_size", "fmt"), PACKED)
def test_packed_linears_equal_the_stored_weights(tiny_llama, tmp_path_factory, method,
                                                 group_size, fmt):
    _check_packed(tiny_llama, tmp_path_factory, method, group_size, fmt)


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3"])
def test_other_architectures_pack(request, tmp_path_factory, model):
    """Qwen2's q/k/v biases (stored beside the packed tensors, loaded into the Int4Linear),
    Qwen3's q/k norms and wider heads; greedy tokens as the float checkpoint's."""
    model_dir = request.getfixturevalue(model)
    _check_packed(model_dir, tmp_path_factory, "gptq", 32, "gptq")
    path, reference = _write(model_dir, tmp_path_factory, "awq", 32)
    float_dir = write_reference(model_dir, tmp_path_factory.mktemp("ref") / "m", reference)
    assert _greedy(path, dtype="float32") == _greedy(float_dir, dtype="float32")


def _check_packed(model_dir, tmp_path_factory, method, group_size, fmt):
    path, reference = _write(model_dir, tmp_path_factory, method, group_size, fmt)
    model = runner(path, "bfloat16").model
    modules = dict(model.named_modules())
    expected = _fused_reference(model, reference)
    assert len(expected) == 8  # 2 layers x (qkv, o, gate_up, down)
    for name, weight in expected.items():
        linear = modules[name]
        assert isinstance(linear, Int4Linear), name
        assert torch.equal(linear.dequantized_reference(torch.float32), weight), name
        assert torch.equal(linear.dequantized(torch.float32), weight), name  # the kernel's
    # Zero points meet float16 scales in float32 offsets (-zero * scale, exact): 2 float32
    # values per group of 32, 0.25 bytes a weight.
    assert _table_bytes(model) == {0.25}
    dense = runner(path, "float32").model  # float32 stays exact: dequantized, not packed
    dense_modules = dict(dense.named_modules())
    assert not any(isinstance(m, Int4Linear) for m in dense.modules())
    for name, weight in expected.items():
        assert torch.equal(dense_modules[name].weight, weight), name
    packed_bias = {n: m.bias for n, m in modules.items() if isinstance(m, Int4Linear)}
    for name, bias in packed_bias.items():  # loaded from the checkpoint, as the dense model's
        dense_bias = dense_modules[name].bias
        assert (bias is None) == (dense_bias is None), name
        assert bias is None or (torch.equal(bias, dense_bias.to(bias.dtype))
                                and bias.abs().sum() > 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("method", "group_size", "fmt"), [PACKED[0], PACKED[3]])
def test_packed_model_matches_the_float_checkpoint(tiny_llama, tmp_path_factory, method,
                                                   group_size, fmt, dtype):
    path, reference = _write(tiny_llama, tmp_path_factory, method, group_size, fmt)
    float_dir = write_reference(tiny_llama, tmp_path_factory.mktemp("ref") / "m", reference)
    packed, dense = runner(path, dtype), runner(float_dir, dtype)
    assert sum(isinstance(m, Int4Linear) for m in packed.model.modules()) == 8
    assert_next_tokens_close(dense, packed, f"{method} g{group_size} {dtype}")


def _greedy(path, **kw) -> list[list[int]]:
    llm = LLM(str(path), block_size=4, num_gpu_blocks_override=32, max_model_len=64,
              device="cpu", **kw)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": CONTINUATION}],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        llm.llm_engine.check_invariants()
        return [o.outputs[0].token_ids for o in out]
    finally:
        llm.shutdown()


def test_dequantized_checkpoint_generates_as_the_float_one(tiny_llama, tmp_path_factory):
    """quantization="none": every weight dequantized to the dtype, the same tokens as the float
    checkpoint of the same weights; "awq" names the method; "gptq" on it is refused."""
    path, reference = _write(tiny_llama, tmp_path_factory, "awq", 32)
    float_dir = write_reference(tiny_llama, tmp_path_factory.mktemp("ref") / "m", reference)
    want = _greedy(float_dir, dtype="float32")
    assert _greedy(path, dtype="float32", quantization="none") == want
    assert _greedy(path, dtype="float32", quantization="awq") == want
    with pytest.raises(ValueError, match="quantization='gptq' asks for a GPTQ checkpoint, but "
                       ".* is an AWQ checkpoint"):
        runner(path, "bfloat16", "gptq")
    with pytest.raises(ValueError, match="is a checkpoint of float weights"):
        runner(tiny_llama, "bfloat16", "awq")


@pytest.mark.parametrize("bits", [2, 8])
def test_other_bit_widths_are_dequantized_exactly(tiny_llama, tmp_path_factory, bits, caplog):
    path, reference = _write(tiny_llama, tmp_path_factory, "gptq", 32, bits=bits)
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        model = runner(path, "bfloat16").model
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert f"8 of the GPTQ checkpoint's quantized linears are dequantized to the model dtype " \
           f"(GPTQ {bits}-bit, groups of 32" in caplog.text
    modules = dict(model.named_modules())
    for name, weight in _fused_reference(model, reference).items():
        assert torch.equal(modules[name].weight, weight.bfloat16()), name


def test_act_order_packs_with_its_features_sorted(tiny_llama, tmp_path_factory):
    """GPTQ's desc_act: the input features dealt to the groups in a permuted order (g_idx),
    one order per input as GPTQ makes them. Each linear packs with its features sorted by
    group (PermutedInt4Linear: the activations gathered into that order), its weight the
    reference, but down_proj, whose order is folded into gate_up's rows (a plain
    Int4Linear); the model's next-token distributions as the float checkpoint's."""
    path, reference = _write(tiny_llama, tmp_path_factory, "gptq", 32, desc_act=True)
    float_dir = write_reference(tiny_llama, tmp_path_factory.mktemp("ref") / "m", reference)
    packed, dense = runner(path, "bfloat16"), runner(float_dir, "bfloat16")
    modules = dict(packed.model.named_modules())
    stored = load_file(path / "model.safetensors")
    for name, weight in _fused_reference(packed.model, reference).items():
        linear = modules[name]
        mlp = name.rsplit(".", 1)[0]
        if name.endswith(("gate_up_proj", "down_proj")):  # down's order, from its g_idx
            g_idx = stored[f"{mlp.replace('layers', 'model.layers', 1)}.down_proj.g_idx"]
            order = torch.from_numpy(np.argsort(g_idx.numpy(), kind="stable"))
        if name.endswith("gate_up_proj"):  # gate's and up's rows in down's input order
            weight = weight[torch.cat((order, order.numel() + order))]
        elif name.endswith("down_proj"):  # a plain Int4Linear, its columns in that order
            weight = weight[:, order]
        folded = name.endswith("down_proj")
        assert isinstance(linear, PermutedInt4Linear) != folded, name
        assert torch.equal(linear.dequantized_reference(torch.float32), weight), name
        assert torch.equal(linear.dequantized(torch.float32), weight), name
    assert_next_tokens_close(dense, packed, "gptq act order")
    assert _greedy(path, dtype="float32") == _greedy(float_dir, dtype="float32")


def test_fused_parts_in_different_orders_are_dequantized(tiny_llama, tmp_path_factory, caplog):
    """q/k/v (gate/up) each in its own act order: one gather cannot serve the fused linear,
    which is dequantized exactly (a warning says how many); o and down still pack."""
    path, reference = _write(tiny_llama, tmp_path_factory, "gptq", 32, desc_act=True,
                             shared_order=False)
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        model = runner(path, "float16").model
    assert "4 of the GPTQ checkpoint's quantized linears are dequantized" in caplog.text
    modules = dict(model.named_modules())
    for name, weight in _fused_reference(model, reference).items():
        fused = name.endswith(("qkv_proj", "gate_up_proj"))
        assert isinstance(modules[name], PermutedInt4Linear) != fused, name
        got = modules[name].weight if fused else modules[name].dequantized(torch.float32)
        assert torch.equal(got, weight.half() if fused else weight), name


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_symmetric_gptq_packs_as_q4_0(tiny_llama, tmp_path_factory, fmt):
    """sym=True: every zero point 8, so each group's offset is -8 times its float16 scale, the
    layout of GGUF's Q4_0 (the scales alone, 0.0625 bytes a weight, the offsets implied)."""
    path, reference = _write(tiny_llama, tmp_path_factory, "gptq", 128, fmt, sym=True)
    model = runner(path, "bfloat16").model
    assert _table_bytes(model) == {0.0625}
    modules = dict(model.named_modules())
    for name, weight in _fused_reference(model, reference).items():
        assert torch.equal(modules[name].dequantized(torch.float32), weight), name


def test_a_quantized_lm_head_is_dequantized(tiny_llama, tmp_path_factory):
    """GPTQModel's lm_head=True: the head stored as qweight/qzeros/scales is read dequantized
    (exactly), then gains the packed linears' int8 copy for decode-sized calls."""
    from pagedkv.model.quant.packed_head import Int8PackedHead

    path, reference = _write(tiny_llama, tmp_path_factory, "gptq", 32, lm_head=True)
    assert "lm_head.weight" in reference
    model = runner(path, "bfloat16").model
    assert isinstance(model.lm_head, Int8PackedHead)
    assert torch.equal(model.lm_head.dense, reference["lm_head.weight"].bfloat16())
    float_dir = write_reference(tiny_llama, tmp_path_factory.mktemp("ref") / "m", reference)
    assert _greedy(path, dtype="float32") == _greedy(float_dir, dtype="float32")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_settings_in_an_older_writers_own_file(tiny_llama, tmp_path_factory, method):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (its w_bit, q_group_size,
    "GEMM"), config.json without a quantization_config: read as vLLM reads them."""
    path, reference = _write(tiny_llama, tmp_path_factory, method, 32, own_file=True)
    assert "quantization_config" not in (path / "config.json").read_text()
    model = runner(path, "bfloat16").model
    modules = dict(model.named_modules())
    for name, weight in _fused_reference(model, reference).items():
        assert isinstance(modules[name], Int4Linear), name
        assert torch.equal(modules[name].dequantized(torch.float32), weight), name


def test_awq_settings_in_quantize_config_json(tiny_llama, tmp_path_factory):
    """AutoAWQ's key names in a quantize_config.json (vLLM's AWQ reads that name too): AWQ."""
    path, reference = _write(tiny_llama, tmp_path_factory, "awq", 32, own_file=True)
    (path / "quant_config.json").rename(path / "quantize_config.json")
    model = runner(path, "bfloat16", "awq").model
    modules = dict(model.named_modules())
    for name, weight in _fused_reference(model, reference).items():
        assert torch.equal(modules[name].dequantized(torch.float32), weight), name
