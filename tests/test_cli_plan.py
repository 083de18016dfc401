"""`pagedkv plan`: the JSON figures, the table, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.cli import main
from pagedkv.kv.spec import bundled_config_path
from tests.kv.test_spec import DEEPSEEK_V2_LITE, MISTRAL_7B_V01

LLAMA = bundled_config_path("llama-3-8b")


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_llama_3_8b_json_in_a_subprocess_without_torch():
    # 32 layers x 2 x 8 kv heads x 128 x 2 bytes = 131072 per token; x 16 = 2097152 per block.
    code = (
        "import sys; from pagedkv.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "plan", "--config", LLAMA, "--memory", "80GiB",
         "--block-size", "16", "--dtype", "bfloat16", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bytes_per_token"] == 131072
    assert result["bytes_per_block"] == 2097152
    assert result["kind"] == "full_attention"
    # floor(80 GiB x 0.9) = 77,309,411,328 - weights 16,060,522,496 (8,030,261,248 params x 2)
    # - activations; 8192-token sequences take 512 blocks each.
    assert result["weights_bytes"] == 16_060_522_496
    expected_blocks = (77_309_411_328 - 16_060_522_496 - result["activation_peak_bytes"]) // 2097152
    assert result["num_blocks"] == expected_blocks
    assert result["max_cached_tokens"] == expected_blocks * 16
    assert result["max_concurrent_seqs"] == expected_blocks // 512
    assert result["num_host_blocks"] == 2048  # default swap space 4 GiB / 2 MiB


def test_console_script_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "plan", "--config", LLAMA, "--memory", "80GB",
         "--weights-bytes", "0", "--utilization", "1.0", "--max-model-len", "1024", "--json",
         "--swap-space", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # 80 GB = 80e9 bytes; minus the estimated activations; / 2 MiB per block.
    assert result["memory_bytes"] == 80 * 10**9
    assert result["num_blocks"] == (80 * 10**9 - result["activation_peak_bytes"]) // 2097152
    assert result["max_concurrent_seqs"] == result["num_blocks"] // 64  # 1024 / 16 = 64 blocks
    assert result["num_host_blocks"] == 0


def test_table_is_the_default(capsys):
    rc, out, err = _plan(capsys, "--config", LLAMA, "--memory", "80GiB")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    values = {line[:21].strip(): line[21:] for line in lines}  # aligned: 19 + 2 spaces
    assert values["bytes per token"].startswith("131,072")
    assert values["bytes per block"].startswith("2,097,152")
    assert values["kv cache"] == "full_attention"
    assert len({line.index(v) for line, v in zip(lines, values.values(), strict=True)}) == 1


def test_model_directory_and_bundled_name(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    rc, out, _ = _plan(capsys, "--config", str(tmp_path), "--memory", "80GiB", "--json",
                       "--max-model-len", "4096")
    assert rc == 0
    result = json.loads(out)
    # MLA: 27 layers x (512 + 64) x 2 bytes = 31104 per token, x 16 = 497664 per block.
    assert (result["kind"], result["bytes_per_token"], result["bytes_per_block"]) == (
        "mla", 31104, 497664)
    rc, out, _ = _plan(capsys, "--config", "llama-3-8b", "--memory", "80GiB", "--json")
    assert rc == 0 and json.loads(out)["bytes_per_token"] == 131072


def test_sliding_window_and_fp8(capsys, tmp_path):
    path = tmp_path / "mistral.json"
    path.write_text(json.dumps(MISTRAL_7B_V01))
    rc, out, _ = _plan(capsys, "--config", str(path), "--memory", "24GiB", "--dtype", "fp8",
                       "--weights-bytes", "8GiB", "--json")
    assert rc == 0
    result = json.loads(out)
    # fp8: 32 x 2 x 8 x 128 x 1 = 65536 per token, 1 MiB per block; window 4096 -> 257 blocks.
    assert (result["kind"], result["bytes_per_token"], result["bytes_per_block"]) == (
        "sliding_window", 65536, 2**20)
    assert result["weights_bytes"] == 8 * 2**30
    assert result["max_blocks_per_seq"] == 257
    assert result["max_concurrent_seqs"] == result["num_blocks"] // 257


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--memory", "80XB"], "unknown unit 'XB'"),
        (["--memory", "lots"], "--memory must be a size"),
        (["--memory", "80GiB", "--swap-space=-4GiB"], "--swap-space"),
        (["--memory", "80GiB", "--weights-bytes", "big"], "--weights-bytes"),
        (["--memory", "80GiB", "--dtype", "int4"], "unknown dtype 'int4'"),
        (["--memory", "80GiB", "--utilization", "1.5"], "utilization"),
        (["--memory", "80GiB", "--block-size", "0"], "block_size"),
        (["--memory", "80GiB", "--max-model-len", "0"], "--max-model-len"),
        (["--memory", "16GiB"], "need 512 blocks (1.00 GiB) for one sequence of max_model_len=8192"),
    ],
)
def test_bad_inputs_give_one_line_errors_and_exit_2(capsys, args, needle):
    rc, out, err = _plan(capsys, "--config", LLAMA, *args)
    assert rc == 2
    assert out == ""
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("pagedkv plan: error: ")
    assert "Traceback" not in err


def test_bad_configs_give_one_line_errors(capsys, tmp_path):
    missing_key = tmp_path / "missing.json"
    missing_key.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    invalid = tmp_path / "invalid.json"
    invalid.write_text("{\"hidden_size\": ")
    cases = [
        (str(missing_key), "num_hidden_layers"),
        (str(invalid), "not valid JSON"),
        (str(tmp_path / "nope.json"), "does not exist"),
        (str(tmp_path), "no config.json"),
    ]
    for config, needle in cases:
        rc, out, err = _plan(capsys, "--config", config, "--memory", "80GiB")
        assert rc == 2, config
        assert needle in err and err.count("\n") == 1, err


def test_missing_required_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--config", LLAMA])
    assert info.value.code == 2
    assert "--memory" in capsys.readouterr().err


def test_kv_store_tier_blocks(capsys):
    rc, out, _ = _plan(capsys, "--config", LLAMA, "--memory", "80GiB", "--json",
                       "--kv-offloading-size", "64GiB", "--kv-offloading-disk-size", "1GiB")
    result = json.loads(out)
    assert rc == 0
    assert result["host_tier_blocks"] == 64 * 2**30 // 2097152  # 32768 blocks of 2 MiB
    # A disk file holds a 24-byte header and a 48-byte key before the block's bytes.
    assert result["disk_tier_blocks"] == 2**30 // (2097152 + 24 + 48) == 511
    rc, out, _ = _plan(capsys, "--config", LLAMA, "--memory", "80GiB")
    assert "store host blocks    0" in out


def test_gemma3_plan_reports_kv_cache_groups(capsys):
    """Gemma 3 (5 sliding layers of window 1,024 per full one) at 32k: a group per 5 layers, the
    sliding ones holding 65 blocks, ~5.7x fewer KV bytes per sequence than all-full layers."""
    rc, out, _ = _plan(capsys, "--config", "gemma-3-4b", "--memory", "24GiB",
                       "--max-model-len", "32768", "--json")
    assert rc == 0
    data = json.loads(out)
    groups = data["kv_cache_groups"]
    assert [g["kind"] for g in groups] == ["full_attention"] + ["sliding_window"] * 6
    assert [g["blocks_per_seq"] for g in groups] == [2048] + [65] * 6
    assert data["bytes_per_block"] == 16 * 5 * 2 * 4 * 256 * 2
    assert data["kv_bytes_per_seq"] == (2048 + 6 * 65) * data["bytes_per_block"]
    assert data["all_full_kv_bytes_per_seq"] == 32768 * 34 * 2 * 4 * 256 * 2
    assert data["saving_vs_all_full"] > 5
    assert data["max_concurrent_seqs"] == data["num_blocks"] // (2048 + 6 * 65)
