"""A model's Hugging Face config as a dict, wherever the model keeps it: config.json (a file,
or a model directory holding one) or a GGUF file's metadata (a .gguf file, or a directory
holding one). Torch-free: the planner and the simulator read configs with it."""

from __future__ import annotations

import os
from typing import Any

from pagedkv.config.hf_config import read_config_json
from pagedkv.model.gguf import gguf_file


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config dict `path` holds (see the module docstring). FileNotFoundError when there
    is no such file, ValueError when config.json is not a JSON object."""
    gguf = gguf_file(path)
    if gguf is not None:
        from pagedkv.model.gguf.config import hf_config  # (lazy: numpy and gguf)
        from pagedkv.model.gguf.file import open_gguf

        return hf_config(open_gguf(gguf))
    return read_config_json(path)
