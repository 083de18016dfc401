"""A GGUF model's 4-bit linears kept packed (quantization "auto") against the same file
dequantized ("none"): next-token distributions of decode steps and of a chunked prefill, as KL
and top-1 agreement (up to `Int4Linear.product_rows()` rows a call, every call with AVX-512
VNNI, computes on activations quantized to int8 per group of 32, as llama.cpp's Q4 x Q8 dot;
beyond, on the expanded weight); the parameter bytes
the engine reports (weights_bytes: the banner, /kv_cache_info) are the packed ones; "int8"
quantizes a safetensors model's linears per channel."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedkv import LLM, SamplingParams
from pagedkv.model.layers import Linear
from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.int8_linear import Int8Linear
from pagedkv.model.quant.packed_head import Int8PackedHead
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import kl_divergence, prompt_logits, teacher_forced_logits
from tests.model.gguf_files import write_gguf

PROMPT = [5, 17, 99, 230, 41, 8, 77, 300, 12, 64, 3, 150, 9, 250, 33, 71, 200, 18, 44, 6]
CONTINUATION = [90, 14, 321, 7, 55, 260, 2, 101, 48, 11, 199, 36]
# Measured on the tiny model (random weights): mean KL about 4e-5 to 1e-4 nats (bfloat16 and
# float16, decode and prefill, all on int8 activations where AVX-512 VNNI runs); codes in the
# wrong order, or a zero off by one step, give about 0.27.
MEAN_KL_BOUND = 1e-3
# Top-1 agreement over the 13 positions: the int8 activations move the tiny model's logits by
# up to about 0.1, and its random weights leave most positions' top two closer than that, so two
# near-ties may flip (dense top-two margins of 0.008 and 0.07 measured); a wrong code or scale
# flips most of them.
TOP1_BOUND = 0.8


@pytest.fixture(scope="module", params=[GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                        GGMLQuantizationType.Q5_1], ids=lambda t: t.name)
def q4_gguf(request, tiny_llama, tmp_path_factory):
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("q4") / "model.gguf",
                      quant=request.param)


def runner(path, quantization: str, dtype: str) -> ModelRunner:
    return ModelRunner(str(path), block_size=4, num_blocks=16, device="cpu", dtype=dtype,
                       quantization=quantization)


def test_auto_keeps_float32_exact(q4_gguf):
    assert not any(isinstance(m, Int4Linear) for m in runner(q4_gguf, "auto", "float32")
                   .model.modules())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_packed_model_matches_dequantized(q4_gguf, dtype):
    packed, dense = runner(q4_gguf, "auto", dtype), runner(q4_gguf, "none", dtype)
    assert sum(isinstance(m, Int4Linear) for m in packed.model.layers.modules()) == 8  # 2 x 4
    assert isinstance(packed.model.lm_head, Int4Linear)  # the untied head, in the file's type
    assert not any(isinstance(m, Int4Linear) for m in dense.model.modules())
    assert_next_tokens_close(dense, packed, f"{q4_gguf.name} {dtype}")


def assert_next_tokens_close(dense: ModelRunner, packed: ModelRunner, label: str) -> None:
    """`packed`'s next-token distributions against `dense`'s, over decode steps of CONTINUATION
    after PROMPT and over one prefill of both: mean KL and top-1 agreement within the bounds."""
    for name, forward in (("decode", lambda r: teacher_forced_logits(r, PROMPT, CONTINUATION)),
                          ("prefill", lambda r: prompt_logits(r, PROMPT + CONTINUATION))):
        with torch.inference_mode():
            kl = kl_divergence([forward(dense)], [forward(packed)])
        print(f"{label} {name}: mean KL {kl.mean_kl:.2e} nats, max {kl.max_kl:.2e}, top-1 "
              f"agreement {kl.top1_agreement:.3f} over {kl.positions}")
        assert kl.mean_kl < MEAN_KL_BOUND, (name, kl)
        assert kl.top1_agreement >= TOP1_BOUND, (name, kl)


def _linear_bytes(model: torch.nn.Module, tables: int) -> tuple[int, int]:
    """(bytes of the model's Int4Linear tensors, what their weights take in 4- or 5-bit groups
    of 32 with one copy of the codes and `tables` float16 values per group: 1 for Q4_0, its
    scale, as in the file; 2 for Q4_1 and Q5_1, its scale and offset)."""
    got = expected = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            n, k = m.out_features, m.in_features
            got += sum(p.numel() * p.element_size() for p in m.parameters())
            expected += n * k * m.bits // 8 + (k // 32) * n * tables * 2
    return got, expected


def test_weights_bytes_count_the_packed_weights(q4_gguf):
    packed, dense = runner(q4_gguf, "auto", "bfloat16"), runner(q4_gguf, "none", "bfloat16")
    from gguf import GGUFReader

    q4_0 = GGUFReader(q4_gguf).tensors[0].tensor_type == GGMLQuantizationType.Q4_0
    tables = 1 if q4_0 else 2
    got, expected = _linear_bytes(packed.model, tables)  # the layers' linears and the head
    assert got == expected > 0
    dense_linear = sum(m.weight.numel() * 2 for m in dense.model.modules()
                       if isinstance(m, Linear))
    embed = packed.model.embed_tokens  # the table in the file's type too
    vocab, dim = embed.num_embeddings, embed.embedding_dim
    bits = 5 if embed.codes.shape[1] * 8 == dim * 5 else 4
    embed_bytes = embed.codes.numel() + embed.scales.numel() * 2
    assert embed_bytes == vocab * dim * bits // 8 + vocab * dim // 32 * tables * 2
    dense_embed = dense.model.embed_tokens.weight.numel() * 2
    assert packed.weights_bytes == \
        dense.weights_bytes - dense_linear - dense_embed + expected + embed_bytes
    llm = LLM(str(q4_gguf), dtype="bfloat16", block_size=4, num_gpu_blocks_override=16,
              max_model_len=64, device="cpu")
    try:  # what the engine reports (the banner, /kv_cache_info): the packed bytes
        assert llm.llm_engine.client.ready.weights_bytes == packed.weights_bytes
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        llm.llm_engine.check_invariants()
    finally:
        llm.shutdown()


def test_int8_quantizes_a_safetensors_model(tiny_llama):
    quantized, dense = runner(tiny_llama, "int8", "float32"), runner(tiny_llama, "none", "float32")
    linears = [m for m in quantized.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 8  # 2 layers x (qkv, o, gate_up, down)
    assert isinstance(quantized.model.lm_head, Int8PackedHead)  # dense, and int8 at decode
    assert quantized.weights_bytes < dense.weights_bytes
    with torch.inference_mode():
        kl = kl_divergence([teacher_forced_logits(dense, PROMPT, CONTINUATION)],
                           [teacher_forced_logits(quantized, PROMPT, CONTINUATION)])
    print(f"int8 per channel: mean KL {kl.mean_kl:.2e}, top-1 {kl.top1_agreement:.3f}")
    assert kl.mean_kl < MEAN_KL_BOUND and kl.top1_agreement >= 0.9, kl


def test_unknown_quantization_is_named(tiny_llama):
    with pytest.raises(ValueError, match=r"quantization must be one of .*got 'int3'"):
        runner(tiny_llama, "int3", "float32")


def _rebuild_decode_stacks(runner: ModelRunner) -> None:
    """Drops the model's C++ decode stacks (built with the tensors its linears had; the next
    decode step builds them anew from the modules): the decode steps then read the swapped
    weights, not the stacks' references to the old ones."""
    from pagedkv.model.decode_stack import DecodeStack

    assert runner.model.decode_stack is not None  # the decode steps ran the stack
    runner.model.decode_stack = DecodeStack()


def _assert_widened_logits_equal(packed: ModelRunner, dense: ModelRunner,
                                 widen: Callable[[], None], label: str) -> None:
    """`packed`'s decode and prefill logits equal, exactly, its own after `widen()` swaps its
    compact weights for the same values in the wide layout (mutates `packed`), and stay within
    the activation quantization's reach of `dense` (the file dequantized)."""
    forwards = {"decode": lambda r: teacher_forced_logits(r, PROMPT, CONTINUATION),
                "prefill": lambda r: prompt_logits(r, PROMPT + CONTINUATION)}
    with torch.inference_mode():
        got = {name: forward(packed) for name, forward in forwards.items()}
        want = {name: forward(dense) for name, forward in forwards.items()}
        widen()
        _rebuild_decode_stacks(packed)
        wide = {name: forward(packed) for name, forward in forwards.items()}
    for name in forwards:
        for a, b in zip(got[name], wide[name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        kl = kl_divergence([want[name]], [got[name]])
        print(f"{label} {name}: mean KL {kl.mean_kl:.2e} nats, top-1 {kl.top1_agreement:.3f}")
        assert kl.mean_kl < 5e-3, (name, kl)


def test_q4_k_model_keeps_the_files_two_level_scales(tmp_path):
    """A Q4_K file (rows of 256: every linear Q4_K; a tiny model's 64-wide rows cannot be)
    packs its linears with the scales as the file has them (uint8 tables: 2.5 bytes per 32
    weights where the float32 table took 8): the logits equal those of the same linears on
    the float32 table exactly, and stay within the activation quantization's reach of the file
    dequantized (measured: mean KL about 1e-3 nats on this random model; a scale misread gives
    tenths)."""
    from gguf import GGMLQuantizationType

    from pagedkv.model.quant.int4_blocks import two_level_scales
    from pagedkv.model.quant.int4_linear import scales_table
    from tests.tiny_models import build_hf_model

    model_dir = build_hf_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                               num_heads=4, num_kv_heads=2, head_dim=64)
    path = write_gguf(model_dir, tmp_path / "q4k.gguf", quant=GGMLQuantizationType.Q4_K)
    packed, dense = runner(path, "auto", "bfloat16"), runner(path, "none", "bfloat16")
    linears = [m for m in packed.model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 9  # 2 layers x 4 and the (untied) head
    assert all(m.scales.dtype == torch.uint8 for m in linears)
    assert all(m.scales.shape[1] * 32 == m.in_features * 5 // 2 for m in linears)

    def widen() -> None:  # the same weights on the float32 table
        for m in linears:
            m.scales = torch.nn.Parameter(scales_table(*two_level_scales(m.scales.numpy())),
                                          requires_grad=False)

    _assert_widened_logits_equal(packed, dense, widen, "Q4_K")


def test_q6_k_model_keeps_the_files_bytes(tmp_path):
    """A Q6_K file (rows of 256) packs every linear, the embedding table and the head as 6-bit
    codes with the scales as the file has them (uint8 tables: int8 sub-scales per 16 and an fp16
    d per 256): 0.82 bytes a weight, the file's 210 per 256, where int8 codes and float32
    scales took 1.25. The logits equal those of the same codes as int8 on float32 scales
    exactly, the engine counts the file's bytes, and the logits stay within the activation
    quantization's reach of the file dequantized."""
    from gguf import GGMLQuantizationType

    from pagedkv.model.quant.int8_block_linear import Int8BlockEmbedding, Int8BlockLinear
    from pagedkv.model.quant.int8_blocks import two_level_block_scales, unpacked_codes
    from tests.tiny_models import build_hf_model

    model_dir = build_hf_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                               num_heads=4, num_kv_heads=2, head_dim=64)
    path = write_gguf(model_dir, tmp_path / "q6k.gguf", quant=GGMLQuantizationType.Q6_K)
    packed, dense = runner(path, "auto", "bfloat16"), runner(path, "none", "bfloat16")
    modules = [m for m in packed.model.modules()
               if isinstance(m, (Int8BlockLinear, Int8BlockEmbedding))]
    assert isinstance(packed.model.embed_tokens, Int8BlockEmbedding)
    assert isinstance(packed.model.lm_head, Int8BlockLinear)
    assert len(modules) == 10  # 2 layers x 4 linears, the head, the table
    assert all(m.scales.dtype == m.codes.dtype == torch.uint8 for m in modules)
    weights = {id(m.codes): m.codes.shape[0] * m.codes.shape[1] * 4 // 3 for m in modules}
    norms = sum(p.numel() * p.element_size() for name, p in packed.model.named_parameters()
                if "norm" in name)
    assert packed.weights_bytes == norms + sum(n * 210 // 256 for n in weights.values())

    def widen() -> None:  # the same codes as int8 on float32 scales
        for m in modules:
            m.codes = torch.nn.Parameter(torch.from_numpy(unpacked_codes(m.codes.numpy(), 6)),
                                         requires_grad=False)
            m.scales = torch.nn.Parameter(
                torch.from_numpy(two_level_block_scales(m.scales.numpy())), requires_grad=False)
        if packed.model.lm_head.scales.dtype == torch.uint8:  # tied: the table's, swapped
            packed.model.lm_head.codes = packed.model.embed_tokens.codes
            packed.model.lm_head.scales = packed.model.embed_tokens.scales

    _assert_widened_logits_equal(packed, dense, widen, "Q6_K")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int4_embedding_table_and_head_stay_packed(tmp_path, tied):
    """A Q4_K file's token embedding table (llama.cpp keeps an untied model's in the base type)
    stays packed as an Int4Embedding, in the file's bytes (codes and two-level scales: 0.578
    bytes a weight where bfloat16 took 2), whose lookups are the dequantized table's rows; an
    untied Q4_K head is an Int4Linear, a tied model's an Int4Linear over the table's very
    parameters; the logits stay within the activation quantization's reach of the file
    dequantized."""
    from pagedkv.model.quant.int4_linear import Int4Embedding
    from tests.tiny_models import build_hf_model

    model_dir = build_hf_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                               num_heads=4, num_kv_heads=2, head_dim=64,
                               tie_word_embeddings=tied)
    path = write_gguf(model_dir, tmp_path / "q4k.gguf", quant=GGMLQuantizationType.Q4_K)
    packed, dense = runner(path, "auto", "bfloat16"), runner(path, "none", "bfloat16")
    embed, head = packed.model.embed_tokens, packed.model.lm_head
    assert isinstance(embed, Int4Embedding) and isinstance(head, Int4Linear)
    assert (head.codes is embed.codes and head.scales is embed.scales) == tied
    vocab, dim = embed.num_embeddings, embed.embedding_dim
    assert embed.codes.numel() + embed.scales.numel() == vocab * dim // 2 + vocab * dim // 32 * 5 // 2
    ids = torch.tensor([[0, 5, 99], [7, 7, vocab - 1]])
    got, want = embed(ids), dense.model.embed_tokens(ids)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == (2, 3, dim)
    torch.testing.assert_close(got, want, rtol=2 ** -8, atol=0)
    with torch.inference_mode():
        for forward in (lambda r: teacher_forced_logits(r, PROMPT, CONTINUATION),
                        lambda r: prompt_logits(r, PROMPT + CONTINUATION)):
            kl = kl_divergence([forward(dense)], [forward(packed)])
            assert kl.mean_kl < 5e-3 and kl.top1_agreement >= 0.8, kl
