"""`bench_kv_quant.py --kl --real-model PATH`: the KL table over windows of a text, with the
given model's tokenizer (here the random model's, on a short text: the real model's figures are
the README's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.testing.random_model import build_random_model_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kv_kl import text_windows  # noqa: E402


def test_text_windows_spread_from_the_start_to_the_end():
    tokens = list(range(100))
    assert text_windows(tokens, 1, 30) == [tokens[:30]]
    assert text_windows(tokens, 3, 30) == [tokens[:30], tokens[35:65], tokens[70:]]
    with pytest.raises(ValueError, match="fewer than the context 101"):
        text_windows(tokens, 1, 101)


def test_real_model_kl_rows_over_a_text(tmp_path):
    model = build_random_model_dir(tmp_path / "m", dtype="float32", seed=0)
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "tests" / "data" / "lincoln_addresses.txt").read_text()[:2000])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kv_quant.py"),
                           "--kl", "--real-model", str(model), "--real-text", str(text),
                           "--kl-contexts", "32", "--kl-sequences", "2", "--kl-weights",
                           "float32", "--kl-formats", "int8", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout[proc.stdout.index("[\n"):])
    assert [r["cache"] for r in rows] == ["bfloat16", "int8"]
    assert all(r["positions"] == 64 and 0 <= r["top1"] <= 1 for r in rows)
    assert 0 < rows[0]["mean_kl"] < rows[1]["mean_kl"]
    errors = rows[1]["int8_over_bf16_sq_error"]
    assert errors["keys_channel_smoothed"] > 0 and errors["key_channel_peak_over_median"] >= 1


def test_real_model_alone_is_refused(capsys):
    # In this process: the refusal is argparse's (exit 2), before the script's work begins.
    import bench_kv_quant

    with pytest.raises(SystemExit) as exit_info:
        bench_kv_quant.main(["--real-model", "/nonexistent"])
    assert exit_info.value.code == 2 and "--real-model goes with --kl" in capsys.readouterr().err
