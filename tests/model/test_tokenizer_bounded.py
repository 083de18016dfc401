"""`Tokenizer.encode_bounded`: equal to `encode` for a text that fits, whatever its script, and
a cheap refusal (a lower bound of the count, from a prefix) for one that does not, even when
the text has fewer characters than the limit (characters do not bound byte-level tokens)."""

from __future__ import annotations

import pytest

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.sched.validation import PromptTooLongError
from pagedkv.testing import build_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tokenizer_files(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", [
    "plain words, nothing special " * 30,
    "数据库里的记录" * 40,  # several byte-level tokens per character
    "x" * 3000,  # one long word: no space to cut at
    "emoji 🙂 " * 50,
])
def test_equal_to_encode_when_it_fits(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.encode_bounded(text, len(ids)) == ids
    assert tokenizer.encode_bounded(text, len(ids), add_special_tokens=False) == \
        tokenizer.encode(text, add_special_tokens=False)


def test_fewer_characters_than_the_limit_can_still_be_too_long(tokenizer):
    text = "数据库里的记录" * 40  # 280 characters
    num_tokens = len(tokenizer.encode(text))
    assert num_tokens > 280
    with pytest.raises(PromptTooLongError):
        tokenizer.encode_bounded(text, 279)


@pytest.mark.parametrize("unit", ["lorem ipsum dolor ", "数据库里的记录", "y" * 50])
def test_a_far_too_long_text_is_refused_with_a_true_lower_bound(tokenizer, unit):
    text = unit * 5000
    limit = 100
    with pytest.raises(PromptTooLongError) as info:
        tokenizer.encode_bounded(text, limit)
    bound = info.value.num_tokens
    assert limit < bound <= len(tokenizer.encode(text))
    assert bound < len(tokenizer.encode(text)) // 10  # only a prefix was tokenized
