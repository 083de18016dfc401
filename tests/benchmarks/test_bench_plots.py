"""`--plot PATH` writes a PNG (matplotlib), and bench_dashboard runs (issue 23); figures are not
checked here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_eviction_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the dev extra)")
    out = tmp_path / "eviction.png"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_eviction.py"),
                           "--requests", "200", "--repeats", "1", "--plot", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 5000


@pytest.mark.timeout(300)
def test_bench_dashboard_runs_both_ways_and_prints_the_ratio(tmp_path, tiny_llama):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the dev extra)")
    out = tmp_path / "dashboard.png"
    model = ["--model", str(tiny_llama)]  # the session's tiny model, not a random one to build
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_dashboard.py"),
                           "--runs", "1", "--prompts", "8", "--max-tokens", "4", *model,
                           "--plot", str(out)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "throughput with a dashboard connected / without: median" in proc.stdout
    assert out.read_bytes()[:8] == PNG
    # The feed as utility calls across the engine core process.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_dashboard.py"),
                           "--runs", "1", "--prompts", "8", "--max-tokens", "4", "--engine-only",
                           "--engine-core", "process", *model], capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "engine core: process" in proc.stdout and "feed share of the engine thread" in \
        proc.stdout
