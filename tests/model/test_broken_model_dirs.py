"""A broken model directory, or a pre-quantized one in a format pagedkv does not read, ends `pagedkv
generate` / `serve` with exit code 2 and one line naming the file or the method at fault: never
a traceback, and never an allocation for what config.json claims before the checkpoint has been
checked against it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedkv.cli import main


def _edit_json(name: str, **changes) -> Callable[[Path], None]:
    def mutate(model_dir: Path) -> None:
        data = json.loads((model_dir / name).read_text())
        data.update(changes)
        (model_dir / name).write_text(json.dumps(data))
    return mutate


def _write(name: str, content: bytes | str) -> Callable[[Path], None]:
    def mutate(model_dir: Path) -> None:
        path = model_dir / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return mutate


def _truncate_weights(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])


CASES = {
    "truncated safetensors": (_truncate_weights, "model.safetensors"),
    "garbage safetensors": (_write("model.safetensors", b"garbage" * 100), "model.safetensors"),
    "corrupt tokenizer.json": (_write("tokenizer.json", '{"version": "1.0", "model": 5'),
                               "tokenizer.json"),
    "config.json is a list": (_write("config.json", "[1, 2]"), "config.json"),
    "non-string eos_token": (_edit_json("tokenizer_config.json", eos_token=5), "eos_token"),
    "negative vocab_size": (_edit_json("config.json", vocab_size=-5), "vocab_size"),
    "malformed generation_config.json": (_write("generation_config.json", "{bad"),
                                         "generation_config.json"),
    "malformed tokenizer_config.json": (_write("tokenizer_config.json", "{bad"),
                                        "tokenizer_config.json"),
    "a billion layers": (_edit_json("config.json", num_hidden_layers=10**9),
                         "num_hidden_layers=1000000000"),
    "layers missing from the weights": (_edit_json("config.json", num_hidden_layers=3),
                                        "num_hidden_layers=3"),
    "vocab_size disagrees with the weights": (_edit_json("config.json", vocab_size=10**9),
                                              "vocab_size=1000000000"),
    # Pre-quantized checkpoints: a method or layout pagedkv does not read named, not a
    # `.weight` tensor found missing; one declared but without a quantized tensor.
    "an FP8 checkpoint": (_edit_json("config.json", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic"}),
        "pre-quantized checkpoint (config.json's quantization_config, quant_method 'fp8'), "
        "which pagedkv does not load (it reads GPTQ and AWQ checkpoints)"),
    "a 3-bit GPTQ checkpoint": (_edit_json("config.json", quantization_config={
        "quant_method": "gptq", "bits": 3, "group_size": 128}),
        "the GPTQ checkpoint's quantization_config has bits 3, which pagedkv does not read "
        "(2, 4, 8)"),
    "AWQ's GEMV layout": (_edit_json("config.json", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
        "has version 'gemv', which pagedkv does not read ('gemm')"),
    "a GPTQ config over float weights": (_edit_json("config.json", quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}),
        "config.json declares a GPTQ checkpoint, but its weights hold no quantized linear"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_model_dir_fails_in_one_line_naming_the_file(tiny_llama, tmp_path, capsys, case):
    mutate, expected = CASES[case]
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama, model_dir)
    mutate(model_dir)
    # A fixed block count: the KV sizing does not stop a huge config before the loader does.
    rc = main(["generate", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
               "--dtype", "float32", "--block-size", "4", "--num-gpu-blocks-override", "8"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("pagedkv generate: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err
