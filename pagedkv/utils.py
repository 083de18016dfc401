"""Small helpers shared by every package (torch-free)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the blocks `a` tokens fill at `b` tokens a block."""
    return -(-a // b)


def freeze_gc_heap() -> None:
    """Move every object alive now (imported modules, the model's tokenizer, the app) to the
    garbage collector's permanent generation, as vLLM's servers do after start-up: full
    collections then scan only what serving allocates, so they no longer pause the event loop
    for tens of milliseconds. Mutates the interpreter's GC state; call once, before serving."""
    import gc

    gc.collect()
    gc.freeze()
