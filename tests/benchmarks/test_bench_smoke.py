"""The benchmarks still run (tiny sizes); their figures are not checked here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kv_runs_and_reports_every_operation():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kv.py"),
                           "--num-requests", "8", "--reps", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["checks"]["failed"] == 0
    # 8 requests share a 512-token prefix: all but the first hit its 32 blocks.
    assert report["checks"]["hit_tokens"] == 7 * 512
    assert set(report["pagedkv"]) == {"hash", "lookup", "prefill", "decode", "free"}


def test_bench_offload_runs_every_tier_with_the_same_tokens():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"),
                           "--prefixes", "3", "--prefix-len", "64", "--rounds", "2",
                           "--device-blocks", "7", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    runs = report["runs"]
    assert set(runs) == {"none", "host", "disk", "redis"}
    assert runs["none"]["prompt_tokens_computed"] == runs["none"]["prompt_tokens"] == 6 * 80
    for name in ("host", "disk", "redis"):
        assert runs[name]["same_tokens_as_none"]
        # Round 2 computes only each prompt's 16-token suffix.
        assert runs[name]["prompt_tokens_computed"] == 3 * 80 + 3 * 16
    assert report["warm_restart"]["prompt_tokens_computed"] == 3 * 16


def test_bench_structured_runs_with_equal_work():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_structured.py"),
                           "--requests", "4", "--tokens", "8", "--reps", "1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["structured_tokens"] == report["baseline_tokens"] > 0
    assert report["ratio_structured_over_baseline"] > 0


def test_bench_kv_quant_runs_and_fp8_quadruples_the_blocks():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kv_quant.py"),
                           "--skip-real", "--prompts", "1", "--prompt-len", "16",
                           "--decode-len", "4", "--num-requests", "2", "--max-output", "8",
                           "--kv-memory", "10MiB",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    tiny = report["accuracy"]["tiny-llama-float32"]
    assert set(tiny) == {"fp8_e4m3", "fp8_e5m2"}
    assert all(0 < r["max_abs_logit_error"] < r["logit_range"] for r in tiny.values())
    runs = report["throughput"]["runs"]
    assert runs["fp8"]["num_blocks"] == 4 * runs["auto"]["num_blocks"] == 4 * 40  # float32 model
    assert runs["fp8"]["output_tokens"] == runs["auto"]["output_tokens"]
