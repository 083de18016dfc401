"""The attention-backend seam: the registry, the Triton backend driving the whole model, and
CUDA graphs for decode (GPU only)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import ModelRunner
from pagedkv.model.backends import ATTENTION_BACKENDS, get_attention_backend
from pagedkv.model.backends.quantized import QuantizedKVBackend
from tests.model.driver import greedy_generate

pytest.importorskip("triton")
pytest.importorskip("transformers")

from tests.model.test_correctness import PROMPTS, hf_greedy_cached  # noqa: E402


def test_registry_picks_the_device_backend_and_rejects_unknown_names():
    assert get_attention_backend(torch.device("cpu")).name == "cpu_native"
    assert get_attention_backend(torch.device("cpu"), "cpu_torch").name == "torch"
    assert get_attention_backend(torch.device("cpu"), "cuda").name == "triton"
    with pytest.raises(ValueError, match="'nope'"):
        get_attention_backend(torch.device("cpu"), "nope")


def test_triton_backend_greedy_matches_transformers(tiny_mistral):
    """The Triton backend (interpreted on CPU, compiled on CUDA) runs the tiny Mistral's mixed
    batches (decodes and chunked prefills in one step, GQA, its sliding window of 8) and yields
    transformers' greedy tokens. Few tokens: the interpreter is slow."""
    runner = ModelRunner(tiny_mistral, block_size=4, num_blocks=64, attention_backend="cuda")
    assert runner.attn_backend.name == "triton"
    ours = greedy_generate(runner, PROMPTS, 3, chunk_size=5)
    assert ours == hf_greedy_cached(str(tiny_mistral), 3)


@pytest.mark.cuda
def test_cuda_graph_decode_matches_eager(tiny_mistral):
    eager = ModelRunner(tiny_mistral, block_size=4, num_blocks=64, device="cuda")
    graphs = ModelRunner(tiny_mistral, block_size=4, num_blocks=64, device="cuda",
                         cuda_graph_batch_sizes=[1, 2, 3, 8], max_model_len=64)
    want = greedy_generate(eager, PROMPTS, 8)
    got = greedy_generate(graphs, PROMPTS, 8)
    assert got == want == hf_greedy_cached(str(tiny_mistral), 8)
    assert graphs.cuda_graphs.num_replays >= 7  # every decode step of 4 requests, padded to 8
    assert eager.cuda_graphs is None


def test_every_backend_declares_what_the_runner_reads():
    """The runner reads capabilities, never probes: a name, CUDA-graph support, the quantized
    cache dtypes read in place, and a fused-kernel switch only cpu_native turns on (the
    quantized wrapper forwards it to the backend it wraps)."""
    cpu = torch.device("cpu")
    backends = {key: get_attention_backend(cpu, key) for key in ATTENTION_BACKENDS}
    for key, backend in backends.items():
        assert isinstance(backend.name, str) and isinstance(backend.supports_cuda_graphs, bool)
        assert isinstance(backend.reads_cache_dtypes, frozenset)
        assert backend.fused is False
        backend.set_fused(True)
        assert backend.fused is (key == "cpu")
    assert [k for k, b in backends.items() if b.supports_cuda_graphs] == ["cuda"]
    assert {"int8", "fp8", "fp8_e5m2"} <= backends["cuda"].reads_cache_dtypes  # interpreter
    assert backends["cpu"].reads_cache_dtypes == frozenset()
    wrapped = QuantizedKVBackend(get_attention_backend(cpu), reads_in_place=True)
    assert not wrapped.supports_cuda_graphs and not wrapped.fused
    wrapped.set_fused(True)
    assert wrapped.fused and wrapped.inner.fused
