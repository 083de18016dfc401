"""The engine core process's malloc (pagedkv.model.cpu_memory): tcmalloc preloaded where it
is installed, unless the user chose theirs; and which malloc a process runs, read from its
memory map."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core_client import core_env
from pagedkv.model.cpu_memory import find_tcmalloc, with_tcmalloc

LIB = "/opt/lib/libtcmalloc_minimal.so.4"


def test_tcmalloc_is_preloaded_unless_the_user_chose():
    assert with_tcmalloc({"PATH": "/bin"}, LIB) == {"PATH": "/bin", "LD_PRELOAD": LIB}
    assert with_tcmalloc({"LD_PRELOAD": "/x/libjemalloc.so"}, LIB)["LD_PRELOAD"] == \
        "/x/libjemalloc.so"
    assert "LD_PRELOAD" not in with_tcmalloc({"MALLOC_ARENA_MAX": "2"}, LIB)
    assert "LD_PRELOAD" not in with_tcmalloc({"PATH": "/bin"}, None)


def test_find_tcmalloc_takes_the_minimal_build_first(tmp_path):
    assert find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc_minimal.so.4")


def test_the_option_and_the_device_decide(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    found = find_tcmalloc()
    assert core_env(EngineArgs(model="m", device="cpu")).get("LD_PRELOAD") == found
    assert "LD_PRELOAD" not in core_env(EngineArgs(model="m", device="cpu", cpu_malloc="glibc"))
    assert "LD_PRELOAD" not in core_env(EngineArgs(model="m", device="cuda"))
    with pytest.raises(ValueError, match="cpu_malloc"):
        EngineArgs(model="m", cpu_malloc="jemalloc").validate()


def test_malloc_in_use_reads_the_process_map():
    library = find_tcmalloc()
    if library is None:
        pytest.skip("no tcmalloc installed (Debian: libtcmalloc-minimal4)")
    code = "from pagedkv.model.cpu_memory import malloc_in_use; print(malloc_in_use())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=with_tcmalloc({"PATH": "/usr/bin"}, library), timeout=60)
    assert out.stdout.strip() == "tcmalloc", out.stderr
