"""The fused kernels' build cache: keyed by what changes the binary (never by a path), one folder
for a test run and the processes it starts, one build per key however many processes ask at
once, and no build at all for the pure-Python tests."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.kernels import cpu

ROOT = Path(__file__).resolve().parents[2]

# A stand-in compiler: each object is an empty file; each link counts as a build, takes a second
# and "builds" by copying the real library.
FAKE_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-c++ 1.0"; exit 0; fi
case " $* " in *" -c "*) object=1;; *) object=0;; esac
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
if [ $object = 1 ]; then : > "$out"; exit 0; fi
echo build >> "{count}"
sleep 1
cp "{library}" "$out"
"""

# A stand-in compiler that writes each command line (one argument a line) to a file of its own
# in a log folder (several run at once) and makes empty outputs.
LOGGING_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-c++ 1.0"; exit 0; fi
for arg in "$@"; do echo "$arg"; done > "{log}/$$"
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
: > "$out"
"""

LOAD = """
from pagedkv.kernels import cpu
print("LOADED", cpu.ensure_cpu_kernels("wait"), cpu.library_path())
"""


def test_the_key_names_no_path(monkeypatch, tmp_path):
    """The same torch and Python reached through another path (a symlinked checkout or venv)
    keep the key, so nothing rebuilds."""
    key = cpu.build_key()
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "elsewhere" / "torch" / "__init__.py"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    assert cpu.build_key() == key


def test_the_key_follows_what_changes_the_binary(monkeypatch, tmp_path):
    with pytest.MonkeyPatch.context() as native:  # the native build's key (`make test-isa`)
        native.delenv("PAGEDKV_CPU_ISA", raising=False)
        key = cpu.build_key()
        monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx2")  # other flags
        assert cpu.build_key() != key
        monkeypatch.delenv("PAGEDKV_CPU_ISA")
        csrc = tmp_path / "csrc"
        shutil.copytree(cpu.CSRC, csrc)
        (csrc / "simd.h").write_bytes((cpu.CSRC / "simd.h").read_bytes() + b"\n// edited\n")
        monkeypatch.setattr(cpu, "CSRC", csrc)  # another header
        assert cpu.build_key() != key
        monkeypatch.undo()
        monkeypatch.setattr(torch, "__version__", "0.0.1")  # another torch
        assert cpu.build_key() != key
        monkeypatch.undo()
        monkeypatch.setattr(cpu, "_compiler_identity", lambda cxx: "c++ (Other) 99.1")
        assert cpu.build_key() != key  # another compiler release
        monkeypatch.undo()
        assert cpu.build_key() == key


@pytest.mark.parametrize("edit", ["common.h", "kv_formats.h", "decode_attention.cpp",
                                  "bindings.cpp", "+extra.h", "-norm_rope_act.cpp"])
def test_an_edit_to_any_source_or_header_rebuilds(monkeypatch, tmp_path, edit):
    """The key covers every file of csrc/ by content: the same files elsewhere keep it; a byte
    more in any source or header, a file added or a file removed give another."""
    key = cpu.build_key()
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu.CSRC, csrc)
    monkeypatch.setattr(cpu, "CSRC", csrc)
    assert cpu.build_key() == key
    if edit.startswith("+"):
        (csrc / edit[1:]).write_text("#pragma once\n")
    elif edit.startswith("-"):
        (csrc / edit[1:]).unlink()
    else:
        (csrc / edit).write_bytes((csrc / edit).read_bytes() + b"\n")
    assert cpu.build_key() != key


def test_every_source_is_compiled_once_as_one_unit_with_the_builds_flags(monkeypatch, tmp_path):
    """One compiler run, with this build's flags (cxxflags: the ISA's), over one translation unit
    that includes every .cpp of csrc/ once; nothing but the library is left behind."""
    log, cxx = tmp_path / "commands", tmp_path / "fake-cxx"
    log.mkdir()
    keep = 'for a in "$@"; do case "$a" in *.cpp) cp "$a" "{seen}";; esac; done\n'
    shebang, logging = LOGGING_CXX.format(log=log).split("\n", 1)
    cxx.write_text(f"{shebang}\n{keep.format(seen=tmp_path / 'unity.cpp')}{logging}")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx2")
    out = tmp_path / "lib" / "pagedkv_cpu_ops.so"
    cpu._compile(out)
    (command,) = [c.read_text().splitlines() for c in log.iterdir()]
    assert command[:len(cpu.cxxflags())] == cpu.cxxflags() and "-mno-avx512f" in command
    sources = sorted(cpu.CSRC.glob("*.cpp"))
    assert len(sources) >= 6
    unity = (tmp_path / "unity.cpp").read_text().splitlines()
    assert unity == [f'#include "{p}"' for p in sources]
    assert out.exists() and list(out.parent.iterdir()) == [out]  # no unity file left behind


def test_the_package_data_ships_every_kernel_file():
    """An installed wheel builds its kernels from csrc/: pyproject's package data matches every
    source and header there."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["pagedkv"]
    files = [p.relative_to(ROOT / "pagedkv").as_posix() for p in cpu.CSRC.iterdir()]
    assert len(files) >= 10
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []


def test_the_cache_folder_is_chosen_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDKV_KERNEL_CACHE_DIR")
    monkeypatch.delenv("PAGEDKV_CACHE_DIR", raising=False)
    assert cpu.kernel_cache_dir() == Path.home() / ".cache" / "pagedkv" / "kernels"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "c"))
    assert cpu.kernel_cache_dir() == tmp_path / "c" / "kernels"
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE_DIR", str(tmp_path / "k"))
    assert cpu.kernel_cache_dir() == tmp_path / "k"
    assert cpu.library_path().parent.parent == tmp_path / "k"


def test_processes_started_by_tests_share_this_runs_build():
    """A child engine or server (inheriting the environment) loads the library this process
    loaded, even though the tests point PAGEDKV_CACHE_DIR (weight digests) at a temp folder."""
    assert cpu.cpu_kernels_loaded()
    assert not cpu.library_path().is_relative_to(os.environ["PAGEDKV_CACHE_DIR"])
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["LOADED", "True", str(cpu.library_path())]


def test_processes_building_at_once_build_once(tmp_path):
    """Three processes wanting a library that is not built: one compiles (holding the key's
    lock), the others wait for it and load its library."""
    count, cxx = tmp_path / "builds", tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX.format(count=count, library=cpu.library_path()))
    cxx.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CXX": str(cxx),
           "PAGEDKV_KERNEL_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.split()[2] for out, _ in outs}
    assert [out.split()[:2] for out, _ in outs] == [["LOADED", "True"]] * 3
    assert len(paths) == 1 and Path(paths.pop()).is_relative_to(tmp_path / "cache")
    assert count.read_text().splitlines() == ["build"]


@pytest.mark.parametrize("test_file", ["tests/kv/test_hashing.py"])
def test_pure_python_tests_build_no_kernels(tmp_path, test_file):
    """With an empty kernel cache and no working compiler, the KV memory system's tests still
    pass: nothing in them waits for (or tries) a build."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CXX": "false",
           "PAGEDKV_KERNEL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", test_file], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
    assert not (tmp_path / "cache").exists()  # no build was even tried


class _Item:
    """What start_kernel_builds reads of a collected test: its runs_model marker, its module."""

    def __init__(self, runs_model: bool, module: object) -> None:
        self.module, self._runs_model = module, runs_model

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "runs_model" and self._runs_model else None


@pytest.mark.parametrize("worker, models, isa_module, avx2_builds", [
    ("gw0", True, True, 1),  # the first worker starts the AVX2 build beside the native one
    ("gw1", True, True, 0),  # the other only the native one (it waits on its lock)
    ("gw0", True, False, 0),  # no module checks the AVX2 build
    ("gw0", False, True, None),  # pure-Python tests: nothing starts
])
def test_the_builds_the_selected_tests_need_start_when_collection_ends(
        monkeypatch, tmp_path, worker, models, isa_module, avx2_builds):
    import tests.conftest as conftest

    started, native = [], []
    monkeypatch.setattr(conftest.subprocess, "Popen", lambda cmd, env, **_: started.append(env))
    monkeypatch.setattr(conftest, "ensure_cpu_kernels", native.append)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    module = type(sys)("isa_checks")
    if isa_module:
        module.run_with_isa = object()
    monkeypatch.setattr(conftest, "_prebuilds", [])  # the session's own, left as it is
    conftest.start_kernel_builds([_Item(False, type(sys)("pure")), _Item(models, module)])
    assert native == ([] if avx2_builds is None else ["auto"])
    assert [env["PAGEDKV_CPU_ISA"] for env in started] == ["avx2"] * (avx2_builds or 0)
