"""Quantized GGUF files on CUDA: the packed kernels are the CPU's, so on a GPU every weight is
dequantized to the model dtype and the greedy tokens are those of the CPU running the same
dequantized weights (`quantization="none"`); `quantization="int8"` is refused off the CPU."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedkv.model.loader import load_model
from pagedkv.model.registry import model_config_from_dir
from tests.model.gguf_files import write_gguf
from tests.model.test_gguf_models import greedy


@pytest.mark.cuda
@pytest.mark.parametrize("quant", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                                   GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K])
def test_quantized_gguf_on_cuda_runs_its_dequantized_weights(tiny_llama, tmp_path, quant):
    path = str(write_gguf(tiny_llama, tmp_path / "model.gguf", quant=quant))
    on_cuda = greedy(path, device="cuda")
    assert on_cuda == greedy(path, device="cpu", quantization="none")


def test_int8_quantization_is_refused_off_the_cpu(tiny_llama):
    config = model_config_from_dir(tiny_llama)
    with pytest.raises(ValueError, match="quantization='int8'.*'meta'"):
        load_model(tiny_llama, config, torch.float32, torch.device("meta"), quantization="int8")
