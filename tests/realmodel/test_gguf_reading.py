"""pagedkv's GGUF reader against the independent ones on the real file: the header against
`gguf.GGUFReader`, the tensors and config against transformers' `load_gguf_checkpoint`, the
tokenizer against transformers' GGUF tokenizer."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.gguf.file import open_gguf
from pagedkv.model.registry import model_config_from_dir
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.hf_reference import transformers_config

pytestmark = pytest.mark.real_model

TEXTS = ["Hello, world! The year 2024 was great.", "  spaces\tand\nnew lines  ",
         "<|im_start|>user\nWhat's up?<|im_end|>\n", "émoji 🙂 naïve café", "x=3.14159*2"]


def test_header_equals_gguf_reader(real_model_path):
    from gguf import GGUFReader

    ours = open_gguf(real_model_path)
    reader = GGUFReader(real_model_path)
    assert set(ours.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        if isinstance(want, float):
            assert ours.metadata[key] == pytest.approx(want, rel=1e-6), key
        else:
            assert ours.metadata[key] == want, key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert info.ggml_type == t.tensor_type and info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name


def test_tensors_and_config_equal_transformers_reader(real_model_path, real_state_dict):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(transformers_config(real_model_path))
    theirs = load_gguf_checkpoint(str(real_model_path), return_tensors=True,
                                  model_to_load=skeleton)
    assert set(theirs["tensors"]) == set(real_state_dict)
    for name, tensor in theirs["tensors"].items():  # q/k un-permuted alike, bit for bit
        assert torch.equal(real_state_dict[name], tensor), name
    ours = model_config_from_dir(real_model_path)
    config = theirs["config"]
    assert (ours.num_layers, ours.hidden_size, ours.intermediate_size, ours.num_heads,
            ours.num_kv_heads, ours.head_dim, ours.vocab_size, ours.tie_word_embeddings) == (
        config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
        config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
        config["vocab_size"], config["tie_word_embeddings"])
    assert ours.rope_theta == config["rope_theta"]
    assert ours.rms_norm_eps == pytest.approx(config["rms_norm_eps"], rel=1e-6)
    assert ours.bos_token_id == config["bos_token_id"]
    assert config["eos_token_id"] in ours.eos_token_ids


def test_tokenizer_equals_transformers(real_model_path):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(real_model_path.parent,
                                           gguf_file=real_model_path.name)
    ours = Tokenizer.from_dir(real_model_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    assert ours.chat_template == theirs.chat_template
    assert ours.add_bos_token is False
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(TEXTS[2])
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "user\nWhat's up?\n"


def test_same_file_in_a_folder_or_by_path(real_model_path, tmp_path):
    """A directory holding the one .gguf is the same model; two .gguf files are refused, naming
    them; no message speaks of config.json."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "m.gguf").symlink_to(real_model_path)
    assert model_config_from_dir(folder) == model_config_from_dir(real_model_path)
    (folder / "other.gguf").symlink_to(real_model_path)
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(m.gguf, other.gguf\)"):
        model_config_from_dir(folder)
