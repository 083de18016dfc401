"""InputProcessor: the frontend's checks of a request before it reaches the core: tokenize the
prompt (bounded by max_model_len), truncate it, check its token ids and that its samples can
ever fit in the KV cache, and turn bad words into token ids. It reads only the core's fixed
facts (`EngineReady`) and the tokenizer, so any thread may call it.
"""

from __future__ import annotations

from pagedkv.engine.messages import EngineReady
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sched.validation import PromptTooLongError
from pagedkv.utils import cdiv

PromptType = str | list[int] | dict
MAX_IDS_NAMED = 10  # an error names at most this many bad token ids
# The attribute of SamplingParams that holds (tokenizer, its bad words' token ids) once
# tokenized (not a field: the core gets the ids in EngineCoreRequest, never with the params).
BAD_WORDS_CACHE = "_bad_words_token_ids"


class InputProcessor:
    def __init__(self, tokenizer, ready: EngineReady) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.block_size = ready.block_size
        self.num_available_blocks = ready.num_usable_blocks - ready.watermark_blocks

    def truncate_prompt(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last `truncate_prompt_tokens` ids (-1: the most that leave room for one
        generated token; None: all), as vLLM truncates from the left."""
        if truncate_prompt_tokens is None:
            return ids
        keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return ids[-keep:] if len(ids) > keep else ids

    def tokenize_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                        ) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids), keeping only the last
        `truncate_prompt_tokens` ids when given; raises ValueError for bad prompts."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if truncate_prompt_tokens is None:  # too long is an error: tokenize a prefix only
                try:
                    ids = self.tokenizer.encode_bounded(text, self.max_model_len - 1)
                except PromptTooLongError as exc:
                    raise ValueError(
                        f"prompt has at least {exc.num_tokens} tokens but max_model_len is "
                        f"{self.max_model_len} (the prompt plus at least one generated token "
                        "must fit)") from None
            else:
                ids = self.tokenizer.encode(text)
        ids = self.truncate_prompt(list(ids), truncate_prompt_tokens)
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        return text, ids

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError when this prompt with `params.n` samples can never fit in the cache."""
        prompt_blocks = cdiv(num_prompt_tokens + 1, self.block_size)
        # n samples share the prompt's full blocks; each other sample needs one block of its own.
        needed = prompt_blocks + params.n - 1
        if needed > self.num_available_blocks:
            raise ValueError(f"a prompt of {num_prompt_tokens} tokens with n={params.n} needs at least "
                             f"{needed} KV blocks but the cache can hold only "
                             f"{self.num_available_blocks}")

    def check_token_ids(self, params: SamplingParams) -> None:
        """ValueError naming the ids of logit_bias, allowed_token_ids or stop_token_ids that
        lie beyond the vocabulary (each list is capped by SamplingParams: a bounded scan)."""
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids or ())):
            bad = sorted({t for t in ids if t >= self.vocab_size})
            if bad:
                shown = ", ".join(map(str, bad[:MAX_IDS_NAMED]))
                more = f" and {len(bad) - MAX_IDS_NAMED} more" if len(bad) > MAX_IDS_NAMED else ""
                raise ValueError(f"{name} has token ids outside the vocabulary "
                                 f"[0, {self.vocab_size}): {shown}{more}")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (vLLM's two spellings), each
        distinct sequence once, in first-seen order."""
        out: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    out.setdefault(tuple(ids))
        return [list(ids) for ids in out]

    def prepare_bad_words(self, params: SamplingParams) -> list[list[int]]:
        """`params.bad_words` as token ids, tokenized once per params object: a caller that
        must not stall (the server) calls it in a tokenizer thread before handing the request
        to the engine loop, whose `add_request` then finds them ready."""
        if not params.bad_words:
            return []
        tokenizer, ready = getattr(params, BAD_WORDS_CACHE, (None, None))
        if ready is None or tokenizer is not self.tokenizer:  # params reused by another engine
            ready = self.bad_words_token_ids(params.bad_words)
            setattr(params, BAD_WORDS_CACHE, (self.tokenizer, ready))
        return ready
