"""GGUF files of every supported architecture, written as llama.cpp writes them (tests/model/
gguf_files.py) from the tiny transformers checkpoints, run token for token like the checkpoints
themselves; unsupported architectures, quantization types and folders are refused plainly."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from pagedkv import LLM, SamplingParams
from pagedkv.model.gguf.file import open_gguf
from pagedkv.model.gguf.tensors import GGUFCheckpoint
from pagedkv.model.loader import load_state_dict
from pagedkv.model.registry import model_config_from_dir
from pagedkv.model.tokenizer import Tokenizer
from tests.model.gguf_files import write_gguf

PROMPTS = [[5, 17, 99, 230, 41, 8, 77, 300, 12, 64, 3, 150], [9, 250, 33, 71]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, num_gpu_blocks_override=64, max_model_len=128)


def greedy(model: str, **engine) -> list[list[int]]:
    """The greedy tokens of PROMPTS through an engine on `model` (ENGINE's options, `engine`'s
    too), its pool checked."""
    llm = LLM(model, **ENGINE, **engine)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        llm.llm_engine.check_invariants()
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_gemma2",
                                   "tiny_gemma3"])
def test_gguf_runs_like_its_checkpoint(request, tmp_path, model):
    model_dir = request.getfixturevalue(model)
    path = write_gguf(model_dir, tmp_path / "model.gguf")
    # Tensors: the checkpoint's (q/k un-permuted, Gemma's norms shifted back).
    ours = GGUFCheckpoint(open_gguf(path))
    want = load_state_dict(model_dir)
    for name in ours:  # (w + 1) - 1 is w only to float32 rounding
        assert torch.allclose(ours.get_tensor(name), want[name].float(), rtol=0, atol=1e-7 if
                              "gemma" in model and name.endswith("norm.weight") else 0), name
    expected = model_config_from_dir(model_dir)
    got = model_config_from_dir(path)
    for field in ("architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "tie_word_embeddings", "qkv_bias", "qk_norm",
                  "layer_sliding_windows", "rope_theta", "rms_norm_eps"):
        assert getattr(got, field) == getattr(expected, field), field
    if model == "tiny_llama":  # the tokenizer too (a byte-level BPE)
        text = "the block table maps tokens"
        assert Tokenizer.from_dir(path).encode(text) == Tokenizer.from_dir(model_dir).encode(text)
    if model in ("tiny_llama", "tiny_gemma2"):  # whole-engine runs: the two most different
        assert greedy(str(path)) == greedy(str(model_dir))


def test_quantized_weights_are_dequantized(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "q8.gguf", quant=GGMLQuantizationType.Q8_0)
    assert {i.type_name for i in open_gguf(path).tensors.values()} == {"Q8_0", "F32"}
    ours = GGUFCheckpoint(open_gguf(path))
    want = load_state_dict(tiny_llama)
    for name in ours:  # Q8_0: within half a step of the block's scale
        w = want[name].float()
        step = w.abs().max() / 127
        assert (ours.get_tensor(name) - w).abs().max() <= step, name


def test_rope_freqs_divide_the_inverse_frequencies(tiny_llama, tmp_path):
    factors = np.linspace(1.0, 8.0, 8)  # head_dim 16: 8 frequencies
    plain = LLM(str(write_gguf(tiny_llama, tmp_path / "a.gguf")), **ENGINE)
    scaled = LLM(str(write_gguf(tiny_llama, tmp_path / "b.gguf", rope_freqs=factors)), **ENGINE)
    try:
        base = plain.llm_engine.runner.model.rotary.inv_freq.cpu()
        got = scaled.llm_engine.runner.model.rotary.inv_freq.cpu()
        assert torch.allclose(got, base / torch.tensor(factors, dtype=torch.float32))
    finally:
        plain.shutdown()
        scaled.shutdown()


def test_unsupported_gguf_architecture_is_named(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' .* is not supported; "
                                         "supported: llama, mistral, qwen2"):
        LLM(str(path))


def test_unsupported_quant_type_is_named(tiny_llama, tmp_path, monkeypatch):
    path = write_gguf(tiny_llama, tmp_path / "q.gguf", quant=GGMLQuantizationType.Q8_0)
    from pagedkv.model.gguf import tensors

    monkeypatch.setattr(tensors, "supported_types", lambda: ["F32"])  # as if Q8_0 were unknown
    with pytest.raises(ValueError, match="quantization type Q8_0, which pagedkv cannot "
                                         "dequantize; supported: F32"):
        LLM(str(path))


def test_folder_with_one_gguf_is_the_model(tiny_llama, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_gguf(tiny_llama, folder / "model.gguf")
    assert greedy(str(folder)) == greedy(str(tiny_llama))
    shutil.copy(folder / "model.gguf", folder / "second.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(model.gguf, second.gguf\)"):
        LLM(str(folder))


def test_not_a_gguf_file_and_no_config(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LLM(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="missing file"):
        LLM(str(empty))


def test_unsupported_architecture_before_any_size_check(tiny_llama, tmp_path):
    """A GPT-2 checkpoint has no num_hidden_layers: the architecture is what is wrong."""
    d = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, d)
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                               "model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match=r"^architecture 'GPT2LMHeadModel' is not supported; "
                                         "supported: LlamaForCausalLM"):
        LLM(str(d))


@pytest.mark.parametrize(("quant", "want"), [(None, "float32"),
                                             (GGMLQuantizationType.F16, "float16"),
                                             (GGMLQuantizationType.BF16, "bfloat16"),
                                             (GGMLQuantizationType.Q4_0, "bfloat16"),
                                             (GGMLQuantizationType.Q8_0, "bfloat16")])
def test_auto_dtype_of_a_gguf_file(tiny_llama, tmp_path, quant, want):
    """`--dtype auto` takes a float file's own dtype (F32, F16, BF16, as a config's torch_dtype)
    and bfloat16 for a quantized one, whose linears then stay packed (float32 would dequantize
    them all); an explicit dtype still wins."""
    from pagedkv.model.quant.int4_linear import Int4Linear
    from pagedkv.model.runner import ModelRunner

    path = write_gguf(tiny_llama, tmp_path / "model.gguf", quant=quant)
    runner = ModelRunner(str(path), block_size=4, num_blocks=8, device="cpu")
    assert runner.dtype == getattr(torch, want)
    packed = sum(isinstance(m, Int4Linear) for m in runner.model.modules())
    assert packed == (9 if quant == GGMLQuantizationType.Q4_0 else 0)  # 2 x 4 linears, the head
    explicit = ModelRunner(str(path), block_size=4, num_blocks=8, device="cpu", dtype="float32")
    assert explicit.dtype == torch.float32


def test_quantized_linears_left_dequantized_are_named(tmp_path, caplog):
    """A quantized type no packed kernel takes (TQ2_0, ternary: rows of 256) is dequantized to
    the model dtype, and the load says so once, with the types (a packed file says nothing)."""
    from pagedkv.model.runner import ModelRunner
    from tests.tiny_models import build_hf_model

    model_dir = build_hf_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                               num_heads=4, num_kv_heads=2, head_dim=64)
    for quant, warned in ((GGMLQuantizationType.TQ2_0, True), (GGMLQuantizationType.Q4_0, False)):
        caplog.clear()
        path = write_gguf(model_dir, tmp_path / f"{quant.name}.gguf", quant=quant)
        with caplog.at_level("WARNING", logger="pagedkv.model.loader"):
            ModelRunner(str(path), block_size=4, num_blocks=8, device="cpu")
        lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
        if warned:
            assert len(lines) == 1 and "8 of the GGUF file's quantized linears" in lines[0] \
                and "TQ2_0" in lines[0], lines
        else:
            assert lines == []
