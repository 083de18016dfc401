"""The text of one token in logprobs, as vLLM 0.32 writes it (`vllm/v1/engine/logprobs.py`).

A byte-level tokenizer splits a multi-byte character over several tokens; decoded alone, such a
token is U+FFFD. vLLM decodes it after up to 4 preceding tokens of the sequence (the sampled
ones, or the prompt's): the text it completes (from the first token of its character on) when
the character is finished with it, "" while it is still unfinished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_CONTEXT = 4  # enough for any UTF-8 sequence

Decode = Callable[[list[int]], str]


def corrected_token_text(decode: Decode, token_id: int, context: Sequence[int]) -> str:
    """The text of `token_id` (whose lone decoding ends in U+FFFD) after `context` (the
    preceding tokens, oldest first): vLLM's `_correct_decoded_token`."""
    context = list(context)[-MAX_CONTEXT:]
    for num in range(1, len(context) + 1):
        window = context[-num:]
        full = decode(window + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(window)  # context tokens of the same unfinished character are skipped
        for j in range(len(window) - 1, -1, -1):
            if decode([window[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix = decode(window[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
