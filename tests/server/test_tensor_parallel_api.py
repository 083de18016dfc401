"""`pagedkv serve --tensor-parallel-size 2` (CPU, gloo): the OpenAI API answers with
transformers' greedy tokens (plain and streamed), bad input is a 400, the blocks come back, and a worker rank that dies ends the server (exit code 1) instead
of leaving it hung."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from pagedkv.model.tokenizer import Tokenizer
from tests.engine.conftest import hf_greedy, make_prompts
from tests.server.helpers import ServerProcess, descendants, engine_flags, wait_for_idle_pool


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tensor_parallel_server_answers_and_dies_with_its_rank(tiny_llama):
    proc = ServerProcess(tiny_llama, *engine_flags(
        dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=256, seed=0,
        tensor_parallel_size=2, cpu_kernels="off", distributed_timeout_s=5.0)).start()
    try:
        prompt = make_prompts(seed=9, vocab=400, num=1, shared_prefix=0, lengths=(20, 20))[0]
        body = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                    ignore_eos=True)
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        expected = Tokenizer.from_dir(tiny_llama).decode(hf_greedy(tiny_llama, prompt, 8))
        assert r.json()["choices"][0]["text"] == expected
        with httpx.stream("POST", proc.url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as stream:
            events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
        bad = httpx.post(proc.url + "/v1/completions", json={**body, "max_tokens": -1},
                         timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert wait_for_idle_pool(proc.url)["pagedkv:kv_cache_usage_perc"] == 0  # blocks back
        # The spawned ranks (not the resource tracker), children of the server or, with the
        # engine core in its own process, of the core.
        workers = descendants(proc.proc.pid, "spawn_main")
        assert workers, "no worker rank process found"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        try:
            r = httpx.post(proc.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code >= 500
        except httpx.HTTPError:
            pass  # the server may already be gone
        deadline = time.monotonic() + 30
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.proc.returncode == 1, proc.output()
        assert "tensor-parallel group failed" in proc.output()
    finally:
        proc.stop()
