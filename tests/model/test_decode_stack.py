"""The decode step's stack in one C++ call (model/decode_stack.py) against the Python forward.

Both run the same kernels in the same order on the same inputs, so the greedy tokens must be the
same and the log-probabilities equal to float rounding of the sampler's own sums (1e-5 nats): a
layer taken out of order, a linear given the wrong arguments or a KV write in the wrong slot
changes the tokens within a few steps. Each test also counts the steps the stack actually ran,
so a condition that silently sends every step to the Python path fails here too. The kernel
choices are forced (each linear kind in turn; the fused decode kernel), as a measured table
would differ between machines and the stack only runs where the fused decode kernel does.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedkv import LLM, SamplingParams
from pagedkv.kernels import choice
from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model import decode_stack
from pagedkv.model.decode_stack import DecodeStack
from tests.model.gguf_files import write_gguf

PROMPTS = [[5, 17, 99, 230, 41, 8, 77, 300, 12], [64, 3, 150, 9, 250, 33], [71, 200, 18, 44, 6, 90,
           14, 321, 7, 55, 260, 2, 101, 48, 11, 199, 36, 120, 19]]


@pytest.fixture(params=["panel", "onednn", "matmul"])
def linear_kernel(request, monkeypatch) -> str:
    """Every dense linear forced to one kernel (where its dtype has it), decodes to the fused
    kernel."""
    kernel = request.param

    def forced(shape, dtype, in_features, make, available, isa_rule):
        return (kernel if kernel in available else available[0],) * len(choice.ROW_BUCKETS)

    monkeypatch.setattr(choice, "choose_linear", forced)
    monkeypatch.setattr("pagedkv.model.backends.cpu_native.decode_route", lambda *a: "native")
    return kernel


def generate(model: str, dtype: str, stack: bool, monkeypatch: pytest.MonkeyPatch,
             **engine) -> tuple[list[list[int]], list[list[float]], int]:
    """(tokens, their log-probabilities, decode steps the stack ran) of greedy generations of
    PROMPTS, the stack on or off; the engine's block pool checked after."""
    ran = []
    original = DecodeStack.run

    def counted(self, *args, **kwargs):
        if not stack:
            return None
        hidden = original(self, *args, **kwargs)
        ran.append(hidden is not None)
        return hidden

    monkeypatch.setattr(DecodeStack, "run", counted)
    llm = LLM(model=model, dtype=dtype, seed=0, block_size=4, cpu_kernels="wait", device="cpu",
              kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False, **engine)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        llm.llm_engine.check_invariants()
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in outs]
    monkeypatch.setattr(DecodeStack, "run", original)
    return tokens, logprobs, sum(ran)


def assert_same(model: str, dtype: str, monkeypatch: pytest.MonkeyPatch, **engine) -> None:
    on_tokens, on_logprobs, ran = generate(model, dtype, True, monkeypatch, **engine)
    off_tokens, off_logprobs, _ = generate(model, dtype, False, monkeypatch, **engine)
    assert ran >= 10  # every decode step of the 11 after the prefill, less any mixed step
    assert on_tokens == off_tokens
    for on, off in zip(on_logprobs, off_logprobs, strict=True):
        assert on == pytest.approx(off, abs=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_llama_mqa", "tiny_qwen2", "tiny_mistral"])
def test_stack_matches_the_python_forward(name, dtype, linear_kernel, request, monkeypatch):
    assert_same(str(request.getfixturevalue(name)), dtype, monkeypatch)


@pytest.mark.parametrize("quant", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
def test_stack_runs_packed_gguf_weights(quant, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr("pagedkv.model.backends.cpu_native.decode_route", lambda *a: "native")
    path = write_gguf(tiny_llama, tmp_path / "model.gguf", quant=quant)
    assert_same(str(path), "bfloat16", monkeypatch, quantization="auto")


@pytest.mark.parametrize(("method", "desc_act"), [("awq", False), ("gptq", True)],
                         ids=["awq", "gptq-act-order"])
def test_stack_runs_gptq_and_awq_weights(method, desc_act, tiny_llama, tmp_path, monkeypatch):
    """GPTQ / AWQ linears: Int4Linear, and with GPTQ's act order PermutedInt4Linear, whose
    gather and product are one op the stack calls as the Python forward does."""
    from pagedkv.testing.prequantized_model import write_prequantized

    monkeypatch.setattr("pagedkv.model.backends.cpu_native.decode_route", lambda *a: "native")
    write_prequantized(tiny_llama, tmp_path / "m", method, group_size=32, desc_act=desc_act)
    assert_same(str(tmp_path / "m"), "bfloat16", monkeypatch, quantization="auto")


def test_stack_is_not_built_for_qk_norm(tiny_qwen3):
    from pagedkv.model.runner import ModelRunner

    assert ensure_cpu_kernels("wait")
    runner = ModelRunner(str(tiny_qwen3), block_size=4, num_blocks=16, device="cpu",
                         dtype="float32", cpu_kernels="wait")
    runner.model.pack_linear_weights(panels=True)
    assert not runner.model._stack_fits() and runner.model.decode_stack is None


def test_int8_cache_steps_take_the_python_forward(tiny_llama, monkeypatch):
    tokens, _, ran = generate(str(tiny_llama), "float32", True, monkeypatch, kv_cache_dtype="int8")
    assert ran == 0 and all(len(t) == 12 for t in tokens)


def test_add_linear_names_a_missing_argument():
    assert ensure_cpu_kernels("wait")
    stack = torch.classes.pagedkv_cpu.DecodeStack(2, 1, 16, 1e-6, 0.25, torch.ones(32))
    with pytest.raises(RuntimeError, match="add_layer first"):
        stack.add_linear("pagedkv_cpu::panel_linear", "", 0, [torch.zeros(1)], [32], [])
    stack.add_layer(torch.ones(32), torch.ones(32))
    with pytest.raises(RuntimeError, match="needs more int arguments"):
        stack.add_linear("pagedkv_cpu::panel_linear", "", 0, [torch.zeros(1), None], [], [])
    with pytest.raises(RuntimeError, match="more arguments than it takes"):
        stack.add_linear("pagedkv_cpu::panel_linear", "", 0, [torch.zeros(1), None, None], [32], [])
    assert stack.num_layers() == 1
    assert decode_stack.LinearCall("x::y", ()).ints == ()
