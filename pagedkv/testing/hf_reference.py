"""transformers' own model class holding a GGUF file's weights: the reference the real-weight
tests, the perplexity test and `benchmarks/lm_eval_check.py --real-model` compare pagedkv with.

The weights are the file's tensors as pagedkv reads them (`GGUFCheckpoint`); that they equal
transformers' own GGUF reader's, bit for bit, is tests/realmodel/test_gguf_reading.py's job.
transformers' `from_pretrained(dir, gguf_file=...)` is not used: it needs `accelerate` and
takes seconds per parse. transformers is a test dependency only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.model.gguf.config import hf_config
from pagedkv.model.gguf.file import open_gguf
from pagedkv.model.gguf.tensors import GGUFCheckpoint


def gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face names, dequantized (pagedkv's reader)."""
    checkpoint = GGUFCheckpoint(open_gguf(path))
    return {name: checkpoint.get_tensor(name) for name in checkpoint}


def transformers_config(path: Path):  # noqa: ANN201 (a transformers PretrainedConfig)
    """The transformers config of the model the file describes."""
    from transformers import AutoConfig

    config = dict(hf_config(open_gguf(path)))
    config.pop("architectures")
    return AutoConfig.for_model(**config)


def transformers_model(path: Path, state_dict: dict[str, torch.Tensor] | None = None
                       ) -> torch.nn.Module:
    """transformers' model (float32, eager attention) holding the file's weights (`state_dict`
    when the caller has read them already)."""
    from transformers import AutoModelForCausalLM

    config = transformers_config(path)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_state_dict(path) if state_dict is None else state_dict
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"{path}: weights do not fit transformers' model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
