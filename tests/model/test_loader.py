"""Loading errors name the problem; sharded checkpoints load; configs parse."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.model import ModelRunner
from pagedkv.model.registry import model_config_from_dict, model_config_from_dir
from pagedkv.testing import build_random_model_dir
from tests.model.driver import prefill_logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_model_dir(tmp_path_factory.mktemp("m") / "llama", num_layers=2)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def shard(d):
    """Split model.safetensors into two shards with an index."""
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(d / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_equals_single(model_dir, tmp_path):
    d = copy_dir(model_dir, tmp_path / "sharded")
    shard(d)
    prompts = [[1, 5, 6, 7, 8]]
    a = prefill_logits(ModelRunner(model_dir, block_size=4, num_blocks=8), prompts)
    b = prefill_logits(ModelRunner(d, block_size=4, num_blocks=8), prompts)
    assert torch.equal(a, b)


def test_missing_shard(model_dir, tmp_path):
    d = copy_dir(model_dir, tmp_path / "sharded")
    shard(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing weight shard.*model-00002-of-00002"):
        ModelRunner(d, block_size=4, num_blocks=8)


def test_unknown_architecture(model_dir, tmp_path):
    d = copy_dir(model_dir, tmp_path / "gpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture .GPT2LMHeadModel. is not supported; supported: LlamaForCausalLM"):
        ModelRunner(d, block_size=4, num_blocks=8)


@pytest.mark.parametrize("bad", ["missing", "shape"])
def test_bad_tensor(model_dir, tmp_path, bad):
    d = copy_dir(model_dir, tmp_path / bad)
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    if bad == "missing":
        del sd[name]
        match = f"missing tensor '{name}'"
    else:
        sd[name] = torch.zeros(8, 64)
        match = rf"wrong shape for tensor '{name}': expected \(32, 64\), got \(8, 64\)"
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        ModelRunner(d, block_size=4, num_blocks=8)


def test_missing_files(tmp_path, model_dir):
    with pytest.raises(ValueError, match="model directory not found"):
        model_config_from_dir(tmp_path / "nope")
    d = copy_dir(model_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        ModelRunner(d, block_size=4, num_blocks=8)
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match="missing file.*config.json"):
        model_config_from_dir(d)


def test_config_parsing():
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
            "vocab_size": 100, "sliding_window": 32, "use_sliding_window": False,
            "torch_dtype": "bfloat16", "eos_token_id": [5, 6],
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    cfg = model_config_from_dict(base, {"eos_token_id": 7})
    assert (cfg.head_dim, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window) == (16, True, False, None)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.torch_dtype == "bfloat16"
    assert cfg.eos_token_ids == (7, 5, 6)
    cfg = model_config_from_dict({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert cfg.layer_sliding_windows == (None, None, 32, 32)
    mistral = {**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    assert model_config_from_dict(mistral).sliding_window is None
    cfg = model_config_from_dict({**base, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'yarn'"):
        model_config_from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
