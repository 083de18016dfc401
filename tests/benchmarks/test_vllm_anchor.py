"""The vLLM anchor of bench_offline.py / bench_serve.py is fair: vLLM gets every core pagedkv gets
(none reserved) and its preloads, and a run whose vLLM log says otherwise reports no ratio."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_offline  # noqa: E402

FAIR_LOG = "INFO cpu_worker.py: auto thread-binding: core ids=[0, 1], reserved_cpus=[]\n"


def test_vllm_gets_every_core_none_reserved_and_its_preloads(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env = bench_offline.vllm_env(str(venv / "bin" / "python"), None, kv_gib=3)
    cpus = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cpus))
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert str(venv / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert bench_offline.vllm_env(str(venv / "bin" / "python"), 1)[
        "VLLM_CPU_OMP_THREADS_BIND"] == str(cpus[0])
    settings = bench_offline.engine_settings(env, None)
    assert f"pagedkv: {len(cpus)} threads" in settings
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in settings and "libiomp5.so" in settings


def test_a_log_that_shows_a_reserved_core_or_a_missing_preload_is_unfair():
    assert bench_offline.vllm_settings_problems(FAIR_LOG, 2) == []
    unfair = ("INFO auto thread-binding: core ids=[0], reserved_cpus=[1]\n"
              "WARNING libtcmalloc is not found in LD_PRELOAD. For best performance, ...\n")
    problems = bench_offline.vllm_settings_problems(unfair, 2)
    assert len(problems) == 3
    assert "reserved CPUs [1]" in problems[0] and "cores [0] of 2" in problems[1]
    assert "LD_PRELOAD" in problems[2]


def test_no_ratio_is_reported_for_an_unfair_run(capsys):
    results = {side: [dict(tokens_per_s=100.0 * (1 + i), tokens=[[1, 2]]) for i in range(2)]
               for side in ("pagedkv", "vllm")}
    row = bench_offline._vs_row("bfloat16", "mixed", results, "vllm", ["vLLM reserved CPUs [1]"])
    assert row["ratio"] is None and row["problems"] == ["vLLM reserved CPUs [1]"]
    assert "no ratio: vLLM reserved CPUs [1]" in capsys.readouterr().out
    assert bench_offline._vs_row("bfloat16", "mixed", results, "vllm", [])["ratio"] == 1.0
