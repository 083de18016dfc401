"""Values that used to pass validation and then break `step()` for every queued request are
refused at `SamplingParams` / `add_request` time with a ValueError naming them; the engine
keeps serving the other requests and holds no block for the refused ones."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.args import EngineArgs
from tests.engine.conftest import assert_pool_empty

OK = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=2**64), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=True), "seed"),
    (dict(logprobs=True), "logprobs"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(stop=["ok", "\ud800"]), "stop"),
])
def test_sampling_params_refuse(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_extreme_seeds_that_fit_sample_fine(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    for seed in (2**63 - 1, -(2**63)):
        params = SamplingParams(n=2, seed=seed, max_tokens=3, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
        assert [len(c.token_ids) for c in out.outputs] == [3, 3]


def test_tiny_temperatures_are_greedy(tiny_llama, make_llm):
    for temperature in (1e-40, 1e-6, 9.99e-6):
        assert SamplingParams(temperature=temperature).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    prompt = {"prompt_token_ids": [1, 30, 31, 32]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    tiny = llm.generate(prompt, SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert tiny == greedy and len(set(greedy)) > 1  # not all token 0 (a NaN argmax)


def test_add_request_refuses_bad_values_and_the_engine_goes_on(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    engine = llm.llm_engine
    engine.add_request("good", {"prompt_token_ids": [1, 5, 6]}, OK)
    with pytest.raises(ValueError, match="cache_salt .*lone surrogate"):
        engine.add_request("salt", {"prompt_token_ids": [1, 5]}, OK, cache_salt="\ud800")
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        engine.add_request("salt2", {"prompt_token_ids": [1, 5]}, OK, cache_salt=b"x")
    for priority in (None, 1.5, True, 2**31):
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("prio", {"prompt_token_ids": [1, 5]}, OK, priority=priority)
    with pytest.raises(ValueError, match="lone surrogate"):
        engine.add_request("text", "hello \udfff", OK)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 2, OK, priority=[None, 1], use_tqdm=False)
    with pytest.raises(ValueError, match=r"n=100000 needs at least"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(n=10**5), use_tqdm=False)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["good"]
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert_pool_empty(llm)


def test_lone_surrogate_in_chat_is_a_value_error(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], OK, use_tqdm=False)


def test_over_long_text_prompt_is_refused_after_a_prefix(tiny_llama, make_llm):
    """A text far over max_model_len is refused with a lower bound of its token count, from
    a prefix: the count it reports is far below the text's real token count."""
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32",
                   max_model_len=64)
    text = "lorem ipsum dolor sit amet " * 20000
    with pytest.raises(ValueError, match="at least") as info:
        llm.generate(text, OK, use_tqdm=False)
    reported = int(str(info.value).split("at least ")[1].split()[0])
    assert 63 < reported < len(llm.get_tokenizer().encode(text)) // 100


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_swap_space_must_be_finite(value):
    with pytest.raises(ValueError, match="swap_space"):
        EngineArgs(model="m", swap_space=value)
