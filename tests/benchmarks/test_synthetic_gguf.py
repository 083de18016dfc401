"""benchmarks/synthetic_gguf.py: a Llama-shaped GGUF file with random weights and SmolLM2's
tokenizer loads in pagedkv with the shape asked for and the shipped file's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedkv.model.runner import ModelRunner
from pagedkv.model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from synthetic_gguf import SHAPES, write_synthetic  # noqa: E402

pytestmark = pytest.mark.real_model


@torch.inference_mode()
def test_synthetic_file_has_the_shape_and_smollm2s_tokenizer(real_model_path, tmp_path):
    path = write_synthetic(tmp_path / "random.gguf", "qwen05b", 1, real_model_path)
    runner = ModelRunner(str(path), block_size=16, num_blocks=4, device="cpu",
                         dtype="bfloat16", quantization="none", cpu_threads=1)
    hidden, inter, _, heads, kv_heads = SHAPES["qwen05b"]
    model = runner.model
    assert len(model.layers) == 1
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (heads, kv_heads, hidden // heads)
    assert mlp.down_proj.in_features == inter and model.embed_tokens.embedding_dim == hidden
    assert model.lm_head is None or model.lm_head.weight is model.embed_tokens.weight  # tied
    text = "The three primary colors are red, yellow and blue."
    ours, shipped = Tokenizer.from_dir(path), Tokenizer.from_dir(real_model_path)
    assert ours.encode(text) == shipped.encode(text) and len(ours.encode(text)) > 5
