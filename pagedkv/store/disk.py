"""DiskTier: KV blocks as files in a local directory (`kv_offloading_disk_path`), surviving restarts.

One file per block, named by its key in hex (`<dir>/<2 hex>/<key hex>.kvb`), holding
`codec.encode_block(key, payload)`. A write goes to a temporary file in the same directory and
is renamed into place, so a crash mid-write never leaves a file under a block's name that reads
as anything but a miss (and every read verifies the header and checksum anyway: a corrupt or
truncated file is deleted and counts as a miss). On start the directory is scanned, so blocks
written by an earlier run (or by another engine sharing the directory) are found; files'
modification times keep the LRU order across restarts (a read touches the file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from pagedkv.events.wire import MEDIUM_DISK
from pagedkv.store.codec import CorruptBlockError, decode_block, encode_block
from pagedkv.store.payload import Payload, payload_buffer
from pagedkv.store.sizing import disk_tier_blocks
from pagedkv.store.tier import KVTier
from pagedkv.store.warn_limit import WARNING_INTERVAL_S, RateLimitedWarning

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_STALE_TMP_S = 600.0
# A full disk (ENOSPC) fails every write, a damaged directory every read: at most one warning
# of each per this many seconds, carrying how many happened since the previous one (all are
# counted in `num_write_errors` / `num_corrupt`).
WRITE_WARNING_INTERVAL_S = WARNING_INTERVAL_S


class DiskTier(KVTier):
    """Block files under `root`, at most `capacity_bytes` of them, LRU by access."""

    name = "disk"
    medium = MEDIUM_DISK

    def __init__(self, root: str | os.PathLike, capacity_bytes: int) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be a positive byte count, "
                             f"got {capacity_bytes!r}")
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offloading_disk_path {str(root)!r} is not a usable "
                             f"directory: {e}") from None
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._used = 0
        self.num_corrupt = 0
        self.num_write_errors = 0  # writes that failed (disk full, permissions, ...)
        self._clock = time.monotonic  # a seam for tests
        self._write_warning = RateLimitedWarning(logger, "block write(s) failed",
                                                 clock=lambda: self._clock())
        self._corrupt_warning = RateLimitedWarning(logger, "unreadable block file(s) dropped",
                                                   clock=lambda: self._clock())
        self._scan()

    # ---- files ----------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        """Where the block stored under `key` lives (whether or not it exists)."""
        name = key.hex()
        return self.root / name[-2:] / (name + SUFFIX)

    def _scan(self) -> None:
        found = []
        now = time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    try:
                        key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                    except ValueError:
                        continue
                    found.append((st.st_mtime, key, st.st_size))
                elif entry.name.startswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    _unlink(Path(entry.path))  # left by a crash mid-write
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        self._evict_over_capacity(0)

    # ---- KVTier -----------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        out = []
        for key in keys:
            with self._lock:
                known = key in self._index
            if not known:  # written by another engine sharing the directory?
                known = self._adopt(key)
            out.append(known)
        return out

    def _adopt(self, key: bytes) -> bool:
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
        return True

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._get(key) for key in keys]

    def _get(self, key: bytes) -> bytes | None:
        path = self.path(key)
        try:
            value = path.read_bytes()
            payload = decode_block(key, value)
        except FileNotFoundError:
            self._forget(key)
            return None
        except (OSError, CorruptBlockError) as e:
            self._corrupt_warning.note("disk tier: dropping unreadable block file %s (%s)",
                                       path, e)
            self.num_corrupt += 1
            self._forget(key)
            _unlink(path)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = len(value)
                self._used += len(value)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return payload

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> list[bytes]:
        new = []
        for key, payload in items:
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    continue
            value = encode_block(key, payload_buffer(payload))
            if len(value) > self.capacity_bytes:
                continue
            self._evict_over_capacity(len(value))
            if self._write(key, value):
                with self._lock:
                    self._index[key] = len(value)
                    self._used += len(value)
                new.append(key)
        return new

    def _write(self, key: bytes, value: bytes) -> bool:
        path = self.path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                os.replace(tmp, path)
            except BaseException:
                _unlink(Path(tmp))
                raise
        except OSError as e:
            self._note_write_error(path, e)
            return False
        return True

    def _note_write_error(self, path: Path, error: OSError) -> None:
        """Count a failed write; warn at most once per WRITE_WARNING_INTERVAL_S."""
        with self._lock:
            self.num_write_errors += 1
        self._write_warning.note("disk tier: cannot write %s (%s), blocks that are not written "
                                 "are recomputed when needed", path, error)

    def _evict_over_capacity(self, incoming: int) -> None:
        evicted = []
        with self._lock:
            while self._index and self._used + incoming > self.capacity_bytes:
                key, size = self._index.popitem(last=False)
                self._used -= size
                evicted.append(key)
        for key in evicted:
            _unlink(self.path(key))
        if evicted:
            self._note_removed(evicted)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def capacity_blocks(self, block_bytes: int) -> int | None:
        return disk_tier_blocks(self.capacity_bytes, block_bytes)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
