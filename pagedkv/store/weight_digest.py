"""A full-content digest of each weight file, cached so a restart does not read it again.

`weight_file_digest(path)` is xxh3-128 over every byte of the file (streamed, 8 MiB at a time:
disk-bound, about a second per few GB once the loader has the file in the page cache). Two
checkpoints that differ in any byte, anywhere, get different digests: a fine-tune with frozen
embeddings and head, or a one-tensor edit in the middle of a shard, is never taken for its base.

The cache is one JSON file, `weight-digests.json`, in `$PAGEDKV_CACHE_DIR`, else
`$XDG_CACHE_HOME/pagedkv`, else `~/.cache/pagedkv`. An entry is keyed by the file's real path and
trusted only while its stat still matches: size, mtime_ns, ctime_ns, inode and device (ctime
changes on every write and cannot be set back by `touch`). A file modified within the last
`_RACY_S` seconds is hashed but not cached (its mtime may not have ticked yet, as in git's
"racy" index entries). An unreadable or unwritable cache only costs a re-hash.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import xxhash

logger = logging.getLogger(__name__)

CACHE_FILE = "weight-digests.json"
_CHUNK = 8 << 20
_MAX_ENTRIES = 4096
_RACY_S = 2.0


def digest_cache_dir() -> Path:
    """Where the digest cache lives (see the module docstring for the order)."""
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def hash_file(path: Path) -> str:
    """xxh3-128 (hex) of every byte of `path`."""
    digest = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _read_cache(cache_path: Path) -> dict:
    try:
        data = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache_path: Path, updates: dict) -> None:
    """Merge `updates` into the cache file atomically (re-read first: another process may
    have added entries); keeps the newest `_MAX_ENTRIES`."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache(cache_path)
        entries.update(updates)
        if len(entries) > _MAX_ENTRIES:
            entries = dict(list(entries.items())[-_MAX_ENTRIES:])
        fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=".digests-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, cache_path)
    except OSError as e:
        logger.debug("weight digest cache %s not written: %r", cache_path, e)


def weight_file_digests(paths: list[Path], cache_dir: Path | None = None) -> list[str]:
    """The full-content digest of each file of `paths`, in order; cached entries are used only
    while the file's stat matches (see the module docstring). Raises OSError for a missing
    or unreadable file."""
    cache_path = (cache_dir or digest_cache_dir()) / CACHE_FILE
    entries = _read_cache(cache_path)
    updates: dict = {}
    digests = []
    for path in paths:
        real = os.path.realpath(path)
        st = os.stat(real)
        entry = entries.get(real)
        if isinstance(entry, dict) and entry.get("stat") == _stat_key(st):
            digests.append(str(entry["xxh3_128"]))
            continue
        digest = hash_file(Path(real))
        after = os.stat(real)
        stable = _stat_key(after) == _stat_key(st)
        if stable and time.time_ns() - after.st_mtime_ns > _RACY_S * 1e9:
            updates[real] = {"stat": _stat_key(after), "xxh3_128": digest}
        digests.append(digest)
    if updates:
        _write_cache(cache_path, updates)
    return digests
