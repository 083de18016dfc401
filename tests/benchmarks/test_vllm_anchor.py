"""The vLLM anchor of bench_offline.py / bench_serve.py is fair: vLLM gets every core pagedkv gets
(none reserved) and its preloads, and a run whose vLLM log says otherwise reports no ratio."""

import json
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


def test_both_servers_get_one_step_budget_and_record_their_steps(tmp_path):
    import bench_serve

    venv_python = str(tmp_path / "venv" / "bin" / "python")
    commands = {kind: bench_serve.server_command(kind, tmp_path, "bfloat16", 8000, 64,
                                                 venv_python, str(tmp_path / "steps"))[0]
                for kind in ("pagedkv", "vllm")}
    for cmd in commands.values():
        at = cmd.index("--max-num-batched-tokens")
        assert cmd[at + 1] == str(bench_serve.MAX_NUM_BATCHED_TOKENS)
        assert cmd[cmd.index("--max-num-seqs") + 1] == "64"
    assert "--enable-logging-iteration-details" in commands["vllm"]
    assert commands["pagedkv"][commands["pagedkv"].index("--step-log") + 1] == str(
        tmp_path / "steps")
    plain = bench_serve.server_command("pagedkv", tmp_path, "bfloat16", 8000, 64, None)[0]
    assert "--step-log" not in plain


def test_the_serving_table_gives_the_ttft_ratio(capsys):
    import bench_serve

    def point(tput, tpot, ttft):
        return {"output_throughput": tput, "tpot_ms": {"mean": tpot}, "ttft_ms": {"mean": ttft}}

    figures = {("pagedkv", 16): [point(300, 10, 100), point(330, 11, 90)],
               ("vllm", 16): [point(200, 20, 400), point(220, 22, 300)]}
    bench_serve._table("bfloat16", ["pagedkv", "vllm"], [16], figures, [])
    out = capsys.readouterr().out
    assert "1.50x tok/s, 0.50x TPOT, 0.28x TTFT" in out  # medians of 1.5/1.5, .5/.5, .25/.3
    bench_serve._table("bfloat16", ["pagedkv", "vllm"], [16], figures, ["vLLM reserved CPUs [1]"])
    assert "no ratio: vLLM reserved CPUs [1]" in capsys.readouterr().out


def test_both_engines_steps_are_read_and_classed(tmp_path):
    import anchors_steps

    log = ("(APIServer pid=1) INFO 11-28 23:50:01 [loggers.py:199] Iteration(7): 8 context "
           "requests, 2048 context tokens, 0 generation requests, 0 generation tokens, "
           "iteration elapsed time: 250.50 ms, CPU KV cache usage: 3.1%\n"
           "(APIServer pid=1) INFO ... Iteration(8): 0 context requests, 0 context tokens, 16 "
           "generation requests, 16 generation tokens, iteration elapsed time: 9.25 ms, CPU KV "
           "cache usage: 3.2%\n")
    theirs = anchors_steps.vllm_steps(log)
    assert theirs == [anchors_steps.Step(2048, 0, 250.5), anchors_steps.Step(0, 16, 9.25)]
    path = tmp_path / "steps.jsonl"
    rows = [dict(prefill_tokens=256, decode_seqs=15, seconds=0.05, own_seconds=0.04),
            dict(prefill_tokens=0, decode_seqs=16, seconds=0.012, own_seconds=0.01),
            dict(prefill_tokens=0, decode_seqs=16, seconds=0.014, own_seconds=0.012)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours = anchors_steps.pagedkv_steps(path)
    assert [s.kind for s in ours] == ["prompt 1-256 tok", "decode b=2-16", "decode b=2-16"]
    table = anchors_steps.step_table(ours)
    assert list(table) == ["decode b=2-16", "prompt 1-256 tok"]
    assert table["decode b=2-16"][0] == 2 and abs(table["decode b=2-16"][1] - 11.0) < 1e-9
    assert anchors_steps.step_table(theirs)["prompt 2048+ tok"][0] == 1
    assert anchors_steps.pagedkv_steps(tmp_path / "missing.jsonl") == []
    assert anchors_steps.same_shapes(ours, [anchors_steps.Step(256, 15, 90.0),
                                            anchors_steps.Step(0, 15, 9.0)]) == 1
