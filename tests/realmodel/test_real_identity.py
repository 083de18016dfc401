"""The KV store's model identity covers the GGUF file's bytes: a one-byte change gives another
identity, so no store tier serves one file's blocks to another."""

from __future__ import annotations

import shutil

import pytest

from pagedkv.model.loader import weight_files
from pagedkv.store.identity import model_identity

pytestmark = pytest.mark.real_model


def test_identity_covers_the_gguf_bytes(real_model_path, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy(real_model_path, copy)
    assert weight_files(copy) == [copy]

    def identity(path):
        return model_identity(path, weight_files(path), "float32", "layout", 16,
                              digest_cache_dir=tmp_path / "digests")

    before = identity(copy)
    assert identity(copy) == before
    with open(copy, "r+b") as f:  # one byte of the last tensor's data
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 1]))
    assert identity(copy) != before
