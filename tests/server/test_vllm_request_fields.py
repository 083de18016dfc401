"""vLLM 0.32's request fields through the HTTP API: honoured (return_token_ids,
add_special_tokens, request_id, echo, detokenize, top_logprobs 0), accepted no-ops (what OpenAI's
SDK, LangChain, LiteLLM and vllm-router send), 400 for what cannot be done, unknown fields
ignored with a warning naming them (400 with --strict-request-fields)."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.vllm_text import vllm_output_text
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags

CHAT = [{"role": "user", "content": "Tell me a story"}]
NO_OPS = {"service_tier": "auto", "store": False, "metadata": {"user": "u1"},
          "modalities": ["text"], "reasoning_effort": "low", "include_reasoning": True,
          "length_penalty": 1.0, "vllm_xargs": {"k": 1, "l": ["a", 2]}, "no_stop_trim": True,
          "return_hidden_states": False, "separate_reasoning": False, "stream_reasoning": False,
          "use_beam_search": False, "spaces_between_special_tokens": False,
          "session_id": "s-1"}
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def tokens(server, prompt: str, add_special_tokens: bool = True) -> list[int]:
    resp = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "Once upon"}),
                                         ("/v1/chat/completions", {"messages": CHAT})])
def test_no_op_fields_are_accepted_and_change_nothing(server, path, base):
    plain = post(server, path, {**base, **GREEDY, "return_token_ids": True})
    with_extras = post(server, path, {**base, **GREEDY, **NO_OPS, "return_token_ids": True})
    assert plain.status_code == 200 and with_extras.status_code == 200, with_extras.text
    assert [c["token_ids"] for c in with_extras.json()["choices"]] == \
        [c["token_ids"] for c in plain.json()["choices"]]


@pytest.mark.parametrize("field, value", [("early_stopping", "sometimes"),
                                          ("return_hidden_states", True),
                                          ("store", "yes"), ("metadata", {"k": 1}),
                                          ("service_tier", "gold"), ("reasoning_effort", "huge"),
                                          ("return_token_ids", "yes"), ("request_id", 5)])
def test_cannot_do_or_bad_value_is_400_naming_the_field(server, field, value):
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        resp = post(server, path, {**base, "max_tokens": 1, field: value})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == field and error["code"] == 400, error


def test_return_token_ids_completion(server):
    prompt = "Once upon a time"
    resp = post(server, "/v1/completions", {"prompt": prompt, **GREEDY, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["prompt_token_ids"] == tokens(server, prompt)
    assert len(choice["token_ids"]) == 6
    tokenizer = Tokenizer.from_dir(server.model_dir).backend_tokenizer
    assert choice["text"] == vllm_output_text(tokenizer, choice["prompt_token_ids"],
                                              choice["token_ids"])
    plain = post(server, "/v1/completions", {"prompt": prompt, **GREEDY}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    # streaming: prompt ids in the first chunk, each chunk's new tokens, same tokens in all
    chunks = _sse(server, "/v1/completions", {"prompt": prompt, **GREEDY, "stream": True,
                                              "return_token_ids": True})
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in streamed[1:])
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]


def test_return_token_ids_chat_matches_the_stream(server):
    body = {"messages": CHAT, **GREEDY, "return_token_ids": True}
    whole = post(server, "/v1/chat/completions", body).json()
    assert whole["prompt_token_ids"] and len(whole["choices"][0]["token_ids"]) == 6
    assert whole["usage"]["prompt_tokens"] == len(whole["prompt_token_ids"])
    chunks = _sse(server, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    ids = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert ids == whole["choices"][0]["token_ids"]


def test_return_prompt_text_is_the_rendered_chat_prompt(server, tiny_llama):
    """vLLM 0.32's chat `return_prompt_text`: the chat template's output, as fed to the model
    (the answer, and the first chunk of a stream); null without it."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}] + CHAT
    expected = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    body = {"messages": messages, **GREEDY, "return_prompt_text": True, "return_token_ids": True}
    whole = post(server, "/v1/chat/completions", body).json()
    assert whole["prompt_text"] == expected and "Be brief." in expected
    assert tokens(server, expected, add_special_tokens=False) == whole["prompt_token_ids"]
    chunks = _sse(server, "/v1/chat/completions", {**body, "stream": True, "n": 2,
                                                   "temperature": 1.0})
    # as vLLM: each choice's role chunk (the first of each) carries it, no other chunk
    roles = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1] and chunks[:2] == roles
    assert all(c["prompt_text"] == expected for c in roles)
    assert all(c["prompt_text"] is None for c in chunks[2:])
    for off in ({}, {"return_prompt_text": False}):
        plain = post(server, "/v1/chat/completions", {"messages": messages, **GREEDY, **off})
        assert plain.status_code == 200 and plain.json()["prompt_text"] is None
    cont = post(server, "/v1/chat/completions", {
        "messages": CHAT + [{"role": "assistant", "content": "Once"}], "max_tokens": 1,
        "add_generation_prompt": False, "continue_final_message": True,
        "return_prompt_text": True}).json()
    assert cont["prompt_text"].endswith("Once")  # what the model continues, cut there
    bad = post(server, "/v1/chat/completions", {"messages": CHAT, "return_prompt_text": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_prompt_text"


def test_add_special_tokens(server):
    prompt = "Once upon a time"
    with_bos, without = tokens(server, prompt), tokens(server, prompt, add_special_tokens=False)
    assert with_bos != without  # the tiny tokenizer adds a BOS
    for flag, expected in ((True, with_bos), (False, without)):
        resp = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                "add_special_tokens": flag,
                                                "return_token_ids": True})
        assert resp.json()["choices"][0]["prompt_token_ids"] == expected
    # chat: the template writes the special tokens (default false); true adds the BOS again
    chat = [post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                  "add_special_tokens": flag,
                                                  "return_token_ids": True}).json()
            for flag in (False, True)]
    assert chat[1]["prompt_token_ids"] == [with_bos[0]] + chat[0]["prompt_token_ids"]


def test_request_id_names_the_response(server):
    resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "abc"})
    assert resp.json()["id"] == "cmpl-abc"
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                 "request_id": "abc"})
    assert resp.json()["id"] == "chatcmpl-abc"
    resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "abc"},
                headers={"X-Request-Id": "hdr"})
    assert resp.json()["id"] == "cmpl-hdr"  # vLLM: the header wins
    # two requests with the same id run side by side (the engine's ids stay unique)
    both = [post(server, "/v1/completions", {"prompt": "y", "max_tokens": 2, "request_id": "same",
                                             "n": 2}) for _ in range(2)]
    assert all(r.status_code == 200 and r.json()["id"] == "cmpl-same" for r in both)


def test_chat_echo_prepends_the_final_assistant_message(server):
    messages = CHAT + [{"role": "assistant", "content": "Once upon a time"}]
    body = {"messages": messages, **GREEDY, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Once upon a time" + plain
    chunks = _sse(server, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == "Once upon a time" + plain
    # the last message is the user's: echo adds nothing
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "echo": True})
    user_plain = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY})
    assert resp.json()["choices"][0]["message"] == user_plain.json()["choices"][0]["message"]


def test_detokenize_false_returns_tokens_only(server):
    resp = post(server, "/v1/completions", {"prompt": "Once", **GREEDY, "detokenize": False,
                                            "return_token_ids": True})
    choice = resp.json()["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 6
    resp = post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 2,
                                            "detokenize": False, "stop": ["a"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "detokenize"


def test_top_logprobs_zero_without_logprobs(server):
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                 "top_logprobs": 0})
    assert resp.status_code == 200, resp.text
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                 "top_logprobs": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"


def test_system_fingerprint_and_integer_error_codes(server):
    first = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).json()
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert first["system_fingerprint"].startswith("pagedkv-")
    assert chat["system_fingerprint"] == first["system_fingerprint"]
    missing = post(server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_unknown_fields_are_ignored_with_a_warning_naming_them(server):
    resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                            "proxy_trace_zq": {"hop": 1}})
    assert resp.status_code == 200, resp.text
    assert "proxy_trace_zq" in server.output()


def test_strict_request_fields_restores_the_400(tiny_llama):
    server = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS),
                           "--strict-request-fields").start()
    try:
        resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "frob": 1})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "frob"
        assert "frob" in resp.json()["error"]["message"]
        resp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **NO_OPS})
        assert resp.status_code == 200, resp.text  # what vLLM defines is still accepted
    finally:
        assert server.stop()


def _sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_no_replacement_character_when_max_tokens_cuts_a_character(server):
    """The first byte of a 4-byte emoji, forced: vLLM's text is empty, never U+FFFD."""
    emoji = tokens(server, "😀", add_special_tokens=False)
    body = {"prompt": "Hi", "max_tokens": 1, "allowed_token_ids": [emoji[0]],
            "return_token_ids": True}
    resp = post(server, "/v1/completions", body)
    assert resp.json()["choices"][0]["token_ids"] == [emoji[0]]
    assert resp.json()["choices"][0]["text"] == ""
    chunks = _sse(server, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ""
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                 "allowed_token_ids": [emoji[0]]})
    assert chat.json()["choices"][0]["message"]["content"] == ""


def test_echo_with_logprobs_fills_choices_prompt_logprobs(server):
    """vLLM fills choices[].prompt_logprobs whenever it computed them (echo + logprobs)."""
    body = {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0.0}
    echoed = post(server, "/v1/completions", {**body, "echo": True, "logprobs": 1}).json()
    asked = post(server, "/v1/completions", {**body, "prompt_logprobs": 1}).json()
    got = echoed["choices"][0]["prompt_logprobs"]
    assert got is not None and got[0] is None
    assert len(got) == len(tokens(server, body["prompt"]))
    want = asked["choices"][0]["prompt_logprobs"]
    assert [None if e is None else {k: round(v["logprob"], 4) for k, v in e.items()}
            for e in got] == \
        [None if e is None else {k: round(v["logprob"], 4) for k, v in e.items()} for e in want]
    plain = post(server, "/v1/completions", {**body, "logprobs": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


VLLM_TOP_KEYS = {"service_tier", "kv_transfer_params", "ec_transfer_params", "metrics",
                 "system_fingerprint", "usage", "choices", "id", "object", "created", "model"}


def test_answers_carry_the_keys_vllm_0_32_writes(server):
    """vLLM's response key structure (benchmarks/vs_vllm_api.py diffs it against a real vLLM):
    its extra keys are there, null where nothing here produces them; an assistant message has
    OpenAI's null refusal/annotations/audio/function_call and no tool_calls key without calls."""
    completion = post(server, "/v1/completions", {"prompt": "Once upon", **GREEDY}).json()
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY}).json()
    for answer in (completion, chat):
        assert answer.keys() >= VLLM_TOP_KEYS, answer.keys()
        assert all(answer[k] is None for k in ("service_tier", "kv_transfer_params",
                                               "ec_transfer_params", "metrics"))
        assert answer["usage"]["completion_tokens_details"] is None
        assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]
        assert answer["choices"][0]["routed_experts"] is None
        assert answer["choices"][0]["stop_reason"] is None
    assert chat["prompt_text"] is None and "prompt_token_ids" in chat
    message = chat["choices"][0]["message"]
    assert set(message) == {"role", "content", "refusal", "annotations", "audio",
                            "function_call", "reasoning"}
    assert message["content"] and message["role"] == "assistant"


def test_chat_echo_fills_prompt_logprobs_as_vllm(server):
    """vLLM's chat `echo` asks for the prompt's logprobs (top_logprobs of them; rank-only at
    0): the answer's `prompt_logprobs` has one entry per prompt token, the first null."""
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "echo": True,
                                                 "return_token_ids": True}).json()
    prompt = resp["prompt_token_ids"]
    assert resp["prompt_logprobs"][0] is None and len(resp["prompt_logprobs"]) == len(prompt)
    for token_id, entry in zip(prompt[1:], resp["prompt_logprobs"][1:], strict=True):
        assert list(entry) == [str(token_id)] and entry[str(token_id)]["logprob"] <= 0
    plain = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY}).json()
    assert plain["prompt_logprobs"] is None


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "Once upon"}),
                                         ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats(server, path, base):
    """vLLM's `stream_options.continuous_usage_stats`: with include_usage every chunk carries
    the usage so far (completion tokens never fall, the last equals the final usage chunk);
    without it only the final chunk does."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _sse(server, path, {**base, **GREEDY, "stream": True, "stream_options": options})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == GREEDY["max_tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-2]["usage"] == chunks[-1]["usage"]
    prompt_tokens = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0
    chunks = _sse(server, path, {**base, **GREEDY, "stream": True,
                                 "stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_completion_chunks_carry_vllms_stream_keys(server):
    """A completions stream chunk has vLLM's keys: none of the answer-only ones
    (service_tier, kv/ec transfer params, metrics, routed_experts, unset prompt_logprobs)."""
    chunks = _sse(server, "/v1/completions", {"prompt": "Once upon", **GREEDY, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    for chunk in chunks:
        assert not {"service_tier", "kv_transfer_params", "ec_transfer_params",
                    "metrics"} & set(chunk), chunk
        assert ("usage" in chunk) == (chunk is chunks[-1])
        for choice in chunk["choices"]:
            assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason",
                                   "token_ids", "prompt_token_ids"}, choice


def test_message_keys_the_sdk_returns_are_ignored(server):
    """An assistant message sent back as the SDK returned it (refusal, annotations, audio,
    reasoning...) and a content part's extra key are ignored, as vLLM does."""
    answer = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY}).json()
    message = answer["choices"][0]["message"]
    assert {"refusal", "annotations", "audio", "function_call", "reasoning"} <= set(message)
    message = {**message, "annotations": [], "reasoning_content": "thought", "audio": {"id": "a"}}
    user = {"role": "user", "content": [{"type": "text", "text": "More",
                                         "cache_control": {"type": "ephemeral"}}]}
    resp = post(server, "/v1/chat/completions", {"messages": CHAT + [message, user], **GREEDY})
    assert resp.status_code == 200, resp.text
    bad = post(server, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": 5, "extra": 1}], **GREEDY})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["param"]


def test_echo_with_return_token_ids_leaves_the_prompt_text_out(server):
    """vLLM: with `return_token_ids`, an echoed completion's text is the output alone (the
    prompt comes back as `prompt_token_ids`); its logprobs still cover the prompt."""
    body = {"prompt": "Once upon a time", **GREEDY, "echo": True, "logprobs": 0}
    echoed = post(server, "/v1/completions", body).json()["choices"][0]
    with_ids = post(server, "/v1/completions", {**body, "return_token_ids": True}).json()
    choice = with_ids["choices"][0]
    assert echoed["text"] == "Once upon a time" + choice["text"]
    assert choice["prompt_token_ids"] and len(choice["token_ids"]) == GREEDY["max_tokens"]
    assert choice["logprobs"]["tokens"] == echoed["logprobs"]["tokens"]
    assert len(choice["logprobs"]["tokens"]) == len(choice["prompt_token_ids"]) + 6


def test_error_param_as_vllms(server):
    """`param` names the field where vLLM's does, and is null where vLLM's is."""
    greedy = post(server, "/v1/completions", {"prompt": "x", "n": 2, "temperature": 0})
    assert greedy.status_code == 400 and greedy.json()["error"]["param"] is None
    bias = post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}})
    assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias"
