"""What the server reads of its engine, read once when the app is built: the engine's
configuration (`EngineArgs`) and what its core said of itself when it started (`EngineReady`:
max_model_len, vocab size, block count, the KV cache's resolved format and one block's bytes).
Both are fixed for the engine's life, so every route reads them here instead of probing the
engine's attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.messages import EngineReady


@dataclass(frozen=True)
class EngineFacts:
    """An engine's configuration and start-up facts, as the server's routes read them."""

    args: EngineArgs
    ready: EngineReady
    # Each engine core's start-up facts and process id (None: in this process), core 0 first:
    # one entry, or `data_parallel_size` of them.
    cores: tuple[tuple[EngineReady, int | None], ...] = ()


def engine_facts(engine: LLMEngine) -> EngineFacts:
    """The facts of `engine`: the one place the server reads them."""
    return EngineFacts(args=engine.args, ready=engine.ready, cores=core_facts(engine))


def core_facts(engine: LLMEngine) -> tuple[tuple[EngineReady, int | None], ...]:
    """(start-up facts, pid or None) of each of `engine`'s cores."""
    client = getattr(engine, "client", None)
    clients = getattr(client, "cores", None) or [client]
    return tuple((getattr(c, "ready", engine.ready),
                  getattr(getattr(c, "process", None), "pid", None)) for c in clients)
