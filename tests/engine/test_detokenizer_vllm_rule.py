"""The detokenizer's text is vLLM 0.32's, checked against tokenizers' `DecodeStream` directly
(pagedkv.testing.vllm_text): over byte tokens of the tiny byte-level tokenizer, a cut inside a
character, a complete character held back with a partial one, an invalid byte then valid text,
prompts that end inside a character, stop tokens, stop strings with min_tokens; both our fast
path (DecodeStream) and our slow path (plain `decode`)."""

from __future__ import annotations

import random

import pytest

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.vllm_text import vllm_output_text

TEXT = "日本語のテキスト😀 héllo wörld"


class SlowTokenizer:
    """Only `decode`: the detokenizer's slow path."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


def ours(decoder, prompt, output, stop_terminated=False, **kwargs) -> str:
    detok = IncrementalDetokenizer(decoder, prompt, [], **kwargs)
    for i, token in enumerate(output):
        detok.update([token], stop_terminated and i == len(output) - 1)
    return detok.text


def both_paths(tok, prompt, output, **kwargs) -> tuple[str, str]:
    return ours(tok, prompt, output, **kwargs), ours(SlowTokenizer(tok), prompt, output, **kwargs)


def test_cut_inside_a_character_leaves_its_bytes_out(tok):
    prompt = tok.encode("Hello", add_special_tokens=False)
    ids = tok.encode("ab 日本", add_special_tokens=False)
    ni = tok.encode("日", add_special_tokens=False)
    assert len(ni) > 1 and tok.decode(ni[:1]).endswith("\ufffd")
    for cut in range(1, len(ids) + 1):
        expected = vllm_output_text(tok.backend_tokenizer, prompt, ids[:cut])
        assert both_paths(tok, prompt, ids[:cut]) == (expected, expected), cut
        assert "\ufffd" not in expected
    assert ours(tok, prompt, ids) == "ab 日本"


def test_complete_character_held_back_with_a_partial_one_is_left_out(tok):
    """The tokens of 日本: the second ends 日 and starts 本, so the window still ends in an
    unfinished character: cut there, vLLM leaves 日 out too (DecodeStream never emitted it)."""
    prompt = tok.encode("Hello", add_special_tokens=False)
    first, second = tok.encode("日本", add_special_tokens=False)[:2]
    assert tok.decode([first, second]) == "日\ufffd"
    assert vllm_output_text(tok.backend_tokenizer, prompt, [first, second]) == ""
    assert both_paths(tok, prompt, [first, second]) == ("", "")
    assert ours(tok, prompt, tok.encode("日本", add_special_tokens=False)) == "日本"


def test_invalid_byte_then_valid_text(tok):
    """A token starting with a continuation byte (invalid here) then text: the window ends in
    U+FFFD while bytes stay unfinished (all held back, left out when cut), and goes out, its
    U+FFFD included, once valid text closes it."""
    prompt = tok.encode("Hello", add_special_tokens=False)
    invalid = tok.encode("日本", add_special_tokens=False)[1]  # ¥ then the start of 本
    assert tok.decode([invalid]).startswith("\ufffd")
    text = tok.encode(" abc def", add_special_tokens=False)
    for output in ([invalid], [invalid, invalid], [invalid, *text], [invalid, invalid, *text]):
        expected = vllm_output_text(tok.backend_tokenizer, prompt, output)
        assert both_paths(tok, prompt, output) == (expected, expected), output
    assert ours(tok, prompt, [invalid]) == ""
    assert ours(tok, prompt, [invalid, *text]).endswith(" abc def")
    assert ours(tok, prompt, [invalid, *text]).startswith("\ufffd")


def test_random_byte_tokens_after_any_prompt_match_decode_stream(tok):
    """Random output over the byte tokens of TEXT after prompts that may end inside a character
    (where vLLM's first text repeats the prompt; that part is left out), token by token and in
    steps of several tokens."""
    pool = sorted(set(tok.encode(TEXT, add_special_tokens=False)))
    rng = random.Random(0)
    slow = SlowTokenizer(tok)
    for _ in range(300):
        prompt = tok.encode(rng.choice(["Hello", "x 日本", "The block pool"]),
                            add_special_tokens=False)
        prompt += [rng.choice(pool) for _ in range(rng.randint(0, 3))]
        output = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
        expected = vllm_output_text(tok.backend_tokenizer, prompt, output)
        assert ours(tok, prompt, output) == expected, (prompt, output)
        assert ours(slow, prompt, output) == expected, (prompt, output)
        detok = IncrementalDetokenizer(tok, prompt, [])
        detok.update(output[:3])  # several tokens in one update: still stepped one by one
        detok.update(output[3:])
        assert detok.text == expected


def test_stop_token_text_is_left_out_unless_asked(tok):
    prompt = tok.encode("Hello", add_special_tokens=False)
    output = tok.encode(" abc 日本 def", add_special_tokens=False)
    expected = vllm_output_text(tok.backend_tokenizer, prompt, output, stop_terminated=True)
    assert expected == " abc 日本 def"[:-len(tok.decode(output[-1:]))]
    assert both_paths(tok, prompt, output, stop_terminated=True) == (expected, expected)
    kept = ours(tok, prompt, output, stop_terminated=True, include_stop_str_in_output=True)
    assert kept == " abc 日本 def"


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def run_chars(text, stop, min_tokens=0, step=1, include=False):
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop, min_tokens=min_tokens,
                                   include_stop_str_in_output=include)
    found = None
    for i in range(0, len(text), step):
        found = found or detok.update([ord(c) for c in text[i:i + step]])
    return found, detok.text


def test_stop_strings_the_first_to_end_wins_and_min_tokens_hides_earlier_ones():
    assert run_chars("abcdef", ["cd", "bc"]) == ("bc", "a")
    assert run_chars("xabcdef", ["abcd", "bc"], step=7) == ("bc", "xa")  # ends first
    assert run_chars("xabcdef", ["bc", "abc"], step=7) == ("bc", "xa")  # tie: list order
    assert run_chars("xabcdef", ["abc", "bc"], step=7) == ("abc", "x")
    # min_tokens 3: "ab" (tokens 1-2) is not a stop; one ending past token 3 is.
    assert run_chars("abcab", ["ab"], min_tokens=3) == ("ab", "abc")
    assert run_chars("abcab", ["ab"], min_tokens=3, step=5) == ("ab", "abc")
    assert run_chars("abcab", ["bc"], min_tokens=2) == ("bc", "a")  # ends at token 3
    assert run_chars("abcab", ["ab"], min_tokens=5) == (None, "abcab")
    assert run_chars("abcdef", ["cd"], include=True) == ("cd", "abcd")


def test_invalid_prefix_restarts_the_stream_without_context():
    """tokenizers raises "Invalid prefix encountered" when a window's text stops starting with
    its earlier text; vLLM then restarts the stream without the prompt and steps the token."""
    made = []

    class RaisingOnce:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

        def decode_stream(self, context, skip_special_tokens=True):
            made.append(list(context))
            calls = []

            def step(token):
                calls.append(token)
                if len(made) == 1 and len(calls) == 2:
                    raise Exception("Invalid prefix encountered while decoding stream")
                return chr(token)
            return step

    detok = IncrementalDetokenizer(RaisingOnce(), [ord("p")], [])
    for c in "abc":
        detok.update([ord(c)])
    assert detok.text == "abc" and made == [[ord("p")], []]


def test_spaces_between_special_tokens_false_joins_added_tokens():
    """A WordPiece decoder puts a space between tokens; with skip_special_tokens and
    spaces_between_special_tokens false, vLLM writes an added token right after another as its
    bare content."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    raw = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(["[CLS]", "[SEP]"])
    tok = Tokenizer(raw, {})
    prompt, output = [3], [4, 1, 2, 5, 1, 3]
    for skip, spaces in ((False, False), (False, True), (True, False)):
        expected = vllm_output_text(raw, prompt, output, skip_special_tokens=skip,
                                    spaces_between_special_tokens=spaces)
        assert ours(tok, prompt, output, skip_special_tokens=skip,
                    spaces_between_special_tokens=spaces) == expected
    assert ours(tok, prompt, output, skip_special_tokens=False,
                spaces_between_special_tokens=False) == " world [CLS][SEP]s [CLS] hello"
    assert ours(tok, prompt, output, skip_special_tokens=False) == " world [CLS] [SEP]s [CLS] hello"


def test_min_tokens_reached_by_a_stop_token_checks_no_earlier_text():
    """min_tokens 3, one update of 4 tokens whose last is a stop token (left out): the text of
    tokens 1-3 is before the boundary, so "ab" in it is no stop string (vLLM: no new text)."""
    detok = IncrementalDetokenizer(CharTokenizer(), [], ["ab"], min_tokens=3)
    assert detok.update([ord(c) for c in "abcz"], stop_terminated=True) is None
    assert detok.text == "abc" and not detok.stopped
