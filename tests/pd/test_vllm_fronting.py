"""`pagedkv router --prefill P --decode D` in front of real vLLM instances in PD mode.

vLLM's CPU build has one KV connector that runs without a GPU or an RDMA library:
`ExampleConnector` (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py). Its
producer writes each prompt's KV, layer by layer, to safetensors files under
`shared_storage_path`, named by a hash of the prompt's tokens; its consumer finds them by the
same hash and loads them instead of computing the prompt. It answers no `kv_transfer_params`
(`request_finished` is the base class's: nothing), so the router's decode hop is the client's
request as vLLM's toy proxy sends it then (`kv_transfer_params` only when the producer gave
some), and the consumer finds the KV by the prompt itself.

Needs PAGEDKV_VLLM_PYTHON: a python with vLLM installed (never a dependency of pagedkv). Two
vLLM servers start (minutes on a busy 2-core machine), so this is skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedkv.testing import build_random_model_dir
from tests.router.helpers import RouterProcess, router_metric
from tests.server.helpers import ServerProcess

VLLM_PYTHON = os.environ.get("PAGEDKV_VLLM_PYTHON", "")
VLLM_STARTUP_S = 600.0  # import, model load and warm-up of vLLM's CPU build on a busy box
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only

pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).is_file()),
    reason="PAGEDKV_VLLM_PYTHON does not name a python with vLLM (the vLLM fronting test "
           "starts real vLLM servers)")


class VLLMServer(ServerProcess):
    """`python -m vllm.entrypoints.openai.api_server` with `kv_transfer_config`."""

    def __init__(self, model_dir: Path, transfer: dict, *args: str) -> None:
        super().__init__(model_dir, *args, model_name="m")
        self.transfer = transfer

    def command(self) -> list[str]:
        return [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(self.model_dir), "--served-model-name", "m", "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "float32", "--block-size",
                str(BLOCK_SIZE), "--max-model-len", "512", "--max-num-seqs", "4",
                "--enforce-eager", "--kv-transfer-config", json.dumps(self.transfer),
                *self.args]

    def start(self) -> VLLMServer:
        venv = Path(VLLM_PYTHON).parent.parent
        preload = [str(p) for p in sorted(venv.glob("lib/libiomp5.so"))[:1]]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": ":".join(preload)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env)
        deadline = time.monotonic() + VLLM_STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM not healthy after {VLLM_STARTUP_S:.0f} s:\n{self.output()}")


class PDRouter(RouterProcess):
    def command(self) -> list[str]:
        prefill, decode = self.backends
        return [sys.executable, "-m", "pagedkv.cli", "router", "--prefill", prefill,
                "--decode", decode, "--model",
                str(self.model_dir), "--port", str(self.port), "--log-level", "warning",
                *self.args]


def connector(role: str, storage: Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-pd")
    model_dir = build_random_model_dir(tmp / "model", hidden_size=256, intermediate_size=512,
                                       num_heads=4, num_kv_heads=2, seed=3)
    storage = tmp / "kv"
    # The consumer keeps no prefix cache: a prompt it has seen is loaded from the connector or
    # computed, never served from its own cache (the reference run below computes it).
    servers = [VLLMServer(model_dir, connector("kv_producer", storage)),
               VLLMServer(model_dir, connector("kv_consumer", storage),
                          "--no-enable-prefix-caching")]
    router = PDRouter(model_dir, [s.url for s in servers], "--pd-prefill-timeout", "300")
    try:
        for server in servers:
            server.start()
        router.start()
        yield {"producer": servers[0], "consumer": servers[1], "router": router,
               "storage": storage, "vocab": json.loads((model_dir / "config.json").read_text())
               ["vocab_size"]}
    finally:
        router.stop()
        for server in servers:
            server.stop()


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_vllm_split_behind_the_router_gives_one_vllm_instances_tokens(fleet):
    """The router runs the prefill on the vLLM producer (which writes the prompt's KV to the
    shared path) and the decode on the vLLM consumer (which loads it, as its log says); the
    tokens equal the consumer's own, computed from scratch once the KV files are gone."""
    prompt = [(13 * i + 7) % fleet["vocab"] for i in range(5 * BLOCK_SIZE + 9)]
    split = complete(fleet["router"].url, prompt)
    assert any(fleet["storage"].rglob("*.safetensors")), "the producer wrote no KV"
    assert "External Cache Hit" in fleet["consumer"].log_path.read_text(errors="replace")
    prefills = router_metric(fleet["router"].url, "pagedkv_router:pd_prefill_requests_total",
                             backend=fleet["producer"].url, outcome="no_params")
    assert prefills >= 1  # ExampleConnector answers no kv_transfer_params
    for path in sorted(fleet["storage"].rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    alone = complete(fleet["consumer"].url, prompt)
    assert split["choices"][0]["text"] == alone["choices"][0]["text"]
    tokens = split["choices"][0].get("token_ids")
    assert tokens is None or tokens == alone["choices"][0].get("token_ids")
    assert split["usage"]["completion_tokens"] == 8
