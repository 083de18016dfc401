"""Builds, caches and loads the fused CPU kernels of csrc/ as `torch.ops.pagedkv_cpu.*`.

The kernels (the panel-packed linear, RMSNorm with the residual add, SiLU-and-mul, in-place RoPE,
the KV writes, paged decode and prefill attention) are C++ against torch's headers, one file per
op family in csrc/ beside the headers they share and one file of bindings (as vLLM's csrc/cpu/).
They are compiled here with the system's C++ compiler (`c++`, or $CXX) for the CPU it runs on
(-march=native) as one translation unit that includes every .cpp (so the hot helpers of the
headers inline across families as they would in one file, and torch's headers are parsed once:
a compiler process per file cost 55% more CPU and left `attend_row` uninlined at 17 call
sites, 0-8% slower shared-block decode), into one library, cached under
`kernel_cache_dir()`/<key>/ ($PAGEDKV_KERNEL_CACHE_DIR, else $PAGEDKV_CACHE_DIR/kernels, else
~/.cache/pagedkv/kernels), where the key hashes what changes the binary: every source and header
(names and bytes), the compiler and its version, the flags, torch's version and C++ ABI, Python's
ABI and the CPU's feature flags, never a path (the same install reached through a symlink reuses
its build). One process builds a key at a time (a file lock beside it); the others wait and load
its library. A build takes about a minute on two cores; a cached one loads in milliseconds.

Modes (the engine's `cpu_kernels` argument):
- "auto" (default): load a cached build at once; with none, build in a background thread and
  keep running the pure-torch reference path until the build is loaded, so no start waits on
  the compiler; a build that fails (no compiler) logs one warning and leaves the reference path.
- "wait": build now (blocking) and fail loudly if the build fails (benchmarks, tests).
- "off": never build or load; the pure-torch path (the reference the tests compare with).

The loaded library is one per process (an operator namespace registers once), shared by every
engine in it; nothing else here is process-wide state.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch

from pagedkv.kernels.modes import CPU_KERNEL_MODES

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++20",
            "-fno-math-errno", "-fno-trapping-math", "-DNDEBUG"]
# PAGEDKV_CPU_ISA=avx2: build without AVX-512 even where the CPU has it (the code a Zen 3 runs;
# how the tests cover both vector paths of the quantized-cache decode on one machine).
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}


def cxxflags() -> list[str]:
    """The compiler flags of this process's build: CXXFLAGS plus PAGEDKV_CPU_ISA's (default
    "native"). Raises ValueError naming an unknown PAGEDKV_CPU_ISA."""
    isa = os.environ.get("PAGEDKV_CPU_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"PAGEDKV_CPU_ISA must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    return [*CXXFLAGS, *ISA_FLAGS[isa]]

_lock = threading.Lock()
_state = {"loaded": False, "error": None, "thread": None}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compiler() -> str:
    """The C++ compiler the build runs: $CXX, else `c++`."""
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_identity(cxx: str) -> str:
    """`cxx --version`'s output (which compiler, which release); empty where it does not run
    (the build then fails and says why)."""
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def kernel_sources() -> list[Path]:
    """The C++ files compiled into the library (csrc/*.cpp), in name order."""
    return sorted(CSRC.glob("*.cpp"))


def unity_source(sources: list[Path]) -> str:
    """The one translation unit the compiler sees: an #include of each source, in order."""
    return "".join(f'#include "{source}"\n' for source in sources)


def _source_digest() -> bytes:
    """Every file of csrc/ (sources and headers), name and bytes, in name order: an edit to any
    of them, or a file added or removed, gives another key."""
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.digest()


def build_key() -> str:
    """What a cached build is valid for: everything that changes the binary (the sources and
    headers, the compiler and its version, the flags, torch's version and C++ ABI, Python's ABI,
    the CPU's features) and nothing that names a place (install paths, the checkout): the loaded
    library finds torch's libraries already in the process."""
    cxx = compiler()
    parts = (_source_digest(), cxx, _compiler_identity(cxx), " ".join(cxxflags()),
             torch.__version__, str(torch.version.git_version),
             str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
             sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag, _cpu_flags())
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def kernel_cache_dir() -> Path:
    """The folder of cached builds, one subfolder per build key: $PAGEDKV_KERNEL_CACHE_DIR, else
    $PAGEDKV_CACHE_DIR/kernels, else ~/.cache/pagedkv/kernels."""
    if os.environ.get("PAGEDKV_KERNEL_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_KERNEL_CACHE_DIR"])
    root = Path(os.environ.get("PAGEDKV_CACHE_DIR") or Path.home() / ".cache" / "pagedkv")
    return root / "kernels"


def library_path() -> Path:
    """This process's build of the kernels (which may not exist yet)."""
    return kernel_cache_dir() / build_key() / "pagedkv_cpu_ops.so"


def _compile(out: Path) -> None:
    """Compile kernel_sources(), as one translation unit (unity_source), into `out` (written to a
    temporary name, then renamed: a crash mid-build never leaves a library that loads
    half-written)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*cxxflags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    fd, unity = tempfile.mkstemp(suffix=".cpp", prefix="unity-", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        f.write(unity_source(kernel_sources()))
    command = [compiler(), *flags, *(f"-I{p}" for p in include_paths()), f"-I{CSRC}", unity,
               "-o", tmp]
    for lib_dir in library_paths():
        command += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    command += ["-lc10", "-ltorch_cpu"]
    # One shell script compiles and renames: a build outliving this process (a short run that
    # exits while its background build goes on) still installs its library for the next one.
    script = (f"{shlex.join(command)} && mv -f {shlex.quote(tmp)} {shlex.quote(str(out))}; "
              f"status=$?; rm -f {shlex.quote(unity)}; exit $status")
    try:
        proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the kernels of {CSRC} failed:\n{proc.stderr[-4000:]}")
    finally:
        for path in (tmp, unity):
            if os.path.exists(path):
                os.unlink(path)


def _build_and_load() -> None:
    path = library_path()
    built = False
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.parent / ".lock", "w") as lock:  # one builder per machine at a time
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.exists():
                    _compile_logged(path)
                    built = True
        with _lock:
            if not _state["loaded"]:
                torch.ops.load_library(str(path))
                _state["loaded"] = True
                if built:
                    logger.info("fused CPU kernels loaded (%s); the model uses them from its "
                                "next step", panel_isa())
    except Exception as e:  # no compiler, a broken toolchain: stay on the reference path
        _state["error"] = e
        logger.warning("fused CPU kernels unavailable, using the pure-torch path: %s", e)


def _compile_logged(path: Path) -> None:
    """`_compile(path)`, saying so before and after (a build takes about a CPU-minute)."""
    logger.info("building the fused CPU kernels (first run with this source, torch and CPU; "
                "about a minute)...")
    started = time.perf_counter()
    _compile(path)
    logger.info("fused CPU kernels built in %.0f s into %s", time.perf_counter() - started,
                path.parent)


def ensure_cpu_kernels(mode: str = "auto") -> bool:
    """Load (building if needed) the fused CPU kernels per `mode` (see the module docstring).
    Returns whether they are loaded now. Raises ValueError for an unknown mode, and
    RuntimeError in "wait" mode when the build fails."""
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_MODES}, got {mode!r}")
    if mode == "off" or _state["loaded"]:
        return _state["loaded"]
    if mode == "wait":
        thread = _state["thread"]
        if thread is not None:
            thread.join()
        if not _state["loaded"]:
            _state["error"] = None
            _build_and_load()
        if not _state["loaded"]:
            raise RuntimeError(f"fused CPU kernels could not be built: {_state['error']}")
        return True
    if library_path().exists():
        _build_and_load()
        return _state["loaded"]
    with _lock:
        if _state["thread"] is None and _state["error"] is None:
            _state["thread"] = threading.Thread(target=_build_and_load, daemon=True,
                                                name="pagedkv-cpu-kernel-build")
            _state["thread"].start()
    return False


# The instruction-set rule, now only PAGEDKV_KERNEL_CHOICE=isa's (the default measures each
# shape: kernels/choice.py; on an AMX Xeon oneDNN wins from about 9 rows, on a Zen 4 the panels
# win): the panel paths (`panel_isa()`) taken for bfloat16 where oneDNN has native bfloat16. Elsewhere (an AVX2 or plain AVX-512 build: bfloat16 widened to
# float32) oneDNN keeps bfloat16 weights where it has native bfloat16 (never measured against
# the panels there); without native bfloat16 in oneDNN the panels take every dtype.
PANELS_BEAT_ONEDNN_BF16 = ("avx512_bf16",)


def panel_isa() -> str | None:
    """The loaded build's panel_linear path ("avx512_bf16", "avx512" or "avx2"; None before the
    kernels load)."""
    return str(torch.ops.pagedkv_cpu.panel_isa()) if _state["loaded"] else None


def cpu_kernels_loaded() -> bool:
    """Whether `torch.ops.pagedkv_cpu` is usable in this process (cheap; read every step)."""
    return _state["loaded"]


def kernels_in_use(mode: str) -> str:
    """What runs a CPU model's hot ops now, in words, for the kernels' `mode` (a start-up
    banner's line)."""
    if mode == "off":
        return "off: the pure-torch path"
    if _state["loaded"]:
        return f"fused C++ kernels ({panel_isa()} panels)"
    if _state["error"] is not None:
        return "the pure-torch path (the fused kernels failed to build)"
    return "the pure-torch path while the fused kernels build in the background"
