"""The model directory as the frontend needs it before a core starts: a Hugging Face id
resolved to its local snapshot, its config.json checked against the checkpoint, its tokenizer.

The frontend's files (`llm_engine.py` and the processors) reach the model package only through
here and the core client, so what they know of a model is a directory and a tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.engine.args import EngineArgs

if TYPE_CHECKING:
    from pagedkv.model.tokenizer import Tokenizer


def open_model_dir(args: EngineArgs, tokenizer: Tokenizer | None = None) -> Tokenizer:
    """Resolve `args.model` in place (a hub id -> its local snapshot), check the directory
    (ValueError naming what is wrong, before anything is sized) and load its tokenizer
    (`tokenizer` when given, else `args.tokenizer`'s, else the model directory's)."""
    from pagedkv.model.hub import resolve_model_args  # (lazy: torch-free until a model opens)
    from pagedkv.model.loader import check_model_dir
    from pagedkv.model.tokenizer import Tokenizer

    resolve_model_args(args)
    check_model_dir(args.model)
    return tokenizer or Tokenizer.from_dir(args.tokenizer or args.model)
