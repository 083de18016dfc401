"""The tiny-model builder: deterministic, byte-level, loadable by transformers and by pagedkv."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.model import ModelRunner, Tokenizer
from pagedkv.testing import build_random_model_dir, build_tokenizer_files
from tests.model.driver import prefill_logits

TEXTS = ["Hello, world!", "Le café est très bon. Élève", "中文文本测试：你好", "emoji 😀🚀 done",
         "  spaces\n\ttabs  ", ""]


def test_tokenizer_is_deterministic_and_byte_level(tmp_path):
    a = build_tokenizer_files(tmp_path / "a")
    b = build_tokenizer_files(tmp_path / "b")
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    tok = Tokenizer.from_dir(a)
    assert 400 <= tok.vocab_size <= 1000
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text
    assert tok.eos_token_ids == (2,)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_random_model_matches_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    d = build_random_model_dir(tmp_path / arch, arch, sliding_window=4 if arch == "mistral" else None,
                               tie_word_embeddings=arch == "qwen3", head_dim=32 if arch == "qwen3" else None)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] % 64 == 0 and cfg["architectures"][0].lower().startswith(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    tok = Tokenizer.from_dir(d)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == hf_tok(
            text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi é"}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    runner = ModelRunner(d, block_size=4, num_blocks=64)
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    ours = prefill_logits(runner, prompts)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_random_model_bf16_and_validation(tmp_path):
    d = build_random_model_dir(tmp_path / "bf16", hidden_size=32, num_heads=2, num_kv_heads=1,
                               dtype="bfloat16", num_layers=1)
    runner = ModelRunner(d, block_size=4, num_blocks=8)
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.kv.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_random_model_dir(tmp_path / "bad", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown arch"):
        build_random_model_dir(tmp_path / "bad2", "gpt2")


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_without_bos_post_processor_matches_transformers(tmp_path, add_bos):
    """Qwen-style tokenizers have no bos post-processor; add_bos_token then decides."""
    transformers = pytest.importorskip("transformers")
    d = build_tokenizer_files(tmp_path)
    tok_json = json.loads((d / "tokenizer.json").read_text())
    tok_json["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tok_json))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = add_bos
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    tok = Tokenizer.from_dir(d)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], (text, add_bos)


def test_chat_template_errors(tmp_path):
    d = build_tokenizer_files(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
