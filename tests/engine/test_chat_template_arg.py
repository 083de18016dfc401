"""`LLM.chat(chat_template=...)` (vLLM's argument; `pagedkv serve --chat-template` is the
server's): the conversation is rendered with the template given, the engine's own tokenizer
keeps the model's."""

from __future__ import annotations

from pagedkv import SamplingParams

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_chat_renders_with_the_template_given(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=64, block_size=4)
    messages = [{"role": "user", "content": "tell me a story"}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt == "[user] tell me a story\n[assistant] "
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    own = llm.chat(messages, params, use_tqdm=False)[0]  # the model's template is untouched
    assert own.prompt == tokenizer.apply_chat_template(messages) != out.prompt
    llm.llm_engine.check_invariants()
