"""What an engine's KV store is built from: a plain, frozen `StoreConfig` (built once from the
engine's options; pickled to every tensor-parallel rank, each of which builds its own store
from it: factory.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.store.transfer_config import KVTransferConfig


@dataclass(frozen=True)
class StoreConfig:
    """The store's tiers and the parts of its keys every rank shares.

    `model_dir` and `weight_files` name the model (its config and every weight file's digest:
    identity.py); `host_bytes` is the host RAM tier's size (0: none), `disk_path` and
    `disk_bytes` the disk tier's (None: none), `remote_url` the Redis tier's (None: none);
    `enable_events`: rank 0's store reports its blocks as KV events; `transfer`: the prefill/
    decode disaggregation role (transfer_config.py: a push consumer's store has a tier of the
    blocks pushed to it; a push producer's, a host tier of at least `kv_buffer_size` bytes)."""

    model_dir: str
    weight_files: tuple[str, ...]
    host_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0
    remote_url: str | None = None
    enable_events: bool = False
    transfer: KVTransferConfig | None = None

