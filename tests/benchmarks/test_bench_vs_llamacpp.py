"""benchmarks/bench_vs_llamacpp.py's llama.cpp side without llama.cpp: the server's command line
and the fallback to unpacked weights, on stand-in tools (shell scripts); the bench part's
rounds on stand-in measures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vs_llamacpp as bench  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_repack_state():
    bench.repack_off.clear()
    yield
    bench.repack_off.clear()


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_llama_server_gets_a_slot_and_its_context_per_request(tmp_path):
    cmd = bench.llama_server_command(tmp_path, Path("m.gguf"), 8080, threads=3, slots=64)
    flags = {flag: cmd[cmd.index(flag) + 1] for flag in ("-np", "-c", "-t", "-tb")}
    assert flags["-np"] == "64" and flags["-c"] == str(64 * bench.SLOT_CTX)
    assert flags["-t"] == flags["-tb"] == "3"
    assert "-cb" in cmd and "--no-repack" not in cmd
    bench.repack_off.add("llama-server")
    assert bench.llama_server_command(tmp_path, Path("m.gguf"), 8080, 3, 16)[-1] == "--no-repack"


def test_a_tool_that_dies_by_a_signal_reruns_without_repacking_alone(tmp_path):
    # Dies by SIGSEGV unless told not to repack; prints its arguments when it lives.
    _tool(tmp_path, "llama-perplexity",
          'case "$*" in *--no-repack*) echo "$@";; *) kill -SEGV $$;; esac')
    out = bench.run_llama(tmp_path, "llama-perplexity", ["-m", "x.gguf"])
    assert out.stdout.split() == ["-m", "x.gguf", "--no-repack"]
    assert bench.repack_off == {"llama-perplexity"}  # llama-bench, llama-server keep repacking
    assert bench.run_llama(tmp_path, "llama-perplexity", ["-c", "8"]).stdout.split()[-1] == \
        "--no-repack"


def test_a_tool_that_fails_plainly_is_not_rerun(tmp_path):
    _tool(tmp_path, "llama-bench", "exit 3")
    with pytest.raises(Exception, match="exit status 3"):
        bench.run_llama(tmp_path, "llama-bench", [])
    assert not bench.repack_off


def test_a_build_without_the_tools_asked_for_names_them(tmp_path):
    (tmp_path / "bin").mkdir()
    _tool(tmp_path / "bin", "llama-bench", "true")
    assert bench.llama_cpp_bin(tmp_path, ("llama-bench",)) == tmp_path / "bin"
    with pytest.raises(SystemExit, match="has no llama-server, llama-perplexity"):
        bench.llama_cpp_bin(tmp_path, ("llama-bench", "llama-server", "llama-perplexity"))


def test_bench_rounds_alternate_the_engines_and_take_the_median(monkeypatch, capsys):
    """`--bench-rounds`: llama.cpp first in even rounds, last in odd ones; each mode's ratios
    per round, then their median and range (stand-in measures: tg128 ratios 1.0, 2.0, 4.0)."""
    calls: list[str] = []
    tg = iter([100.0, 200.0, 400.0])

    def llama_bench(bin_dir, model, threads, reps, depth=0):
        calls.append("llama.cpp")
        return {"pp512": 1000.0, "tg128": 100.0}

    def pagedkv_bench(model, mode, threads, reps, depth=0):
        calls.append(mode)
        return {"pp512": 3000.0, "tg128": next(tg), "step_bytes": 2**20}

    monkeypatch.setattr(bench, "llama_bench", llama_bench)
    monkeypatch.setattr(bench, "pagedkv_bench", pagedkv_bench)
    bench.bench_part(Path("bin"), Path("m.gguf"), ["packed"], threads=2, reps=1, floor=400.0,
                     weight_bytes=2**20, rounds=3)
    assert calls == ["llama.cpp", "packed", "packed", "llama.cpp", "llama.cpp", "packed"]
    out = capsys.readouterr().out
    assert "round 1 pagedkv packed" in out and "tg128 2.00x" in out
    assert "median over 3 rounds (range): pp512 3.00x (3.00-3.00), tg128 2.00x (1.00-4.00)" in out
