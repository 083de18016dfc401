"""Tensor parallelism across two hosts (network namespaces on a bridge, gloo over the veth):
the same tokens as one rank; the engine's start time; a host that drops off the network
(its link cut) fails the engine within its timeout with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv import LLM, SamplingParams
from tests.engine.conftest import make_prompts
from tests.net.conftest import REPO_ROOT, make_cluster, read_json_line

MAX_TOKENS = 8
TIMEOUT_S = 5.0
MASTER_PORT = 29511


@pytest.mark.timeout(150)
def test_tp2_across_two_hosts_matches_tp1_and_fails_on_a_dead_host(tiny_llama):
    prompt = make_prompts(seed=8, vocab=400, num=1)[0]
    one = LLM(model=str(tiny_llama), block_size=4, cpu_kernels="off", dtype="float32",
              kv_cache_memory_bytes=1 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tp1 = one.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    one.shutdown()
    with make_cluster(2) as cluster:
        node0, node1 = cluster[0], cluster[1]
        worker = cluster.popen(node1, [
            sys.executable, "-m", "pagedkv.cli", "serve", str(tiny_llama), "--node-rank", "1",
            "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", node0.addr,
            "--master-port", str(MASTER_PORT), "--cpu-kernels", "off", "--block-size", "4",
            "--dtype", "float32", "--distributed-timeout-s", str(TIMEOUT_S)],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engine = cluster.popen(node0, [
            sys.executable, "-m", "tests.net.tp_engine", str(tiny_llama), node0.addr,
            str(MASTER_PORT), str(TIMEOUT_S), json.dumps(prompt), str(MAX_TOKENS)],
            cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        up = read_json_line(engine.stdout)
        assert up is not None, f"engine exited {engine.wait(10)}"
        assert up["tokens"] == tp1.outputs[0].token_ids
        # The rendezvous and gloo's pairs are on the hosts' own addresses, nothing on loopback.
        assert any(a.startswith(node0.addr) for a in cluster.listeners(node0))
        print(f"\n2-host TP engine up in {up['up_s']:.2f} s")

        cluster.link_down(node1)  # the worker's host vanishes: no FIN, no RST, silence
        engine.stdin.write("go\n")
        engine.stdin.flush()
        failed = read_json_line(engine.stdout)
        assert failed is not None and failed["kind"] == "EngineFatalError", failed
        assert "tensor-parallel group failed" in failed["error"]
        assert failed["fail_s"] < TIMEOUT_S * 2 + 2  # the timeout, then one heartbeat
        print(f"dead host: the engine failed in {failed['fail_s']:.2f} s "
              f"(timeout {TIMEOUT_S} s): {failed['error']}")
        # It ends (shutdown after the failure); its exit code is not asserted: torch's c10d
        # threads, left with a peer that never answered, may abort the interpreter's exit.
        engine.wait(timeout=30)
        assert worker.wait(timeout=3 * TIMEOUT_S) != 0  # its rank lost rank 0 too
