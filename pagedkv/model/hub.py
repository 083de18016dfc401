"""Model ids, as vLLM takes them: `org/name` resolves to its Hugging Face snapshot.

A model argument that is an existing path is used as it is. One that does not exist but reads
as a Hub id (`namespace/name`) is looked up with `huggingface_hub.snapshot_download`: the cache
first when offline (`HF_HUB_OFFLINE=1`), else a download (which itself falls back to the cache
when the network is unreachable). `download_dir` (vLLM's `--download-dir`) replaces the cache
directory; otherwise `HF_HUB_CACHE`, then `HF_HOME`/hub, then huggingface_hub's default, read
when called (not when huggingface_hub was imported). No network and no cached copy: one
ValueError saying so and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

# The files a checkpoint needs (no other weight formats, no README images).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]
_TRUE = ("1", "on", "yes", "true")


def looks_like_repo_id(model: str) -> bool:
    """Whether `model` reads as a Hub id `namespace/name` (and not as a path)."""
    if model.count("/") != 1 or model.startswith((".", "/", "~")) or os.sep != "/" and os.sep in model:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def hub_cache_dir(download_dir: str | None = None) -> str | None:
    """Where snapshots are looked for: `download_dir`, `HF_HUB_CACHE`, `HF_HOME`/hub, or None
    (huggingface_hub's default)."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) as set now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def resolve_model(model: str, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """The local path of `model`: itself when it exists or is not a Hub id, else its snapshot
    directory (downloaded when the network allows). ValueError when the id is neither cached
    nor downloadable."""
    if not model or Path(model).exists() or not looks_like_repo_id(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    cache_dir = hub_cache_dir(download_dir)
    offline = hub_offline()
    try:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                 local_files_only=offline, allow_patterns=ALLOW_PATTERNS)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        raise ValueError(_not_available(model, revision, cache_dir, offline, exc)) from None
    except HfHubHTTPError as exc:
        reason = str(exc).splitlines()[0]
        raise ValueError(f"model {model!r} could not be downloaded from the Hugging Face Hub "
                         f"({reason}); check the id and --revision, or pass a local model "
                         "directory or .gguf file") from None


def _not_available(model: str, revision: str | None, cache_dir: str | None, offline: bool,
                   exc: Exception) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    where = cache_dir or HF_HUB_CACHE
    rev = f" at revision {revision!r}" if revision else ""
    why = ("HF_HUB_OFFLINE is set" if offline
           else f"the Hub cannot be reached: {str(exc).splitlines()[0]}")
    return (f"model {model!r}{rev} is not a local path and is not in the Hugging Face cache "
            f"({where}), and it cannot be downloaded ({why}); download it where the network "
            f"allows (`hf download {model}`, with the same HF_HOME or --download-dir) or pass "
            "a local model directory or .gguf file")


def resolve_model_args(args: object) -> None:
    """Replace an `EngineArgs`' `model` and `tokenizer` ids by their local snapshots (mutates
    `args`; paths stay as they are)."""
    revision = getattr(args, "revision", None)
    download_dir = getattr(args, "download_dir", None)
    args.model = resolve_model(args.model, revision, download_dir)  # type: ignore[attr-defined]
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer:
        args.tokenizer = resolve_model(tokenizer, revision, download_dir)  # type: ignore[attr-defined]
