"""`--distributed-executor-backend ray` on a Ray cluster whose nodes live in namespace hosts
(head on host 0, where the engine runs rank 0; a worker node on host 1): TP = 2 over Ray gives
the tokens of TP = 1 with rank 1 on the other node (STRICT_SPREAD); every Ray listener is on a
namespace address, none in the machine's own namespace; a killed actor fails the engine
within the timeout with a clear error."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from tests.engine.conftest import make_prompts
from tests.net.conftest import REPO_ROOT, make_cluster, read_json_line

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

MAX_TOKENS = 8
TIMEOUT_S = 10.0
GCS_PORT = 6380
RAY_PROCESSES = re.compile(r"raylet|gcs_server|ray::|plasma|dashboard|runtime_env|log_monitor")


def ray_start(cluster, host, *flags: str) -> None:
    ray_cli = str(Path(sys.executable).parent / "ray")
    cluster.run(host, [ray_cli, "start", "--node-ip-address", host.addr, "--num-cpus", "1",
                       "--object-store-memory", str(80 * 1024 * 1024),
                       "--disable-usage-stats", *flags], timeout=120)


def host_addresses(cluster, host) -> set[str]:
    """The IPv4 addresses of `host`'s interfaces."""
    out = cluster.run(host, ["ip", "-4", "-o", "addr", "show"])
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


def root_ray_listeners() -> list[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if RAY_PROCESSES.search(line)]


def ray_worker_pids(cluster, host) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True,
                          text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "_RankActor" in title:
            found.append(int(pid))
    return found


@pytest.mark.timeout(240)
def test_tp2_over_ray_across_two_hosts(tiny_llama):
    prompt = make_prompts(seed=9, vocab=400, num=1)[0]
    one = LLM(model=str(tiny_llama), block_size=4, cpu_kernels="off", dtype="float32",
              kv_cache_memory_bytes=1 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tp1 = one.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    one.shutdown()
    root_before = root_ray_listeners()
    temp_dir = tempfile.mkdtemp(prefix="pkvray-", dir="/tmp")
    try:
        with make_cluster(2) as cluster:
            head, worker = cluster.hosts
            address = f"{head.addr}:{GCS_PORT}"
            ray_start(cluster, head, "--head", "--port", str(GCS_PORT), "--temp-dir", temp_dir,
                      "--include-dashboard=false")
            ray_start(cluster, worker, "--address", address)
            engine = cluster.popen(head, [
                sys.executable, "-m", "tests.net.tp_engine", str(tiny_llama), head.addr, "0",
                str(TIMEOUT_S), json.dumps(prompt), str(MAX_TOKENS), "ray"],
                cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={"RAY_ADDRESS": address})
            up = read_json_line(engine.stdout)
            assert up is not None, f"engine exited {engine.wait(10)}"
            assert up["tokens"] == tp1.outputs[0].token_ids
            assert up["nodes"] == [head.addr, worker.addr]  # STRICT_SPREAD: a node per rank
            print(f"\nTP=2 over Ray up in {up['up_s']:.2f} s")

            # Ray listens on its node address and on wildcards (the GCS on *:PORT): inside a
            # host, whose only addresses are its own and loopback, both are namespace-only.
            assert any(a.endswith(f":{GCS_PORT}") for a in cluster.listeners(head))
            for host in cluster.hosts:
                assert host_addresses(cluster, host) == {"127.0.0.1", host.addr}
                for addr in cluster.listeners(host):
                    assert addr.rsplit(":", 1)[0] in (host.addr, "127.0.0.1", "0.0.0.0", "*",
                                                      "[::]", "[::1]"), (host.ns, addr)
            assert root_ray_listeners() == root_before

            victims = ray_worker_pids(cluster, worker)
            assert len(victims) == 1, victims
            subprocess.run(["kill", "-9", str(victims[0])], check=True)
            engine.stdin.write("go\n")
            engine.stdin.flush()
            failed = read_json_line(engine.stdout)
            assert failed is not None and failed["kind"] == "EngineFatalError", failed
            assert "tensor-parallel group failed" in failed["error"]
            assert failed["fail_s"] < TIMEOUT_S + 2
            print(f"killed actor: the engine failed in {failed['fail_s']:.2f} s: "
                  f"{failed['error']}")
            assert engine.wait(timeout=30) == 0
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
