"""The store key covers every byte of every weight file: a copy of a checkpoint with one middle
tensor edited (same config, same size, same first and last MiB: a ROME-style edit or a partial
fine-tune with frozen embeddings and head) never loads the original's blocks. The weight digests
are cached by path and stat, and a cache entry whose stat no longer matches is not trusted."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.store.identity import model_identity
from pagedkv.store.weight_digest import CACHE_FILE, hash_file, weight_file_digests
from pagedkv.testing.random_model import build_random_model_dir
from tests.store.conftest import make_prefixes, run_one, store_llm, with_suffix

MiB = 1 << 20


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (start, end) byte offsets of each tensor's data in the safetensors file."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    base = 8 + header_len
    return {name: (base + info["data_offsets"][0], base + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


@pytest.fixture(scope="module")
def base_and_edit(tmp_path_factory) -> tuple[Path, Path]:
    """A ~9 MB llama checkpoint and a copy of it with one tensor in the middle negated."""
    base = build_random_model_dir(tmp_path_factory.mktemp("base"), "llama", hidden_size=256,
                                  intermediate_size=1024, num_layers=2, num_heads=4,
                                  num_kv_heads=2, seed=3)
    edit = tmp_path_factory.mktemp("edit")
    shutil.copytree(base, edit, dirs_exist_ok=True)
    weights = base / "model.safetensors"
    size = weights.stat().st_size
    assert size > 4 * MiB
    middle = [name for name, (start, end) in _tensor_spans(weights).items()
              if start >= MiB and end <= size - MiB]
    victim = next(n for n in middle if "mlp.down_proj" in n)
    tensors = load_file(str(weights))
    tensors[victim] = -tensors[victim]
    save_file(tensors, str(edit / "model.safetensors"), metadata={"format": "pt"})
    return base, edit


def test_one_middle_tensor_edit_changes_the_identity(base_and_edit, tmp_path):
    base, edit = base_and_edit
    a, b = (p / "model.safetensors" for p in (base, edit))
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    # What an edge-only fingerprint sees: the same config, size, first and last MiB.
    assert (base / "config.json").read_bytes() == (edit / "config.json").read_bytes()
    assert len(raw_a) == len(raw_b) and raw_a != raw_b
    assert raw_a[:MiB] == raw_b[:MiB] and raw_a[-MiB:] == raw_b[-MiB:]
    ids = [model_identity(d, [d / "model.safetensors"], "float32", "L", 4, tmp_path)
           for d in (base, edit)]
    assert ids[0] != ids[1]
    # Deterministic, from the cache or not.
    assert ids[0] == model_identity(base, [a], "float32", "L", 4, tmp_path / "other")


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_an_edited_copy_never_loads_the_originals_blocks(base_and_edit, tmp_path, tier,
                                                          request):
    base, edit = base_and_edit
    url = request.getfixturevalue("redis_server").url if tier == "redis" else None
    prompt = with_suffix(make_prefixes(seed=21, num=1)[0], seed=4)
    kw = dict(num_gpu_blocks_override=40)
    max_tokens = 8
    writer = store_llm(base, tier, tmp_path, url, **kw)
    base_tokens, cached = run_one(writer, prompt, max_tokens=max_tokens)
    assert cached == 0 and writer.llm_engine.kv_store.snapshot_stats()[0].blocks_written > 0
    writer.shutdown()

    own = store_llm(edit, "none", tmp_path, **kw)
    own_tokens, _ = run_one(own, prompt, max_tokens=max_tokens)
    own.shutdown()
    assert own_tokens != base_tokens  # the edit matters

    reader = store_llm(edit, tier, tmp_path, url, **kw)  # the writer's directory / server
    tokens, cached = run_one(reader, prompt, max_tokens=max_tokens)
    assert cached == 0
    assert reader.llm_engine.kv_store.snapshot_stats()[0].hits == 0
    assert tokens == own_tokens
    reader.shutdown()

    again = store_llm(base, tier, tmp_path, url, **kw)  # the original finds its own blocks
    tokens, cached = run_one(again, prompt, max_tokens=max_tokens)
    assert cached == (len(prompt) - 1) // 4 * 4 and tokens == base_tokens
    again.shutdown()


def test_digest_cache_is_used_and_not_trusted_when_stat_differs(tmp_path):
    weights = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(4096, dtype=torch.float32)}, str(weights))
    old = weights.stat().st_mtime_ns - 10 * 10**9  # not "racy": cacheable
    os.utime(weights, ns=(old, old))
    cache = tmp_path / "cache"
    (first,) = weight_file_digests([weights], cache)
    assert first == hash_file(weights)
    entries = json.loads((cache / CACHE_FILE).read_text())
    assert list(entries) == [os.path.realpath(weights)]
    # A planted digest is served while the stat matches: the cache is really read.
    entries[os.path.realpath(weights)]["xxh3_128"] = "planted"
    (cache / CACHE_FILE).write_text(json.dumps(entries))
    assert weight_file_digests([weights], cache) == ["planted"]
    # Same size, mtime set back: ctime moved, so the entry is not trusted.
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(old, old))
    (second,) = weight_file_digests([weights], cache)
    assert second == hash_file(weights) and second not in ("planted", first)
