"""A fused linear whose GGUF parts mix the 4-bit and int8-block families (llama.cpp's Q4_K_M:
attn_q and attn_k in Q4_K, attn_v in Q6_K) kept packed as one linear per run of parts
(quant/parts_linear.py): its modules, its bias loaded, its bytes counted, its logits against the
file dequantized, and the decode stack running it as the Python forward does.

The Llama file's v is Q6_K, as llama.cpp's (its scales in the file's two levels); the Qwen2
file's int8-block parts are Q8_0 (float16 scales)."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.decode_stack import LinearCall, LinearParts
from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.int8_block_linear import Int8BlockLinear
from pagedkv.model.quant.parts_linear import PartsLinear
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import kl_divergence, prompt_logits, teacher_forced_logits
from tests.model.gguf_files import write_gguf
from tests.model.test_decode_stack import assert_same
from tests.tiny_models import build_hf_model

Q4_K, Q6_K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0
Q5_K, Q5_1 = GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q5_1
Q3_K = GGMLQuantizationType.Q3_K
PROMPT = [5, 17, 99, 230, 41, 8, 77, 300, 12, 64, 3, 150, 9, 250, 33, 71, 200, 18, 44, 6]
CONTINUATION = [90, 14, 321, 7, 55, 260, 2, 101, 48, 11, 199, 36]
# Against the file dequantized to float32: the packed kernels compute on activations quantized
# to int8 per block of 32 (as llama.cpp's dots) and the model runs in bfloat16. The all-Q4_K
# model of test_quant_models measures about 1e-3 nats mean KL against the bfloat16 dequantized
# one; these (against float32, so bfloat16's own rounding too) measure 0.8-1.2e-3 on Zen 4. The
# Qwen2 model without its (small: std 0.02) qkv bias measures 4e-3 (a larger one is caught by
# test_parts_linear_is_its_parts_concatenated).
MEAN_KL_BOUND = 3e-3
# The parts of a Q4_K_M layer (hidden 256: Q4_K's super-blocks of 256 fit the rows).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def llama_q4_k_m(tmp_path_factory) -> object:
    """A Llama GGUF with every linear Q4_K but attn_v in Q6_K (Q4_K_M's layers with Q6_K v)."""
    tmp = tmp_path_factory.mktemp("q4km")
    model_dir = build_hf_model(tmp / "hf", "llama", **SHAPE)
    return write_gguf(model_dir, tmp / "q4km.gguf", quant=Q4_K, types={"attn_v": Q6_K})


@pytest.fixture(scope="module")
def llama_q5_k_m(tmp_path_factory) -> object:
    """A Llama GGUF with every linear Q5_K but attn_v in Q6_K (Q5_K_M's layers with Q6_K v)."""
    tmp = tmp_path_factory.mktemp("q5km")
    model_dir = build_hf_model(tmp / "hf", "llama", **SHAPE)
    return write_gguf(model_dir, tmp / "q5km.gguf", quant=Q5_K, types={"attn_v": Q6_K})


@pytest.fixture(scope="module")
def qwen2_three_runs(tmp_path_factory) -> object:
    """A Qwen2 GGUF (q/k/v biases) with every linear Q4_K but attn_k and ffn_up in Q8_0: qkv
    in three runs (q | k | v), gate_up in two."""
    tmp = tmp_path_factory.mktemp("qwen2parts")
    model_dir = build_hf_model(tmp / "hf", "qwen2", **SHAPE)
    return write_gguf(model_dir, tmp / "mixed.gguf", quant=Q4_K,
                      types={"attn_k": Q8_0, "ffn_up": Q8_0})


def runner(path, quantization: str, dtype: str) -> ModelRunner:
    return ModelRunner(str(path), block_size=4, num_blocks=16, device="cpu", dtype=dtype,
                       quantization=quantization, cpu_kernels="wait")


def _kinds(linear: torch.nn.Module) -> list[tuple[type, int]]:
    return [(type(p), p.out_features) for p in linear.parts]


def _assert_close_to_dequantized(packed: ModelRunner, path) -> None:
    """Decode and prefill logits of `packed` within MEAN_KL_BOUND of the file dequantized to
    float32, most top-1 tokens kept."""
    dense = runner(path, "none", "float32")
    forwards = {"decode": lambda r: teacher_forced_logits(r, PROMPT, CONTINUATION),
                "prefill": lambda r: prompt_logits(r, PROMPT + CONTINUATION)}
    with torch.inference_mode():
        for name, forward in forwards.items():
            kl = kl_divergence([forward(dense)], [forward(packed)])
            print(f"{path.name} {name}: mean KL {kl.mean_kl:.2e} nats, max {kl.max_kl:.2e}, "
                  f"top-1 {kl.top1_agreement:.3f}")
            assert kl.mean_kl < MEAN_KL_BOUND and kl.top1_agreement >= 0.8, (name, kl)


@pytest.mark.parametrize(("fixture", "bits"), [("llama_q4_k_m", 4), ("llama_q5_k_m", 5)])
def test_k_m_qkv_stays_packed(fixture, bits, request, caplog):
    """Q4_K_M's and Q5_K_M's layers: q/k as one 4- or 5-bit linear with the file's two levels of
    scales, v (Q6_K) an int8-block one; every other linear packed alone."""
    path = request.getfixturevalue(fixture)
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        packed = runner(path, "auto", "bfloat16")
    assert "dequantized to the model dtype" not in caplog.text
    for layer in packed.model.layers:
        qkv = layer.self_attn.qkv_proj
        assert type(qkv) is PartsLinear and qkv.bias is None
        assert _kinds(qkv) == [(Int4Linear, 256 + 128), (Int8BlockLinear, 128)]
        assert qkv.parts[0].scales.dtype == torch.uint8  # the K-quant's two levels, as alone
        assert qkv.parts[0].bits == bits
        assert qkv.parts[1].scales.dtype == torch.uint8  # and Q6_K's
        others = (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert all(type(m) is Int4Linear and m.bits == bits for m in others)
    # The model's bytes count the parts (the runner sums the model's parameters).
    part_params = {id(p) for layer in packed.model.layers
                   for p in layer.self_attn.qkv_proj.parts.parameters()}
    assert len(part_params) == 2 * 4  # codes and scales of 2 parts x 2 layers
    assert part_params <= {id(p) for p in packed.model.parameters()}
    _assert_close_to_dequantized(packed, path)


def test_4_and_5_bit_parts_make_one_linear(tmp_path, caplog):
    """q/k in Q4_K beside v in Q5_1 (both with offsets): one 5-bit Int4Linear, the Q4_K parts'
    fifth bits zero (the same values), its logits as the file's dequantized."""
    model_dir = build_hf_model(tmp_path / "hf", "llama", **SHAPE)
    path = write_gguf(model_dir, tmp_path / "m.gguf", quant=Q4_K, types={"attn_v": Q5_1})
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        packed = runner(path, "auto", "bfloat16")
    assert "dequantized to the model dtype" not in caplog.text
    for layer in packed.model.layers:
        qkv = layer.self_attn.qkv_proj
        assert type(qkv) is Int4Linear and qkv.bits == 5 and qkv.out_features == 512
        assert layer.self_attn.o_proj.bits == 4
    _assert_close_to_dequantized(packed, path)


def test_parts_with_a_bias_load_it(qwen2_three_runs, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        packed = runner(qwen2_three_runs, "auto", "bfloat16")
    assert "dequantized to the model dtype" not in caplog.text
    dense = runner(qwen2_three_runs, "none", "bfloat16")
    for layer, dense_layer in zip(packed.model.layers, dense.model.layers, strict=True):
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        assert _kinds(qkv) == [(Int4Linear, 256), (Int8BlockLinear, 128), (Int4Linear, 128)]
        assert _kinds(gate_up) == [(Int4Linear, 512), (Int8BlockLinear, 512)]
        assert all(p.bias is None for p in qkv.parts) and gate_up.bias is None
        # The checkpoint's q/k/v biases, concatenated, loaded as the dense model's (the same
        # values read and rounded once to bfloat16: not computed, so equal).
        assert torch.equal(qkv.bias, dense_layer.self_attn.qkv_proj.bias)
        assert qkv.bias.abs().sum() > 0
    _assert_close_to_dequantized(packed, qwen2_three_runs)


def test_q3_k_m_keeps_three_bit_codes(tmp_path, caplog):
    """A Q3_K_M-style mix (Q3_K, attn_v Q5_K, ffn_down Q4_K): the Q3_K linears keep 3-bit codes
    (3K/8 bytes a row) with the file's two levels of scales, q/k beside the Q5_K v as parts;
    logits as the file's dequantized."""
    model_dir = build_hf_model(tmp_path / "hf", "llama", **SHAPE)
    path = write_gguf(model_dir, tmp_path / "q3km.gguf", quant=Q3_K,
                      types={"attn_v": Q5_K, "ffn_down": GGMLQuantizationType.Q4_K})
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        packed = runner(path, "auto", "bfloat16")
    assert "dequantized to the model dtype" not in caplog.text
    for layer in packed.model.layers:
        qkv = layer.self_attn.qkv_proj
        assert _kinds(qkv) == [(Int8BlockLinear, 256 + 128), (Int4Linear, 128)]
        assert qkv.parts[1].bits == 5
        for m in (qkv.parts[0], layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert type(m) is Int8BlockLinear and m.scales.dtype == torch.uint8
            assert m.codes.shape[1] == m.in_features * 3 // 8
        assert layer.mlp.down_proj.bits == 4
    _assert_close_to_dequantized(packed, path)


def test_a_part_without_a_packed_kernel_leaves_the_linear_dequantized(tmp_path, caplog):
    """A part of neither family (TQ2_0, ternary) keeps the whole fused linear dense, and the
    load names the mix; the other linears stay packed."""
    from pagedkv.model.layers import Linear

    model_dir = build_hf_model(tmp_path / "hf", "llama", **SHAPE)
    path = write_gguf(model_dir, tmp_path / "m.gguf", quant=Q4_K,
                      types={"attn_v": GGMLQuantizationType.TQ2_0})
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.loader"):
        packed = runner(path, "auto", "bfloat16")
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "2 of the GGUF file's quantized linears" in lines[0] \
        and "Q4_K+TQ2_0" in lines[0], lines
    for layer in packed.model.layers:
        assert type(layer.self_attn.qkv_proj) is Linear
        assert type(layer.self_attn.o_proj) is Int4Linear


@pytest.mark.parametrize("fixture", ["llama_q4_k_m", "llama_q5_k_m", "qwen2_three_runs"])
def test_decode_stack_runs_the_parts(fixture, request, monkeypatch):
    """The stack is taken at every decode step (assert_same counts them) and gives the Python
    forward's tokens and log-probabilities (same kernels, same order: 1e-5 nats); the engine's
    block pool checked after each run."""
    monkeypatch.setattr("pagedkv.model.backends.cpu_native.decode_route", lambda *a: "native")
    assert_same(str(request.getfixturevalue(fixture)), "bfloat16", monkeypatch,
                quantization="auto")


def _int4(n: int, k: int, seed: int) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).numpy()
    scale = (torch.rand(n, k // 32, generator=g) * 1e-2 + 1e-3).numpy()
    offset = (-8 * torch.rand(n, k // 32, generator=g) * 1e-2).numpy()
    return Int4Linear(nibbles, scale, offset)


def _int8(n: int, k: int, seed: int) -> Int8BlockLinear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return Int8BlockLinear(codes, (torch.rand(n, k // 16, generator=g) - 0.3) * 1e-2)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_parts_linear_is_its_parts_concatenated(rows):
    """Each part's own output in its columns, the bias added once; at decode sizes (the
    integer products) and a prefill's (the expanded weights)."""
    assert ensure_cpu_kernels("wait")
    k = 256
    parts = [_int4(48, k, 0), _int8(32, k, 1), _int4(16, k, 2)]
    bias = torch.randn(96, generator=torch.Generator().manual_seed(3)).bfloat16()
    linear = PartsLinear(parts, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        y = linear(x)
        own = torch.cat([p(x) for p in parts], dim=-1)
    assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
    # bfloat16 sums of the same products: within one rounding of the output's magnitude.
    torch.testing.assert_close(y, own + bias, rtol=1e-2, atol=1e-2)
    w = linear.dequantized(torch.float32)
    assert w.shape == (96, k)
    torch.testing.assert_close(w[48:80], parts[1].dequantized(torch.float32), rtol=0, atol=0)
    call = linear.decode_call(rows)
    assert isinstance(call, LinearParts) and call.bias is linear.bias
    assert [type(c) for c in call.calls] == [LinearCall] * 3
    assert [c.op for c in call.calls] == ["pagedkv_cpu::int4_linear",
                                          "pagedkv_cpu::int8_block_forward",
                                          "pagedkv_cpu::int4_linear"]


def test_parts_linear_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match=r"two or more parts .* got 1"):
        PartsLinear([_int4(16, 64, 0)])
    with pytest.raises(ValueError, match=r"same in_features, got 2 on \[64, 128\]"):
        PartsLinear([_int4(16, 64, 0), _int4(16, 128, 0)])
    with pytest.raises(ValueError, match=r"bias of shape \[31\] for 32 outputs"):
        PartsLinear([_int4(16, 64, 0), _int4(16, 64, 1)], torch.zeros(31))


def test_add_linear_part_and_bias_need_a_linear():
    assert ensure_cpu_kernels("wait")
    stack = torch.classes.pagedkv_cpu.DecodeStack(2, 1, 16, 1e-6, 0.25, torch.ones(32))
    stack.add_layer(torch.ones(32), torch.ones(32))
    with pytest.raises(RuntimeError, match="add_linear_part: add_linear first"):
        stack.add_linear_part("pagedkv_cpu::panel_linear", "", 0, [torch.zeros(1), None],
                              [32], [])
    with pytest.raises(RuntimeError, match="set_linear_bias: add_linear first"):
        stack.set_linear_bias(torch.zeros(4))
    stack.add_linear("pagedkv_cpu::panel_linear", "", 0, [torch.zeros(1), None], [32], [])
    with pytest.raises(RuntimeError, match="add_linear_part: .* more arguments than it takes"):
        stack.add_linear_part("pagedkv_cpu::panel_linear", "", 0, [torch.zeros(1), None, None],
                              [32], [])
