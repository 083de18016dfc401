"""GGUF checkpoints (llama.cpp's format): a `.gguf` file, or a directory holding one, is a model.

`gguf_file(model)` says whether `model` names one; the config (`config.hf_config`), tokenizer
(`tokenizer.build_tokenizer`) and weights (`tensors.GGUFCheckpoint`) all come from the file.
Weights are dequantized to float32 on load (then cast to the model dtype).
"""

from __future__ import annotations

import os
from pathlib import Path

SUFFIX = ".gguf"


def gguf_file(model: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `model` names: `model` itself when it is a .gguf file; the one .gguf file
    of a directory that holds no Hugging Face checkpoint (config.json); None otherwise.
    ValueError naming them when a directory holds several."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                         "pass the one to load as the model path")
    return found[0] if found else None
