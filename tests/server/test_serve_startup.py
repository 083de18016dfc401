"""`pagedkv serve` says what it is doing: the weight load while it loads, then a banner whose
every figure is the engine's own (checked against /kv_cache_info, /v1/models, the checkpoint
and the process tree); health checks and scrapes stay out of the INFO access log while real
requests are in it; the API answers to the model argument as given (vLLM), not to the
directory's basename; `--chat-template` is what /v1/chat/completions and /tokenize render.
A tensor-parallel node (`--node-rank 1`) says which ranks it runs and when they joined.

The server here is started with `--model DIR` (the alias) and `--port 0`: the banner's URL
must carry the port the kernel picked, the only place it is told."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from pagedkv.kv.sizes import format_size
from pagedkv.model.cpu_memory import find_tcmalloc
from pagedkv.model.tokenizer import Tokenizer
from tests.server.helpers import REPO_ROOT, STARTUP_TIMEOUT_S, descendants

BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS = 4, 256, 301  # 300 usable blocks, 64 per request
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
MESSAGES = [{"role": "user", "content": "Name a colour."}]
SCRAPES = ("/health", "/ping", "/metrics", "/kv_cache_info", "/version")


class StartedServer:
    """A `pagedkv serve` process at --log-level info, its log file and (once ready) its URL."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(model_dir),
               "--port", "0", "--log-level", "info", "--dtype", "float32",
               "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
               "--num-gpu-blocks-override", str(NUM_BLOCKS), "--chat-template", TEMPLATE,
               "--engine-core", "process"]  # the banner names the core process's pid
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_for(r"ready on (http://\S+)").group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for(self, pattern: str, timeout: float = STARTUP_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log())
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} not logged within {timeout} s:\n{self.log()}")

    def banner(self, label: str) -> str:
        """The text after `label: ` on its banner line."""
        return self._wait_for(rf"pagedkv\.server: {re.escape(label)}: (.*)").group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartedServer]:
    proc = StartedServer(tiny_llama, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield proc
    finally:
        code = proc.stop()
    assert code == 0, proc.log()[-3000:]
    assert "Traceback" not in proc.log()


def test_the_banner_carries_the_bound_url_and_the_model(server):
    port = int(server.url.rsplit(":", 1)[1])
    assert port > 0 and server.url == f"http://127.0.0.1:{port}"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    name = str(server.model_dir)
    assert server.banner("model") == f"{name}, served as {name!r}"
    assert server.banner("weights").endswith("float32 on cpu")


def test_the_banner_kv_cache_figures_are_the_engines(server):
    info = httpx.get(server.url + "/kv_cache_info", timeout=10).json()
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    blocks, block_bytes = info["num_gpu_blocks"], info["block_bytes"]
    assert blocks == NUM_BLOCKS and card["max_model_len"] == MAX_MODEL_LEN
    assert server.banner("KV cache") == (
        f"{blocks} blocks of {info['block_size']} tokens, {format_size(block_bytes)} each: "
        f"{format_size(blocks * block_bytes)} ({info['kv_cache_dtype']}); budget: "
        f"{info['kv_budget']}")
    assert info["kv_budget"] == "--num-gpu-blocks-override" and info["weights_bytes"] > 0
    per_request = math.ceil(card["max_model_len"] / info["block_size"])
    concurrency = float(server.banner(
        f"Maximum concurrency for {card['max_model_len']} tokens per request")[:-1])
    assert concurrency == pytest.approx((blocks - 1) / per_request, abs=0.005)


def test_the_banner_weights_are_the_checkpoints(server):
    with safe_open(str(server.model_dir / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # noqa: SIM118 (safe_open is not iterable)
        total = sum(f.get_tensor(k).numel() * 4 for k in names)  # float32 on load
    assert server.banner("weights") == f"{format_size(total)} float32 on cpu"


def test_the_banner_names_the_engine_core_and_the_kernels(server):
    """The core's pid and its malloc: tcmalloc preloaded where installed (cpu_malloc auto),
    read back from the core process's own memory map."""
    cores = descendants(server.proc.pid, "pagedkv.engine.core_proc")
    maps = Path(f"/proc/{cores[0]}/maps").read_text()
    malloc = "tcmalloc" if "libtcmalloc" in maps else "glibc"
    preload = os.environ.get("LD_PRELOAD")
    expected = "libtcmalloc" in preload if preload else find_tcmalloc() is not None
    assert malloc == ("tcmalloc" if expected else "glibc")
    assert server.banner("engine core") == f"pid {cores[0]}, malloc: {malloc}"
    assert len(cores) == 1
    kernels = server.banner("CPU kernels")
    assert re.fullmatch(r"fused C\+\+ kernels \((avx512_bf16|avx512|avx2) panels\)"
                        r"(; .*linears: .+)?|the "
                        r"pure-torch path (while the fused kernels build in the background|"
                        r"\(the fused kernels failed to build\))", kernels), kernels


def test_the_weight_load_is_logged_once_before_the_banner(server):
    log = server.log()
    ready = log.index("ready on")
    loading = re.findall(rf"loading weights from {re.escape(str(server.model_dir))}: "
                         r"[\d.]+ \w*B in 1 file", log)
    loaded = re.findall(r"weights loaded: [\d.]+ \w*B as float32 on cpu in [\d.]+ s", log)
    assert len(loading) == 1 and len(loaded) == 1, log
    assert log.index(loading[0]) < log.index(loaded[0]) < ready


def test_scrapes_are_not_info_lines_but_requests_are(server):
    for path in SCRAPES:
        assert httpx.get(server.url + path, timeout=30).status_code == 200, path
    body = {"model": str(server.model_dir), "prompt": "hello", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    # pagedkv's line format on uvicorn's lines too (time, level, logger).
    server._wait_for(r'\n\d{4}-\d\d-\d\d [\d:,]+ INFO uvicorn\.access: 127\.0\.0\.1:\d+ - '
                     r'"POST /v1/completions HTTP/1.1" 200', timeout=30)
    log = server.log()
    for path in SCRAPES:
        assert f'"GET {path} HTTP' not in log, path


def test_the_router_access_log_keeps_scrapes_out(tmp_path):
    """`pagedkv router --access-log`: its own health checks and scrapes are DEBUG lines too."""
    port, dead = _free_port(), _free_port()
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.cli", "router", "--backend",
             f"http://127.0.0.1:{dead}", "--port", str(port), "--access-log",
             "--log-level", "info"], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert router.poll() is None, log_path.read_text()
            try:
                httpx.get(url + "/metrics", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        for path in ("/health", "/metrics"):
            httpx.get(url + path, timeout=10)
        httpx.get(url + "/v1/models", timeout=30)  # a client's request (no backend: an error)
        while '"GET /v1/models HTTP/1.1"' not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=30)
    text = log_path.read_text()
    assert '"GET /health HTTP' not in text and '"GET /metrics HTTP' not in text, text


def test_the_api_answers_to_the_model_argument_as_given(server):
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == [str(server.model_dir)]
    for model, status in ((str(server.model_dir), 200), (server.model_dir.name, 404)):
        resp = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": model, "prompt": "hi", "max_tokens": 1})
        assert resp.status_code == status, resp.text


def test_chat_uses_the_chat_template_flag(server):
    tokenizer = Tokenizer.from_dir(server.model_dir)
    own = tokenizer.apply_chat_template(MESSAGES)
    tokenizer.use_chat_template(TEMPLATE)
    expected = tokenizer.apply_chat_template(MESSAGES)
    assert expected != own and "<<user>> Name a colour." in expected
    model = str(server.model_dir)
    ids = httpx.post(server.url + "/tokenize", timeout=30,
                     json={"model": model, "messages": MESSAGES}).json()["tokens"]
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_node_says_its_ranks_and_when_they_joined(tiny_llama):
    from pagedkv import LLM, SamplingParams

    port = _free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--cpu-kernels", "off", "--block-size", "4",
             "--distributed-timeout-s", "60", "--dtype", "float32"]
    node1 = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", str(tiny_llama),
                              "--node-rank", "1", "--log-level", "info", *flags], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        llm = LLM(str(tiny_llama), tensor_parallel_size=2, nnodes=2, master_port=port,
                  block_size=4, cpu_kernels="off", distributed_timeout_s=60.0,
                  dtype="float32", num_gpu_blocks_override=64, max_model_len=128)
        out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2
        llm.llm_engine.check_invariants()
        llm.shutdown()
        output, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert node1.returncode == 0, output
    lines = output.splitlines()
    said = [next((i for i, line in enumerate(lines) if text in line), None) for text in (
        f"node 1 of 2: starting tensor-parallel rank 1 of 2, joining node 0 at "
        f"tcp://127.0.0.1:{port}",
        f"rank 1 of 2 joined the group at tcp://127.0.0.1:{port}",
        "rank 1 of 2: loading weights from",
        "rank 1 of 2: weights loaded:",
        "rank 1 of 2: model loaded on cpu",
        "node 1 of 2: every rank ended (exit code 0)")]
    assert None not in said and said == sorted(said), output
    assert "Traceback" not in output
