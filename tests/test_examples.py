"""The scripts under examples/ run: the cheap ones end to end, every one compiles."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(script: str, *args: str, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env,
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_compiles(script, tmp_path):
    py_compile.compile(str(EXAMPLES / script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_the_sample_trace_is_what_make_trace_writes():
    written = _run("make_trace.py", timeout=60)
    assert written == (EXAMPLES / "traces" / "sample_mooncake.jsonl").read_text()


def test_offline_batch_on_a_random_model_hits_the_shared_system_prompt():
    out = _run("offline_batch.py", "--model", "random", "--max-tokens", "4", timeout=300)
    cached = [(int(a), int(b)) for a, b in re.findall(r"\((\d+) of (\d+) prompt tokens cached\)", out)]
    assert len(cached) == 6
    # the system prompt is full blocks of every prompt, computed once by the warm-up request
    assert all(0 < hit < total for hit, total in cached)
    assert "6 requests, 24 tokens" in out


def test_simulate_trace_runs_the_sample():
    out = _run("simulate_trace.py", timeout=300)
    assert "200/200 finished" in out
    assert re.search(r"fewest instances meeting .* for 90% of requests: \d+", out)
