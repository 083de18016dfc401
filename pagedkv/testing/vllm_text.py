"""The output text vLLM 0.32 gives a sequence of tokens, stated with tokenizers' `DecodeStream`
directly (what vLLM's `FastIncrementalDetokenizer` runs), for tests to compare ours with.

vLLM primes a stream with the whole prompt and concatenates what `step` returns for each output
token; nothing is added at the end (a window held back when the sequence ends is left out). A
stop token that ends the sequence (eos, `stop_token_ids`) is not stepped unless
`include_stop_str_in_output`. Where the prompt's text ends in an unfinished character the
stream has no prefix and vLLM's first text repeats the prompt: that repeated prompt text (all
the prompt's text but its last U+FFFD) is taken off, as pagedkv does.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def vllm_output_text(tokenizer: Tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int],
                     skip_special_tokens: bool = True, stop_terminated: bool = False,
                     spaces_between_special_tokens: bool = True) -> str:
    """The text of `output_ids` after `prompt_ids` as vLLM's detokenizer makes it (with both
    `skip_special_tokens` and `spaces_between_special_tokens` false, an added token right
    after another is its bare content)."""
    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
    stepped = output_ids[:-1] if stop_terminated else output_ids
    added = ({} if skip_special_tokens or spaces_between_special_tokens else
             {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()})
    pieces, last_added = [], False
    for token in stepped:
        piece = stream.step(tokenizer, token) or ""
        if token in added and last_added:
            piece = added[token]
        last_added = token in added
        pieces.append(piece)
    text = "".join(pieces)
    prompt_text = tokenizer.decode(list(prompt_ids), skip_special_tokens=skip_special_tokens)
    if prompt_text.endswith("\ufffd") and text:
        assert text.startswith(prompt_text[:-1]), (text, prompt_text)
        text = text[len(prompt_text) - 1:]
    return text
