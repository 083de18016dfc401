"""keep_freed_memory: an activation-sized block freed is kept by malloc for the next step, not
handed back to the kernel (and page-faulted in again)."""

from __future__ import annotations

import ctypes
import os

import pytest

from pagedkv.model import cpu_memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def test_freed_activation_memory_is_kept_for_reuse(monkeypatch):
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    if not cpu_memory.keep_freed_memory():
        pytest.skip("not glibc")
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc before 2.33")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    nbytes = 24 << 20  # a 2,048-token prefill's float32 gate/up projection is 23 MB
    ptr = libc.malloc(nbytes)
    ctypes.memset(ptr, 1, nbytes)
    libc.free(ptr)
    after = libc.mallinfo2()
    # Still the process's, free for the next allocation (glibc's defaults unmap a block this
    # size, or trim it off the heap's top).
    assert after.arena >= nbytes and after.fordblks >= nbytes


def test_user_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert cpu_memory.keep_freed_memory() is False
