"""The fused CPU kernels' start-up lines: a build says it started (it takes about a minute)
and when it ended, once; `kernels_in_use` names what runs the CPU model's hot ops (the
server's banner line) in each state of the kernels."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagedkv.kernels import cpu


def test_a_build_is_announced_before_and_after(monkeypatch, caplog, tmp_path):
    built: list[Path] = []

    def fake_compile(out: Path) -> None:
        assert len(caplog.records) == 1  # the start line comes before the compiler runs
        built.append(out)

    monkeypatch.setattr(cpu, "_compile", fake_compile)
    target = tmp_path / "k" / "pagedkv_cpu_ops.so"
    with caplog.at_level(logging.INFO, logger=cpu.__name__):
        cpu._compile_logged(target)
    assert built == [target]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("building the fused CPU kernels") and "about a minute" in lines[0]
    assert lines[1].startswith("fused CPU kernels built in ") and str(target.parent) in lines[1]


@pytest.mark.parametrize("loaded, error, expected", [
    (False, None, "the pure-torch path while the fused kernels build in the background"),
    (False, RuntimeError("no compiler"), "the pure-torch path (the fused kernels failed to "
                                         "build)"),
])
def test_kernels_in_use_names_each_state(loaded, error, expected, monkeypatch):
    monkeypatch.setitem(cpu._state, "loaded", loaded)
    monkeypatch.setitem(cpu._state, "error", error)
    assert cpu.kernels_in_use("auto") == expected
    assert cpu.kernels_in_use("off") == "off: the pure-torch path"


def test_kernels_in_use_names_the_loaded_panel_path():
    if not cpu.ensure_cpu_kernels("auto"):
        pytest.skip("no fused kernels built on this machine")
    assert cpu.kernels_in_use("auto") == f"fused C++ kernels ({cpu.panel_isa()} panels)"
