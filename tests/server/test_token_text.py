"""Logprobs' token text of a character split over tokens, as vLLM 0.32 writes it: "" while the
character is unfinished, the character from the token that completes it."""

from __future__ import annotations

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.deltas import LogprobsFormatter
from pagedkv.server.token_text import corrected_token_text


def test_split_character_tokens(tiny_llama):
    tokenizer = Tokenizer.from_dir(tiny_llama)
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) == 2 and tokenizer.decode(emoji[:1]).endswith("\ufffd")
    head = tokenizer.encode("ab", add_special_tokens=False)
    ids = head + emoji + tokenizer.encode(" c", add_special_tokens=False)
    at = len(head)

    def decode(token_ids):
        return tokenizer.decode(token_ids, skip_special_tokens=False)
    assert corrected_token_text(decode, emoji[0], ids[:at]) == ""  # unfinished
    completed = corrected_token_text(decode, emoji[1], ids[:at + 1])
    assert completed.endswith("😀") and "\ufffd" not in completed
    # through the formatter, in both formats: no U+FFFD, and the text adds up
    comp = CompletionOutput(0, "", list(ids), logprobs=[{t: -1.0} for t in ids])
    formatter = LogprobsFormatter(tokenizer, 1)
    tokens = formatter.completion(comp, 0, len(ids)).tokens
    chat = [c.token for c in formatter.chat(comp, 0, len(ids)).content]
    assert tokens == chat and "\ufffd" not in "".join(tokens)
    assert "".join(tokens) == tokenizer.decode(ids)
    assert tokens[at] == "" and tokens[at + 1] == completed


def test_unfinished_forever_is_empty(tiny_llama):
    tokenizer = Tokenizer.from_dir(tiny_llama)
    first = tokenizer.encode("😀", add_special_tokens=False)[0]
    comp = CompletionOutput(0, "", [first, first], logprobs=[{first: -0.5}, {first: -0.5}])
    content = LogprobsFormatter(tokenizer, 1).chat(comp, 0, 2).content
    assert [c.token for c in content] == ["", ""]
    assert [t.token for c in content for t in c.top_logprobs] == ["", ""]
