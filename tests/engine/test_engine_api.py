"""LLM / LLMEngine behaviour: errors, aborts, n > 1, stopping, logprobs, chat, detokenization."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.vllm_text import vllm_output_text
from tests.engine.conftest import assert_pool_empty, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def token_prompts(seed=0, num=4, lengths=(5, 20)):
    return [{"prompt_token_ids": p}
            for p in make_prompts(seed=seed, vocab=400, num=num, shared_prefix=0, lengths=lengths)]


def test_prompt_that_can_never_fit_is_refused_at_add_request(tiny_llama, make_llm):
    # 8 usable blocks of 4 tokens; max_model_len is explicitly larger than the cache. The
    # server's "can this ever fit" check (LLMEngine.check_fits) refuses it up front, for the
    # prompt's length or for its n samples, and the other requests are not touched.
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=9, max_model_len=512)
    prompts = token_prompts(num=3, lengths=(4, 8))
    huge = {"prompt_token_ids": list(range(10, 110))}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="100 tokens with n=1 needs at least 26 KV blocks"):
        llm.generate([prompts[0], huge, *prompts[1:]], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"n=1000000 needs at least 1000001 KV blocks"):
        llm.generate(prompts[0], SamplingParams(n=10**6, max_tokens=4), use_tqdm=False)
    assert_pool_empty(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == 4


def test_engine_ready_is_what_the_core_was_built_with(tiny_llama, make_llm):
    """`LLMEngine.ready`: the core's own account of its sizes, read without reaching into it."""
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=9, max_model_len=512,
                   dtype="float32")
    engine = llm.llm_engine
    ready = engine.ready
    kv = engine.scheduler.kv_cache_manager
    assert (ready.block_size, ready.num_gpu_blocks, ready.max_model_len) == (4, 9, 512)
    assert ready.num_usable_blocks == kv.num_usable_blocks == 8
    assert ready.vocab_size == engine.vocab_size and ready.model_dtype == "float32"
    assert ready.kv_cache_dtype == engine.kv_cache_dtype != "auto"


def test_bad_prompts_raise_value_error_and_leak_nothing(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="bogus"):
        LLM(model=str(tiny_llama), bogus=1)
    assert_pool_empty(llm)


def test_parallel_sampling_is_reproducible_with_a_seed(tiny_llama, make_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    # Prompt of 10 tokens with block size 4: the children share a partly filled block.
    prompt = {"prompt_token_ids": list(range(20, 30))}
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_llama, block_size=4)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2]
        runs.append([c.token_ids for c in out.outputs])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1  # the samples differ from each other
    assert all(len(t) == 8 for t in runs[0])


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama, make_llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
    llm = make_llm(tiny_llama)
    alone = llm.generate(token_prompts(seed=1, num=1), params, use_tqdm=False)[0]
    mixed = llm.generate(token_prompts(seed=1, num=1) + token_prompts(seed=2, num=3), params,
                         use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids


def test_abort_frees_every_block(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4)
    engine = llm.llm_engine
    for i, prompt in enumerate(token_prompts(num=4, lengths=(20, 30))):
        engine.add_request(f"req-{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request(["req-0", "req-1", "req-2", "req-3", "unknown"])
    assert engine.get_stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()
    engine.step()  # the runner is told; nothing else happens
    assert_pool_empty(llm)


def test_abort_of_parallel_sampling_request_frees_children(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4)
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": list(range(30, 45))},
                       SamplingParams(n=4, max_tokens=40, ignore_eos=True, seed=1))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_running == 4
    engine.abort_request("p")
    assert_pool_empty(llm)


def test_stop_string_is_cut_from_the_text(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    prompt = token_prompts(seed=4, num=1)[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.find(stop)]
    assert len(cut.token_ids) < len(full.token_ids)


def test_stop_token_ids_min_tokens_and_eos(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    prompt = token_prompts(seed=5, num=1)[0]
    tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[:first + 1]
    # min_tokens: the stop token cannot be sampled before min_tokens outputs.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id], min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_id not in out.token_ids[:first + 1]
    assert out.token_ids[:first] == tokens[:first]
    # eos from generation_config.json stops unless ignore_eos.
    eos = llm.llm_engine.eos_token_ids
    assert eos
    assert 2 in eos


def test_logprobs_hold_the_sampled_token_and_top_n(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    out = llm.generate(token_prompts(seed=6, num=1)[0],
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token] == max(entry.values())  # greedy picks the most likely token
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total)


def test_chat_applies_the_template(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    messages = [{"role": "user", "content": "tell me a story"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_string_prompts_round_trip_through_the_tokenizer(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    out = llm.generate(["Hello world", "The block pool"], GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert out[0].prompt == "Hello world"
    assert out[0].prompt_token_ids == tokenizer.encode("Hello world")
    # (the text vLLM's detokenizer makes: a window held back at the end is left out)
    assert out[1].outputs[0].text == vllm_output_text(
        tokenizer.backend_tokenizer, out[1].prompt_token_ids, out[1].outputs[0].token_ids)


def test_incremental_detokenizer_never_splits_a_character(tiny_llama):
    tokenizer = Tokenizer.from_dir(tiny_llama)
    text = "héllo wörld 中文字符 😀🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, [1], stop=[])
    for token in ids:
        detok.update([token])
        assert "\ufffd" not in detok.text
        assert text.startswith(detok.text)
    assert detok.text == text


def test_incremental_detokenizer_stop_strings():
    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["cd", "bc"])
    found = None
    for ch in "abcdef":
        found = found or detok.update([ord(ch)])
    assert found == "bc" and detok.text == "a"  # the earliest stop string wins
    keep = IncrementalDetokenizer(CharTokenizer(), [], stop=["cd"], include_stop_str_in_output=True)
    for ch in "abcdef":
        keep.update([ord(ch)])
    assert keep.text == "abcd"


def test_request_ids_cannot_clash_with_parallel_samples(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": [5, 6, 7]}
    engine.add_request("a", prompt, SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="a#1"):
        engine.add_request("a#1", prompt, SamplingParams(max_tokens=2))
    engine.add_request("b#1", prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="b#1"):
        engine.add_request("b", prompt, SamplingParams(n=3, max_tokens=2))
    with pytest.raises(ValueError, match="'a'"):
        engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_generated_text_is_vllms_at_every_cut_and_stop_token(tiny_llama, make_llm):
    """Through the engine: byte tokens cut by max_tokens at every length, and a stop token
    (its text left out): the text is vLLM's (DecodeStream's), as is n > 1's."""
    llm = make_llm(tiny_llama)
    tokenizer = llm.get_tokenizer()
    raw = tokenizer.backend_tokenizer
    allowed = sorted(set(tokenizer.encode("日本語😀 ab", add_special_tokens=False)))
    prompt = {"prompt_token_ids": tokenizer.encode("Hello")}
    for max_tokens in range(1, 7):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, allowed_token_ids=allowed,
                                ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        (sample,) = out.outputs
        assert sample.text == vllm_output_text(raw, out.prompt_token_ids, sample.token_ids)
    full = sample.token_ids
    stop_id = full[-1]
    params = SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=allowed,
                            ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    assert out.text == vllm_output_text(raw, prompt["prompt_token_ids"], out.token_ids,
                                        stop_terminated=True)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, allowed_token_ids=allowed)
    for sample in llm.generate([prompt], params, use_tqdm=False)[0].outputs:
        assert sample.text == vllm_output_text(raw, prompt["prompt_token_ids"], sample.token_ids)


def test_generated_partial_character_is_left_out(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    tokenizer = llm.get_tokenizer()
    first_byte = tokenizer.encode("😀", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, allowed_token_ids=[first_byte],
                            ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 5, 6]}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first_byte, first_byte] and out.text == ""
