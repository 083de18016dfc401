"""SamplingParams: how one request samples and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.sched.validation import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    check_max_count,
    check_seed,
    check_text_list,
    is_int,
)
from pagedkv.structured.params import StructuredOutputsParams

# Temperatures below this are greedy (as in vLLM): dividing logits by 1e-40 overflows to inf.
GREEDY_TEMPERATURE_BELOW = 1e-5


def _check(cond: bool, name: str, value: object, rule: str) -> None:
    if not cond:
        shown = repr(value)
        if len(shown) > 200:  # a huge list is named, not echoed whole
            shown = shown[:197] + "..."
        raise ValueError(f"{name} {rule}, got {shown}")


@dataclass
class SamplingParams:
    """Sampling and stopping parameters for one request.

    `temperature == 0` means greedy; so does any temperature below 1e-5 (it is set to 0). `top_k <= 0` and `top_p == 1` disable those filters.
    `seed` makes this request's sampling reproducible whatever else is in the batch.
    `logprobs=N` returns the top-N log-probabilities (plus the sampled token's) per output token.
    `stop` strings end generation and are left out of the text.
    `prompt_logprobs=N` returns, for every prompt token after the first, its log-probability
    and the top-N alternatives (vLLM's `RequestOutput.prompt_logprobs`, entry 0 None).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # False (with skip_special_tokens False): two added tokens in a row are written as their
    # contents, without the space a tokenizer's decoder may put between them (vLLM's rule).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Log-probabilities of the prompt's tokens (top-N plus the actual token at each position
    # after the first). Such a request computes its whole prompt: no prefix-cache hit.
    prompt_logprobs: int | None = None
    # A JSON schema / regex / choice / grammar the output must follow (vLLM's field).
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: the last token of each is banned when the output ends with the
    # others (tokenized by the engine, with and without a leading space, as vLLM does).
    bad_words: list[str] | None = None
    # Keep only the prompt's last N tokens (-1: as many as max_model_len allows).
    truncate_prompt_tokens: int | None = None
    # Beam search (pagedkv/sched/beam.py): `n` is the beam width and the number of sequences
    # returned, best first; scored as transformers' `generate(num_beams=n)`: cumulative
    # logprob / generated length ** length_penalty; `early_stopping` True, False or "never".
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Filled in from `stop` so callers can rely on a list.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
               "n", self.n, "must be an integer >= 1")
        _check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
               "temperature", self.temperature, "must be in [0, 100]")
        if self.temperature < GREEDY_TEMPERATURE_BELOW:
            self.temperature = 0.0
        _check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
               "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
               "top_k", self.top_k, "must be an integer >= -1 (0 or -1 disables it)")
        _check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0,
               "min_p", self.min_p, "must be in [0, 1]")
        check_seed(self.seed)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                           and not isinstance(self.max_tokens, bool)
                                           and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        _check(is_int(self.min_tokens) and self.min_tokens >= 0,
               "min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "must be an integer in [0, 20] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and -2.0 <= value <= 2.0, name, value,
                   "must be in [-2, 2]")
        _check(isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", self.repetition_penalty, "must be in (0, 10]")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        check_text_list(self.stop_strings, "stop", MAX_STOP_STRINGS)
        _check(all(s for s in self.stop_strings), "stop", self.stop, "must not contain empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               self.stop_token_ids, "must be a list of non-negative integers")
        check_max_count(len(self.stop_token_ids), "stop_token_ids", MAX_STOP_TOKEN_IDS, "ids")
        _check(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", self.prompt_logprobs, "must be an integer in [0, 20] or None")
        self._check_token_controls()
        self._check_beam_search()
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs,
               "must be a StructuredOutputsParams or None")

    def _check_token_controls(self) -> None:
        """Validate logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens, each
        within its cap (validation.py), and reduce allowed_token_ids to its sorted distinct ids
        (token ids against the vocabulary are checked by the engine, which knows it)."""
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, dict), "logit_bias", bias,
               "must map token ids (ints >= 0) to biases in [-100, 100]")
        if bias is not None:
            check_max_count(len(bias), "logit_bias", MAX_LOGIT_BIAS)
            _check(all(is_int(k) and k >= 0 and isinstance(v, (int, float)) and -100 <= v <= 100
                       for k, v in bias.items()), "logit_bias", bias,
                   "must map token ids (ints >= 0) to biases in [-100, 100]")
        allowed = self.allowed_token_ids
        _check(allowed is None or (isinstance(allowed, (list, tuple)) and len(allowed) > 0),
               "allowed_token_ids", allowed, "must be a non-empty list of token ids")
        if allowed is not None:
            check_max_count(len(allowed), "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "ids")
            _check(all(is_int(t) and t >= 0 for t in allowed),
                   "allowed_token_ids", allowed, "must be a non-empty list of token ids")
            self.allowed_token_ids = sorted(set(allowed))
        words = self.bad_words
        _check(words is None or (isinstance(words, (list, tuple))
                                 and all(isinstance(w, str) for w in words)),
               "bad_words", words, "must be a list of non-blank strings")
        if words is not None:
            check_text_list(list(words), "bad_words", MAX_BAD_WORDS)
            _check(all(w.strip() for w in words), "bad_words", words,
                   "must be a list of non-blank strings")
        truncate = self.truncate_prompt_tokens
        _check(truncate is None or (is_int(truncate) and (truncate >= 1 or truncate == -1)),
               "truncate_prompt_tokens", truncate, "must be an integer >= 1, or -1")

    def _check_beam_search(self) -> None:
        """Beam search's own values, and what it cannot be combined with: the candidates are
        each beam's most likely tokens, so nothing that reshapes or constrains sampling."""
        _check(isinstance(self.length_penalty, (int, float))
               and not isinstance(self.length_penalty, bool), "length_penalty",
               self.length_penalty, "must be a number")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               self.early_stopping, 'must be true, false or "never"')
        if not self.use_beam_search:
            return
        _check(self.structured_outputs is None, "structured_outputs", self.structured_outputs,
               "cannot be combined with use_beam_search")
        _check(not self.stop_strings, "stop", self.stop, "cannot be combined with use_beam_search")
        _check(self.min_tokens == 0, "min_tokens", self.min_tokens,
               "cannot be combined with use_beam_search")
        _check(self.max_tokens is not None, "max_tokens", self.max_tokens,
               "must be set with use_beam_search")
        _check(self.prompt_logprobs is None, "prompt_logprobs", self.prompt_logprobs,
               "cannot be combined with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (`LLM.beam_search`): `beam_width` beams, each at most
    `max_tokens` long, scored by cumulative logprob / length ** `length_penalty`.
    `temperature` is accepted for vLLM's signature: the candidates are each beam's most likely
    tokens (raw logprobs), so it does not change the result. `early_stopping` as transformers'
    (False, True or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check(is_int(self.beam_width) and self.beam_width >= 1, "beam_width", self.beam_width,
               "must be an integer >= 1")
        _check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
               "temperature", self.temperature, "must be in [0, 100]")
        self.sampling_params()  # checks the rest

    def sampling_params(self) -> SamplingParams:
        """The engine request these parameters make: `beam_width` samples, logprobs returned
        (their cumulative sum is each sequence's score's numerator)."""
        return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=0.0, logprobs=0,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              use_beam_search=True, length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping)
